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
| ZP205 | warning         | stage 3 with ``reduce_scatter: false``: gradient buckets that fit are all-reduced (twice the traffic; qgZ skips them) |
| ZP301 | info / warning  | stage 3 where stage 1 or 2 fits with the minimum headroom (warning when that lower stage is >= 5% faster) |
| ZP302 | warning         | offload where the same stage fits without it (offload costs PCIe time every step) |
| ZP303 | warning         | stage 3: the GPU waits >= 5% of the step for DeepSpeed's module hooks on the host (twice the micro-batch evaluated) |
| ZP304 | warning         | stage 3, MoE blocks as ZeRO-3 leaf modules (DeepSpeed's default): does not fit with the headroom, but fits with ``leaf_module: {"classes": []}`` |

"Fits" for ZP204/ZP301/ZP302 means peak <= GPU memory × (1 − min_headroom) and host RAM fits.
Exit codes (commands/check.py): 0 pass, 1 a finding at or above ``fail_on``, 2 bad input.

The rules themselves live in advice/check_rules.py, grouped by concern; this module reads each
file, evaluates its plan and runs them. Imports: module level only.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from zeroplan._util import InputError, display_path, expand_path, read_text_file
from zeroplan.advice.alternatives import AdviceContext, bucket_latency_share
from zeroplan.advice.config_paths import expand_config_paths
from zeroplan.advice.check_rules import CHECK_RULES, capacity_rules, comm_rules, stage_rules
from zeroplan.advice.reasons import Alternative, Quantity, Reason
from zeroplan.core.finetune_inputs import FINETUNE_KEYS
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



def check_config(
    path: str,
    *,
    model: str,
    hardware: str,
    gpus: int | None = None,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    precision: str | None = None,
    optimizer: str | None = None,
    micro_batch: int | None = None,
    seq_len: int | None = None,
    grad_accum: int | None = None,
    checkpointing: str | None = None,
    flash_attention: bool | None = None,
    kernels: str | None = None,
    comm_model: str = "deepspeed",
    mfu: float | None = None,
    max_comm_share: float = 0.5,
    min_headroom: float = 0.10,
    fail_on: str = "error",
    **finetune: Any,
) -> ConfigCheck:
    """Check one DeepSpeed config file (see the module docstring for the rules). ``finetune``:
    build_plan_inputs' fine-tuning keywords (core/finetune_inputs.FINETUNE_KEYS)."""
    if set(finetune) - set(FINETUNE_KEYS):
        raise TypeError(f"unexpected keywords {sorted(set(finetune) - set(FINETUNE_KEYS))}")
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
            precision=precision, optimizer=optimizer, micro_batch=micro_batch, seq_len=seq_len,
            grad_accum=grad_accum, checkpointing=checkpointing, flash_attention=flash_attention, kernels=kernels,
            **finetune,
        )
    except InputError as exc:  # the CLI options were validated before: this is the file itself
        msg = str(exc)
        m = re.search(r"line (\d{1,9})\b", msg)
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
    capacity_rules(ctx, plan, add, gpu)
    comm_rules(ctx, plan, add, max_comm_share)
    stage_rules(ctx, plan, add)

    level = SEVERITY_ORDER[fail_on]
    verdict = "fail" if any(SEVERITY_ORDER[f.severity] >= level for f in findings) else "pass"
    rules = [r for r in CHECK_RULES if r != "ZP000"] + list(DS_RULES)
    return ConfigCheck(path=path, verdict=verdict, findings=findings, rules=rules, plan=_summary(plan, inp.training))


def run_check(patterns: list[str], *, fail_on: str = "error", expand_globs: bool = False,
              **opts: Any) -> CheckReport:
    """Check every config in ``patterns`` (globs with ``expand_globs``). ``opts``: check_config's keywords."""
    if fail_on not in ("error", "warning", "info"):
        raise InputError(f"--fail-on {fail_on!r} is unknown; expected error or warning")
    mcs = opts.get("max_comm_share", 0.5)
    if not (0 < mcs <= 1):
        raise InputError(f"--max-comm-share {mcs} must be in [0.001, 1]")
    mh = opts.get("min_headroom", 0.10)
    if not (0 <= mh < 1):
        raise InputError(f"--headroom {mh} must be in [0, 1)")
    if opts.get("comm_model", "deepspeed") not in ("deepspeed", "paper"):
        raise InputError(f"--comm-model {opts['comm_model']!r} is unknown; expected deepspeed or paper")
    if opts.get("mfu") is not None and not (1e-3 <= opts["mfu"] <= 1):
        raise InputError(f"--mfu {opts['mfu']} must be in [0.001, 1]")
    if not opts.get("hardware"):
        raise InputError("check needs --hardware (a profile name from `zeroplan profiles list` or a TOML path): "
                         "its rules compare memory and links with the hardware")
    # validate the shared options once (bad model / hardware / cluster → exit 2, not a per-file finding)
    inp = build_plan_inputs(
        model=opts["model"], hardware=opts["hardware"], gpus=opts.get("gpus"), nodes=opts.get("nodes"),
        gpus_per_node=opts.get("gpus_per_node"), precision=opts.get("precision"), optimizer=opts.get("optimizer"),
        micro_batch=opts.get("micro_batch"), seq_len=opts.get("seq_len"), grad_accum=opts.get("grad_accum"),
        checkpointing=opts.get("checkpointing"), kernels=opts.get("kernels"),
        **{k: opts[k] for k in FINETUNE_KEYS if k in opts},
    )
    paths = expand_config_paths(patterns, expand_globs=expand_globs)
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
