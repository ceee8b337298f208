"""The bytes real DeepSpeed's optimizer step streams through memory, op by op.

Real DeepSpeed 0.19.8 as rank 0 of 8 on torch's fake process group (as peak_live.py), a model of the catalog
scaled to 2 layers (hidden and vocabulary as given), a client ``torch.optim.AdamW(fused=True)`` (one fused
pass, as DeepSpeed's FusedAdam on a GPU) and ``gradient_clipping`` 1e-6: clipping on, as the HF Trainer's
``max_grad_norm`` 1.0 sets it, and below the norm, so that BF16_Optimizer, which multiplies only when the norm
exceeds the bound, clips as well. The second ``engine.step()`` runs under a ``TorchDispatchMode`` that charges
every ATen op the bytes it reads and writes, each tensor once: every tensor argument is read (the destination
of ``copy_``, ``zero_`` and ``fill_`` is not), every argument the op's schema marks as written is written (a
fused Adam's gradients only when it unscales them), and every new output is written. Views, allocations and
metadata ops move nothing, and collectives are left to the communication ledger. That is the cost model of
zeroplan's ``core/optimizer_step.py``, applied to the ops DeepSpeed really runs on the host's device, so the
file says whether the plan's passes are DeepSpeed's.

    python examples/validation/cpu-replay/step_traffic.py OUT.json [MODEL] [--hidden H] [--vocab V]
        [--world N] [--runs 'bf16:1,bf16:2,bf16:3,bf16-fp32acc:1,bf16:0,fp32:2']

Each run is ``precision:stage``; ``bf16-fp32acc`` adds ``data_types.grad_accum_dtype: fp32`` (ZeRO-1 then
runs BF16_Optimizer). The report lists, per run, the total bytes, the elements of rank 0's partition and
the ops that moved the most.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from zeroplan.bench.deepspeed_engine import _disable_shm_comm_op
from zeroplan.bench.ds_config_prep import make_ds_config
from zeroplan.bench.zero_predict import scaled_spec
from zeroplan.runtime.model import build_model
from zeroplan.runtime.simulate import _private_apis
from zeroplan.specs.model import load_model

NO_READ = {"aten.copy_.default", "aten.zero_.default", "aten.fill_.Scalar", "aten.fill_.Tensor"}


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def _key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel(), t.dtype)


def _nbytes(ts: list[torch.Tensor]) -> int:
    seen: dict[tuple, int] = {}
    for t in ts:
        seen.setdefault(_key(t), t.numel() * t.element_size())
    return sum(seen.values())


class Traffic(TorchDispatchMode):
    """Bytes read and written per ATen op (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, list[int]] = {}  # name -> [calls, bytes]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        name = str(func)
        if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns) \
                or name.startswith(("c10d.", "aten.empty")):
            return out  # a view or an allocation moves nothing; collectives are the ledger's
        vals = dict(zip([a.name for a in schema.arguments], args))
        vals.update(kwargs)
        read, written = [], []
        for a in schema.arguments:
            ts = _tensors(vals.get(a.name))
            # torch's fused Adam kernels store the gradients back only to unscale them (grad_scale given):
            # aten/src/ATen/native/cuda/fused_adam_utils.cuh skips kGradIdx otherwise
            keep = not (name.startswith("aten._fused_adam") and a.name == "grads" and vals.get("grad_scale") is None)
            if a.alias_info is not None and a.alias_info.is_write and keep:
                written += ts
                if name in NO_READ:
                    continue
            read += ts
        inputs = {_key(t) for t in read + written}
        written += [t for t in _tensors(out) if _key(t) not in inputs]
        moved = _nbytes(read) + _nbytes(written)
        if moved:
            slot = self.ops.setdefault(name, [0, 0])
            slot[0] += 1
            slot[1] += moved
        return out


def _run(spec, precision: str, stage: int, fp32_acc: bool, world: int) -> dict:
    import deepspeed

    cfg = make_ds_config(stage=stage, precision=precision, micro_batch=1, grad_accum=1, comms_logger=False)
    cfg["gradient_clipping"] = 1e-6
    if fp32_acc:
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    model = build_model(spec, "fp32", "cpu", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    mode = None
    for step in range(2):
        ids = torch.randint(0, spec.vocab_size, (1, 64))
        engine.backward(engine(ids))
        if step == 1:
            mode = Traffic()
            with mode:
                engine.step()
        else:
            engine.step()
    opt = engine.optimizer
    names = ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups", "fp32_groups_flat_partition",
             "fp32_groups_flat")
    groups = next((g for g in (getattr(opt, n, None) for n in names) if g), None)
    elements = sum(g.numel() for g in groups) if groups else sum(p.numel() for p in model.parameters())
    ops = sorted(([n, c, b] for n, (c, b) in mode.ops.items()), key=lambda r: -r[2])
    del engine
    return {"precision": precision, "stage": stage, "grad_accum_dtype": "fp32" if fp32_acc else precision,
            "wrapper": type(opt).__name__, "partition_elements": elements,
            "total_bytes": sum(r[2] for r in ops), "ops": [{"op": n, "calls": c, "bytes": b} for n, c, b in ops]}


def main(out: str, model_name: str, hidden: int | None, vocab: int | None, world: int, runs: list[str]) -> None:
    import deepspeed

    torch.set_num_threads(2)
    spec = scaled_spec(load_model(model_name), layers=2, hidden=hidden, vocab=vocab, experts=None)
    _, fake_store = _private_apis()
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    _disable_shm_comm_op()
    dist.init_process_group("fake", rank=0, world_size=world, store=fake_store())
    deepspeed.init_distributed(dist_backend="gloo")
    results = []
    for run in runs:
        prec, _, stage = run.partition(":")
        results.append(_run(spec, prec.split("-")[0], int(stage), prec.endswith("fp32acc"), world))
        print(f"{run}: {results[-1]['total_bytes']:,} bytes over {results[-1]['partition_elements']:,} elements",
              file=sys.stderr, flush=True)
    report = {
        "environment": {"device": "cpu", "torch": torch.__version__, "deepspeed": deepspeed.__version__,
                        "python": platform.python_version()},
        "command": "python examples/validation/cpu-replay/step_traffic.py " + " ".join(sys.argv[1:]),
        "inputs": {"model": model_name, "layers": 2, "hidden": hidden, "vocab": vocab, "world": world, "rank": 0,
                   "optimizer": "torch.optim.AdamW(fused=True)", "gradient_clipping": 1e-6},
        "runs": results,
    }
    with open(out + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(out + ".tmp", out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("model", nargs="?", default="llama-2-7b")
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--runs", default="bf16:1,bf16:2,bf16:3,bf16-fp32acc:1,bf16:0,fp32:2")
    a = ap.parse_args()
    main(a.out, a.model, a.hidden, a.vocab, a.world, a.runs.split(","))
