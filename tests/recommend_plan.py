"""A ``recommend`` candidate planned again by ``evaluate()`` (shared by the tests that hold the sweep to it)."""

from __future__ import annotations

from zeroplan.advice.recommend import candidate_zero
from zeroplan.core.inputs import zero_for_stage
from zeroplan.core.plan import evaluate


def evaluate_candidate(inp, c, *, stage: int | None = None, offload_optimizer: str | None = None,
                       offload_param: str | None = None):
    """``evaluate()`` of candidate ``c`` of ``recommend(inp)``: its stage, offload, buckets, hpZ, micro-batch and
    checkpointing (``stage`` / ``offload_*`` override the candidate's)."""
    zero = candidate_zero(zero_for_stage(inp, c.stage if stage is None else stage),
                          offload_optimizer=c.offload_optimizer if offload_optimizer is None else offload_optimizer,
                          offload_param=c.offload_param if offload_param is None else offload_param,
                          reduce_bucket_size=c.reduce_bucket_size, prefetch_bucket_size=c.prefetch_bucket_size,
                          hpz_partition_size=c.hpz_partition_size)
    tr = inp.training.model_copy(update={"micro_batch": c.micro_batch, "checkpointing": c.checkpointing})
    return evaluate(model=inp.spec, training=tr, zero=zero, n_gpus=inp.n_gpus, gpus_per_node=inp.gpus_per_node,
                    hardware=inp.hardware, finetune=inp.finetune)
