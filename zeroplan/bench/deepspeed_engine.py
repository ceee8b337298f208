"""Run the REAL DeepSpeed engine on a zeroplan model and record what it issues.

This is the external witness for zeroplan's ledger (``zeroplan.core.comm``) and memory model:
the same model is trained by ``deepspeed.initialize`` / ``engine.backward`` / ``engine.step``
on CPU over gloo, and every collective DeepSpeed issues is recorded by wrapping the
``torch.distributed`` functions in each rank (op, FULL buffer bytes, dtype, group size,
phase), with DeepSpeed's own comms logger as a second witness. Persistent memory per rank
is read from the optimizer object after the steps (tensor storages, deduplicated).

Conventions:
- ``buffer_bytes`` follows ``zeroplan.specs.collectives``: the output of an all-gather, the
  input of a reduce-scatter, the tensor of an all-reduce / broadcast / reduce (bytes of the
  dtype actually sent).
- A "step" is one optimizer step = ``grad_accum`` micro-steps. Phases: ``forward`` (the
  module call), ``backward`` (``engine.backward``), ``step`` (``engine.step``).
- Memory values are bytes per rank (CPU tensor storages, each storage counted once).

Device (``select_device``): CUDA with NCCL when CUDA is available and has at least ``nproc``
GPUs (``DS_ACCELERATOR=cuda``, rank r on ``cuda:r``; the config's ``optimizer`` block is kept,
so DeepSpeed builds its FusedAdam as it would for the user; without one, a client torch
AdamW); else CPU: ``DS_ACCELERATOR=cpu``, gloo, a plain ``torch.optim.AdamW`` with
``zero_force_ds_cpu_optimizer: false``. On CUDA every rank also reports
``max_memory_allocated`` / ``max_memory_reserved`` over the measured steps. The shared-memory comm op DeepSpeed would otherwise
JIT-compile at ``init_distributed`` (60-70 s on first use, only used for inference
all-reduce) is switched off by marking it incompatible in ``deepspeed.ops.__compatible_ops__``
before the backend starts (see ``_disable_shm_comm_op``).

torch and deepspeed are imported inside functions only.

The work is split by concern, and this module re-exports every name: ``ds_recorder`` (the
collectives recorder), ``ds_memory`` (storages by category), ``ds_frozen`` (the frozen-parameter
check), ``ds_config_prep`` (configs), ``ds_worker`` (one rank), ``ds_jobs`` (the launch and the
entry points), ``ds_results`` (results and summaries).
"""

from __future__ import annotations

# re-exported: zeroplan.bench.deepspeed_engine keeps every name it had
from zeroplan.bench.ds_config_prep import _drop_auto, make_ds_config, prepare_ds_config  # noqa: F401
from zeroplan.bench.ds_frozen import _frozen_check, _numel_of_tensors  # noqa: F401
from zeroplan.bench.ds_jobs import (  # noqa: F401
    deepspeed_available, run_deepspeed_jobs, run_deepspeed_matrix, run_deepspeed_steps, select_device)
from zeroplan.bench.ds_memory import (  # noqa: F401
    _CATEGORY_RULES, MEMORY_CATEGORIES, _categorize, _collect_storages, _memory_by_category)
from zeroplan.bench.ds_recorder import DS_OPS, _OBJECT_OPS, _dtype_name, _nbytes, _Recorder  # noqa: F401
from zeroplan.bench.ds_results import (  # noqa: F401
    DeepSpeedRankResult, _to_rank_result, per_step_summary, steps_identical, summarize_step)
from zeroplan.bench.ds_worker import (  # noqa: F401
    _build_model, _die_with_parent, _disable_shm_comm_op, _register_backward_snapshot, _run_job, _worker)

__all__ = [
    "DS_OPS",
    "DeepSpeedRankResult",
    "run_deepspeed_steps",
    "run_deepspeed_matrix",
    "run_deepspeed_jobs",
    "prepare_ds_config",
    "make_ds_config",
    "deepspeed_available",
    "summarize_step",
    "per_step_summary",
    "steps_identical",
]
