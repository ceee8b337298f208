"""Simulated scale: the same engine code, one process, any world size, no real memory.

Under ``FakeTensorMode`` every tensor has a shape, a dtype and a (fake) storage size but no
data, and torch's fake process group answers every collective at once. The ZeRO engine,
the model and the storage tracker run unchanged, so the per-rank memory by category and
phase, and the exact collective schedule, of e.g. llama-2-70b at N = 64 are traced in
seconds within a few hundred MiB of RAM. The heaviest of the N ranks is simulated (rank 0
unless the stage-1/2 gradient partition buffers differ by rank; the loss is NaN: fake
tensors have no values).

Private APIs (wrapped; a moved API raises ``SimulationUnavailable`` saying which):
``torch._subclasses.fake_tensor.FakeTensorMode`` and
``torch.testing._internal.distributed.fake_pg.FakeStore`` (the "fake" backend).
Not supported: MoE models (data-dependent token routing has no fake shape).
"""

from __future__ import annotations

from typing import Any

__all__ = ["SimulationUnavailable", "simulate_rank", "heaviest_rank"]


class SimulationUnavailable(RuntimeError):
    """This torch build lacks a private API the simulation needs."""


def _private_apis() -> tuple[Any, Any]:
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
    except ImportError as exc:  # pragma: no cover - depends on the torch build
        raise SimulationUnavailable(f"torch._subclasses.fake_tensor.FakeTensorMode is not available: {exc}") from exc
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as exc:  # pragma: no cover
        raise SimulationUnavailable(
            f"torch.testing._internal.distributed.fake_pg.FakeStore (the 'fake' process group) is not available: {exc}"
        ) from exc
    return FakeTensorMode, FakeStore


def heaviest_rank(spec: Any, n: int, stage: int) -> int:
    """The rank holding the most model-state bytes: in stages 1-2 the gradient partition buffer
    covers the whole params overlapping a rank's slice (DeepSpeed's sizing), so ranks differ;
    otherwise every rank holds the same and rank 0 is simulated."""
    if stage not in (1, 2) or n <= 1:
        return 0
    numels = [t.numel for t in spec.tensors if t.tied_to is None]
    part = (-(-sum(numels) // (2 * n)) * 2 * n) // n
    from zeroplan.runtime.engine import grad_span

    best, best_rank = -1, 0
    for r in range(n):
        lo, hi = grad_span(numels, r * part, (r + 1) * part)
        if hi - lo > best:
            best, best_rank = hi - lo, r
    return best_rank


def simulate_rank(spec: Any, zero: Any, *, n: int, precision: str, micro_batch: int = 1, seq_len: int = 128,
                  grad_accum: int = 1, comm_model: str = "deepspeed", steps: int = 3, rank: int | None = None) -> dict:
    """Trace one rank of an ``n``-rank run: the last of ``steps`` optimizer steps is measured.

    Returns the same measurement dict as ``zeroplan.bench.validate.measure_rank`` (collectives
    of one step grouped by "op/phase", model_states, phase_peaks, host_bytes).
    """
    import torch
    import torch.distributed as dist

    from zeroplan.runtime.results import group_records as _group
    from zeroplan.runtime.comm import InstrumentedComm
    from zeroplan.runtime.engine import ZeroEngine
    from zeroplan.runtime.memory import StorageTracker
    from zeroplan.runtime.model import build_model

    if spec.num_experts:
        raise SimulationUnavailable("simulation of MoE models is not supported (token routing is data-dependent)")
    FakeTensorMode, FakeStore = _private_apis()
    if dist.is_initialized():
        raise RuntimeError("simulate_rank needs a process without an initialised torch.distributed group")
    if rank is None:
        rank = heaviest_rank(spec, n, int(getattr(zero, "stage", 0)))
    dist.init_process_group("fake", rank=rank, world_size=n, store=FakeStore())
    engine = None
    try:
        comm = InstrumentedComm()
        tracker = StorageTracker()
        with FakeTensorMode(allow_non_fake_inputs=True), tracker:
            model = build_model(spec, precision, "cpu", seed=0, check_count=not spec.approximate)
            engine = ZeroEngine(model, zero, precision=precision, comm=comm, grad_accum=grad_accum,
                                comm_model=comm_model, meter=tracker)
            per_step = []
            states: dict[str, int] = {}
            for s in range(steps):
                if s == steps - 1:
                    comm.reset()
                    tracker.reset_peaks()
                # made one micro-step at a time, as a training loop makes them (see train_step)
                batches = (torch.zeros(micro_batch, seq_len, dtype=torch.long) for _ in range(grad_accum))
                n0 = len(comm.records)
                r = engine.train_step(batches)
                states = r["model_states"]
                if s == steps - 1:
                    per_step.append(_group(comm.records[n0:]))
        return {"rank": rank, "collectives": per_step[0], "steady": True, "model_states": states,
                "phase_peaks": tracker.phase_peaks(), "host_bytes": int(tracker.host_bytes), "step_time_s": None,
                "losses": None}
    finally:
        if engine is not None:
            engine.close()
        dist.destroy_process_group()
