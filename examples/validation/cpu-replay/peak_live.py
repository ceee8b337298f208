"""What real DeepSpeed holds at its peak: every tensor storage over 1 MiB live at the largest total.

Real DeepSpeed 0.19.8 as one rank (rank 0 of 8 unless told) on torch's fake process group (as replay.py), 2 layers of a
model at full width (Llama-2-7B unless MODEL names another catalog model or config file), bf16, one
ZeRO stage; the peak of the second step, taken when a new
allocation raises the live total. Each storage is named by the parameter it backs, if any, and by
where it was allocated (phase and DeepSpeed frames), so the gathered parameters, DeepSpeed's
buffers and the activations at that moment can be told apart.

    python examples/validation/cpu-replay/peak_live.py STAGE MICRO_BATCH SEQ OUT.json [MODEL]
        [--world N] [--rank R] [--zero '{"reduce_bucket_size": 200000000}'] [--phase backward]
        [--grad-accum G] [--checkpointing full] [--config '{"data_types": {"grad_accum_dtype": "fp32"}}']
        [--lora R [--lora-targets q_proj,v_proj]] [--transformers-hidden H]

``--world`` sets the data-parallel size (default 8), ``--rank`` the rank measured (default 0; on the
fake group every rank runs alone, so any one can be), and ``--zero`` adds keys to the zero_optimization
block (JSON), so a run can put a bucket inside one rank's partition or make a parameter outgrow it;
``--phase`` takes the peak within one phase (forward, backward or step) instead of the whole step, and
``--grad-accum`` runs G micro-steps per optimizer step (the report says which micro-step peaked), and
``--checkpointing full`` recomputes every decoder layer in the backward (``torch.utils.checkpoint``, as
transformers' gradient checkpointing calls it), ``--config`` adds top-level keys to the DeepSpeed config, and
``--lora R`` trains PEFT-named LoRA adapters of rank R on a frozen base (``runtime/lora.py``; the client AdamW
gets the trainable parameters only), and ``--transformers-hidden H`` runs transformers' own implementation of the
model at hidden H instead of the bundled model (transformers' module tree: Mixtral's fused experts).
``bucket_flushes`` lists every gradient-bucket reduction of the measured backward: for stages 1-2 its
elements and the bytes each flatten copied; for stage 3 how it was reduced (all-reduce or reduce-scatter),
its elements, and the live bytes when it began and the most while it ran.
"""

from __future__ import annotations

import argparse
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

LAYERS, MIB = 2, 1 << 20


def _frames(skip: int) -> list[str]:
    """The allocation's frames in DeepSpeed and the model, innermost last."""
    keep = []
    for f in traceback.extract_stack()[:-skip]:
        path = f.filename.split("site-packages/")[-1]
        if path.startswith("deepspeed/") or "zeroplan/runtime/model" in path:
            keep.append(f"{path}:{f.lineno} {f.name}")
    return keep[-4:]


def _record_flushes(optimizer, flushes: list, active) -> None:
    """Stages 1-2: per bucket reduction while ``active()`` (the measured step's backward), its elements and
    the bytes each flatten made (``allreduce_bucket`` flattens the pieces it all-reduces; 0 where torch
    returned a view)."""
    reduce, flatten = optimizer.reduce_ipg_grads, optimizer.flatten

    def _reduce(comm_dtype=None):
        if active():
            flushes.append({"elements": sum(b.elements for b in optimizer.ipg_buckets.values()), "copies": []})
        return reduce(comm_dtype)

    def _flatten(tensors):
        out = flatten(tensors)
        if active() and flushes:
            shared = out.untyped_storage().data_ptr() == tensors[0].untyped_storage().data_ptr()
            flushes[-1]["copies"].append({"pieces": [t.numel() for t in tensors],
                                          "copied_bytes": 0 if shared else out.untyped_storage().nbytes()})
        return out

    optimizer.reduce_ipg_grads, optimizer.flatten = _reduce, _flatten


def _record_stage3_flushes(optimizer, flushes: list, active, live_total, live_list) -> None:
    """Stage 3: per bucket reduction while ``active()``, how it was reduced (``all_reduce``: a bucket that fits,
    all-reduced in place in the flat buffer when ``reduce_scatter`` is off; ``reduce_scatter``:
    ``reduce_scatter_coalesced`` of the bucket's gradients), its elements, the live bytes when it began
    and the most while it ran (its copies included): ``stage3.py __reduce_and_partition_ipg_grads``; and
    what was live over 1 MiB when it began (``live_list()``)."""
    cls = "_DeepSpeedZeroOptimizer_Stage3"
    contiguous, scatter = (getattr(optimizer, f"{cls}__avg_scatter{k}_grads") for k in ("_contiguous", ""))

    def _wrap(fn, kind, elements):
        def run(first, *args, **kwargs):
            if not active():
                return fn(first, *args, **kwargs)
            rec = {"kind": kind, "elements": elements(first), "live_before": live_total(), "peak": live_total(),
                   "live_over_1_MiB": live_list()}
            flushes.append(rec)
            try:
                return fn(first, *args, **kwargs)
            finally:
                rec["open"] = False
        return run

    setattr(optimizer, f"{cls}__avg_scatter_contiguous_grads", _wrap(contiguous, "all_reduce", lambda b: b.numel()))
    setattr(optimizer, f"{cls}__avg_scatter_grads",
            _wrap(scatter, "reduce_scatter", lambda ps: sum(p.grad.numel() for p in ps)))


def _transformers_model(spec, checkpointing: str):
    """transformers' own implementation of ``spec``'s family at its (scaled) config, in training mode, with
    transformers' gradient checkpointing where asked."""
    import transformers

    cfg = dict(spec.hf_config)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.train()
    if checkpointing == "full":
        model.gradient_checkpointing_enable()
    return model


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def main(stage: int, mb: int, seq: int, out: str, model_name: str = "llama-2-7b", world: int = 8,
         zero: dict | None = None, phase: str | None = None, rank: int = 0, grad_accum: int = 1,
         checkpointing: str = "none", extra: dict | None = None, lora: dict | None = None,
         hf_hidden: int | None = None) -> None:
    import deepspeed

    N = world
    torch.set_num_threads(2)
    spec = scaled_spec(load_model(model_name), layers=LAYERS, hidden=hf_hidden, vocab=None, experts=None)
    _, fake_store = _private_apis()
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(N), "LOCAL_WORLD_SIZE": str(N),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    _disable_shm_comm_op()
    dist.init_process_group("fake", rank=rank, world_size=N, store=fake_store())
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = make_ds_config(stage=stage, precision="bf16", micro_batch=mb, grad_accum=grad_accum, zero=zero, comms_logger=False)
    cfg.update(extra or {})
    tr = StorageTracker()
    origin: dict[int, tuple[str, list[str]]] = {}
    best: dict = {"total": 0, "live": []}
    flushes: list = []
    measuring = [False]
    engine = None

    register = tr._register

    def _register(st, category, host, _o=register):
        _o(st, category, host)
        if st.nbytes() > MIB:
            origin[id(st)] = (tr.phase, _frames(3))

    def _live_now() -> list:
        """Storages over 1 MiB live now, with the parameter each backs and where it was allocated (read now:
        a storage's Python id can be reused once it is freed)."""
        names = {id(p.untyped_storage()): n for n, p in engine.module.named_parameters()}
        out = []
        for key, (nbytes, *_) in tr._live.items():
            if nbytes > MIB:
                where, frames = origin.get(key, ("?", []))
                out.append({"bytes": nbytes, "parameter": names.get(key, ""), "allocated_in": where, "frames": frames})
        return sorted(out, key=lambda e: -e["bytes"])

    add = tr._add

    def _add(category, host, nbytes, _o=add):
        _o(category, host, nbytes)
        if flushes and flushes[-1].get("open", True) and "peak" in flushes[-1]:
            flushes[-1]["peak"] = max(flushes[-1]["peak"], tr.ledger.total)
        if measuring[0] and (phase is None or tr.phase == phase) and tr.ledger.total > best["total"]:
            best["total"] = tr.ledger.total
            if nbytes > MIB:  # a large allocation raised the peak: record what lives beside it
                best["live"] = _live_now()
                best["phase"], best["micro"] = tr.phase, getattr(tr, "micro", 0)

    tr._register, tr._add = _register, _add

    with tr:
        tr.phase = "step"
        if hf_hidden is not None:
            model = _transformers_model(spec, checkpointing)
        else:
            model = build_model(spec, "fp32", "cpu", seed=0, checkpointing=checkpointing)
        if lora:
            from zeroplan.runtime.lora import apply_finetune
            from zeroplan.specs.finetune import FineTune, LoraSpec

            ft = FineTune(method="lora", lora=LoraSpec(r=lora["r"], targets=tuple(lora["targets"])))
            model = apply_finetune(model, spec, ft)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, fused=True)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        if stage == 3:
            _record_stage3_flushes(engine.optimizer, flushes, lambda: measuring[0] and tr.phase == "backward",
                                   lambda: tr.ledger.total, _live_now)
        if stage in (1, 2) and hasattr(engine.optimizer, "reduce_ipg_grads"):  # not BF16_Optimizer's
            _record_flushes(engine.optimizer, flushes, lambda: measuring[0] and tr.phase == "backward")
        for step in range(2):
            if step == 1:
                tr.reset_peaks()
                best["total"] = 0 if phase else tr.ledger.total
                measuring[0] = True
            for micro in range(grad_accum):  # engine.step() steps the optimizer at the last micro-step only
                ids = torch.randint(0, spec.vocab_size, (mb, seq))
                tr.phase, tr.micro = "forward", micro
                loss = engine(input_ids=ids, labels=ids).loss if hf_hidden is not None else engine(ids)
                tr.phase = "backward"
                engine.backward(loss)
                tr.phase = "step"
                engine.step()
            print(f"step {step} done", file=sys.stderr, flush=True)
    report = {
        "environment": {"device": "cpu", "torch": torch.__version__, "deepspeed": deepspeed.__version__,
                        "python": platform.python_version()},
        "command": "python examples/validation/cpu-replay/peak_live.py " + " ".join(sys.argv[1:]),
        "inputs": {"model": model_name, "layers": LAYERS, "rank": rank, "world": N, "stage": stage,
                   "transformers": {"hidden": hf_hidden, "version": _transformers_version()} if hf_hidden else None,
                   "micro_batch": mb, "seq_len": seq, "grad_accum": grad_accum, "precision": "bf16", "zero": zero or {},
                   "checkpointing": checkpointing, "config": extra or {}, "lora": lora,
                   "phase": phase or "all"},
        "peak_bytes": best["total"], "peak_phase": best.get("phase"), "peak_micro_step": best.get("micro", 0),
        "live_over_1_MiB": best["live"],
    }
    if flushes:
        report["bucket_flushes"] = [{k: v for k, v in f.items() if k != "open"} for f in flushes if f["elements"]]
    with open(out + ".tmp", "w") as f:
        json.dump(report, f, indent=1)
    os.replace(out + ".tmp", out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stage", type=int)
    ap.add_argument("micro_batch", type=int)
    ap.add_argument("seq", type=int)
    ap.add_argument("out")
    ap.add_argument("model", nargs="?", default="llama-2-7b")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--zero", type=json.loads, default=None, help="extra zero_optimization keys (JSON)")
    ap.add_argument("--phase", choices=("forward", "backward", "step"), default=None,
                    help="the peak within this phase only (default: the whole step)")
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step (default 1)")
    ap.add_argument("--checkpointing", choices=("none", "full"), default="none",
                    help="full: every decoder layer recomputed in the backward (default none)")
    ap.add_argument("--config", type=json.loads, default=None, help="extra top-level DeepSpeed config keys (JSON)")
    ap.add_argument("--lora", type=int, default=None, help="LoRA rank: adapters on a frozen base (default: full)")
    ap.add_argument("--lora-targets", default="q_proj,v_proj", help="LoRA target modules (default q_proj,v_proj)")
    ap.add_argument("--transformers-hidden", type=int, default=None,
                    help="run transformers' implementation (not the bundled model) at this hidden size")
    a = ap.parse_args()
    if a.lora and a.transformers_hidden:
        ap.error("--lora adapts the bundled model only; drop --transformers-hidden or --lora")
    main(a.stage, a.micro_batch, a.seq, a.out, a.model, a.world, a.zero, a.phase, a.rank, a.grad_accum,
         a.checkpointing, a.config,
         {"r": a.lora, "targets": a.lora_targets.split(",")} if a.lora else None, a.transformers_hidden)
