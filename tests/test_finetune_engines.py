"""LoRA (frozen base, trained adapters) through both engines, against the planner (issue #15 §4).

The tiny Llama (2 layers, hidden 64, vocab 128) gets LoRA r=4 on q_proj and v_proj
(``runtime/lora.py``: PEFT's adapter names, B zero-initialised, the base frozen). World 2,
stages 0-3. The bundled runtime (forked gloo ranks) and the REAL DeepSpeed 0.19.8 engine (one
launch for the whole module, shared by the tests) must issue exactly the collectives of
zeroplan's ledger (``core.plan.evaluate`` with ``core.finetune.finetune_views``: op, phase,
full-buffer bytes, dtype, calls) and hold model states within 1 % of its memory model.
DeepSpeed's own objects must show the frozen parameters carry no gradient and no optimizer state.
Closed forms written here from the tensor list check the numbers independently of zeroplan.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

torch = pytest.importorskip("torch")

from zeroplan.bench import deepspeed_engine as dse  # noqa: E402
from zeroplan.specs.finetune import FineTune, LoraSpec  # noqa: E402

needs_ds = pytest.mark.skipif(not dse.deepspeed_available(), reason="DeepSpeed is not installed")

N = 2
R = 4
H, V, I, L = 64, 128, 172, 2  # scaled_spec of llama-2-7b: 4 heads of 16, intermediate 11008·64/4096
FT = FineTune(method="lora", lora=LoraSpec(r=R, targets=("q_proj", "v_proj")))
ADAPTERS = [R * H, H * R] * 2 * L  # q_proj and v_proj: A [r, 64], B [64, r] per layer, in forward order
TRAINABLE = sum(ADAPTERS)  # 2,048
FT_DOWN = FineTune(method="lora", lora=LoraSpec(r=R, targets=("down_proj",)))
ADAPTERS_DOWN = [R * I, H * R] * L  # down_proj: A [r, 172], B [64, r] per layer
BASE = V * H + L * (2 * H + 4 * H * H + 3 * H * I) + H + V * H  # 115,520 (untied)
THR = 64  # a stage-3 persistence threshold under the adapters' 256 elements: everything is gathered
REGATHER = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
            "stage3_max_live_parameters": 0}

CONFIGS = {
    "s0-bf16": {"stage": 0},
    "s0-fp32": {"stage": 0},
    "s1-bf16": {"stage": 1},
    "s2-bf16": {"stage": 2},
    "s2-bf16-gas2": {"stage": 2},
    "s3-bf16": {"stage": 3},
    "s3-bf16-thr64": {"stage": 3, "stage3_param_persistence_threshold": THR},
    "s3-bf16-thr64-gas2": {"stage": 3, "stage3_param_persistence_threshold": THR},
    # one gather per module, released after its forward and re-gathered in backward: only modules
    # whose output needs a gradient are (core/finetune.py no_backward_modules)
    "s3-bf16-regather": dict(REGATHER),
    "s3-bf16-regather-down": dict(REGATHER),
}
PRECISION = {k: ("fp32" if "fp32" in k else "bf16") for k in CONFIGS}
GAS = {k: (2 if k.endswith("gas2") else 1) for k in CONFIGS}
CASES = list(CONFIGS)


def _ft(case):
    return FT_DOWN if case.endswith("-down") else FT


def _adapters(case):
    return ADAPTERS_DOWN if case.endswith("-down") else ADAPTERS


def _spec():
    from zeroplan.bench.validate import scaled_spec
    from zeroplan.specs.model import load_model

    return scaled_spec(load_model("llama-2-7b"), layers=L, hidden=H, vocab=V)


def _zero(case):
    from zeroplan.specs.deepspeed_config import load_ds_config

    return load_ds_config({"zero_optimization": CONFIGS[case]}, world_size=N).zero


def _plan(case):
    """The planner's plan for the case: the trainable and full views of core.finetune, as estimate
    and bench zero's predict() build them; the CPU engines step torch's AdamW on CPU tensors (the
    single-tensor path, as in test_deepspeed_engine)."""
    from zeroplan.core.finetune import finetune_views
    from zeroplan.core.plan import evaluate
    from zeroplan.specs.training import TrainingSetup, get_precision

    prec = get_precision(PRECISION[case])
    training = TrainingSetup(precision=prec, micro_batch=1, seq_len=16, grad_accum=GAS[case],
                             optimizer_impl="torch-single")
    return evaluate(model=_spec(), training=training, zero=_zero(case), n_gpus=N, gpus_per_node=N,
                    finetune=finetune_views(_spec(), _ft(case), compute_bytes=prec.param_bytes))


_BUNDLED: dict[str, list] = {}
_DS: dict[str, list] = {}


def _bundled():
    """Every case in ONE launch of N forked ranks of the bundled engine."""
    if not _BUNDLED:
        from zeroplan.bench.validate import _rank_entry
        from zeroplan.runtime.launch import spawn

        runs = [{"zero": _zero(c), "precision": PRECISION[c], "micro_batch": 1, "seq_len": 16, "grad_accum": GAS[c],
                 "warmup": 1, "steps": 2, "comm_model": "deepspeed", "finetune": _ft(c)} for c in CASES]
        per_rank = spawn(_rank_entry, N, args=(_spec(), runs, "cpu"), timeout_s=300)
        for k, c in enumerate(CASES):
            _BUNDLED[c] = [per_rank[r][k] for r in range(N)]
    return _BUNDLED


def _deepspeed():
    """Every case in ONE launch of the real DeepSpeed engine (start-up costs ~10 s per launch)."""
    if not _DS:
        runs = [{"ds_config": {"zero_optimization": CONFIGS[c]}, "precision": PRECISION[c], "micro_batch": 1,
                 "grad_accum": GAS[c], "finetune": _ft(c)} for c in CASES]
        out = dse.run_deepspeed_matrix(_spec(), runs, nproc=N, steps=2, warmup=2, seq_len=16, device="cpu")
        for c, ranks in zip(CASES, out):
            for r in ranks:
                assert r.failure is None, f"{c}: {r.failure.message}"
            _DS[c] = ranks
    return _DS


def _ledger(case):
    expected = Counter()
    for e in _plan(case).comm.collectives:
        expected[(e.op, e.phase, e.buffer_bytes, e.dtype)] += e.count
    return expected


def _predicted_states(case):
    mem = _plan(case).memory
    return {"params": mem.params, "gradients": mem.gradients + mem.buffers_detail.get("gradient_partition_whole_params", 0),
            "optimizer_states": mem.optimizer_states}


def _closed_form_states(case, step_counters=False):
    """Model states per rank from the tensor list and DeepSpeed's padding rules (not zeroplan's code).

    ``step_counters``: count torch AdamW's fp32 ``step`` tensor (4 bytes) per tensor it steps, as
    DeepSpeed's optimizer state holds them (the bundled engine keeps none; within 1 % either way).
    """
    stage = CONFIGS[case]["stage"]
    b = 4 if PRECISION[case] == "fp32" else 2
    adapters = _adapters(case)
    trainable = sum(adapters)
    steps = 4 * (len(adapters) if stage == 0 else 1) if step_counters else 0
    if stage == 0:
        # fp32 stage 0: torch AdamW on the parameters (m, v); bf16: FP16_UnfusedOptimizer, fp32 copy + m + v
        return {"params": b * (BASE + trainable), "gradients": b * trainable,
                "optimizer_states": (8 if b == 4 else 12) * trainable + steps}
    if stage in (1, 2):
        part = math.ceil(trainable / (2 * N)) * 2 * N // N
        return {"params": b * (BASE + trainable), "gradients": b * (trainable if stage == 1 else part),
                "optimizer_states": 12 * part + steps}
    thr = CONFIGS[case].get("stage3_param_persistence_threshold", 100_000)
    numels = _spec_numels(case)
    padded = [math.ceil(k / N) * N for k in numels]
    whole = sum(p for k, p in zip(numels, padded) if k <= thr)
    part = sum(math.ceil(k / N) for k in adapters)
    return {"params": b * (sum(padded) // N + whole), "gradients": b * part, "optimizer_states": 12 * part + steps}


def _spec_numels(case):
    """Every parameter (base + adapters) of the fine-tuned runtime model."""
    from zeroplan.runtime.lora import apply_finetune
    from zeroplan.runtime.model import build_model

    model = apply_finetune(build_model(_spec(), "fp32"), _spec(), _ft(case))
    return [p.numel() for p in model.parameters()]


# ----------------------------------------------------------------------------------- the model


def test_lora_model_has_peft_names_frozen_base_and_zero_b():
    from zeroplan.runtime.lora import apply_finetune
    from zeroplan.runtime.model import build_model
    from zeroplan.specs.finetune import finetune_inventory

    spec = _spec()
    base = build_model(spec, "fp32")
    ids = torch.randint(0, V, (1, 16), generator=torch.Generator().manual_seed(0))
    before = base(ids).item()
    model = apply_finetune(base, spec, FT)
    train = [n for n, p in model.named_parameters() if p.requires_grad]
    assert train[:2] == ["model.layers.0.self_attn.q_proj.lora_A.default.weight",
                         "model.layers.0.self_attn.q_proj.lora_B.default.weight"]
    assert [p.numel() for n, p in model.named_parameters() if p.requires_grad] == ADAPTERS
    assert sum(p.numel() for p in model.parameters() if not p.requires_grad) == BASE
    inv = finetune_inventory(spec, FT)
    assert (inv.trainable_params, inv.frozen_params) == (TRAINABLE, BASE)
    assert sorted(t.name for t in inv.trainable_tensors) == sorted(train)
    # B = 0: the adapted model computes the base model's loss; the units list adapters after their module
    assert model(ids).item() == before
    # PEFT's structure: the base weight moves into base_layer; the units list it, then A, then B
    assert "model.layers.0.self_attn.q_proj.base_layer.weight" in dict(model.named_parameters())
    units = [name for name, _, _ in model.zero_units]
    q = units.index("model.layers.0.self_attn.q_proj.base_layer")
    assert units[q + 1:q + 3] == ["model.layers.0.self_attn.q_proj.lora_A.default",
                                  "model.layers.0.self_attn.q_proj.lora_B.default"]
    model(ids).backward()
    assert all((p.grad is not None) == p.requires_grad for p in model.parameters())


# ----------------------------------------------------------------------------------- bundled runtime


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_bundled_runtime_collectives_exact_and_states_within_one_percent(case):
    from zeroplan.bench.validate import compare

    measured = _bundled()[case]
    rows = [r for r in compare(_plan(case), measured) if r["kind"] in ("collective", "model_state")]
    bad = [(r["name"], r["predicted"], r["measured"]) for r in rows if not r["ok"]]
    assert rows and not bad, f"{case}: (figure, zeroplan, bundled runtime): {bad}"
    assert all(r["steady"] for r in measured)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_bundled_runtime_matches_closed_forms(case):
    want = _closed_form_states(case)
    for r in _bundled()[case]:
        got = {k: r["model_states"][k] for k in want}
        assert got == want, f"{case} rank {r['rank']}"


# ----------------------------------------------------------------------------------- DeepSpeed


@needs_ds
@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.parametrize("case", CASES)
def test_deepspeed_collectives_equal_the_ledger_call_for_call(case):
    expected = _ledger(case)
    for result in _deepspeed()[case]:
        assert result.steps == 2 and dse.steps_identical(result)
        for step in result.records_by_step:
            got = Counter((r.op, r.phase, r.buffer_bytes, r.dtype) for r in step)
            assert got == expected, f"DeepSpeed - zeroplan: {got - expected}; zeroplan - DeepSpeed: {expected - got}"


@needs_ds
@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.parametrize("case", CASES)
def test_deepspeed_and_bundled_runtime_issue_the_same_collectives(case):
    bundled = _bundled()[case][0]["collectives"]
    ds = dse.per_step_summary(_deepspeed()[case][0])
    assert {f"{op}/{ph}": v for (op, ph), v in ds.items()} == {
        k: {"count": v["count"], "bytes": v["bytes"]} for k, v in bundled.items()}


@needs_ds
@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.parametrize("case", CASES)
def test_deepspeed_model_states_within_one_percent(case):
    predicted = _predicted_states(case)
    closed = _closed_form_states(case, step_counters=True)
    stage = CONFIGS[case]["stage"]
    for result in _deepspeed()[case]:
        before = result.memory_before_step
        measured = {"params": before["params"], "optimizer_states": before["optimizer_states"],
                    "gradients": max(before["gradients"],
                                     result.memory_in_backward.get("gradients", 0) if stage <= 1 else 0)}
        for cat, want in predicted.items():
            assert abs(measured[cat] - want) <= 0.01 * want, (case, result.rank, cat, measured[cat], want)
        assert measured == closed, (case, result.rank)


@needs_ds
@pytest.mark.slow
@pytest.mark.deepspeed
@pytest.mark.parametrize("case", CASES)
def test_deepspeed_keeps_no_optimizer_state_for_frozen_parameters(case):
    stage = CONFIGS[case]["stage"]
    adapters = _adapters(case)
    trainable = sum(adapters)
    for result in _deepspeed()[case]:
        fc = result.frozen_check
        assert (fc["trainable_numel"], fc["frozen_numel"]) == (trainable, BASE)
        # frozen: the embedding, 2 norms + 7 linears per layer, the final norm, the head
        assert (fc["trainable_tensors"], fc["frozen_tensors"]) == (len(adapters), 1 + 9 * L + 2)
        assert fc["frozen_in_groups"] == [] and fc["frozen_with_grad"] == []
        # the optimizer steps the trainable elements only (this rank's share of them from stage 1 on)
        if stage == 0:
            owned = trainable
        elif stage in (1, 2):
            owned = math.ceil(trainable / (2 * N)) * 2 * N // N
        else:
            owned = sum(math.ceil(k / N) for k in adapters)
        assert fc["optimizer_numel"] == owned, (case, fc)
        assert fc["optimizer_state_numel"] == 2 * owned  # AdamW exp_avg + exp_avg_sq
        if fc["zero_group_numel"]:
            assert fc["zero_group_numel"] == trainable


def test_no_backward_modules_follow_the_data_flow():
    """Planner side of the re-gather rule: before the first adapter nothing needs a gradient, and an
    adapted module's base weight (PEFT's base_layer) needs none while its input needs none."""
    from zeroplan.core.finetune import finetune_views

    assert finetune_views(_spec(), FT, 2).no_backward == {
        "model.embed_tokens", "model.layers.0.input_layernorm", "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"}
    layer0 = {f"model.layers.0.{m}" for m in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj",
                                               "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert finetune_views(_spec(), FT_DOWN, 2).no_backward == layer0 | {"model.embed_tokens"}


@needs_ds
@pytest.mark.slow
@pytest.mark.deepspeed
def test_deepspeed_skips_backward_gathers_of_modules_without_gradient():
    """The measured counterpart: with a gather per module and no reuse, DeepSpeed re-gathers in
    backward every module but those whose output needs no gradient (5 for q/v, 10 for down_proj)."""
    for case, skipped in (("s3-bf16-regather", 5), ("s3-bf16-regather-down", 10)):
        summary = dse.per_step_summary(_deepspeed()[case][0])
        assert summary[("all_gather", "forward")]["count"] - summary[("all_gather", "backward")]["count"] == skipped


def test_runtime_lora_model_has_peft_names_shapes_and_trainability():
    """runtime/lora.py against PEFT 0.21 itself: ``get_peft_model`` on the transformers model of
    the same config (meta device) gives the same parameters, shapes and ``requires_grad``."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from zeroplan.runtime.lora import apply_finetune
    from zeroplan.runtime.model import build_model

    spec = _spec()
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**spec.hf_config))
    hf = peft.get_peft_model(hf, peft.LoraConfig(r=R, target_modules=["q_proj", "v_proj"]))
    prefix = "base_model.model."
    want = {n.removeprefix(prefix): (tuple(p.shape), p.requires_grad) for n, p in hf.named_parameters()}
    model = apply_finetune(build_model(spec, "fp32"), spec, FT)
    got = {n: (tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()}
    assert got == want


@pytest.mark.slow
def test_bench_zero_plans_and_runs_the_same_fine_tuning():
    """run_bench_zero (what `bench zero --method lora` calls): predict() takes the fine-tuning too."""
    from zeroplan.bench.validate import run_bench_zero
    from zeroplan.bench.zero_inputs import header_lines

    report = run_bench_zero(_spec(), [3], nproc=N, precision="bf16", micro_batch=1, seq_len=16, steps=1,
                            finetune=FT, timeout_s=300)
    assert report["ok"], [r for st in report["stages"] for r in st["rows"] if not r["ok"]]
    assert report["finetune"]["trainable_params"] == TRAINABLE and report["finetune"]["frozen_params"] == BASE
    assert "fine-tuning: LoRA r=4 on q_proj,v_proj; 2,048 trainable, 115,520 frozen" in "\n".join(header_lines(report))


@pytest.mark.parametrize("flags, words", [
    ({"method": "qlora", "lora_r": 4}, "--method qlora"),
    ({"method": "lora", "lora_r": 4, "simulate": True}, "--simulate"),
])
def test_bench_zero_refuses_what_the_runtime_cannot_run(flags, words):
    from zeroplan._util import InputError
    from zeroplan.bench.validate import run_bench_zero_cli

    with pytest.raises(InputError, match=words):
        run_bench_zero_cli(model="llama-2-7b", stage="3", **flags)
