"""One rank of ``bench zero``: every configuration run on the bundled engine, collectives grouped
per step, model states and phase peaks measured, an OOM recorded as a result (split out of
``bench/validate.py``)."""

from __future__ import annotations

import statistics
import time
from typing import Any

from zeroplan.bench.cuda_oom import cuda_oom_record, is_cuda_oom
from zeroplan.runtime.results import group_records


def measure_rank(rank: int, world: int, spec: Any, runs: list[dict[str, Any]], device: str = "cpu") -> list[dict]:
    """Run every configuration of ``runs`` on this rank; return one measurement dict per run.

    A run: {"zero": ZeroConfig, "precision", "micro_batch", "seq_len", "grad_accum", "warmup",
    "steps", "comm_model", "memory_limit_bytes" (optional), "seed", "finetune" (optional: a
    ``FineTune``; LoRA adapters and a frozen base, ``runtime.lora.apply_finetune``)}.
    """
    import gc

    import torch

    from zeroplan.runtime.comm import InstrumentedComm
    from zeroplan.runtime.engine import ZeroEngine
    from zeroplan.runtime.lora import apply_finetune
    from zeroplan.runtime.memory import SimulatedOutOfMemory, make_meter
    from zeroplan.runtime.model import build_model

    dev = torch.device(device if device != "cuda" else f"cuda:{torch.cuda.current_device()}")
    out = []
    for run in runs:
        comm = InstrumentedComm()
        meter = make_meter(dev, run.get("memory_limit_bytes"))
        res: dict[str, Any] = {"rank": rank}
        engine = model = None
        try:
            with meter:
                model = build_model(spec, run["precision"], dev, seed=run.get("seed", 0),
                                    checkpointing=run.get("checkpointing", "none"))
                apply_finetune(model, spec, run.get("finetune"), seed=run.get("seed", 0))
                engine = ZeroEngine(model, run["zero"], precision=run["precision"], comm=comm,
                                    grad_accum=run["grad_accum"], comm_model=run["comm_model"], meter=meter)
                gen = torch.Generator().manual_seed(1000 + rank)
                per_step: list[dict] = []
                times: list[float] = []
                states: dict[str, int] = {}
                losses = []
                fault = run.get("fault")
                for s in range(run["warmup"] + run["steps"]):
                    if fault and fault["rank"] == rank and fault.get("step", 0) == s:
                        _inject(fault["kind"])
                    if s == run["warmup"]:
                        comm.reset()
                        meter.reset_peaks()
                    batches = (torch.randint(0, spec.vocab_size, (run["micro_batch"], run["seq_len"]),
                                             generator=gen).to(dev) for _ in range(run["grad_accum"]))
                    n0 = len(comm.records)
                    t0 = time.perf_counter()
                    r = engine.train_step(batches)
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    dt = time.perf_counter() - t0
                    losses.append(r["loss"])
                    if s >= run["warmup"]:
                        times.append(dt)
                        states = r["model_states"]
                        per_step.append(_group(comm.records[n0:]))
            res.update(
                collectives=per_step[0] if per_step else {},
                steady=all(p == per_step[0] for p in per_step),
                model_states=states,
                phase_peaks=meter.phase_peaks(),
                host_bytes=int(meter.host_bytes),
                step_time_s=statistics.median(times) if times else None,
                losses=losses,
            )
        except SimulatedOutOfMemory as exc:
            res["oom"] = {"phase": exc.phase, "where": getattr(exc, "where", None),
                          "requested_bytes": exc.requested_bytes, "live_bytes": exc.live_bytes,
                          "limit_bytes": exc.limit_bytes, "by_category": exc.by_category, "message": str(exc)}
        except Exception as exc:  # noqa: BLE001 - only a real CUDA OOM is a result; anything else re-raised
            if not is_cuda_oom(exc):
                raise
            # one configuration ran out of device memory: record it, free what it held, go on
            res["oom"] = cuda_oom_record(exc, meter)
        finally:
            if engine is not None:
                engine.close()
            del engine, model
            gc.collect()  # this run's garbage; what is alive now is frozen, so the next collection skips it
            gc.freeze()
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        out.append(res)
    return out


def _inject(kind: str) -> None:
    """Test hook (``run["fault"]``): make this rank hang, die or raise."""
    import os
    import signal

    if kind == "hang":
        time.sleep(3600)
    elif kind == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        raise RuntimeError("injected fault")


_group = group_records  # 'op/phase' -> {count, bytes, dtypes} for one step's records


def _rank_entry(rank: int, world: int, spec: Any, runs: list[dict], device: str) -> list[dict]:
    if device == "cuda":
        import os

        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    return measure_rank(rank, world, spec, runs, device)


def _preload_dispatch() -> None:
    """Entering the first TorchDispatchMode imports torch._dynamo (~3.5 s): do it once before forking."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception:  # noqa: BLE001 - only a start-up optimisation
        pass
