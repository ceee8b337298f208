"""What the planning inputs take from a DeepSpeed config besides its ZeroConfig: how Adam runs
(``optimizer_impl_from_config``), ``data_types.grad_accum_dtype``, the config's ``zeroplan`` block
(read back by ``planning_metadata``, written by ``annotate_ds_config``), and ``refuse_ds_errors``
(a config DeepSpeed refuses is one InputError at ``file:line``). core/inputs.py uses them.
"""

from __future__ import annotations

import json
import re
from typing import Any

from zeroplan._util import InputError, read_text_file
from zeroplan.specs.config_lines import find_key_line, key_lines
from zeroplan.specs.ds_keys import _DTYPE_ENUM, ZEROPLAN_KEY
from zeroplan.specs.ds_schema import DEEPSPEED_VERSION, ActivationCheckpointingConfig, DSConfig
from zeroplan.specs.training import ACTIVATION_IMPLS, KERNELS, TrainingSetup

__all__ = ["CHECKPOINTING", "optimizer_impl_from_config", "grad_accum_dtype_from_config", "planning_metadata",
           "annotate_ds_config", "refuse_ds_errors"]

CHECKPOINTING = ("none", "selective", "full")


def optimizer_impl_from_config(ds: DSConfig | None) -> tuple[str, str]:
    """(impl, why): how DeepSpeed 0.19.8 runs Adam for this config on CUDA.

    engine.py ``_configure_basic_optimizer`` / ``get_optimizer_configuration``: an ``optimizer``
    block gives DeepSpeedCPUAdam with optimizer offload, torch.optim.Adam/AdamW with
    ``torch_adam: true`` (``foreach`` from the block, torch's default otherwise: foreach on CUDA),
    else FusedAdam. No block: the client's optimizer (the HF Trainer's torch AdamW, foreach).
    """
    if ds is None:
        return "fused-adam", "default: DeepSpeed's FusedAdam (no DeepSpeed config; give --optimizer-impl)"
    if ds.zero.optimizer_offload_device != "none":
        return "cpu-adam", "optimizer offload: DeepSpeedCPUAdam steps on the host"
    block = ds.raw.get("optimizer")
    if isinstance(block, dict):
        params = block.get("params") if isinstance(block.get("params"), dict) else {}
        if params.get("torch_adam") is True:
            if params.get("foreach") is False:
                return "torch-single", "optimizer.params.torch_adam with foreach false: torch Adam, one tensor at a time"
            return "torch-foreach", "optimizer.params.torch_adam: torch Adam (foreach on CUDA)"
        return "fused-adam", f"optimizer block {block.get('type')!r}: DeepSpeed FusedAdam on CUDA"
    return "torch-foreach", "no optimizer block: the client's optimizer (torch AdamW, foreach on CUDA) is assumed"


def grad_accum_dtype_from_config(ds: DSConfig | None) -> str | None:
    """``data_types.grad_accum_dtype`` as fp32/bf16/fp16, or None (the model dtype).

    Spelled as DeepSpeed's ``DtypeEnum`` takes it (runtime/config.py; case-sensitive: "torch.float32",
    "fp32", "float32", "float" ...), as ``DeepSpeedEngine.get_data_types`` resolves it. Any other value
    (int8, which only ZeRO's sanity check lets through, or a spelling DtypeEnum refuses) is planned
    as absent: the config reader has reported what DeepSpeed does with it (specs/ds_shapes.py
    ``check_data_types``), and ``--lenient`` plans on."""
    if ds is None:
        return None
    dt = ds.raw.get("data_types")
    val = dt.get("grad_accum_dtype") if isinstance(dt, dict) else None
    dtype = _DTYPE_ENUM.get(val) if isinstance(val, str) else None
    return dtype if dtype in ("fp32", "bf16", "fp16") else None


# ------------------------------------------------------------------ the config's zeroplan block
# DeepSpeed 0.19.8 ignores top-level keys it does not know (DeepSpeedConfig._initialize_params
# reads known keys with get_scalar_param and never rejects extras; tests/test_cli_options.py
# constructs DeepSpeedConfig on an emitted file to prove it). zeroplan stores there what it
# assumed and DeepSpeed cannot express: sequence length, checkpointing, flash attention, and which code
# computes the activations (``activations``: transformers or megatron; core/activations.py).

_META_CHECKS = {
    "seq_len": ("a positive integer", lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 10**8),
    "checkpointing": ("none, selective or full", lambda v: v in CHECKPOINTING),
    "flash_attention": ("true or false", lambda v: isinstance(v, bool)),
    "finetune": ("an object of fine-tuning options", lambda v: isinstance(v, dict)),
    "activations": (" or ".join(ACTIVATION_IMPLS), lambda v: v in ACTIVATION_IMPLS),
    "kernels": (", ".join(KERNELS), lambda v: v in KERNELS),
}


_META_RECORD_ONLY = ("planned_for", "note")  # written by annotate_ds_config for the reader, not read back


def _where(ds: DSConfig, key: str) -> str:
    """``file:line`` of a dotted key (``file`` alone when the line is unknown)."""
    if not ds.path:
        return ds.label or "<config>"
    line = None
    try:
        line = find_key_line(key_lines(read_text_file(ds.path, "DeepSpeed config")), key)
    except InputError:
        pass
    return f"{ds.path}:{line}" if line else ds.path


def planning_metadata(ds: DSConfig) -> dict[str, Any]:
    """The validated planning values of the config's ``zeroplan`` block (absent keys left out)."""
    block = ds.raw.get(ZEROPLAN_KEY)
    if block is None:
        return {}
    if not isinstance(block, dict):
        raise InputError(f"{_where(ds, ZEROPLAN_KEY)}: {ZEROPLAN_KEY} = {block!r}: expected an object "
                         "(zeroplan's planning metadata)")
    # what annotate_ds_config writes that planning does not read back: kept, not checked
    unknown = [k for k in block if k not in _META_CHECKS and k not in _META_RECORD_ONLY]
    if unknown:  # a typo ("seq_length") would plan the defaults without a word
        key = unknown[0]
        raise InputError(f"{_where(ds, f'{ZEROPLAN_KEY}.{key}')}: {ZEROPLAN_KEY}.{key} is not a key of zeroplan's "
                         f"block; expected one of {', '.join(sorted([*_META_CHECKS, *_META_RECORD_ONLY]))}")
    out: dict[str, Any] = {}
    for key, (expected, ok) in _META_CHECKS.items():
        if key in block:
            if not ok(block[key]):
                raise InputError(f"{_where(ds, f'{ZEROPLAN_KEY}.{key}')}: {ZEROPLAN_KEY}.{key} = "
                                 f"{json.dumps(block[key])}: expected {expected}")
            out[key] = block[key]
    return out


def annotate_ds_config(config: dict[str, Any], *, seq_len: int, checkpointing: str, flash_attention: bool,
                       model: str, hardware: str | None, n_gpus: int,
                       finetune: dict[str, Any] | None = None, activations: str | None = None,
                       kernels: str | None = None) -> dict[str, Any]:
    """``config`` plus what the plan assumed: a ``zeroplan`` block (read back by ``check`` and
    ``estimate``) and, for full checkpointing, DeepSpeed's ``activation_checkpointing`` block with
    DeepSpeed's defaults (what ``deepspeed.checkpointing.checkpoint`` uses when the script calls it;
    the block configures checkpointing but does not switch it on, and cannot say "selective").
    ``activations``: the code that computes activations; written only when it is not the default
    (transformers), so a Megatron-LM plan reads back as one."""
    out = dict(config)
    if checkpointing == "full" and "activation_checkpointing" not in out:
        defaults = ActivationCheckpointingConfig()  # DeepSpeed's defaults, written once (specs/ds_schema.py)
        out["activation_checkpointing"] = {k: getattr(defaults, k) for k in (
            "partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
            "synchronize_checkpoint_boundary")}
    out[ZEROPLAN_KEY] = {
        "seq_len": seq_len, "checkpointing": checkpointing, "flash_attention": flash_attention,
        "planned_for": {"model": model, "hardware": hardware, "gpus": n_gpus},
        "note": "written by zeroplan recommend; DeepSpeed ignores this key",
    }
    if finetune is not None:  # core/finetune_inputs.py finetune_record: read back by fill_from_record
        out[ZEROPLAN_KEY]["finetune"] = finetune
    if activations is not None and activations != TrainingSetup.model_fields["activation_impl"].default:
        out[ZEROPLAN_KEY]["activations"] = activations  # read back by core/inputs.py _activation_code
    if kernels is not None and kernels != TrainingSetup.model_fields["kernels"].default:
        out[ZEROPLAN_KEY]["kernels"] = kernels  # read back by core/inputs.py _kernels
    return out


# ------------------------------------------------------------------ refusing what DeepSpeed refuses
_FALLBACK = re.compile(r";\s*(?:DeepSpeed rejects it|using the default [^;]*|using [^;]*$|planning with [^;]*|zeroplan plans with [^;]*)")


def refuse_ds_errors(ds: DSConfig | None) -> None:
    """Raise InputError for the first error finding of ``ds``: a config DeepSpeed 0.19.8 refuses.

    Error-severity findings are exactly those where DeepSpeed raises (pydantic ValidationError in
    DeepSpeedZeroConfig / DeepSpeedFP16Config / DeepSpeedBF16Config, the batch and precision
    assertions in DeepSpeedConfig._do_sanity_check / _batch_assertion, removed keys) or fails at
    engine start (odd allgather_bucket_size at stage 1/2, nvme without nvme_path); see
    specs/deepspeed_config.py's rule table. One line: file:line, the finding (key = value: expected).
    """
    if ds is None or not ds.errors:
        return
    first = ds.errors[0]
    where = _where(ds, first.key) if first.key else (ds.path or ds.label or "<config>")
    msg = _FALLBACK.sub("", first.message).rstrip("; ")
    more = f" (and {len(ds.errors) - 1} more error(s); `zeroplan check` lists them)" if len(ds.errors) > 1 else ""
    raise InputError(f"{where}: {first.rule_id} {msg}; DeepSpeed {DEEPSPEED_VERSION} refuses this config "
                     f"(--lenient plans it anyway){more}")
