"""The rules of ``check`` on one evaluated plan, by concern (the table is in advice/check.py):

- capacity (``capacity_rules``): ZP101 OOM, ZP102 the stage-3 gather phase, ZP103 headroom,
  ZP104 host RAM, ZP105 NVMe;
- communication (``comm_rules``): ZP201 exposed share, ZP202 ZeRO-3 over Ethernet, ZP203
  latency-bound gradient buckets, ZP205 stage 3 all-reducing its gradient buckets;
- stage choice (``stage_rules``): ZP204 stage 2 with large accumulation, ZP301 stage 3 where a
  lower stage fits, ZP302 offload where it is not needed, ZP303 stage 3 waiting for its host hooks, ZP304
  MoE blocks as ZeRO-3 leaves where the memory is short.

Each rule reports through ``add(rule, severity, reason, key, value, alternatives=...)``; every
suggested change is evaluated (``AdviceContext.try_change``) before it is claimed.

Imports: module level only.
"""

from __future__ import annotations

from typing import Callable

from zeroplan.advice.alternatives import (
    NDR_GBPS_PER_GPU, AdviceContext, bucket_latency_share, comm_remedies, fits_with_headroom, is_ethernet,
)
from zeroplan.advice.reasons import (
    MEANINGFUL, Quantity, join_reasons, qbytes, qbytes_gib, qcount, qfraction, qseconds, qtokens, reason,
)
from zeroplan.core.moe_leaf import moe_leaf_units
from zeroplan.core.plan import Plan

__all__ = ["CHECK_RULES", "PREFETCH_SMALL", "BUCKET_LARGE", "capacity_rules", "comm_rules", "stage_rules"]

CHECK_RULES: dict[str, tuple[str, str]] = {
    "ZP000": ("error", "config readable"),
    "ZP101": ("error", "peak fits GPU memory"),
    "ZP102": ("error", "stage-3 gather fits the memory left"),
    "ZP103": ("warning", "GPU memory headroom"),
    "ZP104": ("error", "offload fits host RAM per node"),
    "ZP105": ("error", "NVMe offload fits NVMe capacity"),
    "ZP201": ("warning", "exposed communication share"),
    "ZP202": ("warning", "ZeRO-3 across nodes over Ethernet"),
    "ZP203": ("warning", "gradient buckets not latency-bound"),
    "ZP204": ("warning", "stage 2 with large gradient accumulation"),
    "ZP205": ("warning", "stage-3 gradients reduce-scattered, not all-reduced"),
    "ZP301": ("info", "stage 3 only where needed"),
    "ZP302": ("warning", "offload only where needed"),
    "ZP303": ("warning", "stage-3 step not host-bound"),
    "ZP304": ("warning", "MoE leaf blocks fit stage 3's memory"),
}

PREFETCH_SMALL = 10_000_000  # stage3_prefetch_bucket_size tried for ZP102, elements (as recommend's search)
BUCKET_LARGE = 500_000_000  # reduce_bucket_size tried for ZP203 at least, elements (DeepSpeed's default)

_B, _BG, _S, _F, _T, _N = qbytes, qbytes_gib, qseconds, qfraction, qtokens, qcount
_joined = join_reasons


Add = Callable[..., None]


def capacity_rules(ctx: AdviceContext, plan: Plan, add: Add, gpu: str) -> None:
    mem, hw, z = plan.memory, ctx.hw, "zero_optimization"
    gpu_mem = int(plan.gpu_memory_bytes or 0)
    stage = int(ctx.zero.stage)
    if mem.peak > gpu_mem:
        add("ZP101", "error", reason("OOM: predicted peak {peak} per GPU in {phase} exceeds the {gpu} by {over}; {why}",
                                     peak=_BG(mem.peak), phase=mem.peak_phase, gpu=gpu, over=_B(mem.peak - gpu_mem),
                                     why=mem.peak_reason), f"{z}.stage", stage)
    if stage == 3:
        ov = hw.overhead
        frac = float(ov.fragmentation_fraction)
        fixed = int(ov.cuda_context_bytes) + int(ov.nccl_bytes) * mem.communicators
        for phase in ("forward", "backward"):
            g = mem.buffers_detail.get(f"gathered_params_{phase}", 0)
            if not g:
                continue
            rest = mem.phases[phase].peak - g
            # split-segment slack on the churned bytes only (core/allocator.py); the gather churns
            churned = max(0, mem.phases[phase].peak - mem.held_bytes.get(phase, 0))
            need = rest + g + int(churned * frac) + fixed
            without = rest + int(max(0, churned - g) * frac) + fixed
            if need > gpu_mem and without <= gpu_mem:
                module = mem.gather.module if mem.gather is not None else "the largest module"
                r = reason("OOM during the {phase} gather phase: states, buffers and activations take {without} "
                           "(with overhead) of the {gpu}, leaving {left}, but gathering parameters around `{module}` "
                           "needs {gather}", phase=phase, without=_B(without), gpu=gpu, left=_B(gpu_mem - without),
                           module=module, gather=_B(int(g * (1 + frac))))
                alts = []
                pf = int(ctx.zero.prefetch_bucket_size)
                if pf > PREFETCH_SMALL:
                    a = ctx.try_change({"prefetch_bucket_size": PREFETCH_SMALL}, "peak_bytes", "lower")
                    alts.append(a)
                    slots = dict(pf=Quantity(value=PREFETCH_SMALL, unit="elements"), after=_B(a.after_peak_bytes))
                    r = _joined([r, reason("with stage3_prefetch_bucket_size {pf} the peak is {after}" +
                                           (" and fits" if a.fits else ", still over"), **slots)])
                add("ZP102", "error", r, f"{z}.prefetch_bucket_size", alternatives=alts)
                break
    if mem.peak <= gpu_mem and (plan.headroom_bytes or 0) < ctx.min_headroom * gpu_mem:
        r = reason("headroom {free} is {share} of the {gpu}, under the {min} kept free (peak {peak} in {phase})",
                   free=_B(plan.headroom_bytes or 0), share=_F((plan.headroom_bytes or 0) / gpu_mem, 1), gpu=gpu,
                   min=_F(ctx.min_headroom), peak=_B(mem.peak), phase=mem.peak_phase)
        mb2 = 2 * ctx.training.micro_batch
        p2 = ctx.plan({"micro_batch": mb2})
        if p2.memory.peak > gpu_mem:
            r = _joined([r, reason("micro-batch {mb2} would peak at {p2}: OOM", mb2=_N(mb2), p2=_B(p2.memory.peak))])
        add("ZP103", "warning", r, f"{z}.stage", stage)
    host_ram = int(hw.node.host_ram_bytes)
    if mem.host.per_node_bytes > host_ram:
        key = f"{z}.offload_optimizer" if plan.offload_optimizer != "none" else f"{z}.offload_param"
        add("ZP104", "error", reason(
            "offload needs {host} of host RAM per node ({ranks} ranks, pinned {pinned}) but a node has {ram}: the "
            "host OOMs (nvidia-smi does not show it)", host=_BG(mem.host.per_node_bytes), ranks=_N(ctx.inp.gpus_per_node),
            pinned=_B(mem.host.pinned_per_node_bytes), ram=_BG(host_ram)), key)
    nvme_cap = int(hw.node.nvme_capacity_bytes)
    if mem.host.nvme_per_node_bytes > nvme_cap:
        key = f"{z}.offload_optimizer.device" if plan.offload_optimizer == "nvme" else f"{z}.offload_param.device"
        add("ZP105", "error", reason("NVMe offload needs {need} per node but the node has {cap} of NVMe",
                                     need=_B(mem.host.nvme_per_node_bytes), cap=_B(nvme_cap)), key, "nvme")


def comm_rules(ctx: AdviceContext, plan: Plan, add: Add, max_comm_share: float) -> None:
    hw, z, stage = ctx.hw, "zero_optimization", int(ctx.zero.stage)
    t = plan.time
    if t is not None and t.comm_share > max_comm_share:
        r = reason("exposed communication is {share} of the {step} step (limit {lim}): {sent} sent per GPU per step, "
                   "{best}–{worst} exposed, compute {compute}", share=_F(t.comm_share), step=_S(t.step_time_s),
                   lim=_F(max_comm_share), sent=_B(plan.comm.bytes_per_gpu_per_step),
                   best=_S(t.exposed_time_s["best"]), worst=_S(t.exposed_time_s["worst"]), compute=_S(t.compute_time_s))
        rem = comm_remedies(ctx)
        add("ZP201", "warning", _joined([r] + [x for _, x in rem]), f"{z}.stage", stage,
            alternatives=[a for a, _ in rem])
    if stage == 3 and ctx.inp.nodes > 1 and is_ethernet(hw.inter_node):
        r = reason("ZeRO-3 across {nodes} nodes over Ethernet ({link}, {bw} per GPU): parameters are all-gathered "
                   "over the slow link in forward and backward every micro-step ({inter} per GPU per step across "
                   "nodes, {share} of the step exposed)", nodes=_N(ctx.inp.nodes), link=hw.inter_node.name,
                   bw=Quantity(value=hw.inter_node.bandwidth_GBps_per_gpu, unit="GB/s"),
                   inter=_B(plan.comm.inter_node_bytes_per_gpu_per_step), share=_F(t.comm_share if t else 0.0))
        parts, alts = [r], []
        lower = [(s, ctx.try_change({"stage": s}, "tokens_per_s", "higher")) for s in (1, 2)]
        fit_lower = [(s, a) for s, a in lower if a.fits]
        if fit_lower:
            s, a = max(fit_lower, key=lambda x: x[1].after)
            alts.append(a)
            verb = "is faster" if a.holds else "is not faster"
            parts.append(reason("ZeRO-{s} fits and " + verb + ": {after} vs {before}", s=_N(s), after=_T(a.after),
                                before=_T(a.before)))
        else:
            parts.append(reason("no lower stage fits"))
        gpn = ctx.inp.gpus_per_node
        if int(ctx.zero.zero_hpz_partition_size or 1) != gpn:
            h = ctx.try_change({"hpz_partition_size": gpn}, "tokens_per_s", "higher")
            alts.append(h)
            parts.append(reason("hpZ (zero_hpz_partition_size {gpn}) " + ("reaches" if h.holds else "only reaches") +
                                " {after} vs {before}" + ("" if h.fits else " and does not fit (peak {peak})"),
                                gpn=_N(gpn), after=_T(h.after), before=_T(h.before), peak=_B(h.after_peak_bytes)))
        f = ctx.try_change({"inter_node_GBps_per_gpu": NDR_GBPS_PER_GPU}, "tokens_per_s", "higher")
        alts.append(f)
        parts.append(reason("a {bw}-per-GPU link (NDR InfiniBand) " + ("reaches" if f.holds else "only reaches") +
                            " {after} vs {before}", bw=Quantity(value=NDR_GBPS_PER_GPU, unit="GB/s"),
                            after=_T(f.after), before=_T(f.before)))
        add("ZP202", "warning", _joined(parts), f"{z}.stage", stage, alternatives=alts)
    if stage == 3 and not ctx.zero.reduce_scatter:
        _reduce_scatter_off(ctx, plan, add)
    share, calls, bucket_s = bucket_latency_share(plan, hw)
    if share > 0.5:
        rbs = int(ctx.zero.reduce_bucket_size)
        r = reason("gradient reduction is latency-bound: {calls} bucket collectives per step, latency is {share} of "
                   "their {secs} (α–β model)", calls=_N(calls), share=_F(share), secs=_S(bucket_s))
        big = max(4 * rbs, BUCKET_LARGE)
        a = ctx.try_change({"reduce_bucket_size": big}, "bucket_latency_share", "lower")
        slots = dict(rbs=Quantity(value=rbs, unit="elements"), big=Quantity(value=big, unit="elements"),
                     after=_F(a.after), peak=_B(a.after_peak_bytes))
        if a.holds:
            tail = reason("reduce_bucket_size {big} (now {rbs}) lowers it to {after} (peak {peak}, fits)", **slots)
        else:
            tail = reason("reduce_bucket_size {big} (now {rbs}) gives {after}" +
                          ("" if a.fits else " and does not fit (peak {peak})"), **slots)
        add("ZP203", "warning", _joined([r, tail]), f"{z}.reduce_bucket_size", rbs, alternatives=[a])


def _reduce_scatter_off(ctx: AdviceContext, plan: Plan, add: Add) -> None:
    """ZP205: stage 3 with ``reduce_scatter: false`` all-reduces every gradient bucket that fits
    (core/grad_buckets.py), twice a reduce-scatter's traffic, and outside qgZ's quantisation; reported
    where those all-reduces are at least ``MEANINGFUL`` of the bytes the step sends."""
    ar = [e for e in plan.comm.collectives if e.op == "all_reduce" and e.phase == "backward"]
    sent = sum(e.sent_bytes for e in ar)
    if sent < MEANINGFUL * plan.comm.bytes_per_gpu_per_step:
        return  # only small buckets fit (the norms' under a small reduce_bucket_size): nothing to gain
    a = ctx.try_change({"reduce_scatter": True}, "comm_bytes_per_gpu_per_step", "lower")
    r = reason("reduce_scatter is false at stage 3: {calls} gradient buckets per step are all-reduced in place "
               "({sent} sent per GPU per step, twice what a reduce-scatter of them sends)" +
               (", and qgZ does not quantise them" if ctx.zero.zero_quantized_gradients else "") +
               "; with reduce_scatter true the step sends {after} instead of {before} (peak {peak})",
               calls=_N(sum(e.count for e in ar)), sent=_B(sent), after=_B(a.after), before=_B(a.before),
               peak=_B(a.after_peak_bytes))
    add("ZP205", "warning", r, "zero_optimization.reduce_scatter", "false", alternatives=[a])


def stage_rules(ctx: AdviceContext, plan: Plan, add: Add) -> None:
    z, stage, training = "zero_optimization", int(ctx.zero.stage), ctx.training
    gpu_mem = int(plan.gpu_memory_bytes or 0)
    if stage == 2 and training.grad_accum >= 4:
        a = ctx.try_change({"stage": 1}, "comm_bytes_per_gpu_per_step", "lower")
        if a.holds:
            p1 = ctx.plan({"stage": 1})
            add("ZP204", "warning", reason(
                "stage 2 reduces gradients every micro-step: with gradient_accumulation_steps = {gas} it sends {s2} per "
                "GPU per step, stage 1 {s1} (once per step), and stage 1 fits (peak {peak}; {t1} vs {t2})",
                gas=_N(training.grad_accum), s2=_B(a.before), s1=_B(a.after), peak=_B(p1.memory.peak),
                t1=_T(p1.tokens_per_s), t2=_T(plan.tokens_per_s)),
                "gradient_accumulation_steps", training.grad_accum, alternatives=[a])
    if stage == 3:
        lower = [(s, ctx.try_change({"stage": s}, "tokens_per_s", "not_lower")) for s in (1, 2)]
        fit = [(s, a) for s, a in lower if a.fits]
        if fit:
            s, a = max(fit, key=lambda x: (x[1].after, -x[0]))
            if a.holds:  # the lower stage is at least as fast, within the model's noise
                faster = a.after >= (1 + MEANINGFUL) * a.before
                p = ctx.plan({"stage": s})
                add("ZP301", "warning" if faster else "info", reason(
                    "stage {s} fits (peak {peak} of {cap}) with {after} vs stage 3's {before}: " +
                    ("faster, without" if faster else "as fast within the model's {noise}, and without") +
                    " stage 3's parameter all-gathers every micro-step ({gather} per GPU per step)",
                    s=_N(s), peak=_B(p.memory.peak), cap=_B(gpu_mem), after=_T(a.after), before=_T(a.before),
                    noise=_F(MEANINGFUL), gather=_B(plan.comm.bytes_per_gpu_per_step_by_op.get("all_gather", 0))),
                    f"{z}.stage", stage, alternatives=[a])
    if stage == 3:
        _host_bound(ctx, plan, add)
        _moe_leaf(ctx, plan, add)
    if plan.offload_optimizer != "none" or plan.offload_param != "none":
        a = ctx.try_change({"offload_optimizer": "none", "offload_param": "none"}, "tokens_per_s", "not_lower")
        if a.holds:
            p0 = ctx.plan({"offload_optimizer": "none", "offload_param": "none"})
            add("ZP302", "warning", reason(
                "ZeRO-{stage} fits without offload (peak {peak} of {cap}, {after} vs {before} with offload): offload "
                "moves {pcie} over PCIe per GPU per step and takes {host} of host RAM per node for no speed-up",
                stage=_N(stage), peak=_B(p0.memory.peak), cap=_B(gpu_mem), after=_T(a.after), before=_T(a.before),
                pcie=_B(sum(x.bytes_per_step for x in plan.comm.pcie)), host=_B(plan.memory.host.per_node_bytes)),
                f"{z}.offload_optimizer" if plan.offload_optimizer != "none" else f"{z}.offload_param",
                alternatives=[a])



def _host_bound(ctx: AdviceContext, plan: Plan, add: Add) -> None:
    """ZP303: the GPU waits at least ``MEANINGFUL`` of the step for DeepSpeed's stage-3 module hooks on
    the host (core/host_time.py), with twice the micro-batch evaluated as the remedy."""
    t = plan.time
    if t is None or t.host_bound_s < MEANINGFUL * t.step_time_s:
        return
    mb = ctx.training.micro_batch
    a = ctx.try_change({"micro_batch": 2 * mb}, "tokens_per_s", "higher")
    r = reason("the GPU waits {wait} of the {step} step for DeepSpeed's stage-3 module hooks, which take {host} per "
               "step on the host (measured on CPU: a lower bound); micro-batch {mb2} " +
               ("reaches {after} vs {before} (peak {peak}, fits)" if a.holds else
                "gives {after} vs {before}" + ("" if a.fits else " and does not fit (peak {peak})")),
               wait=_S(t.host_bound_s), step=_S(t.step_time_s), host=_S(t.host_time_s), mb2=_N(2 * mb),
               after=_T(a.after), before=_T(a.before), peak=_B(a.after_peak_bytes))
    add("ZP303", "warning", r, "train_micro_batch_size_per_gpu", mb, alternatives=[a])


def _moe_leaf(ctx: AdviceContext, plan: Plan, add: Add) -> None:
    """ZP304: an MoE model whose sparse blocks are ZeRO-3 leaf modules (core/moe_leaf.py: each block gathered
    whole and its gradients held together at its backward hook) does not fit with the headroom, and without
    leaf modules (router and fused experts fetched apart) it does."""
    if not moe_leaf_units(ctx.inp.spec, ctx.zero) or fits_with_headroom(plan, ctx.min_headroom):
        return
    a = ctx.try_change({"leaf_module": "none"}, "peak_bytes", "lower")
    if not a.fits:
        return
    alt = ctx.plan({"leaf_module": "none"})
    r = reason("the {model} MoE blocks are ZeRO-3 leaf modules (zero_optimization.leaf_module; DeepSpeed's default "
               "classes include them): each is gathered whole and its gradients are held together at its backward hook, so the peak "
               "is {before}; with \"leaf_module\": {{\"classes\": []}} the router and the fused experts are fetched apart, "
               "the peak is {after} and fits, at {t1} vs {t2} (more fetches, more host time)",
               model=ctx.inp.spec.model_type, before=_BG(plan.memory.peak), after=_BG(a.after_peak_bytes),
               t1=_T(alt.tokens_per_s), t2=_T(plan.tokens_per_s))
    add("ZP304", "warning", r, "zero_optimization.leaf_module", "default", alternatives=[a])
