"""The optimizer step on the GPU: HBM bytes it moves per step, pass by pass.

Every pass of the step is an element-wise kernel bound by memory bandwidth, so its time is the
bytes it reads and writes over ``HBM bandwidth × HBM_EFFICIENCY`` (core/compute.py). The step runs
after the last gradient bucket and before the next forward: nothing hides it (issue 13, "the
optimizer step and the last bucket never overlap"). Offloaded optimizers step on the host instead
(core/timing.py ``cpu_adam_rate``), and are 0 here.

Bytes per element of what the optimizer updates (``b``: the model dtype's bytes, ``g``: the
gradient's as the step finds it), DeepSpeed 0.19.8:

- **ZeRO stages 1-3** (``stage_1_and_2.py`` / ``stage3.py`` ``step``), over the rank's partition:
  the overflow check (``has_inf_or_nan``: an ``amax`` and an ``amin`` pass, 2g; stages 1-2 for fp16
  and, by ``bf16.check_grad_overflow``'s default, bf16; stage 3 for fp16 only); the norm
  (``get_grad_norm_direct``: ``.to(get_norm_dtype())``, an fp64 copy, then its norm: g + 16); the flat
  fp32 gradient (``flatten`` 2g, then ``.to(fp32)`` g + 4; stages 1-2 skip both when the gradients
  already sit in an fp32 partition buffer, ``_use_compact_grad_partition_buffer``, the cast when they
  are fp32, and the flatten when the rank's partition lies inside one tensor: torch's
  ``flatten_dense_tensors`` returns a lone tensor as a view); ``unscale_and_clip_grads`` (``mul_``: 8;
  stages 1-2 skip it for bf16 and fp32 without ``gradient_clipping``, counted here all the same); the
  optimizer; the copy back to the model dtype (``bit16_partitions[...].data.copy_``: 4 + b).
- **BF16_Optimizer** (``bf16_optimizer.py`` ``step``, ZeRO-1 with fp32 gradient accumulation): over
  the whole model's fp32 gradient buffer the norm (``get_global_norm_of_tensors``: 4), the clip
  (``clip_tensors_by_global_norm``: 8, when the norm exceeds ``gradient_clipping``) and
  ``clear_hp_grads``' ``zero_()``, run by the step and again by the engine's ``zero_grad`` (8); over
  the partition the optimizer and ``update_lp_params``' copy (4 + b).
- **FP16_Optimizer / FP16_UnfusedOptimizer** (``fp16/fused_optimizer.py``, ``unfused_optimizer.py``;
  ZeRO-0 with 16-bit weights), over the whole model: the overflow check (2b); each gradient cast to
  fp32 (b + 4), which the fused wrapper flattens (8) and takes the norm of (4), while the unfused one
  takes the norm of another fp32 copy of each 16-bit gradient (``get_weight_norm``: b + 8); the
  unscale (8); the optimizer; the copy back (4 + b).
- **No wrapper** (fp32 without ZeRO): the optimizer alone.

The optimizer itself, per fp32 element: a one-pass kernel (DeepSpeed FusedAdam's
``multi_tensor_adam.cu`` ``AdamFunctor``, torch's ``_fused_adamw``) reads the parameter, the
gradient and the states and writes the parameter and the states: 12 + 2 × state bytes (Adam: 28).
torch's ``_multi_tensor_adam`` (foreach) and ``_single_tensor_adam`` run Adam as separate passes:
weight decay ``mul_`` (8, AdamW: torch's default weight decay is 0.01; Adam's is 0), ``lerp_`` of
the first moment (12), ``mul_`` (8) and ``addcmul_`` (12) of the second, its ``sqrt`` (8), ``div_``
(8) and ``add_`` of eps (8), and the ``addcdiv_`` update (16): 80 bytes for AdamW, 72 for Adam.
Other optimizers are counted as one pass.

``examples/validation/cpu-replay/step_traffic.py`` traces real DeepSpeed's step op by op on CPU and
``tests/test_optimizer_step.py`` holds these counts to it. Not counted: kernel launches and host
synchronisations, which matter only when the partition is many small tensors (DeepSpeed 0.10's
FP16_Optimizer still read each gradient's overflow sum back to the host, ``float(x.float().sum())``).
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from zeroplan.core.layout import Layout
from zeroplan.core.memory_states import state_plan
from zeroplan.specs.ds_schema import ZeroConfig, zero_or_default
from zeroplan.specs.training import TrainingSetup

__all__ = ["OptimizerPass", "OptimizerTraffic", "inner_step_passes", "optimizer_traffic"]

_ADAM = ("adam", "adamw")
_Passes = list[tuple[str, int]]  # (what, bytes per element)
# torch.optim.adam _multi_tensor_adam / _single_tensor_adam, one fp32 element (4 B) per tensor touched
_TORCH_ADAM_PASSES: tuple[tuple[str, int], ...] = (
    ("lerp_ first moment", 12), ("mul_ second moment", 8), ("addcmul_ second moment", 12),
    ("sqrt", 8), ("div_ bias correction", 8), ("add_ eps", 8), ("addcdiv_ update", 16))


class OptimizerPass(BaseModel):
    what: str
    bytes_per_element: int
    elements: int  # the partition, or the whole model for BF16_Optimizer's gradient passes

    @property
    def bytes(self) -> int:
        return self.bytes_per_element * self.elements


class OptimizerTraffic(BaseModel):
    """HBM traffic of one optimizer step on one GPU (empty when the optimizer steps on the host)."""
    wrapper: str = ""
    elements: int = 0  # elements the optimizer updates on this GPU
    passes: list[OptimizerPass] = Field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(p.bytes for p in self.passes)

    def describe(self) -> str:
        if not self.passes:
            return "no optimizer step on the GPU"
        per = ", ".join(f"{p.what} {p.bytes_per_element}" + ("" if p.elements == self.elements else
                                                               f" (over {p.elements:,})") for p in self.passes)
        return f"{self.elements:,} elements ({self.wrapper}); bytes per element: {per}"


def inner_step_passes(training: TrainingSetup) -> list[tuple[str, int]]:
    """The optimizer's own passes over fp32 elements (module docstring)."""
    opt = training.optimizer
    one_pass = 12 + 2 * int(opt.state_bytes)
    if opt.name in _ADAM and training.optimizer_impl in ("torch-foreach", "torch-single"):
        decay = [("mul_ weight decay", 8)] if opt.name == "adamw" else []
        return decay + list(_TORCH_ADAM_PASSES)
    return [(f"{opt.name} ({training.optimizer_impl}, one pass)", one_pass)]


def _partition_is_one_piece_12(layout: Layout, rank: int | None) -> bool:
    """Whether a rank's stage-1/2 partition lies inside one tensor, so that ``flatten`` returns it as a view:
    torch's ``flatten_dense_tensors`` copies only two or more tensors, and the last partition is padded by
    one more (``flatten_dense_tensors_aligned``). ``rank`` None: every rank's (the step waits for the slowest)."""
    part, total = layout.partition_12, layout.params
    bounds, pos = [], 0
    for t in layout.tensors:
        pos += t.numel
        bounds.append(pos)
    if rank is None:
        return total % part == 0 and all(b % part == 0 for b in bounds)
    lo, hi = rank * part, (rank + 1) * part
    if lo >= total:
        return True  # padding alone
    inner = sum(1 for b in bounds[:-1] if lo < b < min(hi, total))
    return inner == 0 and hi <= total


def _zero_passes(training: TrainingSetup, stage: int, g: int, b: int, one_piece: bool) -> list[tuple[str, int]]:
    """DeepSpeedZeroOptimizer / DeepSpeedZeroOptimizer_Stage3 ``step`` over the partition."""
    name = training.precision.name
    compact = stage in (1, 2) and g == 4 and b != 4  # stage_1_and_2.py _use_compact_grad_partition_buffer
    # engine.py _configure_zero_optimizer: check_grad_overflow for fp16, and for bf16 by its config's default
    # (precision_config.py check_grad_overflow = True); stage3.py checks fp16 only
    overflow = name == "fp16" or (name == "bf16" and stage in (1, 2))
    out = [("overflow check", 2 * g)] if overflow else []
    out.append(("norm in fp64", g + 16))
    if not compact:
        if not one_piece:
            out.append(("flatten", 2 * g))
        if g != 4:
            out.append(("cast to fp32", g + 4))
    return out + [("unscale and clip", 8)]


def _wrapper_passes(wrapper: str, stage: int, training: TrainingSetup, g: int,
                    one_piece: bool) -> tuple[_Passes, _Passes, _Passes]:
    """DeepSpeed's wrapper around the optimizer (module docstring): (partition passes before the optimizer,
    partition passes after it, whole-model passes)."""
    b = training.precision.param_bytes
    copy_back = [("copy to the model dtype", 4 + b)]
    if wrapper == "basic":
        return [], [], []
    if wrapper == "bf16_optimizer":
        return [], copy_back, [("norm (whole model)", 4), ("clip (whole model)", 8),
                               ("zero the fp32 gradients twice", 8)]
    if stage == 0:
        norm = [("flatten", 8), ("norm", 4)] if wrapper == "fp16_optimizer" else [("norm of an fp32 copy", b + 8)]
        return [("overflow check", 2 * b), ("cast to fp32", b + 4), *norm, ("unscale and clip", 8)], copy_back, []
    return _zero_passes(training, stage, g, b, one_piece), copy_back, []


def optimizer_traffic(layout: Layout, training: TrainingSetup, zero: ZeroConfig | None, *,
                      rank: int | None = None) -> OptimizerTraffic:
    """The passes of one optimizer step on one GPU over the layout of what trains (module docstring): on
    ``rank``, or (None) on the rank with the most to do. What DeepSpeed runs, whatever accounting
    (``--flavour``) the memory plan uses."""
    zero = zero_or_default(zero)
    stage = zero.stage
    if zero.optimizer_offload_device != "none" and stage >= 1:
        return OptimizerTraffic()  # the host steps it (core/timing.py cpu_adam_rate)
    # without offload the step runs on the GPU whatever --optimizer-impl says (DeepSpeedCPUAdam would assert
    # that its parameters are on the CPU: ops/adam/cpu_adam.py): a cpu-adam impl here is counted as one pass
    sp = state_plan(training, stage, offload=False)
    part = layout.params if stage == 0 else layout.partition_12 if stage in (1, 2) else layout.partition_3
    model = layout.flat_padded if stage in (1, 2) else layout.params
    one_piece = stage in (1, 2) and _partition_is_one_piece_12(layout, rank)
    before, after, whole = _wrapper_passes(sp.wrapper, stage, training, sp.grad_bytes, one_piece)
    passes = [OptimizerPass(what=w, bytes_per_element=n, elements=part)
              for w, n in before + inner_step_passes(training) + after]
    passes += [OptimizerPass(what=w, bytes_per_element=n, elements=model) for w, n in whole]
    return OptimizerTraffic(wrapper=sp.wrapper, elements=part, passes=passes)
