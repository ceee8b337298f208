"""Speed benchmark (not a test): ZeRO-3 step time of the bundled engine vs PyTorch FSDP2.

Same model (a llama-shaped ``ModelSpec`` scaled down, built by ``zeroplan.runtime.model``),
same world size, gloo on CPU, one thread per rank, fp32, AdamW. FSDP2 (``fully_shard``) is
applied to every parameter-owning module and the root, i.e. the same per-module gather
granularity as the engine's stage 3 (``stage3_prefetch_bucket_size: 0``: one gather per module,
re-gathered in backward). The engine runs with its default (no-op) meter: no memory tracking.

Prints the median step time of each and the ratio engine / FSDP2 (goal <= 1.2).
Usage: python tests/bench/bench_fsdp_ratio.py [--nproc 2] [--layers 4] [--hidden 256] [--steps 8]
"""

from __future__ import annotations

import argparse
import statistics
import time


def _rank(rank: int, world: int, spec, steps: int, warmup: int, mb: int, seq: int) -> dict:
    import torch

    from zeroplan.runtime.comm import InstrumentedComm
    from zeroplan.runtime.engine import ZeroEngine
    from zeroplan.runtime.model import build_model
    from zeroplan.specs.deepspeed_config import ZeroConfig

    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, spec.vocab_size, (mb, seq), generator=gen) for _ in range(steps + warmup)]

    zero = ZeroConfig(stage=3, prefetch_bucket_size=0, max_reuse_distance=0, param_persistence_threshold=0,
                      overlap_comm=True)
    model = build_model(spec, "fp32", "cpu", seed=0)
    engine = ZeroEngine(model, zero, precision="fp32", comm=InstrumentedComm(), lr=1e-4)
    t_engine = []
    for i, b in enumerate(batches):
        t0 = time.perf_counter()
        engine.train_step([b])
        if i >= warmup:
            t_engine.append(time.perf_counter() - t0)
    engine.close()
    del engine, model

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = build_model(spec, "fp32", "cpu", seed=0)
    for _name, mod, _ps in model.zero_units:
        fully_shard(mod, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    t_fsdp = []
    for i, b in enumerate(batches):
        t0 = time.perf_counter()
        loss = model(b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            t_fsdp.append(time.perf_counter() - t0)
    return {"engine": statistics.median(t_engine), "fsdp": statistics.median(t_fsdp)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    args = ap.parse_args()

    from zeroplan.bench.validate import scaled_spec
    from zeroplan.runtime.launch import spawn
    from zeroplan.specs.model import load_model

    spec = scaled_spec(load_model("llama-2-7b"), layers=args.layers, hidden=args.hidden, vocab=args.vocab)
    res = spawn(_rank, args.nproc, args=(spec, args.steps, args.warmup, args.micro_batch, args.seq_len),
                timeout_s=600)
    engine = max(r["engine"] for r in res)
    fsdp = max(r["fsdp"] for r in res)
    print(f"model {spec.name}: {spec.params:,} parameters, {args.layers} layers, hidden {args.hidden}; "
          f"N={args.nproc} gloo/CPU fp32, micro-batch {args.micro_batch} x {args.seq_len} tokens")
    print(f"zeroplan engine stage 3: {engine * 1e3:.1f} ms/step (median, slowest rank)")
    print(f"PyTorch FSDP2:           {fsdp * 1e3:.1f} ms/step")
    print(f"ratio engine / FSDP2:    {engine / fsdp:.2f}  (goal <= 1.2)")


if __name__ == "__main__":
    main()
