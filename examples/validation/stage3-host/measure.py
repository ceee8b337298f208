"""Host time of DeepSpeed's stage-3 module hooks, per fetch, on CPU (world size 1).

Stage 3 runs Python on the host for every module call: ``parameter_offload.py`` registers
forward pre/post hooks and backward pre/post functions on every module, and each drives the
``PartitionedParameterCoordinator`` (``fetch_sub_module`` / ``release_sub_module``). That host work
does not depend on the device. This script measures it as the difference between stage 3 and
stage 0 of the same tiny transformers model (hidden 16, so the arithmetic is negligible), at 2 and
10 layers: the per-layer difference, divided by the fetches per layer DeepSpeed makes for modules
that own parameters (counted here by wrapping ``fetch_sub_module``), is the host time per fetch.

    python examples/validation/stage3-host/measure.py --output examples/validation/stage3-host/run2.json

Each configuration runs in a fresh process (DeepSpeed keeps global state); medians of 15 steps
after 4 warm-up steps. Needs torch, transformers and deepspeed. ``--device cuda`` measures the same
on one GPU (examples/validation/gpu/run.sh runs it), where DeepSpeed's CUDA calls are real.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

LAYERS = (2, 10)
WARMUP, STEPS = 4, 15
COUNTS = {"forward": [0, 0], "backward": [0, 0]}  # [modules owning parameters, modules without]
PHASE = ["forward"]


def _model(arch: str, layers: int):
    import transformers

    if arch == "llama":
        cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                                       num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                       max_position_embeddings=64)
    elif arch == "llama-lora":  # PEFT LoRA r=4 on q_proj and v_proj, the base frozen
        import peft

        return peft.get_peft_model(_model("llama", layers), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    else:
        cfg = transformers.GPT2Config(n_embd=16, n_layer=layers, n_head=2, vocab_size=64, n_positions=64)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def _count_fetches() -> None:
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as Coord

    inner = Coord.fetch_sub_module
    if getattr(inner, "counting", False):  # a second configuration in the same process
        return

    def wrapped(self, current_submodule, *a, **k):
        owns = any(True for _ in current_submodule.parameters(recurse=False))
        COUNTS[PHASE[0]][0 if owns else 1] += 1
        return inner(self, current_submodule, *a, **k)

    wrapped.counting = True  # type: ignore[attr-defined]
    Coord.fetch_sub_module = wrapped


def run_one(stage: int, arch: str, layers: int, ckpt: bool, device: str = "cpu") -> dict:
    """One configuration in this process: per-phase medians in ms, and fetches per step. ``device``
    cuda: DeepSpeed's CUDA accelerator over NCCL, the model on the GPU, the device synchronised
    before every clock reading (so a phase ends when its kernels do)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", DS_ACCELERATOR=device)
    os.environ.setdefault("MASTER_PORT", "29631")
    import deepspeed
    import torch

    torch.set_num_threads(1)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if stage == 3:
        _count_fetches()
    ds = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}}}
    deepspeed.init_distributed(dist_backend="nccl" if device == "cuda" else "gloo")
    model = _model(arch, layers).to(device)
    if ckpt:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    eng, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=trained)
    ids = torch.randint(0, 64, (1, 8), device=device)
    fwd, bwd = [], []
    for i in range(WARMUP + STEPS):
        if i == WARMUP:
            for v in COUNTS.values():
                v[:] = [0, 0]
        PHASE[0] = "forward"
        sync()
        t0 = time.perf_counter()
        loss = eng(input_ids=ids, labels=ids).loss
        sync()
        t1 = time.perf_counter()
        PHASE[0] = "backward"
        eng.backward(loss)
        sync()
        t2 = time.perf_counter()
        PHASE[0] = "step"
        eng.step()
        if i >= WARMUP:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
    return {"stage": stage, "arch": arch, "layers": layers, "checkpointing": ckpt, "device": device,
            "forward_ms": round(1e3 * statistics.median(fwd), 4), "backward_ms": round(1e3 * statistics.median(bwd), 4),
            "fetches_per_step": None if stage != 3 else
            {k: {"owning_params": v[0] // STEPS, "without_params": v[1] // STEPS} for k, v in COUNTS.items()}}


def _launch(stage: int, arch: str, layers: int, ckpt: bool, port: int, device: str) -> dict:
    env = dict(os.environ, MASTER_PORT=str(port))
    out = subprocess.run([sys.executable, __file__, "--one", str(stage), arch, str(layers), str(int(ckpt)), device],
                         env=env, capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _per_fetch(runs: list[dict], arch: str, ckpt: bool) -> dict:
    """Stage 3 minus stage 0, per layer and per fetch of a parameter-owning module, by phase."""
    by = {(r["stage"], r["layers"]): r for r in runs if r["arch"] == arch and r["checkpointing"] == ckpt}
    lo, hi = LAYERS
    out = {}
    for ph in ("forward", "backward"):
        extra_ms = ((by[3, hi][f"{ph}_ms"] - by[3, lo][f"{ph}_ms"]) - (by[0, hi][f"{ph}_ms"] - by[0, lo][f"{ph}_ms"]))
        per_layer_ms = extra_ms / (hi - lo)
        fetches = (by[3, hi]["fetches_per_step"][ph]["owning_params"]
                   - by[3, lo]["fetches_per_step"][ph]["owning_params"]) / (hi - lo)
        others = (by[3, hi]["fetches_per_step"][ph]["without_params"]
                  - by[3, lo]["fetches_per_step"][ph]["without_params"]) / (hi - lo)
        out[ph] = {"extra_ms_per_layer": round(per_layer_ms, 4), "fetches_per_layer": fetches,
                   "fetches_per_layer_without_params": others,
                   "ms_per_fetch": round(per_layer_ms / fetches, 4)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--output", required=True)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: on one GPU over NCCL, where DeepSpeed's stream, event and launch calls are real")
    args = ap.parse_args()
    import deepspeed
    import torch
    import transformers

    runs = []
    port = 29631
    for arch in ("llama", "gpt2"):
        for ckpt in (False, True):
            for stage in (0, 3):
                for layers in LAYERS:
                    port += 1
                    runs.append(_launch(stage, arch, layers, ckpt, port, args.device))
                    print(json.dumps(runs[-1]), file=sys.stderr)
    derived = {f"{arch}{'-checkpointed' if ck else ''}": _per_fetch(runs, arch, ck)
               for arch in ("llama", "gpt2") for ck in (False, True)}
    env = {"python": platform.python_version(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
           "transformers": transformers.__version__, "machine": platform.machine(), "processor": _cpu_name(),
           "cores": os.cpu_count(), "device": args.device,
           "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None}
    result = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "environment": env,
              "steps": {"warmup": WARMUP, "measured": STEPS, "statistic": "median"}, "runs": runs, "per_fetch": derived}
    tmp = args.output + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    os.replace(tmp, args.output)
    print(json.dumps(derived, indent=1))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    if len(sys.argv) >= 7 and sys.argv[1] == "--one" and (len(sys.argv) - 2) % 5 == 0:
        # GPT-2's Conv1D under deepspeed.zero.Init fails with transformers 5 (a Tensor.__new__ signature check),
        # so the model is built outside it; deepspeed.initialize partitions it then. Several configurations
        # (STAGE ARCH LAYERS CKPT DEVICE each) run one after the other: the fetch counts do not depend on the
        # process, the timings main() records come from one configuration per process.
        for i in range(2, len(sys.argv), 5):
            a = sys.argv[i:i + 5]
            print(json.dumps(run_one(int(a[0]), a[1], int(a[2]), a[3] == "1", a[4])))
    else:
        main()
