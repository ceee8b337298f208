"""``recommend --method any`` and ``--lora-ranks``: the fine-tuning method and LoRA rank searched.

Each variant (full fine-tuning, LoRA at each rank, QLoRA at each rank) is one full ``recommend``
search (a callable the API passes in, so this module never builds inputs); its best configuration,
or, when nothing fits, its leanest one without offload (the smallest peak its stage summaries hold),
is kept as a ``FineTuneVariant``.

Choice (``FINETUNE_RULE``): zeroplan does not judge model quality, so it takes the least
approximate method that fits: full fine-tuning, else LoRA on bf16/fp16 weights, else QLoRA on
quantised weights. Among the ranks of that method it takes the largest whose useful throughput is
within ``NOISE`` (5%, recommend's "as fast") of the fastest fitting rank: a higher rank is more
adapter capacity, and is only given up when it costs speed. Every sentence is built from the
variants' numbers (``Reason``): what does not fit and by how much, what fits instead.
"""

from __future__ import annotations

from typing import Any, Callable

from zeroplan.advice.reasons import Reason, qbytes, qcount, qfraction, qtokens, reason
from zeroplan.advice.recommend_models import FINETUNE_RULE, NOISE, Candidate, FineTuneSearch, FineTuneVariant

__all__ = ["FineTuneVariant", "FineTuneSearch", "FINETUNE_RULE", "METHODS", "search_finetune", "variant_label"]

METHODS = ("full", "lora", "qlora")


def variant_label(method: str, lora_r: int | None, quant_bits: int | None = None) -> str:
    if method == "full":
        return "full"
    return f"QLoRA {quant_bits or 4}-bit r={lora_r}" if method == "qlora" else f"LoRA r={lora_r}"


def _variant(label: str, method: str, lora_r: int | None, rec: Any) -> FineTuneVariant:
    inv = rec.finetune
    trainable = inv.trainable_params if inv is not None else rec.model.params
    if rec.chosen is not None:
        conf = rec.chosen
    else:
        conf = min((s.leanest for s in rec.stages), key=lambda c: c.peak_bytes)
    return FineTuneVariant(label=label, method=method, lora_r=lora_r, trainable_params=trainable,
                           fits=rec.chosen is not None, configuration=conf, peak_bytes=conf.peak_bytes,
                           tokens_per_s=conf.tokens_per_s if rec.chosen is not None else None,
                           grad_accum=int(rec.training["grad_accum"]))


def _conf(c: Candidate) -> str:
    return f"{c.label()}, micro-batch {c.micro_batch}, checkpointing {c.checkpointing}"


def choose_variant(variants: list[FineTuneVariant]) -> FineTuneVariant | None:
    """``FINETUNE_RULE``: the first method in METHODS order with a fitting variant; its largest rank
    within NOISE of the fastest."""
    for m in METHODS:
        fit = [v for v in variants if v.method == m and v.fits]
        if fit:
            best = max(v.tokens_per_s or 0.0 for v in fit)
            near = [v for v in fit if (v.tokens_per_s or 0.0) >= (1 - NOISE) * best]
            return max(near, key=lambda v: (v.lora_r or 0, v.tokens_per_s or 0.0))
    return None


def _reasons(variants: list[FineTuneVariant], chosen: FineTuneVariant | None, usable: int, gpu: int) -> list[Reason]:
    out: list[Reason] = []
    full = next((v for v in variants if v.method == "full"), None)
    if full is not None and not full.fits:
        out.append(reason(
            "Full fine-tuning does not fit: no searched configuration does (offload included); its leanest without "
            "offload ({full_conf}) needs {full_peak} per GPU, {over} more than the {usable} usable of {gpu}.",
            full_conf=_conf(full.configuration), full_peak=qbytes(full.peak_bytes),
            over=qbytes(full.peak_bytes - usable), usable=qbytes(usable), gpu=qbytes(gpu)))
        if chosen is not None:
            out.append(reason(
                "{label} fits: {conf} peaks at {peak} per GPU ({free} under the usable memory, {less} less than full "
                "fine-tuning's leanest), training {trainable} parameters at {tps}.",
                label=chosen.label, conf=_conf(chosen.configuration), peak=qbytes(chosen.peak_bytes),
                free=qbytes(usable - chosen.peak_bytes), less=qbytes(full.peak_bytes - chosen.peak_bytes),
                trainable=qcount(chosen.trainable_params), tps=qtokens(chosen.tokens_per_s)))
    elif full is not None and chosen is full and full.configuration.offload:
        lean = [v for v in variants if v.method != "full" and v.fits and not v.configuration.offload]
        if lean:
            best = max(lean, key=lambda v: v.tokens_per_s or 0.0)
            out.append(reason(
                "Full fine-tuning fits only with offload ({full_conf}: {full_tps}); {label} fits without "
                "({conf}: {tps}, so a token takes {ratio} of full fine-tuning's time).",
                full_conf=_conf(full.configuration), full_tps=qtokens(full.tokens_per_s), label=best.label,
                conf=_conf(best.configuration), tps=qtokens(best.tokens_per_s),
                ratio=qfraction((full.tokens_per_s or 0.0) / (best.tokens_per_s or 1.0))))
    if chosen is None:
        out.append(reason("No searched method fits: the smallest peak is {peak} per GPU ({label}, {conf}), over the "
                          "{usable} usable.", peak=qbytes(min(v.peak_bytes for v in variants)),
                          label=min(variants, key=lambda v: v.peak_bytes).label,
                          conf=_conf(min(variants, key=lambda v: v.peak_bytes).configuration), usable=qbytes(usable)))
        return out
    ranks = [v for v in variants if v.method == chosen.method and v.fits and v.lora_r is not None]
    if len(ranks) > 1:
        fastest = max(ranks, key=lambda v: v.tokens_per_s or 0.0)
        out.append(reason(
            "Rank {r}: the largest searched rank within {noise} of the fastest ({fastest}: {fastest_tps}; "
            "{label}: {tps}, {trainable} trainable parameters, {peak} per GPU).",
            r=str(chosen.lora_r), noise=qfraction(NOISE), fastest=fastest.label,
            fastest_tps=qtokens(fastest.tokens_per_s), label=chosen.label, tps=qtokens(chosen.tokens_per_s),
            trainable=qcount(chosen.trainable_params), peak=qbytes(chosen.peak_bytes)))
    return out


def search_finetune(run: Callable[[str, int | None], Any], *, methods: list[str], lora_ranks: list[int],
                    quant_bits: int | None, notes: list[str] | None = None) -> tuple[Any, FineTuneSearch]:
    """Run ``run(method, lora_r)`` (→ a Recommendation with ``finetune`` set) for every variant; the
    chosen variant's Recommendation (else the first variant's) and the search."""
    results: list[tuple[FineTuneVariant, Any]] = []
    for m in methods:
        for r in ([None] if m == "full" else lora_ranks):
            rec = run(m, r)
            results.append((_variant(variant_label(m, r, quant_bits), m, r, rec), rec))
    variants = [v for v, _ in results]
    chosen = choose_variant(variants)
    rec = next((x for v, x in results if v is chosen), results[0][1])
    usable, gpu = int(rec.usable_gpu_bytes), int(rec.cluster.gpu_memory_bytes or 0)
    reasons = _reasons(variants, chosen, usable, gpu)
    fs = FineTuneSearch(methods=list(methods), lora_ranks=list(lora_ranks), variants=variants,
                        chosen=chosen.label if chosen is not None else None, usable_gpu_bytes=usable,
                        gpu_memory_bytes=gpu, reasons=reasons, explanation=[x.text() for x in reasons],
                        notes=list(notes or []))
    return rec, fs
