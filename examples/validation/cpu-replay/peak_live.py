"""What real DeepSpeed holds at its peak: every tensor storage over 1 MiB live at the largest total.

Real DeepSpeed 0.19.8 as rank 0 of 8 on torch's fake process group (as replay.py), 2 layers of a
model at full width (Llama-2-7B unless MODEL names another catalog model or config file), bf16, one
ZeRO stage; the peak of the second step, taken when a new
allocation raises the live total. Each storage is named by the parameter it backs, if any, and by
where it was allocated (phase and DeepSpeed frames), so the gathered parameters, DeepSpeed's
buffers and the activations at that moment can be told apart.

    python examples/validation/cpu-replay/peak_live.py STAGE MICRO_BATCH SEQ OUT.json [MODEL]
"""

from __future__ import annotations

import json
import os
import platform
import sys
import traceback

import torch
import torch.distributed as dist

from zeroplan.bench.deepspeed_engine import _disable_shm_comm_op
from zeroplan.bench.ds_config_prep import make_ds_config
from zeroplan.bench.zero_predict import scaled_spec
from zeroplan.runtime.memory import StorageTracker
from zeroplan.runtime.model import build_model
from zeroplan.runtime.simulate import _private_apis
from zeroplan.specs.model import load_model

N, LAYERS, MIB = 8, 2, 1 << 20


def _frames(skip: int) -> list[str]:
    """The allocation's frames in DeepSpeed and the model, innermost last."""
    keep = []
    for f in traceback.extract_stack()[:-skip]:
        path = f.filename.split("site-packages/")[-1]
        if path.startswith("deepspeed/") or "zeroplan/runtime/model" in path:
            keep.append(f"{path}:{f.lineno} {f.name}")
    return keep[-4:]


def main(stage: int, mb: int, seq: int, out: str, model_name: str = "llama-2-7b") -> None:
    import deepspeed

    torch.set_num_threads(2)
    spec = scaled_spec(load_model(model_name), layers=LAYERS, hidden=None, vocab=None, experts=None)
    _, fake_store = _private_apis()
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(N), "LOCAL_WORLD_SIZE": str(N),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    _disable_shm_comm_op()
    dist.init_process_group("fake", rank=0, world_size=N, store=fake_store())
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = make_ds_config(stage=stage, precision="bf16", micro_batch=mb, grad_accum=1, comms_logger=False)
    tr = StorageTracker()
    origin: dict[int, tuple[str, list[str]]] = {}
    best: dict = {"total": 0, "live": []}
    measuring = [False]
    engine = None

    register = tr._register

    def _register(st, category, host, _o=register):
        _o(st, category, host)
        if st.nbytes() > MIB:
            origin[id(st)] = (tr.phase, _frames(3))

    add = tr._add

    def _add(category, host, nbytes, _o=add):
        _o(category, host, nbytes)
        if measuring[0] and tr.ledger.total > best["total"]:
            best["total"] = tr.ledger.total
            if nbytes > MIB:  # a large allocation raised the peak: record what lives beside it
                names = {id(p.untyped_storage()): n for n, p in engine.module.named_parameters()}
                best["live"] = [(b, k, names.get(k, "")) for k, (b, *_) in tr._live.items() if b > MIB]
                best["phase"] = tr.phase

    tr._register, tr._add = _register, _add
    with tr:
        tr.phase = "step"
        model = build_model(spec, "fp32", "cpu", seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        for step in range(2):
            if step == 1:
                tr.reset_peaks()
                best["total"] = tr.ledger.total
                measuring[0] = True
            ids = torch.randint(0, spec.vocab_size, (mb, seq))
            tr.phase = "forward"
            loss = engine(ids)
            tr.phase = "backward"
            engine.backward(loss)
            tr.phase = "step"
            engine.step()
            print(f"step {step} done", file=sys.stderr, flush=True)
    live = []
    for nbytes, key, name in sorted(best["live"], reverse=True):
        phase, frames = origin.get(key, ("?", []))
        live.append({"bytes": nbytes, "parameter": name, "allocated_in": phase, "frames": frames})
    report = {
        "environment": {"device": "cpu", "torch": torch.__version__, "deepspeed": deepspeed.__version__,
                        "python": platform.python_version()},
        "command": "python examples/validation/cpu-replay/peak_live.py " + " ".join(sys.argv[1:]),
        "inputs": {"model": model_name, "layers": LAYERS, "rank": 0, "world": N, "stage": stage,
                   "micro_batch": mb, "seq_len": seq, "precision": "bf16"},
        "peak_bytes": best["total"], "peak_phase": best.get("phase"),
        "live_over_1_MiB": live,
    }
    with open(out + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(out + ".tmp", out)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], *sys.argv[5:6])
