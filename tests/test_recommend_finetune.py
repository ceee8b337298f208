"""Fine-tuning in ``recommend`` (issue 15 §3) and LoRA's compute: frozen weights skip the
weight-gradient GEMM (core/finetune_compute.py). Deterministic; no GPU."""

from __future__ import annotations

import pytest

import zeroplan
from zeroplan.core.finetune_compute import FULL_TRAINING, matmul_work
from zeroplan.core.inputs import build_plan_inputs

H100 = dict(model="llama-2-7b", hardware="dgx-h100", gpus=8, precision="bf16", stage=2, micro_batch=1)


def _compute(**kw):
    return zeroplan.estimate(**{**H100, **kw}).stages[0].time.compute


# ------------------------------------------------------------------ LoRA compute
def test_full_finetuning_flops_are_unchanged_6_psi():
    inp = build_plan_inputs(model="llama-2-7b", precision="bf16")
    assert matmul_work(inp.spec, inp.finetune) == FULL_TRAINING
    c = _compute()
    # 6 FLOPs per matmul weight per token + attention 3 × forward, as before the change
    from zeroplan.core.compute import flops_per_token

    f = flops_per_token(inp.spec, 2048)
    assert c.model_flops == pytest.approx(3 * (f["matmul"] + f["attention"]) * 2048)


def test_lora_flops_are_about_two_thirds_of_full():
    full = _compute().model_flops
    lora = _compute(method="lora", lora_r=16).model_flops
    assert 0.67 <= lora / full <= 0.70  # 4Ψ of 6Ψ on the weights; attention core unchanged (3 × forward)


def test_lora_all_linear_adds_adapter_flops_and_recompute_adds_a_forward():
    base = _compute(method="lora", lora_r=16, lora_targets="all-linear")
    small = _compute(method="lora", lora_r=16)
    assert base.model_flops > small.model_flops  # more adapters, 6 FLOPs each
    ck = _compute(method="lora", lora_r=16, lora_targets="all-linear", checkpointing="full")
    assert ck.model_flops == pytest.approx(base.model_flops)
    # full recomputation runs the forward again: hardware − model = one forward = model / (1 + 1 + 0) minus
    # the attention's share; with frozen weights the forward is more than a third of the work
    assert 0.40 < (ck.hardware_flops - ck.model_flops) / ck.model_flops < 0.52
    inp = build_plan_inputs(model="llama-2-7b", precision="bf16", method="lora", lora_r=16, lora_targets="all-linear")
    w = matmul_work(inp.spec, inp.finetune)
    assert w.trainable_share == 0.0 and w.adapter_params_per_token == inp.finetune.inventory.adapter_params


def test_lora_step_is_faster_than_full():
    full = zeroplan.estimate(**H100).stages[0]
    lora = zeroplan.estimate(**H100, method="lora", lora_r=16).stages[0]
    assert lora.time.compute_time_s < 0.75 * full.time.compute_time_s


def test_modules_to_save_and_partial_training_count_their_weight_gradients():
    inp = build_plan_inputs(model="llama-2-7b", precision="bf16", method="lora", modules_to_save="lm_head")
    w = matmul_work(inp.spec, inp.finetune)
    head = inp.spec.hidden_size * inp.spec.vocab_size
    assert 0 < w.trainable_share < 0.05 and w.trainable_share * 6.6e9 == pytest.approx(head, rel=0.1)
    part = build_plan_inputs(model="llama-2-7b", precision="bf16", trainable="last:4")
    share = matmul_work(part.spec, part.finetune).trainable_share
    assert 4 / 32 * 0.9 < share < 4 / 32 + 0.05


# ------------------------------------------------------------------ recommend: method and rank search
import json  # noqa: E402
from pathlib import Path  # noqa: E402

from typer.testing import CliRunner  # noqa: E402

from zeroplan.advice.global_batch import grad_accum_for, parse_global_batch  # noqa: E402
from zeroplan.advice.recommend_models import NOISE, Recommendation  # noqa: E402
from zeroplan.cli import app  # noqa: E402
from zeroplan._util import InputError  # noqa: E402

runner = CliRunner()
# 70B on 8 × A100-40GB, stage 3 only (fast): full fine-tuning fits nowhere, LoRA and QLoRA do
BIG = dict(model="llama-2-70b", hardware="dgx-a100-40gb", gpus=8, precision="bf16", stage=3, allow_nvme=False,
           quant_storage="bf16")  # ZeRO-3 QLoRA needs 4-bit weights stored in bf16
NO_QUANT = {**BIG, "quant_storage": None}  # full and LoRA: --quant-storage is refused there
BIG_ARGS = ["-m", "llama-2-70b", "-H", "dgx-a100-40gb", "--gpus", "8", "-p", "bf16", "--stage", "3", "--no-nvme",
            "--quant-storage", "bf16"]


def invoke(args):
    return runner.invoke(app, args, catch_exceptions=False)


def one_error_line(result) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


@pytest.fixture(scope="module")
def big_any():
    return zeroplan.recommend(**BIG, method="any", lora_ranks=[8, 64])


def test_method_any_searches_every_method_and_rank(big_any):
    fs = big_any.finetune_search
    assert [v.label for v in fs.variants] == ["full", "LoRA r=8", "LoRA r=64", "QLoRA 4-bit r=8", "QLoRA 4-bit r=64"]
    full, *rest = fs.variants
    assert not full.fits and all(v.fits for v in rest)
    # rank search: LoRA at the largest rank within 5% of the fastest LoRA rank
    lora = [v for v in rest if v.method == "lora"]
    assert fs.chosen == "LoRA r=64"
    assert lora[1].tokens_per_s >= (1 - NOISE) * max(v.tokens_per_s for v in lora)
    # the recommendation around it is that variant's search
    assert big_any.chosen == lora[1].configuration and big_any.finetune.trainable_params == lora[1].trainable_params
    assert lora[1].trainable_params == 8 * lora[0].trainable_params


def test_full_does_not_fit_sentence_quotes_the_variants_numbers(big_any):
    fs = big_any.finetune_search
    full, chosen = fs.variants[0], next(v for v in fs.variants if v.label == fs.chosen)
    first, second = fs.reasons[:2]
    assert first.text().startswith("Full fine-tuning does not fit")
    q = first.quantities
    assert q["full_peak"].value == full.peak_bytes and q["usable"].value == fs.usable_gpu_bytes
    assert q["over"].value == full.peak_bytes - fs.usable_gpu_bytes > 0
    assert full.peak_bytes == min(s.leanest.peak_bytes for s in zeroplan.recommend(**NO_QUANT).stages)
    q2 = second.quantities
    assert second.text().startswith(f"{chosen.label} fits")
    assert q2["peak"].value == chosen.peak_bytes == big_any.chosen.peak_bytes
    assert q2["free"].value == fs.usable_gpu_bytes - chosen.peak_bytes > 0
    assert q2["less"].value == full.peak_bytes - chosen.peak_bytes
    assert fs.explanation == [r.text() for r in fs.reasons] and big_any.explanation[:len(fs.reasons)] == fs.explanation


def test_default_method_is_todays_behaviour():
    rec = zeroplan.recommend(**NO_QUANT, method="lora")
    assert rec.finetune_search is None and rec.global_batch is None
    assert rec.finetune.method == "lora" and rec.peft["peft"]["r"] == 8


def test_lora_ranks_alone_searches_lora_only():
    rec = zeroplan.recommend(**NO_QUANT, lora_ranks=[4, 16])
    assert [v.label for v in rec.finetune_search.variants] == ["LoRA r=4", "LoRA r=16"]


@pytest.mark.parametrize("args, needle", [
    (["--method", "full", "--lora-ranks", "8"], "--lora-ranks with --method full"),
    (["--lora-r", "8", "--lora-ranks", "8,16"], "--lora-r 8 and --lora-ranks"),
    (["--lora-ranks", "8,x"], "'x' is not a positive whole rank"),
    (["--lora-ranks", "0"], "is not a positive whole rank"),
    (["--method", "some"], "--method 'some' is unknown"),
    (["--global-batch", "512"], "give the unit"),
    (["--global-batch", "4Mbananas"], "expected a number"),
    (["--global-batch", "1.5tokens"], "whole number"),
    (["--global-batch", "64samples", "--grad-accum", "2"], "not both"),
])
def test_bad_finetune_search_options_are_one_line(args, needle):
    line = one_error_line(invoke(["recommend", *BIG_ARGS, *args]))
    assert needle in line, line


def test_schema_has_the_new_keys():
    props = Recommendation.model_json_schema()["properties"]
    assert {"finetune", "finetune_search", "global_batch", "peft"} <= set(props)
    r = invoke(["schema", "recommend"])
    assert r.exit_code == 0 and "finetune_search" in r.stdout and "global_batch" in r.stdout


# ------------------------------------------------------------------ --global-batch
@pytest.mark.parametrize("text, value, unit", [
    ("4Mtokens", 4_000_000, "tokens"), ("4M tokens", 4_000_000, "tokens"), ("1.5Ktok", 1500, "tokens"),
    ("512samples", 512, "samples"), ("2kseqs", 2000, "samples"), ("1Gtokens", 10**9, "tokens"),
])
def test_global_batch_syntax(text, value, unit):
    assert parse_global_batch(text) == (value, unit)


@pytest.mark.parametrize("text", ["512", "4M", "tokens", "-4Mtokens", "0samples", "4Ttokens", "1e6tokens"])
def test_global_batch_refuses_ambiguous_or_invalid(text):
    with pytest.raises(InputError):
        parse_global_batch(text)


def test_grad_accum_rounds_up_and_reports_the_real_batch():
    g = grad_accum_for(1_000_000, "tokens", micro_batch=2, data_parallel=8, seq_len=2048)
    assert g.grad_accum == 31 and g.samples == 496 and g.tokens == 1_015_808  # ceil(489 / 16) = 31
    assert "+1.6% over the target" in g.sentence
    g = grad_accum_for(512, "samples", micro_batch=4, data_parallel=8, seq_len=2048)
    assert g.grad_accum == 16 and g.samples == 512 and "exactly" in g.sentence


def test_recommend_global_batch_sets_grad_accum_and_ds_config():
    rec = zeroplan.recommend(**NO_QUANT, method="lora", global_batch="512samples")
    g, c = rec.global_batch, rec.chosen
    assert g.micro_batch == c.micro_batch and g.grad_accum * c.micro_batch * 8 == g.samples >= 512
    assert g.grad_accum == -(-512 // (c.micro_batch * 8))
    assert rec.training["grad_accum"] == g.grad_accum == rec.ds_config["gradient_accumulation_steps"]
    assert rec.ds_config["train_batch_size"] == g.samples
    assert rec.explanation[0] == g.sentence and rec.explanation_reasons[0] == g.reason
    # the useful throughput counts the whole step's tokens
    assert c.tokens_per_s == pytest.approx(g.tokens / c.step_time_s)


def test_global_batch_caps_the_micro_batch_at_the_target():
    rec = zeroplan.recommend(**BIG, method="qlora", global_batch="16samples")
    assert rec.chosen.micro_batch <= 2 and rec.global_batch.samples == 16


# ------------------------------------------------------------------ --emit-config: PEFT sidecar and check
def test_emit_config_writes_peft_sidecar_and_check_passes(tmp_path: Path):
    out = tmp_path / "ds.json"
    r = invoke(["recommend", *BIG_ARGS, "--method", "any", "--lora-ranks", "8,64", "--lora-targets", "all-linear",
                "--lora-alpha", "32", "--global-batch", "1Mtokens", "--emit-config", str(out), "--json"])
    assert r.exit_code == 0, r.output
    rec = json.loads(r.stdout)
    side = json.loads((tmp_path / "ds.peft.json").read_text())
    cfg = json.loads(out.read_text())
    assert side["method"] == "lora" and side["peft"]["r"] == 64 and side["peft"]["target_modules"] == "all-linear"
    assert side["peft"]["lora_alpha"] == 32 and side["peft"]["lora_dropout"] == 0.0 and side["quantization"] is None
    t = side["trainer"]
    assert t["per_device_train_batch_size"] == rec["chosen"]["micro_batch"] == cfg["train_micro_batch_size_per_gpu"]
    assert t["gradient_accumulation_steps"] == rec["global_batch"]["grad_accum"] == cfg["gradient_accumulation_steps"]
    assert t["bf16"] is True and t["max_seq_length"] == 2048 and t["deepspeed"] == str(out)
    assert t["gradient_checkpointing"] == (rec["chosen"]["checkpointing"] != "none")
    assert cfg["zeroplan"]["finetune"] == {"method": "lora", "lora_r": 64, "lora_targets": "all-linear", "dora": False,
                                           "lora_alpha": 32}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.json", "ds.peft.json"]  # no temp files left
    # check with default flags plans the recorded fine-tuning back, and passes
    r = invoke(["check", str(out), "-m", "llama-2-70b", "-H", "dgx-a100-40gb", "--gpus", "8", "-f", "json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    assert report["counts"]["error"] == 0
    assert report["files"][0]["plan"]["peak_bytes"] == rec["chosen"]["peak_bytes"]


def test_qlora_sidecar_spells_bitsandbytes():
    rec = zeroplan.recommend(**BIG, method="qlora")
    q = rec.peft["quantization"]
    assert q == {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                 "bnb_4bit_quant_storage": "bfloat16", "bnb_4bit_compute_dtype": "bfloat16"}


def test_full_fits_only_with_offload_sentence():
    # 13B on 8 × RTX 4090 (24 GB): full fine-tuning needs optimizer offload, LoRA and QLoRA do not
    rec = zeroplan.recommend(model="llama-2-13b", hardware="rtx4090-8x-workstation", precision="bf16", stage=3,
                             allow_nvme=False, method="any", quant_storage="bf16")
    fs = rec.finetune_search
    full = fs.variants[0]
    assert fs.chosen == "full" and full.fits and full.configuration.offload
    (r,) = [x for x in fs.reasons if x.text().startswith("Full fine-tuning fits only with offload")]
    lean = next(v for v in fs.variants if v.label == r.words["label"])
    assert lean.fits and not lean.configuration.offload
    assert r.quantities["full_tps"].value == pytest.approx(full.tokens_per_s)
    assert r.quantities["ratio"].value == pytest.approx(full.tokens_per_s / lean.tokens_per_s) and lean.tokens_per_s > full.tokens_per_s


def test_sweep_times_lora_as_evaluate_does():
    # the search's shared sweep and evaluate() count the same frozen-weight FLOPs
    rec = zeroplan.recommend(**NO_QUANT, method="lora")
    assert rec.plan.step_time_s == pytest.approx(rec.chosen.step_time_s, rel=1e-12)
    assert rec.plan.time.compute.model_flops < 0.75 * zeroplan.estimate(
        model="llama-2-70b", hardware="dgx-a100-40gb", gpus=8, precision="bf16", stage=3,
        micro_batch=rec.chosen.micro_batch, checkpointing=rec.chosen.checkpointing).stages[0].time.compute.model_flops


def test_method_any_outside_recommend_is_one_line():
    line = one_error_line(invoke(["estimate", "-m", "llama-2-7b", "--gpus", "8", "--method", "any"]))
    assert "--method any" in line and "zeroplan recommend" in line


def test_lora_sweep_matches_evaluate_with_stage3_forward_moments():
    """With a frozen base, stage 3 gathers in its forward, which core/memory.py plans region by region
    (forward_moments); the sweep carries those moments as data, so every alternative still equals
    evaluate() byte for byte."""
    from zeroplan.advice.recommend import recommend

    from recommend_plan import evaluate_candidate

    inp = build_plan_inputs(model="llama-2-7b", hardware="dgx-a100-80gb", gpus=8, precision="bf16", method="lora",
                            lora_r=16, seq_len=512)
    rec = recommend(inp, top=10)
    stage3 = [a for a in rec.alternatives if a.stage == 3]
    assert stage3
    for a in rec.alternatives:
        p = evaluate_candidate(inp, a)
        assert p.memory.peak == a.peak_bytes, a
        if a.stage == 3:
            assert p.memory.forward_moments  # the frozen base is gathered in the forward
