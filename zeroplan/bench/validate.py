"""`zeroplan bench zero`: run real ZeRO steps with the bundled engine and compare every figure
with the planner's prediction for exactly the same model, world size, precision and config.

Flow per requested stage: scale the model spec down (``spec.scaled``; the planner knows the
scaled inventory exactly), start ``nproc`` ranks (``launch.spawn``; or join torchrun), run
``warmup`` + ``steps`` optimizer steps (stage 3's first step differs: warm-up >= 2), then
compare, per optimizer step:

- collectives grouped by (op, phase): calls and full-buffer bytes — must be EQUAL;
- model states (params, gradients, optimizer_states, their sum; bytes per rank, measured at
  the start of the optimizer step) — within 1 %;
- phase peaks (forward, backward, step; bytes per rank, max over ranks) — within the plan's
  phase-peak tolerance (see below), and the category breakdown at each peak (shown, not gated);
- step time: predicted only when a hardware profile is given (never gated: CPU timings).

Memory is exact tensor-storage accounting on CPU (``runtime.memory.StorageTracker``) and
``torch.cuda.max_memory_allocated`` per phase on CUDA; never process RSS.

Phase-peak tolerance, from measurements (``examples/validation/phase-peaks/``: 256 runs of llama- and
gpt2-shaped models of 0.16-0.2 M parameters, N = 2 and 4, fp32 and bf16, stages 0-3, grad_accum 1 and 2,
reduce_bucket_size 3000 and the default 5e8, 2 x 16 and 4 x 64 tokens), set by how well the plan knows
each phase (``zero_compare.phase_peak_tolerance``): ``PHASE_PEAK_TOLERANCE_TRACED = 0.15`` where the
activations are the transformers trace, ``PHASE_PEAK_TOLERANCE = 0.6`` where Korthikanti's formula, the
paper flavour, or stage 3's forward with gathered parameters (see the sweep's README for the ranges measured; step peaks agree within 0.2 % in every run, the plan taking the optimizer the
engine runs, ``zero_predict.engine_optimizer_impl``). ``--tolerance`` is a floor under it.

The work is split by concern and this module re-exports every name it had: ``zero_predict``
(scaled model, per-stage ZeroConfig, the plan), ``zero_measure`` (one rank on the bundled engine),
``zero_compare`` (predicted vs measured rows, the tolerances), ``zero_runs`` (the bundled,
DeepSpeed and simulated runs into a report); here: the command (``run_bench_zero_cli``) and its
terminal rendering.
"""

from __future__ import annotations

import json
import math
from typing import Any

from zeroplan._util import InputError, atomic_write_text
from zeroplan.bench.limits import check_repeats
from zeroplan.bench.zero_compare import (  # noqa: F401 - re-exported
    _CATS, _PHASES, _STATES, MODEL_STATE_TOLERANCE, PHASE_PEAK_TOLERANCE, PHASE_PEAK_TOLERANCE_TRACED, _row, compare,
    phase_peak_tolerance)
from zeroplan.bench.zero_inputs import header_lines
from zeroplan.bench.zero_measure import _group, _inject, _preload_dispatch, _rank_entry, measure_rank  # noqa: F401
from zeroplan.bench.zero_predict import _zero_config, predict, scaled_spec  # noqa: F401
from zeroplan.bench.zero_runs import (  # noqa: F401 - re-exported
    _finetune_summary, _fmt_req, run_bench_zero, run_deepspeed_bench, run_simulated_bench)
from zeroplan.core.inputs import MAX_OPTION_VALUES

__all__ = [
    "run_bench_zero_cli",
    "run_bench_zero",
    "run_deepspeed_bench",
    "run_simulated_bench",
    "measure_rank",
    "predict",
    "compare",
    "scaled_spec",
    "PHASE_PEAK_TOLERANCE",
    "PHASE_PEAK_TOLERANCE_TRACED",
    "phase_peak_tolerance",
    "MODEL_STATE_TOLERANCE",
]


def _fmt_num(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and not v.is_integer():
        return f"{v:.4g}"
    return f"{int(v):,}"


def _render(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(highlight=False)
    con = Console(highlight=False, width=max(con.width, 120))  # the table needs ~110 columns
    for k, line in enumerate(header_lines(report)):
        con.print(("[bold]bench zero[/]: " if k == 0 else "  ") + line.replace("[", "\\["), markup=True,
                  soft_wrap=True)
    for f in report["failures"]:
        con.print(f"[red]rank {f['rank']} {f['kind']}:[/] {f['message']}", markup=True)
    for st in report["stages"]:
        if "oom" in st:
            con.print(f"[red]finding:[/] {st['oom']['message']}", markup=True)
            continue
        t = Table(title=f"stage {st['stage']}", show_lines=False)
        for col in ("kind", "figure", "predicted", "measured", "error", "tolerance", ""):
            t.add_column(col, justify="right" if col in ("predicted", "measured", "error", "tolerance") else "left")
        for r in st["rows"]:
            err = "-" if r["error"] is None else f"{100 * r['error']:+.2f}%"
            if r["kind"] == "step_time" and not r.get("comparable", True) and r["measured"] is not None:
                err = "not comparable"
            tol = "info" if r["tolerance"] is None else ("exact" if r["tolerance"] == 0 else f"±{100 * r['tolerance']:g}%")
            t.add_row(r["kind"], r["name"], _fmt_num(r["predicted"]), _fmt_num(r["measured"]), err, tol,
                      "ok" if r["ok"] else "[red]FAIL[/]")
        con.print(t)
        for r in st["rows"]:
            if r.get("note") and r["kind"] == "step_time":
                con.print(f"  step time: {r['note']}", soft_wrap=True)
    for f in report["findings"]:
        if not any("oom" in s for s in report["stages"]):
            con.print(f"finding: {f['message']}")
    con.print("[green]all figures within tolerance[/]" if report["ok"] else "[red]some figures are out of tolerance[/]",
              markup=True)


def _parse_stages(stage: Any, ds: Any) -> list[int]:
    if stage is None:
        return [ds.zero.stage] if ds is not None else [0, 1, 2, 3]
    if isinstance(stage, (list, tuple)):
        vals = list(stage)
    else:
        vals = [s.strip() for s in str(stage).split(",") if s.strip()]
    if not vals:
        raise InputError(f"--stage {stage!r}: expected stages 0..3 as a comma list, e.g. 0,1,2,3 "
                         "(omit --stage for every stage, or the --ds-config's)")
    out = []
    for v in vals:
        try:
            iv = int(v)
        except (TypeError, ValueError):
            raise InputError(f"--stage {stage!r}: expected stages 0..3 as a comma list, e.g. 0,1,2,3") from None
        if iv not in (0, 1, 2, 3):
            raise InputError(f"--stage {stage!r}: expected stages 0..3 as a comma list, e.g. 0,1,2,3")
        out.append(iv)
    return out


def _positive(name: str, v: Any) -> int:
    """A positive option value; the per-GPU work options within the planner's bounds
    (core/inputs.MAX_OPTION_VALUES), as ``estimate`` takes them."""
    if v is None or int(v) < 1:
        raise InputError(f"{name} {v!r}: expected a positive integer")
    bound = MAX_OPTION_VALUES.get(name)
    if bound is not None and int(v) > bound:
        raise InputError(f"{name} {int(v):,} is beyond what bench zero runs: expected at most {bound:,}")
    return int(v)


def _memory_limit(memory_limit: Any) -> int | None:
    """``--memory-limit`` in bytes (``2000000``, ``2M``), or None."""
    from zeroplan._util import parse_count

    limit = None
    if memory_limit is not None:
        try:
            limit = parse_count(str(memory_limit)) if not isinstance(memory_limit, int) else memory_limit
        except (ValueError, InputError):
            raise InputError(f"--memory-limit {memory_limit!r}: expected bytes, e.g. 2000000 or 2M") from None
    return limit


def _scale_to(name: str, v: int | None) -> int | None:
    """``--layers`` / ``--hidden``: None (the default) or a whole number >= 1, checked before any work."""
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise InputError(f"{name} {v!r}: expected a whole number >= 1 to scale the model to (omit {name} for the "
                         "default)")
    return v


def _tolerance(tolerance: float | None) -> dict[str, float] | None:
    """``--tolerance`` as the per-kind tolerances (phase peaks never tighter than their default)."""
    tol = None
    if tolerance is not None:
        if not (math.isfinite(tolerance) and tolerance >= 0):  # nan and inf too: the report is strict JSON
            raise InputError(f"--tolerance {tolerance!r}: expected a finite relative error >= 0, e.g. 0.01")
        # a floor under each plan's phase-peak tolerance (zero_compare.phase_peak_tolerance), never tighter
        tol = {"model_state": float(tolerance), "phase_peak": float(tolerance)}
    return tol


def _check_engine(engine: str, checkpointing: str, simulate: bool) -> None:
    """``--engine`` and ``--checkpointing``, and the combinations the runs cannot do."""
    if engine not in ("zeroplan", "deepspeed"):
        raise InputError(f"--engine {engine!r}: expected zeroplan (the bundled runtime) or deepspeed")
    if checkpointing not in ("none", "full"):
        raise InputError(f"--checkpointing {checkpointing!r}: expected none or full (the bundled runtime "
                         "recomputes whole layers; selective is planned, not run)")
    if checkpointing != "none" and (engine == "deepspeed" or simulate):
        raise InputError("--checkpointing runs with the bundled runtime on real ranks only; "
                         "drop --engine deepspeed / --simulate")


def run_bench_zero_cli(model: str, stage: Any = None, stages: Any = None, nproc: int = 2, precision: str | None = None,
                       ds_config: str | None = None, micro_batch: int | None = None, seq_len: int | None = None,
                       grad_accum: int | None = None, steps: int | None = None, warmup: int | None = None,
                       tolerance: float | None = None, comm_model: str = "deepspeed", json_out: bool = False,
                       output: str | None = None, simulate: bool = False, gpus: int | None = None,
                       layers: int | None = None, hidden: int | None = None, hardware: str | None = None,
                       optimizer: str | None = None, backend: str = "auto", memory_limit: Any = None,
                       timeout: float = 300.0, engine: str = "zeroplan", checkpointing: str = "none",
                       keep_buckets: bool = False, method: str | None = None, lora_r: int | None = None,
                       lora_alpha: float | None = None, lora_targets: str | None = None,
                       trainable: str | None = None, **_ignored: Any) -> int:
    """The `bench zero` command: returns the exit code (0 ok, 1 a figure out of tolerance or a fault)."""
    from zeroplan.specs.model import load_model

    tol = _tolerance(tolerance)  # the flags' own checks first: nothing is loaded or started before them
    layers, hidden = _scale_to("--layers", layers), _scale_to("--hidden", hidden)
    if stage is not None or stages is not None:
        _parse_stages(stage if stage is not None else stages, None)
    if comm_model not in ("deepspeed", "paper"):
        raise InputError(f"--comm-model {comm_model!r}: expected deepspeed or paper")
    if optimizer not in (None, "adamw", "adam"):
        raise InputError(f"--optimizer {optimizer!r}: the bundled engine runs AdamW only (adamw)")
    ds = None
    if ds_config is not None:
        from zeroplan.specs.deepspeed_config import load_ds_config

        ds = load_ds_config(ds_config)
    prec = precision or (ds.precision if ds is not None else "fp32")
    if prec not in ("fp32", "bf16", "fp16"):
        raise InputError(f"--precision {prec!r}: expected fp32, bf16 or fp16")
    st_list = _parse_stages(stage if stage is not None else stages, ds)
    for st in st_list:
        z = _zero_config(st, ds)
        if st == 3 and str(z.offload_param.device) != "none":
            where = f"{ds_config}: zero_optimization.offload_param.device" if ds_config else "offload_param"
            raise InputError(f"{where} = {z.offload_param.device!r}: parameter offload is not implemented by the "
                             "bundled engine; expected 'none' for bench zero (the planner still models it)")
    full = load_model(model)
    hw = None
    if hardware is not None:
        from zeroplan.specs.hardware import load_profile

        hw = load_profile(hardware)
    mb = _positive("--micro-batch", micro_batch if micro_batch is not None else
                   (ds.micro_batch if ds is not None and ds.micro_batch else 2))
    sl = _positive("--seq-len", seq_len if seq_len is not None else 32)
    ga = _positive("--grad-accum", grad_accum if grad_accum is not None else
                   (ds.grad_accum if ds is not None and ds.grad_accum else 1))
    nsteps = int(steps) if steps is not None else 2
    nwarm = int(warmup) if warmup is not None else 2
    check_repeats(nsteps, nwarm, iters_flag="--steps")
    limit = _memory_limit(memory_limit)
    _check_engine(engine, checkpointing, simulate)
    ft = _bench_finetune(full, method=method, lora_r=lora_r, lora_alpha=lora_alpha, lora_targets=lora_targets,
                         trainable=trainable)
    if ft is not None and simulate:
        raise InputError("--simulate traces full training only; drop --method / --lora-* / --trainable")
    if engine == "deepspeed":
        if ds_config is None:
            raise InputError("--engine deepspeed needs --ds-config CONFIG (the DeepSpeed config to run)")
        if simulate:
            raise InputError("--simulate runs the bundled runtime only; drop --engine deepspeed")
        spec = scaled_spec(full, layers=layers if layers is not None else 2, hidden=hidden if hidden is not None else 64)
        report = run_deepspeed_bench(spec, ds_config, st_list, nproc=_positive("--nproc", nproc), precision=prec,
                                     micro_batch=mb, seq_len=sl, grad_accum=ga, steps=nsteps, warmup=nwarm,
                                     hardware=hw, tolerance=tol, timeout_s=timeout, finetune=ft)
    elif simulate:
        n = _positive("--gpus", gpus if gpus is not None else nproc)
        spec = scaled_spec(full, layers=layers, hidden=hidden, vocab=None, experts=None) if (layers or hidden) else full
        report = run_simulated_bench(spec, st_list, n=n, precision=prec, ds=ds, micro_batch=mb, seq_len=sl,
                                     grad_accum=ga, comm_model=comm_model, hardware=hw, tolerance=tol)
    else:
        from zeroplan.runtime.launch import resolve_backend

        spec = scaled_spec(full, layers=layers if layers is not None else 2, hidden=hidden if hidden is not None else 64)
        scale = None if keep_buckets or spec.params >= full.params else spec.params / full.params
        report = run_bench_zero(spec, st_list, nproc=_positive("--nproc", nproc), precision=prec, ds=ds,
                                micro_batch=mb, seq_len=sl, grad_accum=ga, steps=nsteps, warmup=nwarm,
                                comm_model=comm_model, hardware=hw, backend=resolve_backend(backend),
                                memory_limit_bytes=limit, timeout_s=timeout, tolerance=tol,
                                checkpointing=checkpointing, bucket_scale=scale, scaled_from=full, finetune=ft)
    if report.get("non_zero_rank"):
        return 0
    text = json.dumps(report, indent=2, allow_nan=False, default=str)
    if output:
        atomic_write_text(output, text + "\n")
    if json_out:
        import sys

        sys.stdout.write(text + "\n")
    else:
        _render(report)
    return 0 if report["ok"] else 1


def _bench_finetune(spec: Any, **flags: Any) -> Any:
    """The ``FineTune`` of the fine-tuning flags (core/finetune_inputs.py, as ``estimate`` reads
    them), or None for full training; refuses what the bundled runtime cannot build (runtime/lora.py)."""
    from zeroplan.core.finetune_inputs import FineTuneOptions, _fine_tune

    ft = _fine_tune(spec, FineTuneOptions(**flags))
    if ft is None or ft.is_full:
        return None
    if ft.method == "qlora":
        raise InputError("--method qlora: bench zero runs LoRA on an unquantised base (the planner still models "
                         "QLoRA); use --method lora")
    return ft
