"""``check``: the CI gate over committed DeepSpeed configs — rules with stable IDs, a verdict.

For each config file: the DeepSpeed reader's findings (DS001…DS011, see
specs/deepspeed_config.py) plus zeroplan's rules on the plan ``evaluate()`` gives for the config's
stage on the given model and hardware:

| rule  | severity        | meaning |
|-------|-----------------|---------|
| ZP000 | error           | the config cannot be read (malformed JSON, empty, binary, not UTF-8); nothing else is evaluated |
| ZP101 | error           | predicted peak per GPU exceeds GPU memory: OOM (peak, what dominates) |
| ZP102 | error           | stage 3: states + buffers + activations fit, but the parameter gather pushes the phase over GPU memory — the "OOM during the gather phase" (names the module) |
| ZP103 | warning         | fits, but headroom is under ``min_headroom`` (default 10%) of GPU memory |
| ZP104 | error           | offload needs more host RAM per node than the node has (nvidia-smi does not show it) |
| ZP105 | error           | NVMe offload needs more NVMe per node than the node has |
| ZP201 | warning         | exposed communication is above ``max_comm_share`` of the step time |
| ZP202 | warning         | ZeRO-3 across nodes over an Ethernet inter-node link |
| ZP203 | warning         | gradient-bucket collectives are latency-bound: the α (latency) part is > 50% of their α–β time |
| ZP204 | warning         | stage 2 with gradient accumulation >= 4 (stage 2 reduces gradients every micro-step) where stage 1 fits |
| ZP301 | info / warning  | stage 3 where stage 1 or 2 fits with the minimum headroom (warning when that lower stage is >= 5% faster) |
| ZP302 | warning         | offload where the same stage fits without it (offload costs PCIe time every step) |

"Fits" for ZP204/ZP301/ZP302 means peak <= GPU memory × (1 − min_headroom) and host RAM fits.
Exit codes (commands/check.py): 0 pass, 1 a finding at or above ``fail_on``, 2 bad input.
"""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, Field

from zeroplan._util import InputError, read_text_file
from zeroplan.advice.alternatives import (
    NDR_GBPS_PER_GPU, AdviceContext, bucket_latency_share, comm_remedies, is_ethernet,
)
from zeroplan.advice.reasons import (
    MEANINGFUL, Alternative, Quantity, Reason, join_reasons, qbytes, qbytes_gib, qcount, qfraction, qseconds, qtokens,
    reason,
)
from zeroplan.core.inputs import build_plan_inputs
from zeroplan.core.plan import ClusterSummary, Plan
from zeroplan.specs.config_lines import find_key_line, key_lines
from zeroplan.specs.deepspeed_config import RULES as DS_RULES
from zeroplan.specs.findings import SEVERITY_ORDER, Finding

__all__ = [
    "CHECK_RULES",
    "LocatedFinding",
    "PlanSummary",
    "ConfigCheck",
    "CheckReport",
    "expand_config_paths",
    "check_config",
    "run_check",
    "bucket_latency_share",
]

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
    "ZP301": ("info", "stage 3 only where needed"),
    "ZP302": ("warning", "offload only where needed"),
}
_GLOB_CHARS = re.compile(r"[*?\[]")


PREFETCH_SMALL = 10_000_000  # stage3_prefetch_bucket_size tried for ZP102, elements (as recommend's search)
BUCKET_LARGE = 500_000_000  # reduce_bucket_size tried for ZP203 at least, elements (DeepSpeed's default)


class LocatedFinding(Finding):
    """A Finding with the 1-based line of its key in the config file (None when unknown).

    zeroplan's own rules also carry ``reason`` (the message as a template and its quantities with
    units) and ``alternatives`` (each suggested change, evaluated: see advice/reasons.py)."""

    line: int | None = None
    reason: Reason | None = None
    alternatives: list[Alternative] = Field(default_factory=list)


class PlanSummary(BaseModel):
    """The evaluated plan of one config. Bytes per GPU unless named per node; GB = 1e9 bytes."""

    stage: int
    offload_optimizer: str
    offload_param: str
    precision: str
    micro_batch: int
    grad_accum: int
    checkpointing: str
    peak_bytes: int
    peak_phase: str
    peak_reason: str
    gpu_memory_bytes: int
    headroom_bytes: int
    host_memory_per_node_bytes: int
    host_ram_per_node_bytes: int
    nvme_per_node_bytes: int
    comm_bytes_per_gpu_per_step: int
    step_time_s: float | None
    tokens_per_s: float | None
    comm_share: float | None


class ConfigCheck(BaseModel):
    path: str
    verdict: str  # "pass" | "fail"
    findings: list[LocatedFinding] = Field(default_factory=list)
    rules: list[str] = Field(default_factory=list)  # rule IDs evaluated
    plan: PlanSummary | None = None
    error: str | None = None  # ZP000: why the file could not be read


class CheckReport(BaseModel):
    """What ``zeroplan check --format json`` prints."""

    verdict: str
    exit_code: int
    fail_on: str
    model: str
    hardware: str
    cluster: ClusterSummary
    counts: dict[str, int]
    files: list[ConfigCheck]
    rule_descriptions: dict[str, str]


def expand_config_paths(patterns: list[str]) -> list[str]:
    """Paths and globs (``**`` recursive) → existing files, in order, without duplicates.

    A glob matching nothing or a missing path is an InputError (exit 2).
    """
    if not patterns:
        raise InputError("check needs at least one DeepSpeed config path or glob")
    out: list[str] = []
    for pat in patterns:
        if _GLOB_CHARS.search(pat):
            hits = sorted(h for h in glob.glob(pat, recursive=True) if os.path.isfile(h))
            if not hits:
                raise InputError(f"{pat}: the glob matches no file")
        else:
            if not os.path.exists(pat):
                raise InputError(f"{pat}: DeepSpeed config not found")
            if os.path.isdir(pat):
                raise InputError(f"{pat}: is a directory; give config files or a glob such as {pat.rstrip('/')}/*.json")
            hits = [pat]
        for h in hits:
            if h not in out:
                out.append(h)
    return out


def _summary(plan: Plan, training: Any) -> PlanSummary:
    return PlanSummary(
        stage=plan.stage, offload_optimizer=plan.offload_optimizer, offload_param=plan.offload_param,
        precision=training.precision.name, micro_batch=training.micro_batch, grad_accum=training.grad_accum,
        checkpointing=training.checkpointing, peak_bytes=plan.memory.peak, peak_phase=plan.memory.peak_phase,
        peak_reason=plan.memory.peak_reason, gpu_memory_bytes=plan.gpu_memory_bytes,
        headroom_bytes=plan.headroom_bytes, host_memory_per_node_bytes=plan.host_memory_per_node,
        host_ram_per_node_bytes=plan.host_ram_per_node_bytes,
        nvme_per_node_bytes=plan.memory.host.nvme_per_node_bytes,
        comm_bytes_per_gpu_per_step=plan.comm.bytes_per_gpu_per_step, step_time_s=plan.step_time_s,
        tokens_per_s=plan.tokens_per_s, comm_share=plan.time.comm_share if plan.time else None,
    )


_B, _BG, _S, _F, _T, _N = qbytes, qbytes_gib, qseconds, qfraction, qtokens, qcount
_joined = join_reasons


Add = Callable[..., None]


def _capacity_rules(ctx: AdviceContext, plan: Plan, add: Add, gpu: str) -> None:
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
        fixed = int(ov.cuda_context_bytes) + int(ov.nccl_bytes)
        for phase in ("forward", "backward"):
            g = mem.buffers_detail.get(f"gathered_params_{phase}", 0)
            if not g:
                continue
            rest = mem.phases[phase].peak - g
            need = int((rest + g) * (1 + frac)) + fixed
            without = int(rest * (1 + frac)) + fixed
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


def _comm_rules(ctx: AdviceContext, plan: Plan, add: Add, max_comm_share: float) -> None:
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


def _stage_rules(ctx: AdviceContext, plan: Plan, add: Add) -> None:
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


def check_config(
    path: str,
    *,
    model: str,
    hardware: str,
    gpus: int | None = None,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    micro_batch: int | None = None,
    seq_len: int = 2048,
    grad_accum: int | None = None,
    checkpointing: str = "none",
    flash_attention: bool = True,
    comm_model: str = "deepspeed",
    mfu: float | None = None,
    max_comm_share: float = 0.5,
    min_headroom: float = 0.10,
    fail_on: str = "error",
) -> ConfigCheck:
    """Check one DeepSpeed config file (see the module docstring for the rules)."""
    findings: list[LocatedFinding] = []
    if not Path(path).is_file():  # a missing path or a directory is a command-line mistake: exit 2
        read_text_file(path, "DeepSpeed config")
    try:
        text = read_text_file(path, "DeepSpeed config")
    except InputError as exc:  # empty, binary, not UTF-8: reported like malformed JSON (ZP000)
        msg = str(exc)
        findings.append(LocatedFinding(rule_id="ZP000", severity="error", message=msg, file=path, line=1))
        return ConfigCheck(path=path, verdict="fail", findings=findings, rules=["ZP000"], error=msg)
    lines = key_lines(text)

    def add(rule: str, severity: str, why: Reason, key: str = "", value: Any = None,
            alternatives: list[Alternative] | None = None) -> None:
        findings.append(LocatedFinding(rule_id=rule, severity=severity, message=why.text(), key=key, file=path,
                                       value=None if value is None else str(value),
                                       line=find_key_line(lines, key) or (1 if not key else None),
                                       reason=why, alternatives=list(alternatives or [])))

    try:
        inp = build_plan_inputs(
            model=model, hardware=hardware, gpus=gpus, nodes=nodes, gpus_per_node=gpus_per_node, ds_config=path,
            micro_batch=micro_batch, seq_len=seq_len, grad_accum=grad_accum, checkpointing=checkpointing,
            flash_attention=flash_attention,
        )
    except InputError as exc:  # the CLI options were validated before: this is the file itself
        msg = str(exc)
        m = re.search(r"line (\d+)", msg)
        findings.append(LocatedFinding(rule_id="ZP000", severity="error", message=msg, file=path,
                                       line=int(m.group(1)) if m else 1))
        return ConfigCheck(path=path, verdict="fail", findings=findings, rules=["ZP000"], error=msg)

    ds = inp.ds
    for f in ds.findings:
        findings.append(LocatedFinding(**f.model_dump(exclude={"file"}), file=path,
                                       line=find_key_line(lines, f.key) if f.key else 1))
    hw = inp.hardware
    ctx = AdviceContext(inp=inp, zero=inp.zero(ds.zero.stage), training=inp.training, comm_model=comm_model,
                        mfu=mfu, min_headroom=min_headroom)
    plan = ctx.plan()
    gpu = f"{hw.gpu.name} ({Quantity(value=int(plan.gpu_memory_bytes or 0), unit='bytes_gib').text()})"
    _capacity_rules(ctx, plan, add, gpu)
    _comm_rules(ctx, plan, add, max_comm_share)
    _stage_rules(ctx, plan, add)

    level = SEVERITY_ORDER[fail_on]
    verdict = "fail" if any(SEVERITY_ORDER[f.severity] >= level for f in findings) else "pass"
    rules = [r for r in CHECK_RULES if r != "ZP000"] + list(DS_RULES)
    return ConfigCheck(path=path, verdict=verdict, findings=findings, rules=rules, plan=_summary(plan, inp.training))


def run_check(patterns: list[str], *, fail_on: str = "error", **opts: Any) -> CheckReport:
    """Check every config matched by ``patterns``. ``opts``: check_config's keyword arguments."""
    if fail_on not in ("error", "warning", "info"):
        raise InputError(f"--fail-on {fail_on!r} is unknown; expected error or warning")
    mcs = opts.get("max_comm_share", 0.5)
    if not (0 < mcs <= 1):
        raise InputError(f"--max-comm-share {mcs} must be in (0, 1]")
    mh = opts.get("min_headroom", 0.10)
    if not (0 <= mh < 1):
        raise InputError(f"--min-headroom {mh} must be in [0, 1)")
    if opts.get("comm_model", "deepspeed") not in ("deepspeed", "paper"):
        raise InputError(f"--comm-model {opts['comm_model']!r} is unknown; expected deepspeed or paper")
    if opts.get("mfu") is not None and not (0 < opts["mfu"] <= 1):
        raise InputError(f"--mfu {opts['mfu']} must be in (0, 1]")
    if not opts.get("hardware"):
        raise InputError("check needs --hardware (a profile name from `zeroplan profiles list` or a TOML path): "
                         "its rules compare memory and links with the hardware")
    # validate the shared options once (bad model / hardware / cluster → exit 2, not a per-file finding)
    inp = build_plan_inputs(
        model=opts["model"], hardware=opts["hardware"], gpus=opts.get("gpus"), nodes=opts.get("nodes"),
        gpus_per_node=opts.get("gpus_per_node"), micro_batch=opts.get("micro_batch"),
        seq_len=opts.get("seq_len", 2048), grad_accum=opts.get("grad_accum"),
        checkpointing=opts.get("checkpointing", "none"),
    )
    paths = expand_config_paths(patterns)
    files = [check_config(p, fail_on=fail_on, **opts) for p in paths]
    counts = {"error": 0, "warning": 0, "info": 0}
    for f in files:
        for x in f.findings:
            counts[x.severity] += 1
    verdict = "fail" if any(f.verdict == "fail" for f in files) else "pass"
    descr = {k: v[1] for k, v in CHECK_RULES.items()} | dict(DS_RULES)
    return CheckReport(
        verdict=verdict, exit_code=1 if verdict == "fail" else 0, fail_on=fail_on, model=inp.spec.name,
        hardware=inp.hardware.name,
        cluster=ClusterSummary(n_gpus=inp.n_gpus, nodes=inp.nodes, gpus_per_node=inp.gpus_per_node,
                               hardware=inp.hardware.name, gpu=inp.hardware.gpu.name,
                               gpu_memory_bytes=inp.hardware.gpu.memory_bytes),
        counts=counts, files=files, rule_descriptions=descr,
    )
