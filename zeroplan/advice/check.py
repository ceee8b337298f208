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
from typing import Any

from pydantic import BaseModel, Field

from zeroplan._util import InputError, read_text_file
from zeroplan.core.inputs import build_plan_inputs, zero_for_stage
from zeroplan.core.plan import ClusterSummary, evaluate
from zeroplan.core.timing import collective_time_s
from zeroplan.report.formats import find_key_line, key_lines
from zeroplan.report.render import gb, gb_gib, seconds
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


class LocatedFinding(Finding):
    """A Finding with the 1-based line of its key in the config file (None when unknown)."""

    line: int | None = None


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


def bucket_latency_share(plan: Any, hw: Any) -> tuple[float, int, float]:
    """(latency share, calls per step, seconds) of the gradient-bucket collectives under the α–β model.

    The α part of one call is ``collective_time_s`` of the same call with a zero-byte buffer.
    """
    lat = tot = 0.0
    calls = 0
    for e in plan.comm.collectives:
        if "gradient bucket" not in e.what:
            continue
        t = collective_time_s(e, hw, plan.n_gpus, plan.gpus_per_node)
        a = collective_time_s(e.model_copy(update={"buffer_bytes": 0}), hw, plan.n_gpus, plan.gpus_per_node)
        tot += e.count * t
        lat += e.count * a
        calls += e.count
    return (lat / tot if tot > 0 else 0.0), calls, tot


def _fits(plan: Any, min_headroom: float) -> bool:
    return plan.memory.peak <= plan.gpu_memory_bytes * (1 - min_headroom) and bool(plan.host_fits)


def _summary(plan: Any, training: Any) -> PlanSummary:
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
    from zeroplan.advice.recommend import is_ethernet

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

    def add(rule: str, severity: str, message: str, key: str = "", value: Any = None) -> None:
        findings.append(LocatedFinding(rule_id=rule, severity=severity, message=message, key=key, file=path,
                                       value=None if value is None else str(value),
                                       line=find_key_line(lines, key) or (1 if not key else None)))

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

    from zeroplan.specs.deepspeed_config import RULES as DS_RULES

    ds = inp.ds
    for f in ds.findings:
        findings.append(LocatedFinding(**f.model_dump(exclude={"file"}), file=path,
                                       line=find_key_line(lines, f.key) if f.key else 1))
    hw = inp.hardware
    stage = ds.zero.stage
    training = inp.training

    def plan_for(zero: Any) -> Any:
        return evaluate(model=inp.spec, training=training, zero=zero, n_gpus=inp.n_gpus,
                        gpus_per_node=inp.gpus_per_node, hardware=hw, comm_model=comm_model, mfu=mfu)

    zero = inp.zero(stage)
    plan = plan_for(zero)
    mem = plan.memory
    gpu_mem = plan.gpu_memory_bytes
    gpu = f"{hw.gpu.name} ({gb_gib(gpu_mem)})"
    z = "zero_optimization"

    # ---- capacity ----
    if mem.peak > gpu_mem:
        add("ZP101", "error",
            f"OOM: predicted peak {gb_gib(mem.peak)} per GPU in {mem.peak_phase} exceeds the {gpu} by "
            f"{gb(mem.peak - gpu_mem)}; {mem.peak_reason}", f"{z}.stage", stage)
    if stage == 3:
        ov = hw.overhead
        frac = float(ov.fragmentation_fraction)
        fixed = int(ov.cuda_context_bytes) + int(ov.nccl_bytes) * mem.communicators
        for phase in ("forward", "backward"):
            g = mem.buffers_detail.get(f"gathered_params_{phase}", 0)
            if not g:
                continue
            rest = mem.phases[phase].peak - g
            need = int((rest + g) * (1 + frac)) + fixed
            without = int(rest * (1 + frac)) + fixed
            if need > gpu_mem and without <= gpu_mem:
                module = mem.gather.module if mem.gather is not None else "the largest module"
                add("ZP102", "error",
                    f"OOM during the {phase} gather phase: states, buffers and activations take {gb(without)} "
                    f"(with overhead) of the {gpu}, leaving {gb(gpu_mem - without)}, but gathering parameters "
                    f"around `{module}` needs {gb(int(g * (1 + frac)))}; lower stage3_prefetch_bucket_size / "
                    f"stage3_max_live_parameters or stage3_max_reuse_distance", f"{z}.prefetch_bucket_size")
                break
    if mem.peak <= gpu_mem and plan.headroom_bytes < min_headroom * gpu_mem:
        add("ZP103", "warning",
            f"headroom {gb(plan.headroom_bytes)} is {plan.headroom_bytes / gpu_mem:.1%} of the {gpu}, under "
            f"{min_headroom:.0%}: allocator fragmentation, a longer sequence or a larger batch can OOM "
            f"(peak {gb(mem.peak)} in {mem.peak_phase})", f"{z}.stage", stage)
    host_ram = int(hw.node.host_ram_bytes)
    if mem.host.per_node_bytes > host_ram:
        key = f"{z}.offload_optimizer" if plan.offload_optimizer != "none" else f"{z}.offload_param"
        add("ZP104", "error",
            f"offload needs {gb_gib(mem.host.per_node_bytes)} of host RAM per node ({inp.gpus_per_node} ranks, "
            f"pinned {gb(mem.host.pinned_per_node_bytes)}) but a node has {gb_gib(host_ram)}: the host OOMs "
            "(nvidia-smi does not show it)", key)
    nvme_cap = int(hw.node.nvme_capacity_bytes)
    if mem.host.nvme_per_node_bytes > nvme_cap:
        key = f"{z}.offload_optimizer.device" if plan.offload_optimizer == "nvme" else f"{z}.offload_param.device"
        add("ZP105", "error",
            f"NVMe offload needs {gb(mem.host.nvme_per_node_bytes)} per node but the node has "
            f"{gb(nvme_cap)} of NVMe", key, "nvme")

    # ---- communication ----
    t = plan.time
    if t is not None and t.comm_share > max_comm_share:
        add("ZP201", "warning",
            f"exposed communication is {t.comm_share:.0%} of the {seconds(t.step_time_s)} step (limit "
            f"{max_comm_share:.0%}): {gb(plan.comm.bytes_per_gpu_per_step)} sent per GPU per step, "
            f"{seconds(t.exposed_time_s['best'])}–{seconds(t.exposed_time_s['worst'])} exposed, compute "
            f"{seconds(t.compute_time_s)}", f"{z}.stage", stage)
    if stage == 3 and inp.nodes > 1 and is_ethernet(hw.inter_node):
        add("ZP202", "warning",
            f"ZeRO-3 across {inp.nodes} nodes over Ethernet ({hw.inter_node.name}, "
            f"{hw.inter_node.bandwidth_GBps_per_gpu:g} GB/s per GPU): parameters are all-gathered over the slow "
            f"link in forward and backward every micro-step ({gb(plan.comm.inter_node_bytes_per_gpu_per_step)} "
            "per GPU per step across nodes); prefer a lower stage if it fits, hpZ (zero_hpz_partition_size), "
            "or InfiniBand", f"{z}.stage", stage)
    share, calls, bucket_s = bucket_latency_share(plan, hw)
    if share > 0.5:
        add("ZP203", "warning",
            f"gradient reduction is latency-bound: {calls:,} bucket collectives per step, latency is {share:.0%} "
            f"of their {seconds(bucket_s)} (α–β model); raise reduce_bucket_size "
            f"(now {zero.reduce_bucket_size:,} elements)", f"{z}.reduce_bucket_size", zero.reduce_bucket_size)

    # ---- is this the right stage / offload? ----
    if stage == 2 and training.grad_accum >= 4:
        p1 = plan_for(zero_for_stage(inp, 1))
        if _fits(p1, min_headroom):
            add("ZP204", "warning",
                f"stage 2 reduces gradients every micro-step: with gradient_accumulation_steps = "
                f"{training.grad_accum} it sends {gb(plan.comm.bytes_per_gpu_per_step)} per GPU per step, stage 1 "
                f"{gb(p1.comm.bytes_per_gpu_per_step)} (once per step), and stage 1 fits (peak {gb(p1.memory.peak)})",
                "gradient_accumulation_steps", training.grad_accum)
    if stage == 3:
        for lower in (1, 2):
            pl = plan_for(zero_for_stage(inp, lower))
            if _fits(pl, min_headroom):
                faster = (pl.tokens_per_s or 0) >= 1.05 * (plan.tokens_per_s or 0)
                add("ZP301", "warning" if faster else "info",
                    f"stage {lower} fits (peak {gb(pl.memory.peak)} of {gb(gpu_mem)}) with "
                    f"{pl.tokens_per_s or 0:,.0f} tokens/s vs stage 3's {plan.tokens_per_s or 0:,.0f}: stage 3 "
                    "adds parameter all-gathers every micro-step", f"{z}.stage", stage)
                break
    if plan.offload_optimizer != "none" or plan.offload_param != "none":
        from zeroplan.specs.deepspeed_config import OffloadOptimizerConfig, OffloadParamConfig

        p0 = plan_for(zero.model_copy(update={"offload_optimizer": OffloadOptimizerConfig(),
                                              "offload_param": OffloadParamConfig()}))
        if _fits(p0, min_headroom):
            add("ZP302", "warning",
                f"ZeRO-{stage} fits without offload (peak {gb(p0.memory.peak)} of {gb(gpu_mem)}, "
                f"{p0.tokens_per_s or 0:,.0f} vs {plan.tokens_per_s or 0:,.0f} tokens/s with offload): offload "
                f"moves {gb(sum(x.bytes_per_step for x in plan.comm.pcie))} over PCIe per GPU per step and "
                f"{gb(mem.host.per_node_bytes)} of host RAM per node for nothing",
                f"{z}.offload_optimizer" if plan.offload_optimizer != "none" else f"{z}.offload_param")

    level = SEVERITY_ORDER[fail_on]
    verdict = "fail" if any(SEVERITY_ORDER[f.severity] >= level for f in findings) else "pass"
    rules = [r for r in CHECK_RULES if r != "ZP000"] + list(DS_RULES)
    return ConfigCheck(path=path, verdict=verdict, findings=findings, rules=rules, plan=_summary(plan, training))


def run_check(patterns: list[str], *, fail_on: str = "error", **opts: Any) -> CheckReport:
    """Check every config matched by ``patterns``. ``opts``: check_config's keyword arguments."""
    from zeroplan.specs.deepspeed_config import RULES as DS_RULES

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
