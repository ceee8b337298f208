"""Fine-tuning: which parameters train, which are frozen, and what adapters add.

A :class:`FineTune` says how a model is fine-tuned (full, LoRA/DoRA, QLoRA, or full training
of a subset of tensors); :func:`finetune_inventory` turns it and a ModelSpec into exact element
counts: trainable vs frozen, adapter tensors per target, ``modules_to_save`` copies, and the
storage of quantised base weights. All counts are ELEMENTS unless a name ends in ``_bytes``.

The rules follow PEFT 0.21 and bitsandbytes as they are implemented:

- target matching — ``peft.tuners.tuners_utils.check_target_module_exists``: a list of
  targets matches a module whose name equals a target or ends in ``"." + target``; a single
  string is a regular expression matched with ``re.fullmatch``; ``all-linear``
  (``_maybe_include_all_linear_layers``) takes every ``nn.Linear``/``Conv1D`` except the
  model's output embedding (``lm_head``). Modules listed in ``modules_to_save`` never get an
  adapter.
- LoRA on a linear layer (``peft.tuners.lora.layer.Linear.update_layer``): ``lora_A``
  [r, in] and ``lora_B`` [out, r], no bias (``bias="none"``); on an embedding
  (``lora.layer.Embedding``): ``lora_embedding_A`` [r, vocab] and ``lora_embedding_B``
  [hidden, r]. DoRA (``lora.dora.DoraLinearLayer``) adds a magnitude vector of ``out``
  elements per adapted layer.
- ``modules_to_save`` (``peft.utils.other.ModulesToSaveWrapper``) keeps the original module
  frozen and trains a full copy: the model gains the module's parameters again.
- 4-bit (``bitsandbytes.nn.Params4bit``, blocksize 64): packed weights are numel/2 bytes in
  any ``bnb_4bit_quant_storage`` dtype; one fp32 absmax per 64-element block (4/64 B per
  element), or with double quantisation one uint8 absmax per block plus an fp32 absmax per
  256 blocks (``bitsandbytes.functional.quantize_4bit`` with ``compress_statistics``).
  8-bit (``bitsandbytes.nn.Int8Params``): int8 weights plus one fp32 scale per output row.
  transformers quantises every linear layer except the output embedding
  (``get_keys_to_not_convert``); embeddings and norms stay in the compute dtype. A forward
  pass dequantises one layer at a time to the compute dtype: the transient is the largest
  quantised layer.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from zeroplan._util import InputError
from zeroplan.specs.model import ModelSpec, ParamTensor

__all__ = [
    "ALL_LINEAR",
    "LoraSpec",
    "QuantSpec",
    "FineTune",
    "FineTuneInventory",
    "finetune_inventory",
    "LINEAR_ROLES",
]

ALL_LINEAR = "all-linear"
# Roles of ParamTensor that live in nn.Linear / Conv1D modules (specs.model.ROLES).
LINEAR_ROLES = frozenset({
    "attn_q", "attn_k", "attn_v", "attn_qkv", "attn_o", "mlp_up", "mlp_gate", "mlp_down",
    "mlp_gate_up", "router", "expert_up", "expert_gate", "expert_down", "lm_head",
})
EMBED_ROLES = frozenset({"embed", "pos_embed"})
NF4_BLOCK = 64  # bitsandbytes 4-bit blocksize (transformers' BitsAndBytesConfig default)
DOUBLE_QUANT_BLOCK = 256  # second-level blocks of absmax under double quantisation
MAX_LORA_RANK = 1 << 16


class LoraSpec(BaseModel):
    """A PEFT LoraConfig, as far as memory depends on it."""

    model_config = ConfigDict(defer_build=True, frozen=True)
    r: int = Field(16, ge=1, le=MAX_LORA_RANK)
    alpha: float | None = None  # scaling only; no memory effect
    targets: tuple[str, ...] | str = ("q_proj", "v_proj")  # a list, a regex string, or "all-linear"
    dora: bool = False
    modules_to_save: tuple[str, ...] = ()


class QuantSpec(BaseModel):
    """bitsandbytes quantisation of the frozen base weights (QLoRA)."""

    model_config = ConfigDict(defer_build=True, frozen=True)
    bits: Literal[4, 8] = 4
    quant_type: Literal["nf4", "fp4"] = "nf4"
    double_quant: bool = True
    storage_dtype: Literal["uint8", "bfloat16", "float16", "float32"] = "uint8"


class FineTune(BaseModel):
    """How the model is fine-tuned. ``method="full"`` with no patterns is plain training."""

    model_config = ConfigDict(defer_build=True, frozen=True)
    method: Literal["full", "lora", "qlora"] = "full"
    lora: LoraSpec | None = None
    quant: QuantSpec | None = None
    # Full training restricted to tensors matching these globs (e.g. "model.layers.3*.*",
    # "lm_head.*"); "last:K" trains the last K transformer blocks. Empty = everything.
    trainable: tuple[str, ...] = ()

    @property
    def is_full(self) -> bool:
        return self.method == "full" and not self.trainable


class TargetCount(BaseModel):
    model_config = ConfigDict(defer_build=True)

    target: str  # the module-name suffix it matched ("q_proj"), or the module for regex targets
    modules: int
    params: int


class FineTuneInventory(BaseModel):
    """Exact element counts of a fine-tuned model (PEFT's view of the parameters)."""

    model_config = ConfigDict(defer_build=True)

    method: str
    base_params: int  # the model's own parameters (tied counted once)
    trainable_base_params: int  # base tensors left trainable (full / partial fine-tuning)
    frozen_params: int  # base tensors with requires_grad=False (incl. originals of modules_to_save)
    adapter_params: int  # LoRA A/B (+ DoRA magnitudes)
    saved_copy_params: int  # trainable copies made by modules_to_save
    unmatched_modules_to_save: list[str] = Field(default_factory=list)  # names that matched no module
    trainable_params: int  # trainable_base + adapter + saved copies
    total_params: int  # base + adapter + saved copies (what PEFT's all_param counts)
    adapted_modules: int
    by_target: list[TargetCount] = Field(default_factory=list)
    quantized_params: int = 0  # base elements stored quantised
    frozen_storage_bytes: int | None = None  # frozen base weights at rest (quantised + unquantised)
    quant_constant_bytes: int = 0  # absmax / scales
    dequant_transient_elems: int = 0  # the largest quantised layer, dequantised per forward
    largest_trainable_tensor: int = 0
    notes: list[str] = Field(default_factory=list)
    # The trainable tensors (adapters, modules_to_save copies, trainable base tensors) and the
    # frozen base tensors, named as PEFT names them: the layouts of core/ are built from these.
    trainable_tensors: list[ParamTensor] = Field(default_factory=list, exclude=True)
    frozen_tensors: list[ParamTensor] = Field(default_factory=list, exclude=True)

    @property
    def trainable_fraction(self) -> float:
        return self.trainable_params / self.total_params if self.total_params else 0.0


def _names(module: str, role: str) -> tuple[str, ...]:
    """The names a module is matched by: its own, and ``lm_head`` for an output head that
    transformers 5 renamed (GPT-NeoX's checkpoint ``embed_out`` is ``lm_head`` there)."""
    return (module, "lm_head") if role == "lm_head" and module != "lm_head" else (module,)


def _module_matches(module: str, role: str, targets: tuple[str, ...] | str) -> str | None:
    """The target that matches ``module`` under PEFT's rule, or None."""
    for name in _names(module, role):
        if isinstance(targets, str):
            if re.fullmatch(targets, name):
                return name
            continue
        for t in targets:
            if name == t or name.endswith("." + t):
                return t
    return None


def _saved(module: str, role: str, modules_to_save: tuple[str, ...]) -> bool:
    # peft.utils.other._set_trainable matches a module whose name ends in one of the keys
    return any(n == m or n.endswith("." + m) for n in _names(module, role) for m in modules_to_save)


def _last_layers(spec: ModelSpec, pattern: str) -> set[int] | None:
    m = re.fullmatch(r"last:(\d{1,30})", pattern)  # int() refuses over 4,300 digits
    if m is None:
        if re.fullmatch(r"last:\d+", pattern):
            raise InputError(f"--trainable {pattern[:40]!r}…: expected last:K with 1 <= K <= {spec.num_layers} layers")
        return None
    k = int(m.group(1))
    if not 1 <= k <= spec.num_layers:
        raise InputError(f"--trainable {pattern!r}: expected last:K with 1 <= K <= {spec.num_layers} layers")
    return set(range(spec.num_layers - k, spec.num_layers))


def _trainable_base(spec: ModelSpec, patterns: tuple[str, ...]) -> set[str]:
    names: set[str] = set()
    for pat in patterns:
        layers = _last_layers(spec, pat)
        hit = {t.name for t in spec.tensors if t.tied_to is None and (
            (t.layer in layers) if layers is not None else fnmatch.fnmatchcase(t.name, pat))}
        if not hit:
            raise InputError(f"--trainable {pat!r} matches no parameter of {spec.name} "
                             f"(names look like {spec.tensors[1].name if len(spec.tensors) > 1 else '?'})")
        names |= hit
    return names


def _module_shape(tensors: list[ParamTensor]) -> tuple[int, int]:
    """(in, out) features of a Linear/Conv1D/Embedding module from its weight."""
    w = next(t for t in tensors if t.name.endswith(".weight"))
    if w.role in EMBED_ROLES:  # nn.Embedding weight [num, dim]
        return w.shape[0], w.shape[1]
    if len(w.shape) == 2 and w.role in LINEAR_ROLES:
        if _is_conv1d(w):
            return w.shape[0], w.shape[1]  # GPT-2 Conv1D weight [in, out]
        return w.shape[1], w.shape[0]  # nn.Linear weight [out, in]
    raise InputError(f"LoRA target {w.module!r} is a {w.role} module, not a linear or embedding layer")


def _is_conv1d(w: ParamTensor) -> bool:
    return w.name.startswith("transformer.h.") and (".attn.c_" in w.name or ".mlp.c_" in w.name)


def _quant_bytes(numel: int, out_features: int, q: QuantSpec) -> tuple[int, int]:
    """(packed weight bytes, quantisation constant bytes) of one quantised linear weight."""
    if q.bits == 8:
        return numel, 4 * out_features  # int8 + fp32 SCB per row (bnb Int8Params)
    packed = (numel + 1) // 2
    blocks = -(-numel // NF4_BLOCK)
    if q.double_quant:
        consts = blocks + 4 * -(-blocks // DOUBLE_QUANT_BLOCK) + 4  # uint8 absmax, fp32 absmax2, fp32 offset
    else:
        consts = 4 * blocks
    return packed, consts


def _modules(spec: ModelSpec) -> dict[str, list[ParamTensor]]:
    out: dict[str, list[ParamTensor]] = {}
    for t in spec.tensors:
        out.setdefault(t.module, []).append(t)
    return out


def finetune_inventory(spec: ModelSpec, ft: FineTune, compute_bytes: int = 2) -> FineTuneInventory:
    """Trainable / frozen / adapter counts of ``spec`` fine-tuned as ``ft``.

    ``compute_bytes`` is the bytes per element of unquantised weights (2 for bf16/fp16).
    """
    if not spec.tensors:
        raise InputError(f"model {spec.name!r} has no parameter inventory; fine-tuning needs a config.json or catalog model")
    if ft.method in ("lora", "qlora") and ft.lora is None:
        raise InputError(f"--method {ft.method} needs LoRA settings (--lora-r, --lora-targets)")
    if ft.method == "qlora" and ft.quant is None:
        raise InputError("--method qlora needs a quantisation (4 or 8 bits)")
    mods = _modules(spec)
    lora = ft.lora if ft.method in ("lora", "qlora") else None
    saved_keys = lora.modules_to_save if lora is not None else ()
    if ft.method == "full":
        train_names = _trainable_base(spec, ft.trainable) if ft.trainable else {t.name for t in spec.tensors}
    else:
        train_names = _trainable_base(spec, ft.trainable) if ft.trainable else set()

    targets: tuple[str, ...] | str = ()
    if lora is not None:
        if lora.targets == ALL_LINEAR:
            targets = tuple(sorted(m for m, ts in mods.items()
                                   if ts[0].role in LINEAR_ROLES and ts[0].role != "lm_head"))
        else:
            targets = lora.targets
    adapter = saved = 0
    adapted = 0
    copies: list[ParamTensor] = []
    by_target: dict[str, list[int]] = {}
    largest_trainable = 0
    for module, ts in mods.items():
        if lora is None:
            continue
        if saved_keys and _saved(module, ts[0].role, saved_keys):
            n = sum(t.numel for t in ts)  # a tied head's copy is a real, untied tensor
            saved += n
            largest_trainable = max(largest_trainable, max(t.numel for t in ts))
            copies.extend(t.model_copy(update={"name": f"{module}.modules_to_save.default.{t.name.rsplit('.', 1)[-1]}",
                                               "module": f"{module}.modules_to_save.default", "tied_to": None})
                          for t in ts)
            continue
        hit = _module_matches(module, ts[0].role, targets)
        if hit is None:
            continue
        fan_in, fan_out = _module_shape(ts)
        n = lora.r * (fan_in + fan_out) + (fan_out if lora.dora else 0)
        emb = ts[0].role in EMBED_ROLES
        a, b = ("lora_embedding_A", "lora_embedding_B") if emb else ("lora_A", "lora_B")
        layer = ts[0].layer
        copies.append(ParamTensor(name=f"{module}.{a}.default.weight" if not emb else f"{module}.{a}.default",
                                  module=f"{module}.{a}.default", shape=[lora.r, fan_in], role="lora", layer=layer))
        copies.append(ParamTensor(name=f"{module}.{b}.default.weight" if not emb else f"{module}.{b}.default",
                                  module=f"{module}.{b}.default", shape=[fan_out, lora.r], role="lora", layer=layer))
        if lora.dora:
            copies.append(ParamTensor(name=f"{module}.lora_magnitude_vector.default.weight",
                                      module=f"{module}.lora_magnitude_vector.default", shape=[fan_out], role="lora",
                                      layer=layer))
        adapter += n
        adapted += 1
        key = hit if lora.targets != ALL_LINEAR else module.rsplit(".", 1)[-1]
        by_target.setdefault(key, [0, 0])
        by_target[key][0] += 1
        by_target[key][1] += n
        largest_trainable = max(largest_trainable, lora.r * max(fan_in, fan_out))
    # PEFT skips a modules_to_save name that matches no module (one list serves several families:
    # embed_tokens, lm_head); the plan does too, and says so (core/finetune_inputs.py)
    missed = [m for m in saved_keys if not any(_saved(module, ts[0].role, (m,)) for module, ts in mods.items())]
    if lora is not None and adapted == 0 and not saved:
        raise InputError(f"--lora-targets {_fmt_targets(lora.targets)} match no module of {spec.name} "
                         f"(modules look like {next(iter(mods))!r})")

    base = spec.params
    trainable_base = sum(t.numel for t in spec.tensors if t.tied_to is None and t.name in train_names)
    largest_trainable = max([largest_trainable] + [t.numel for t in spec.tensors if t.name in train_names])
    inv = FineTuneInventory(
        method=ft.method, base_params=base, trainable_base_params=trainable_base,
        frozen_params=base - trainable_base, adapter_params=adapter, saved_copy_params=saved,
        trainable_params=trainable_base + adapter + saved, total_params=base + adapter + saved,
        adapted_modules=adapted, unmatched_modules_to_save=missed,
        by_target=[TargetCount(target=k, modules=v[0], params=v[1]) for k, v in sorted(by_target.items())],
        largest_trainable_tensor=largest_trainable,
        trainable_tensors=[t for t in spec.tensors if t.tied_to is None and t.name in train_names] + copies,
        frozen_tensors=[t for t in spec.tensors if t.tied_to is None and t.name not in train_names],
    )
    _add_storage(inv, spec, ft, mods, train_names, compute_bytes)
    return inv


def _add_storage(inv: FineTuneInventory, spec: ModelSpec, ft: FineTune, mods: dict[str, list[ParamTensor]],
                 train_names: set[str], compute_bytes: int) -> None:
    """Bytes of the frozen base weights at rest, quantised where QLoRA quantises them."""
    q = ft.quant if ft.method == "qlora" else None
    frozen_bytes = consts = qparams = transient = 0
    for module, ts in mods.items():
        for t in ts:
            if t.tied_to is not None or t.name in train_names:
                continue
            quantised = (q is not None and t.role in LINEAR_ROLES and t.role != "lm_head"
                         and t.name.endswith(".weight") and len(t.shape) == 2)
            if quantised:
                out_f = t.shape[1] if _is_conv1d(t) else t.shape[0]
                packed, c = _quant_bytes(t.numel, out_f, q)
                frozen_bytes += packed
                consts += c
                qparams += t.numel
                transient = max(transient, t.numel)
            else:
                frozen_bytes += t.numel * compute_bytes
    inv.frozen_storage_bytes = frozen_bytes + consts
    inv.quant_constant_bytes = consts
    inv.quantized_params = qparams
    inv.dequant_transient_elems = transient
    if q is not None:
        inv.notes.append(
            f"{qparams:,} base weights stored in {q.bits}-bit"
            + (f" {q.quant_type}{' with double quantisation' if q.double_quant else ''}" if q.bits == 4 else "")
            + f" ({inv.frozen_storage_bytes - (inv.frozen_params - qparams) * compute_bytes:,} bytes incl. "
            f"{consts:,} of constants); one layer of {transient:,} elements is dequantised per forward")


def _fmt_targets(t: tuple[str, ...] | str) -> str:
    return t if isinstance(t, str) else ",".join(t)
