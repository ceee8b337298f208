"""The explanation of ``recommend``: why this configuration, why not the others, what the
communication costs on this hardware, and what to change when nothing fits.

Every sentence is a structured ``Reason`` built from numbers of the sweep or of an evaluated
alternative (``rec.suggestions``); ``rec.explanation`` / ``rec.warnings`` are their texts.

Imports: module level only.
"""

from __future__ import annotations

from typing import Any

from zeroplan.advice.alternatives import AdviceContext, comm_remedies, is_ethernet
from zeroplan.advice.reasons import (
    Quantity, Reason, join_reasons, qbytes, qcount, qelements, qfraction, qseconds, qtokens, reason,
)
from zeroplan.advice.recommend_models import NOISE, OFFLOAD_RATIO, Recommendation
from zeroplan.core.elementwise import elementwise_traffic

__all__ = ["explain"]

_B, _S, _F, _T, _N, _E = qbytes, qseconds, qfraction, qtokens, qcount, qelements
_joined = join_reasons


def explain(rec: Recommendation, inp: Any, hw: Any, *, micro_batch_fixed: int | None, ckpts: list[str],
             ctx: AdviceContext | None = None, lean_zero: Any = None) -> None:
    """Fill ``rec.explanation_reasons`` / ``rec.warning_reasons`` (and their texts): every sentence is
    built from numbers of the sweep or of an evaluated alternative (``rec.suggestions``)."""
    gpu_r = reason("{usable} usable on the {cap} {gpu}" + (" ({free} kept free)" if rec.headroom else ""),
                   usable=_B(rec.usable_gpu_bytes), cap=_B(rec.cluster.gpu_memory_bytes or 0), gpu=hw.gpu.name,
                   free=_F(rec.headroom))
    gpu = gpu_r.text()
    c = rec.chosen
    ex = rec.explanation_reasons
    warn = rec.warning_reasons
    by_stage = {s.stage: s for s in rec.stages}
    if c is not None:
        ex.append(reason(
            "Recommended: {label}, micro-batch {mb}, checkpointing {ckpt}, reduce_bucket_size {rbs}"
            + (", stage3_prefetch_bucket_size {pf}" if c.stage == 3 else "")
            + (", hpZ {hpz}" if c.hpz_partition_size > 1 else "")
            + ": peak {peak} per GPU ({free} free of {cap}), {tps} on {n} GPUs.",
            label=c.label(), mb=_N(c.micro_batch), ckpt=c.checkpointing, rbs=_E(c.reduce_bucket_size),
            pf=_E(c.prefetch_bucket_size or 0), hpz=_N(c.hpz_partition_size), peak=_B(c.peak_bytes),
            free=_B(c.headroom_bytes), cap=_B(c.gpu_memory_bytes), tps=_T(c.tokens_per_s), n=_N(rec.cluster.n_gpus)))
    _explain_stages(rec, ex, gpu)
    if c is not None and c.offload:
        non = [a for a in rec.alternatives if not a.offload]
        if not non:
            ex.append(reason("Offload is recommended because no configuration without offload fits."))
        else:
            ex.append(reason("Offload is recommended because the best configuration without it ({label}, {tps}) "
                             "reaches less than {ratio} of {ctps}.", label=non[0].label(), tps=_T(non[0].tokens_per_s),
                             ratio=_F(OFFLOAD_RATIO), ctps=_T(c.tokens_per_s)))
    elif c is not None:
        fit_off = [a for a in rec.alternatives if a.offload]
        if fit_off:
            ex.append(reason("No offload: the best offload configuration ({label}) reaches {tps}; offload is used "
                             "only when nothing without it reaches {ratio} of that.", label=fit_off[0].label(),
                             tps=_T(fit_off[0].tokens_per_s), ratio=_F(OFFLOAD_RATIO)))
    # communication on this hardware
    p = rec.plan
    if c is not None and p is not None and p.time is not None:
        t = p.time
        where = ("{inter} of it across nodes over {link}" if rec.cluster.nodes > 1 else "inside one node over {link}")
        ex.append(reason(
            "Communication on {hw}: ZeRO-{s} sends {sent} per GPU per optimizer step (" + where + "); {comm} of "
            "collectives ({algos}), {exposed} exposed after overlap (bracket {best}–{worst}; {hidden} hidden behind "
            "compute, which slows it by {slowdown}), {share} of the {step} step. Compute {compute} at MFU {mfu} "
            "({terms})"
            + ("; the optimizer step on the GPU {gpu_opt} ({opt_gb} of HBM traffic, not overlapped)"
               if t.gpu_optimizer_time_s else "")
            + ("; offload: PCIe copies {pcie}" if t.pcie_time_s else "")
            + (", CPU optimizer step {cpu_opt}" if t.cpu_optimizer_time_s else "")
            + (", NVMe swap {nvme}" if t.nvme_time_s else "")
            + ("; host-bound: DeepSpeed's stage-3 module hooks take {host} on the host and the GPU waits {host_wait} "
               "for them" if t.host_bound_s else "") + ".",
            hw=hw.name, s=_N(c.stage), sent=_B(p.comm.bytes_per_gpu_per_step),
            inter=_B(p.comm.inter_node_bytes_per_gpu_per_step),
            link=hw.inter_node.name if rec.cluster.nodes > 1 else hw.intra_node.name, comm=_S(t.comm_time_s),
            algos=_algos(t), exposed=_S(t.exposed_time_s["estimate"]), best=_S(t.exposed_time_s["best"]),
            worst=_S(t.exposed_time_s["worst"]), hidden=_S(t.hidden_comm_s), slowdown=_S(t.overlap_slowdown_s),
            share=_F(t.comm_share), step=_S(t.step_time_s), compute=_S(t.compute_time_s), mfu=_F(t.mfu),
            terms=_compute_terms(t), gpu_opt=_S(t.gpu_optimizer_time_s), opt_gb=_B(t.gpu_optimizer_bytes),
            pcie=_S(t.pcie_time_s or 0.0), cpu_opt=_S(t.cpu_optimizer_time_s or 0.0),
            nvme=_S(t.nvme_time_s or 0.0), host=_S(t.host_time_s), host_wait=_S(t.host_bound_s)))
        _explain_kernels(rec, inp, ex)
        if c.stage == 3 and rec.cluster.nodes > 1 and is_ethernet(hw.inter_node):
            warn.append(reason(
                "ZeRO-3 across {nodes} nodes over Ethernet ({link}, {bw} per GPU): parameter all-gathers in forward "
                "and backward cross the slow link every micro-step; " +
                ("it is communication-bound ({share} of the step is exposed communication)." if t.comm_share > 0.5
                 else "{share} of the step is exposed communication."),
                nodes=_N(rec.cluster.nodes), link=hw.inter_node.name,
                bw=Quantity(value=hw.inter_node.bandwidth_GBps_per_gpu, unit="GB/s"), share=_F(t.comm_share)))
        if t.comm_share > 0.5 and ctx is not None:
            rem = comm_remedies(ctx)
            rec.suggestions.extend(a for a, _ in rem)
            head = reason("Communication-bound: exposed communication is {share} of the step.", share=_F(t.comm_share))
            tail = _joined([r for _, r in rem], "; ")
            tail = tail.model_copy(update={"template": tail.template[:1].upper() + tail.template[1:] + "."})
            warn.append(_joined([head, tail], " "))
    # ZeRO-3 communication-bound where it is the only option
    s3 = by_stage.get(3)
    if c is not None and c.stage < 3 and s3 is not None and s3.best is not None and s3.best.comm_share is not None \
            and s3.best.comm_share > 0.5:
        ex.append(reason("ZeRO-3 would be communication-bound here ({share} of its step is exposed communication).",
                         share=_F(s3.best.comm_share)))
    if c is None:
        _explain_nothing_fits(rec, inp, hw, micro_batch_fixed=micro_batch_fixed, ckpts=ckpts, lean_zero=lean_zero)
    rec.explanation = [r.text() for r in rec.explanation_reasons]
    rec.warnings = [r.text() for r in rec.warning_reasons]


def _explain_stages(rec: Recommendation, ex: list[Reason], gpu: str) -> None:
    """Why the lower stages (or no offload) were not chosen, and higher stages within the noise."""
    c = rec.chosen
    by_stage = {s.stage: s for s in rec.stages}
    upto = c.stage if c is not None else 4
    for s in sorted(by_stage):
        ss = by_stage[s]
        if s > upto:
            continue
        ln = ss.leanest
        if not ss.fits_without_offload and (s < upto or c is None or c.offload):
            if ln.limit == "host":
                ex.append(reason("ZeRO-{s} without offload does not fit: host RAM per node {host} exceeds {usable} usable.",
                                 s=_N(s), host=_B(ln.host_per_node_bytes), usable=_B(rec.usable_host_bytes_per_node)))
            else:
                ex.append(reason(
                    "ZeRO-{s} does not fit without offload: even at its leanest (micro-batch {mb}, checkpointing "
                    "{ckpt}, reduce_bucket_size {rbs}, no offload) it needs {peak} per GPU, {over} over the {gpu}; "
                    "the largest part is {dom}.", s=_N(s), mb=_N(ln.micro_batch), ckpt=ln.checkpointing,
                    rbs=_E(ln.reduce_bucket_size), peak=_B(ln.peak_bytes), over=_B(ln.peak_bytes - rec.usable_gpu_bytes),
                    gpu=gpu, dom=ss.leanest_dominant))
            if ss.fits and ss.best is not None and (c is None or s < upto):
                b = ss.best
                ex.append(reason("  With offload ({off}) ZeRO-{s} fits (peak {peak}, host RAM {host} per node) but "
                                 "reaches {tps}.", off=b.offload_label(), s=_N(s), peak=_B(b.peak_bytes),
                                 host=_B(b.host_per_node_bytes), tps=_T(b.tokens_per_s)))
        elif s < upto and ss.best is not None and c is not None:
            b = ss.best
            ex.append(reason(
                "ZeRO-{s} fits (best: {label}, micro-batch {mb}, {tps}) but is "
                + ("slower" if b.tokens_per_s < c.tokens_per_s else "not faster") + " than the choice by {gap}"
                + (" (within the {noise} noise band the lower stage would have been preferred)."
                   if b.tokens_per_s >= (1 - NOISE) * c.tokens_per_s else "."),
                s=_N(s), label=b.label(), mb=_N(b.micro_batch), tps=_T(b.tokens_per_s),
                gap=_F(abs(1 - b.tokens_per_s / c.tokens_per_s)), noise=_F(NOISE)))
    for s in sorted(by_stage):
        ss = by_stage[s]
        if c is not None and s > c.stage and ss.best is not None and ss.best.tokens_per_s > c.tokens_per_s:
            b = ss.best
            ex.append(reason("ZeRO-{s} ({label}, micro-batch {mb}) would reach {tps}, {more} more: within the {noise} "
                             "noise of the model, so the lower stage is preferred (less communication, fewer moving "
                             "parts).", s=_N(s), label=b.label(), mb=_N(b.micro_batch), tps=_T(b.tokens_per_s),
                             more=_F(b.tokens_per_s / c.tokens_per_s - 1, 1), noise=_F(NOISE)))


def _explain_nothing_fits(rec: Recommendation, inp: Any, hw: Any, *, micro_batch_fixed: int | None,
                          ckpts: list[str], lean_zero: Any) -> None:
    ex = rec.explanation_reasons
    ex.append(reason("Nothing fits on {n} GPUs ({nodes} node(s) of {hw}) with {headroom} headroom.",
                     n=_N(rec.cluster.n_gpus), nodes=_N(rec.cluster.nodes), hw=hw.name, headroom=_F(rec.headroom)))
    mb_lean = rec.stages[0].leanest.micro_batch if rec.stages else 1
    for k, v in rec.nodes_needed.items():
        if v is not None:
            ex.append(reason("  {k} without offload (micro-batch {mb}, full checkpointing) fits on {v} nodes ({g} GPUs).",
                             k=k, mb=_N(mb_lean), v=_N(v), g=_N(v * rec.cluster.gpus_per_node)))
        else:
            ex.append(reason("  {k} without offload does not fit on any number of nodes up to 16384: its replicated "
                             "states do not shrink with more GPUs.", k=k))
    for s in [s for s in rec.stages if s.leanest.limit == "host"]:
        ex.append(reason("  ZeRO-{s}: host RAM is the limit ({host} per node).", s=_N(s.stage),
                         host=_B(s.leanest.host_per_node_bytes)))
    if lean_zero is not None:
        # evaluated: the highest searched stage, no offload, with full checkpointing / micro-batch 1
        ctx = AdviceContext(inp=inp, zero=lean_zero, training=inp.training.model_copy(update={
            "micro_batch": micro_batch_fixed or 1, "checkpointing": ckpts[-1]}), min_headroom=rec.headroom)
        s = int(lean_zero.stage)
        if "full" not in ckpts:
            a = ctx.try_change({"checkpointing": "full"}, "peak_bytes", "lower")
            rec.suggestions.append(a)
            ex.append(reason("  With --checkpointing full, ZeRO-{s} at micro-batch {mb} peaks at {after} per GPU ("
                             + ("fits" if a.fits else "still over") + ").", s=_N(s), mb=_N(micro_batch_fixed or 1),
                             after=_B(a.after_peak_bytes)))
        if micro_batch_fixed and micro_batch_fixed > 1:
            a = ctx.try_change({"micro_batch": 1}, "peak_bytes", "lower")
            rec.suggestions.append(a)
            ex.append(reason("  With micro-batch 1 (and more gradient accumulation) instead of {mb}, ZeRO-{s} peaks at "
                             "{after} per GPU (" + ("fits" if a.fits else "still over") + ").",
                             mb=_N(micro_batch_fixed), s=_N(s), after=_B(a.after_peak_bytes)))
    ex.append(reason("  Offload (CPU/NVMe) was searched too; see the host-RAM and NVMe limits above, or add nodes."))


def _algos(t: Any) -> str:
    """NCCL algorithm/protocol the model picks for the largest call of each collective."""
    return ", ".join(f"{op} {a}" for op, a in sorted(t.algorithms.items())) or "none"


def _compute_terms(t: Any) -> str:
    c = t.compute
    if c is None or c.gemm_fraction is None:
        return t.mfu_source
    return (f"{c.generation}: matmuls at {c.gemm_fraction:.2f} of peak × shape {c.shape_factor:.2f}, attention "
            f"{c.attention_share:.0%} of the FLOPs at {c.attention_fraction:.2f}")


def _explain_kernels(rec: Recommendation, inp: Any, ex: list[Reason]) -> None:
    """What transformers' code run op by op costs the chosen step, and what fusing it would save
    (core/elementwise.py: the same bytes at the same HBM rate, counted for fused kernels)."""
    t, c = rec.plan.time, rec.chosen
    training = inp.training.model_copy(update={"checkpointing": c.checkpointing, "micro_batch": c.micro_batch})
    if training.kernels == "fused" or t.compute is None or t.mfu_source.startswith("--mfu"):
        return

    def streamed(kernels: str) -> float:
        e = elementwise_traffic(inp.spec, training.model_copy(update={"kernels": kernels}))
        return e.forward_bytes + e.backward_bytes + (e.recompute_bytes if training.checkpointing == "full" else 0.0)

    ew = t.compute.elementwise_time_s
    fused = ew * streamed("fused") / streamed(training.kernels)
    ex.append(reason(
        "Element-wise kernels run op by op ({kernels}: transformers' modeling code): norms, activation functions, "
        "rotary and the loss stream {ew} of the {step} step through HBM; Liger's kernels or torch.compile fuse "
        "them to about {fused}, {saving} less per step (--kernels fused).",
        kernels=training.kernels, ew=_S(ew), step=_S(t.step_time_s), fused=_S(fused), saving=_S(ew - fused)))
