"""Real DeepSpeed on transformers' own model, as rank 0 of a virtual N-GPU job, on one GPU: the peak allocated
and reserved per phase, and each phase's time.

torch's fake process group answers every collective at once (no data moves, no kernel runs), so rank 0
allocates what it would in the N-rank job and spends the time the job would spend on the GPU and the host
without its communication: compute, DeepSpeed's copies, and its Python (the stage-3 module hooks). Several
decoder layers of a catalog model at full width (or at ``--hidden``), bf16, a client ``torch.optim.AdamW``
(fused: no step temporaries, as DeepSpeed's FusedAdam; nothing to build).

    python examples/validation/gpu/hf_deepspeed.py MODEL STAGE MICRO_BATCH SEQ OUT.json [--world N] [--layers L]
        [--hidden H] [--checkpointing full] [--zero '{"reduce_bucket_size": 2e8}'] [--steps S] [--device cuda]

Step 0 warms up; the figures are the medians of the later steps' phase times (each phase ends when its
kernels do: the device is synchronised at every boundary) and the last step's peaks (the allocator's peak
statistics are reset at each phase's start). ``--device cpu`` runs the same path without the allocator's
figures (for testing the script where there is no GPU). tests/test_gpu_transformers.py sets the plan beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

from zeroplan.bench.deepspeed_engine import _disable_shm_comm_op
from zeroplan.bench.ds_config_prep import make_ds_config
from zeroplan.bench.zero_predict import scaled_spec
from zeroplan.runtime.simulate import _private_apis
from zeroplan.specs.model import load_model

PHASES = ("forward", "backward", "step")


def _model(spec, checkpointing: str, device: str):
    """transformers' implementation of ``spec``'s family, built in bf16 on ``device`` (DeepSpeed casts to bf16
    anyway; building on the GPU keeps a full-width model's random init short)."""
    import transformers

    cfg = dict(spec.hf_config)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.train()
    if checkpointing == "full":
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    return model


def _device_stats(cuda: bool) -> dict:
    if not cuda:
        return {}
    s = torch.cuda.memory_stats()
    return {"peak_allocated": int(s["allocated_bytes.all.peak"]), "peak_reserved": int(s["reserved_bytes.all.peak"]),
            "allocated": int(s["allocated_bytes.all.current"]), "reserved": int(s["reserved_bytes.all.current"]),
            "alloc_retries": int(s.get("num_alloc_retries", 0))}


def run(args: argparse.Namespace) -> dict:
    import deepspeed

    cuda = args.device == "cuda"
    spec = scaled_spec(load_model(args.model), layers=args.layers, hidden=args.hidden, vocab=None, experts=None)
    _, fake_store = _private_apis()
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(args.world),
                       "LOCAL_WORLD_SIZE": str(args.world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    _disable_shm_comm_op()
    dist.init_process_group("fake", rank=0, world_size=args.world, store=fake_store())
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    cfg = make_ds_config(stage=args.stage, precision="bf16", micro_batch=args.micro_batch, grad_accum=1,
                         zero=args.zero, comms_logger=False)
    model = _model(spec, args.checkpointing, args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    del model, opt
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        sync()
        torch.cuda.empty_cache()
    states = _device_stats(cuda).get("allocated")
    times: dict[str, list[float]] = {p: [] for p in PHASES}
    peaks: dict[str, dict] = {}
    for step in range(args.steps):
        last = step == args.steps - 1
        ids = torch.randint(0, spec.vocab_size, (args.micro_batch, args.seq_len), device=args.device)
        for phase in PHASES:
            sync()
            if cuda and last:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            if phase == "forward":
                loss = engine(input_ids=ids, labels=ids).loss
            elif phase == "backward":
                engine.backward(loss)
            else:
                engine.step()
            sync()
            if step:
                times[phase].append(time.perf_counter() - t0)
            if last:
                peaks[phase] = _device_stats(cuda)
        print(f"step {step} done", file=sys.stderr, flush=True)
    env = {"device": args.device, "python": platform.python_version(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "deepspeed": deepspeed.__version__, "transformers": _version("transformers")}
    if cuda:
        env["gpu"] = torch.cuda.get_device_name(0)
    return {"command": "python examples/validation/gpu/hf_deepspeed.py " + " ".join(sys.argv[1:]), "environment": env,
            "inputs": {"model": args.model, "layers": args.layers, "hidden": args.hidden, "world": args.world,
                       "stage": args.stage, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
                       "checkpointing": args.checkpointing, "zero": args.zero or {}, "precision": "bf16",
                       "optimizer": "torch.optim.AdamW(fused=True)", "steps": args.steps},
            "states_allocated": states, "peaks": peaks,
            "time_s": {p: statistics.median(v) for p, v in times.items() if v}}


def _version(name: str) -> str:
    import importlib.metadata

    return importlib.metadata.version(name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("stage", type=int)
    ap.add_argument("micro_batch", type=int)
    ap.add_argument("seq_len", type=int)
    ap.add_argument("out")
    ap.add_argument("--world", type=int, default=8, help="data-parallel size rank 0 plans for (default 8)")
    ap.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    ap.add_argument("--hidden", type=int, default=None, help="hidden size (default: the model's own)")
    ap.add_argument("--checkpointing", choices=("none", "full"), default="none")
    ap.add_argument("--zero", type=json.loads, default=None, help="extra zero_optimization keys (JSON)")
    ap.add_argument("--steps", type=int, default=4, help="steps; the first warms up (default 4)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=os.environ.get("ZEROPLAN_HF_DEVICE", "cuda"),
                    help="cpu: the same path without the allocator's figures (default cuda, or $ZEROPLAN_HF_DEVICE, "
                         "which lets run.sh's loop be tried where there is no GPU)")
    args = ap.parse_args()
    if args.steps < 2:
        ap.error("--steps must be at least 2: the first step warms up")
    report = run(args)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    os.replace(tmp, args.out)
    print(json.dumps({k: report[k] for k in ("peaks", "time_s")}))


if __name__ == "__main__":
    main()
