"""What ``bench zero`` compares against: the model scaled down, the ZeroConfig of each stage, and the
planner's ``Plan`` for exactly the run (split out of ``bench/validate.py``)."""

from __future__ import annotations

from typing import Any


def scaled_spec(spec: Any, layers: int | None = 2, hidden: int | None = 64, vocab: int | None = 512,
                experts: int | None = 4) -> Any:
    """A small model of the same family: ``layers`` blocks of width ``hidden`` (None = keep), as the bundled
    runtime builds it: one module per checkpoint module (``module_tree`` "checkpoint": an MoE layer's experts
    are modules of their own, not transformers 5's fused one, core/moe_leaf.py)."""
    if layers is None and hidden is None and vocab is None:
        return spec.model_copy(update={"module_tree": "checkpoint"})
    kw: dict[str, Any] = {}
    if layers is not None:
        kw["num_layers"] = min(layers, spec.num_layers)
    if hidden is not None and hidden < spec.hidden_size:
        head_dim = 16 if hidden % 16 == 0 else hidden // max(1, hidden // 16)
        heads = max(1, hidden // head_dim)
        ratio = max(1, spec.num_attention_heads // max(1, spec.num_key_value_heads))
        kv = max(1, heads // ratio) if spec.num_key_value_heads > 1 else 1
        while heads % kv:
            kv -= 1
        kw.update(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv,
                  intermediate_size=max(1, spec.intermediate_size * hidden // spec.hidden_size))
    if vocab is not None and vocab < spec.vocab_size:
        kw["vocab_size"] = vocab
    if experts is not None and spec.num_experts and experts < spec.num_experts:
        kw["num_experts"] = max(experts, spec.experts_per_token)
    return spec.scaled(**kw).model_copy(update={"module_tree": "checkpoint"})


def _zero_config(stage: int, ds: Any) -> Any:
    from zeroplan.specs.deepspeed_config import ZeroConfig

    if ds is None:
        return ZeroConfig(stage=stage, overlap_comm=stage == 3)
    upd: dict[str, Any] = {"stage": stage}
    if ds.zero.stage != stage and "overlap_comm" not in (ds.raw.get("zero_optimization") or {}):
        upd["overlap_comm"] = stage == 3
    return ds.zero.model_copy(update=upd)


def engine_optimizer_impl(device: str) -> str:
    """The optimizer rule (core/memory_states.py ``optimizer_temp_bytes``) of the bundled engine's AdamW on
    ``device``: on CPU its ``planner`` mimic keeps one fp32 temporary of the group's size (engine_base.py
    ``_adamw_one``: the denominator), torch's foreach rule; on CUDA it updates in FusedAdam's chunks."""
    return "fused-adam" if device == "cuda" else "torch-foreach"


def deepspeed_optimizer_impl(device: str, optimizer_block: bool) -> str:
    """The optimizer DeepSpeed steps in ``bench zero --engine deepspeed`` (bench/ds_worker.py): on CUDA the
    config's optimizer block becomes FusedAdam, without one a client torch AdamW (foreach on CUDA tensors);
    on CPU a client torch AdamW, which takes its single-tensor path for CPU tensors."""
    if device != "cuda":
        return "torch-single"
    return "fused-adam" if optimizer_block else "torch-foreach"


def predict(spec: Any, zero: Any, *, precision: str, micro_batch: int, seq_len: int, grad_accum: int,
            n: int, comm_model: str = "deepspeed", hardware: Any = None, optimizer: str = "adamw",
            checkpointing: str = "none", finetune: Any = None, optimizer_impl: str = "fused-adam") -> Any:
    """The planner's ``Plan`` for exactly this run (``zeroplan.core.plan.evaluate``).

    ``finetune``: a ``specs.finetune.FineTune`` (LoRA / partial training): the plan then takes
    the trainable and full views of ``core.finetune.finetune_views``, as ``estimate`` does.
    ``optimizer_impl``: the optimizer's step temporaries (``engine_optimizer_impl``,
    ``deepspeed_optimizer_impl``).
    """
    from zeroplan.core.finetune import finetune_views
    from zeroplan.core.plan import evaluate
    from zeroplan.specs.training import TrainingSetup, get_optimizer, get_precision

    training = TrainingSetup(precision=get_precision(precision), optimizer=get_optimizer(optimizer),
                             micro_batch=micro_batch, seq_len=seq_len, grad_accum=grad_accum, flash_attention=True,
                             checkpointing=checkpointing, optimizer_impl=optimizer_impl)
    views = None
    if finetune is not None and not finetune.is_full:
        views = finetune_views(spec, finetune, compute_bytes=training.precision.param_bytes)
    return evaluate(model=spec, training=training, zero=zero, n_gpus=n, gpus_per_node=n, hardware=hardware,
                    comm_model=comm_model, finetune=views)
