"""Stage 3 with tied embeddings under every stage-3 knob: the REAL DeepSpeed engine (0.19.8,
CPU/gloo), zeroplan's ledger and the bundled runtime issue the same all-gathers, call for call.

Issue #12 §1. ``max_live_parameters``, ``max_reuse_distance``, ``prefetch_bucket_size`` and
``param_persistence_threshold`` each at 0, small and large (DeepSpeed's default), and the
combinations that change the schedule: no prefetch with no reuse (every module gathered before
its forward and again before its backward; the tied head gathers the embedding's weight again), a
prefetch bound of a few modules (the prefetch runs into the backward part of the trace), a reuse
window shorter than the model, every parameter persistent, two micro-steps. Models: a GPT-2 with
its head tied to ``wte`` (Conv1D, learned positions), a Llama with ``tie_word_embeddings``, and the
untied Llama of tests/test_engine.py under the partial-prefetch configuration that file cannot
write a closed form for.

One DeepSpeed launch (N = 2) and one runtime launch run every configuration; skipped without
DeepSpeed. The full grid (max_live_parameters, max_reuse_distance, prefetch_bucket_size each at
0, 1000 and the default, persistence 0 and 1e9: 54 settings) on both tied models at N = 2 and 4
was measured the same way once: 0 disagreements for the ledger against DeepSpeed and for the
runtime against the ledger (before this replay: 18 of 54 per model and N). It takes minutes, too
slow for the suite.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest

from zeroplan.bench import deepspeed_engine as dse

needs_ds = pytest.mark.skipif(not dse.deepspeed_available(), reason="DeepSpeed is not installed")

N = 2
SEQ = 16
E9 = 10**9  # DeepSpeed's default max_live_parameters and max_reuse_distance


def _gpt2_tied():
    from zeroplan.specs.model import load_model

    return load_model("gpt2").scaled(num_layers=2, hidden_size=48, vocab_size=301, num_attention_heads=3)


def _llama_tied():
    from zeroplan.specs.model import load_model
    from zeroplan.specs.model_spec import spec_from_config

    s = load_model("llama-2-7b").scaled(num_layers=2, hidden_size=48, intermediate_size=130, vocab_size=301,
                                        num_attention_heads=3, num_key_value_heads=1)
    cfg = copy.deepcopy(s.hf_config)
    cfg["tie_word_embeddings"] = True
    return spec_from_config(cfg, "llama-tied", "test")


def _llama_engine():
    from zeroplan.bench.validate import scaled_spec
    from zeroplan.specs.model import load_model

    return scaled_spec(load_model("llama-2-7b"), layers=2, hidden=64, vocab=128)


def _mixtral():
    from zeroplan.bench.validate import scaled_spec
    from zeroplan.specs.model import load_model

    return scaled_spec(load_model("mixtral-8x7b"), layers=2, hidden=64, vocab=128)


def _knobs(ml, rd, pf, pt, **extra):
    return {"stage3_max_live_parameters": ml, "stage3_max_reuse_distance": rd, "stage3_prefetch_bucket_size": pf,
            "stage3_param_persistence_threshold": pt, **extra}


# (model, knobs, precision, grad_accum, micro_batch, checkpointing)
CASES = [
    ("gpt2", _knobs(0, 0, 0, 0), "bf16", 1, 1, "none"),
    ("gpt2", _knobs(0, 1000, 0, 0), "bf16", 1, 1, "none"),
    ("gpt2", _knobs(1000, 0, 1000, 0), "bf16", 1, 1, "none"),
    ("gpt2", _knobs(1000, E9, 1000, 0), "bf16", 1, 1, "none"),
    ("gpt2", _knobs(E9, 0, 1000, 0), "bf16", 1, 1, "none"),
    ("gpt2", _knobs(E9, 1000, 1000, 0), "bf16", 1, 1, "none"),
    ("gpt2", _knobs(E9, E9, 50_000_000, 0), "bf16", 1, 1, "none"),
    ("gpt2", _knobs(0, 0, 0, E9), "bf16", 1, 1, "none"),
    ("gpt2", _knobs(E9, 0, 1000, 1000), "bf16", 1, 1, "none"),
    ("gpt2", _knobs(E9, 0, 1000, 0), "bf16", 2, 1, "none"),
    ("llama", _knobs(0, 0, 0, 0), "bf16", 1, 1, "none"),
    ("llama", _knobs(1000, 0, 1000, 0), "bf16", 1, 1, "none"),
    ("llama", _knobs(E9, 1000, 1000, 200), "bf16", 1, 1, "none"),
    ("engine", _knobs(E9, 20000, 5000, 64, reduce_bucket_size=3000), "fp32", 2, 2, "none"),
    # full activation checkpointing (issue #13): each layer recomputed inside backward, its modules
    # fetched again; DeepSpeed's defaults (persistence 0: the whole tiny model would stay whole), no
    # prefetch, no reuse, a small live bound, nothing at all, two micro-steps, an MoE layer
    ("gpt2", _knobs(E9, E9, 50_000_000, 0), "bf16", 1, 1, "full"),
    ("gpt2", _knobs(E9, E9, 0, 0), "bf16", 1, 1, "full"),
    ("gpt2", _knobs(E9, 0, 1000, 0), "bf16", 1, 1, "full"),
    ("gpt2", _knobs(1000, E9, 1000, 0), "bf16", 1, 1, "full"),
    ("gpt2", _knobs(0, 0, 0, 0), "bf16", 1, 1, "full"),
    ("gpt2", _knobs(E9, 1000, 1000, 1000), "bf16", 2, 1, "full"),
    ("llama", _knobs(1000, 0, 1000, 0), "bf16", 1, 1, "full"),
    ("mixtral", _knobs(E9, 0, 1000, 0), "bf16", 1, 1, "full"),
    ("mixtral", _knobs(0, 0, 0, 0), "bf16", 1, 1, "full"),
]
# LoRA (q_proj + v_proj, or down_proj) on the engine's Llama under full checkpointing: the frozen base
# weights a recomputation fetches are held for the running backward module
# (update_recompute_parameters); (knobs, LoRA targets)
LORA_CASES = [
    (_knobs(0, 0, 0, 0), ("q_proj", "v_proj")),
    (_knobs(0, 0, 0, 0), ("down_proj",)),
    (_knobs(E9, 0, 3000, 0), ("q_proj", "v_proj")),
    (_knobs(E9, 0, 3000, 0), ("down_proj",)),
]
SPECS = {"gpt2": _gpt2_tied, "llama": _llama_tied, "engine": _llama_engine, "mixtral": _mixtral}


def _case_id(i):
    model, k, prec, gas, _, ckpt = CASES[i]
    short = {"stage3_max_live_parameters": "live", "stage3_max_reuse_distance": "reuse",
             "stage3_prefetch_bucket_size": "prefetch", "stage3_param_persistence_threshold": "persist",
             "reduce_bucket_size": "rbs"}
    return (f"{model}-{prec}-gas{gas}-" + "-".join(f"{short[key]}{v:g}" for key, v in k.items())
            + ("-ckpt" if ckpt == "full" else ""))


_CACHE: dict[str, object] = {}


def _spec(model):
    if model not in _CACHE:
        _CACHE[model] = SPECS[model]()
    return _CACHE[model]


def _ds_config(i):
    knobs = CASES[i][1]
    return {"zero_optimization": {"stage": 3, **knobs}}


def _zero(i):
    from zeroplan.specs.deepspeed_config import load_ds_config

    return load_ds_config(_ds_config(i), world_size=N).zero


def _plan(i):
    from zeroplan.core.plan import evaluate
    from zeroplan.specs.training import TrainingSetup, get_precision

    model, _, prec, gas, mb, ckpt = CASES[i]
    training = TrainingSetup(precision=get_precision(prec), micro_batch=mb, seq_len=SEQ, grad_accum=gas,
                             optimizer_impl="torch-single", checkpointing=ckpt)
    return evaluate(model=_spec(model), training=training, zero=_zero(i), n_gpus=N)


def _lora(j):
    from zeroplan.specs.finetune import FineTune, LoraSpec

    return FineTune(method="lora", lora=LoraSpec(r=4, targets=LORA_CASES[j][1]))


def _lora_zero(j):
    from zeroplan.specs.deepspeed_config import load_ds_config

    return load_ds_config({"zero_optimization": {"stage": 3, **LORA_CASES[j][0]}}, world_size=N).zero


def _lora_plan(j):
    from zeroplan.core.finetune import finetune_views
    from zeroplan.core.plan import evaluate
    from zeroplan.specs.training import TrainingSetup, get_precision

    prec = get_precision("bf16")
    training = TrainingSetup(precision=prec, micro_batch=1, seq_len=SEQ, grad_accum=1, optimizer_impl="torch-single",
                             checkpointing="full")
    spec = _spec("engine")
    return evaluate(model=spec, training=training, zero=_lora_zero(j), n_gpus=N, gpus_per_node=N,
                    finetune=finetune_views(spec, _lora(j), compute_bytes=prec.param_bytes))


def _deepspeed():
    if "ds" not in _CACHE:
        runs = [{"ds_config": _ds_config(i), "precision": CASES[i][2], "grad_accum": CASES[i][3],
                 "micro_batch": CASES[i][4], "spec": _spec(CASES[i][0]), "checkpointing": CASES[i][5]}
                for i in range(len(CASES))]
        runs += [{"ds_config": {"zero_optimization": {"stage": 3, **k}}, "precision": "bf16", "grad_accum": 1,
                  "micro_batch": 1, "spec": _spec("engine"), "checkpointing": "full", "finetune": _lora(j)}
                 for j, (k, _) in enumerate(LORA_CASES)]
        _CACHE["ds"] = dse.run_deepspeed_matrix(_spec("gpt2"), runs, nproc=N, steps=2, warmup=2, seq_len=SEQ)
    return _CACHE["ds"]


def _measure(rank, world, groups):
    from zeroplan.bench.validate import measure_rank

    return [measure_rank(rank, world, spec, runs) for spec, runs in groups]


def _runtime():
    """The bundled engine on the same configurations: {case index: rank 0's measurement}."""
    if "rt" not in _CACHE:
        from zeroplan.bench.validate import _preload_dispatch
        from zeroplan.runtime.launch import spawn

        groups, index = [], []
        for model in SPECS:
            ids = [i for i, c in enumerate(CASES) if c[0] == model]
            runs = [{"zero": _zero(i), "precision": CASES[i][2], "micro_batch": CASES[i][4], "seq_len": SEQ,
                     "grad_accum": CASES[i][3], "warmup": 1, "steps": 2, "comm_model": "deepspeed", "seed": 0,
                     "checkpointing": CASES[i][5]}
                    for i in ids]
            groups.append((_spec(model), runs))
            index.append(ids)
        groups.append((_spec("engine"), [
            {"zero": _lora_zero(j), "precision": "bf16", "micro_batch": 1, "seq_len": SEQ, "grad_accum": 1,
             "warmup": 1, "steps": 2, "comm_model": "deepspeed", "seed": 0, "checkpointing": "full",
             "finetune": _lora(j)} for j in range(len(LORA_CASES))]))
        index.append([("lora", j) for j in range(len(LORA_CASES))])
        _preload_dispatch()
        per_rank = spawn(_measure, N, args=(groups,), timeout_s=600)
        _CACHE["rt"] = {i: [per_rank[r][g][k] for r in range(N)]
                        for g, ids in enumerate(index) for k, i in enumerate(ids)}
    return _CACHE["rt"]


def _by_phase(entries):
    """(op, phase) -> [calls, Σ full-buffer bytes] per optimizer step."""
    out: dict[tuple[str, str], list[int]] = {}
    for op, phase, nbytes, count in entries:
        c = out.setdefault((op, phase), [0, 0])
        c[0] += count
        c[1] += count * nbytes
    return out


@needs_ds
@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.parametrize("i", range(len(CASES)), ids=_case_id)
def test_ledger_equals_deepspeed_equals_runtime(i):
    plan = _plan(i)
    expected = Counter()
    for e in plan.comm.collectives:
        expected[(e.op, e.phase, e.buffer_bytes, e.dtype)] += e.count
    for rank in _deepspeed()[i]:
        assert rank.failure is None, rank.failure.message
        assert dse.steps_identical(rank)
        for step in rank.records_by_step:
            got = Counter((r.op, r.phase, r.buffer_bytes, r.dtype) for r in step)
            assert got == expected, f"DeepSpeed - zeroplan: {got - expected}; zeroplan - DeepSpeed: {expected - got}"
    ledger = _by_phase((e.op, e.phase, e.buffer_bytes, e.count) for e in plan.comm.collectives)
    for res in _runtime()[i]:
        assert "oom" not in res and res["steady"], res.get("oom")
        runtime = {tuple(k.split("/")): [v["count"], v["bytes"]] for k, v in res["collectives"].items()}
        assert runtime == ledger


def _reads(spec):
    """Per module (spec order), the padded numel of each parameter its forward reads; a tied head
    reads the embedding's weight. Written from the spec, independently of core/layout.py."""
    numel = {t.name: t.numel for t in spec.tensors if t.tied_to is None}
    pad = lambda k: -(-k // N) * N  # noqa: E731
    out: dict[str, list[int]] = {}
    for t in spec.tensors:
        out.setdefault(t.module, []).append(pad(numel[t.tied_to or t.name]))
    return list(out.values())


@needs_ds
@pytest.mark.slow
@pytest.mark.deepspeed
def test_tied_weight_is_gathered_again_by_the_head_without_prefetch_or_reuse():
    """Closed form, from the spec alone: no prefetch, no reuse, nothing persistent -> every module,
    the tied head included, gathers what it reads before its forward and again before its backward."""
    i = CASES.index(("gpt2", _knobs(0, 0, 0, 0), "bf16", 1, 1, "none"))
    reads = _reads(_spec("gpt2"))
    want = [len(reads), 2 * sum(sum(r) for r in reads)]  # bf16: 2 bytes
    tied = [t for t in _spec("gpt2").tensors if t.tied_to]
    assert tied and tied[0].module not in {t.module for t in _spec("gpt2").tensors if t.tied_to is None}
    summary = dse.per_step_summary(_deepspeed()[i][0])
    for phase in ("forward", "backward"):
        assert [summary[("all_gather", phase)]["count"], summary[("all_gather", phase)]["bytes"]] == want


@needs_ds
@pytest.mark.slow
@pytest.mark.deepspeed
def test_one_prefetch_gathers_the_tied_model_once():
    """Closed form: a prefetch bound above the model -> the model's own fetch gathers every
    parameter once (the tied weight once), nothing in backward."""
    i = CASES.index(("gpt2", _knobs(E9, E9, 50_000_000, 0), "bf16", 1, 1, "none"))
    spec = _spec("gpt2")
    padded = sum(-(-t.numel // N) * N for t in spec.tensors if t.tied_to is None)
    summary = dse.per_step_summary(_deepspeed()[i][0])
    assert summary[("all_gather", "forward")] == {"count": 1, "bytes": 2 * padded}
    assert ("all_gather", "backward") not in summary


@needs_ds
@pytest.mark.slow
@pytest.mark.deepspeed
def test_full_checkpointing_regathers_every_module_of_a_layer_but_its_last():
    """Closed form, from the spec alone: full checkpointing with no prefetch, no reuse, nothing
    persistent -> the backward gathers every module again (as without checkpointing), and the
    recomputation of each layer gathers its modules once more, all but the last one, whose backward
    fetch ran just before and started the recomputation (torch.utils.checkpoint's unpack hook)."""
    i = CASES.index(("gpt2", _knobs(0, 0, 0, 0), "bf16", 1, 1, "full"))
    spec = _spec("gpt2")
    reads = _reads(spec)
    layer_of = {t.module: t.layer for t in spec.tensors}
    modules = list(dict.fromkeys(t.module for t in spec.tensors))
    per_layer: dict[int, list[int]] = {}
    for m, r in zip(modules, reads):
        if layer_of[m] is not None:
            per_layer.setdefault(layer_of[m], []).append(sum(r))
    again = [b for mods in per_layer.values() for b in mods[:-1]]
    summary = dse.per_step_summary(_deepspeed()[i][0])
    total = sum(sum(r) for r in reads)
    assert [summary[("all_gather", "forward")]["count"], summary[("all_gather", "forward")]["bytes"]] == \
        [len(reads), 2 * total]
    assert [summary[("all_gather", "backward")]["count"], summary[("all_gather", "backward")]["bytes"]] == \
        [len(reads) + len(again), 2 * (total + sum(again))]


@needs_ds
@pytest.mark.slow
@pytest.mark.deepspeed
def test_full_checkpointing_gathers_in_deepspeeds_order():
    """Under full checkpointing the replay issues DeepSpeed's all-gathers in DeepSpeed's order (one
    micro-step per optimizer step), not only the same multiset: the recomputation's fetches sit in
    the trace where autograd runs them, so every prefetch and release decision downstream agrees."""
    from zeroplan.core.layout import zero_layout
    from zeroplan.core.stage3_fetch import stage3_gathers

    for i, (model, _, prec, gas, _, ckpt) in enumerate(CASES):
        if ckpt != "full" or gas != 1:
            continue
        zero = _zero(i)
        lay = zero_layout(_spec(model), N, zero)
        pset = {t.name for t in lay.persistent_tensors}
        gathers = stage3_gathers([t.numel for t in lay.tensors], [lay.padded(t.numel) for t in lay.tensors],
                                 [t.name in pset for t in lay.tensors], lay.units,
                                 max_live=zero.max_live_parameters, prefetch_bucket=zero.prefetch_bucket_size,
                                 max_reuse=zero.max_reuse_distance, grad_accum=1, recompute_layers=True)
        width = 2 if prec == "bf16" else 4
        want = [(g.phase, g.elements * width) for g, _ in gathers]
        for step in _deepspeed()[i][0].records_by_step:
            got = [(r.phase, r.buffer_bytes) for r in step if r.op == "all_gather" and r.phase != "step"]
            assert got == want, _case_id(i)


def _phase_totals(records):
    return _by_phase((r.op, r.phase, r.buffer_bytes, 1) for r in records)


@needs_ds
@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.parametrize("j", range(len(LORA_CASES)))
def test_lora_full_checkpointing_runtime_equals_deepspeed(j):
    """LoRA under full checkpointing: the bundled runtime holds the frozen weights a recomputation
    fetches for the running backward module, as DeepSpeed does, and issues DeepSpeed's collectives
    per phase (without the hold torch's checkpoint finds a released frozen weight: CheckpointError).
    With no prefetch the ledger issues them too; with a partial prefetch its LoRA forward is one
    prefetch off already without checkpointing (not this replay's)."""
    ds = _deepspeed()[len(CASES) + j]
    rt = _runtime()[("lora", j)]
    for rank, res in zip(ds, rt):
        assert rank.failure is None, rank.failure.message
        assert "oom" not in res and res["steady"], res.get("oom")
        runtime = {tuple(k.split("/")): [v["count"], v["bytes"]] for k, v in res["collectives"].items()}
        for step in rank.records_by_step:
            assert _phase_totals(step) == runtime
    if LORA_CASES[j][0]["stage3_prefetch_bucket_size"] == 0:
        plan = _lora_plan(j)
        ledger = _by_phase((e.op, e.phase, e.buffer_bytes, e.count) for e in plan.comm.collectives)
        assert _phase_totals(ds[0].records_by_step[-1]) == ledger
