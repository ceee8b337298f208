"""What `bench zero` runs, said out loud: bucket scaling, the header line, comparable rows.

- ``scale_buckets``: the bench runs a model scaled down from the one named (by default a
  ~172k-parameter model for llama-2-7b). DeepSpeed's bucket defaults are absolute element
  counts (``reduce_bucket_size`` 5e8 = 1 GB of bf16), so on the small model one fixed bucket
  dominates the backward peak and the comparison says nothing about the model. The buckets the
  DeepSpeed config does not set are therefore scaled by the same factor as the model
  (Ψ_scaled / Ψ_full), which keeps their share of the peak what it is on the full model.
- ``step_time_row``: the planner predicts a step on the profile's GPU; a CPU/gloo
  measurement of a tiny model is not a measurement of that. Such a row is marked "not
  comparable" with the reason instead of an error of +188364 %.
- ``header_lines``: every input the run used (model as scaled, batch shape, steps, buckets,
  checkpointing, device), so nothing is hidden behind a default.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SCALED_BUCKET_KEYS", "scale_buckets", "step_time_row", "header_lines", "user_zero_keys"]

# ZeroConfig fields that are buffer sizes in elements (DeepSpeed 0.19.8 defaults in
# runtime/zero/config.py: reduce_bucket_size 5e8, allgather_bucket_size 5e8,
# stage3_prefetch_bucket_size 5e7). Per-parameter thresholds (param_persistence_threshold)
# and distances are not scaled: they select parameters by their own size, which the scaled
# model changes differently (a norm stays a norm).
SCALED_BUCKET_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size")


def user_zero_keys(ds: Any) -> set[str]:
    """ZeroConfig fields the DeepSpeed config sets explicitly (never scaled)."""
    if ds is None:
        return set()
    return set(getattr(ds.zero, "model_fields_set", set()))


def scale_buckets(zero: Any, factor: float, user_keys: set[str]) -> tuple[Any, dict[str, dict[str, int]]]:
    """``zero`` with its default bucket sizes multiplied by ``factor`` (0 < factor <= 1).

    Returns the new config and {key: {"default": elements, "scaled": elements}} for what changed.
    ``allgather_bucket_size`` stays even (DeepSpeed asserts a multiple of 2).
    """
    if not 0 < factor <= 1:
        raise ValueError(f"bucket scale factor {factor!r}: expected 0 < factor <= 1")
    upd: dict[str, int] = {}
    report: dict[str, dict[str, int]] = {}
    for key in SCALED_BUCKET_KEYS:
        if key in user_keys:
            continue
        default = int(getattr(zero, key))
        if default == 0:
            continue
        scaled = max(2, round(default * factor))
        if key == "allgather_bucket_size":
            scaled += scaled % 2
        if scaled != default:
            upd[key] = scaled
            report[key] = {"default": default, "scaled": scaled}
    return (zero.model_copy(update=upd) if upd else zero), report


def step_time_row(predicted_s: float | None, measured_s: float | None, *, device: str,
                  hardware_name: str | None, gpu_name: str | None) -> dict[str, Any]:
    """The step-time row: compared only when both sides are GPU figures, else "not comparable"."""
    row: dict[str, Any] = {"kind": "step_time", "name": "step time (s)", "predicted": predicted_s,
                           "measured": measured_s, "error": None, "tolerance": None, "ok": True,
                           "comparable": False, "note": None}
    if predicted_s is None:
        row["note"] = "no prediction: pass --hardware PROFILE for a predicted step time"
        return row
    if measured_s is None:
        row["note"] = "not measured"
        return row
    if device != "cuda":
        row["note"] = (f"not comparable: predicted for this model on the GPUs of {hardware_name or 'the profile'} "
                       f"({gpu_name or 'GPU'}), measured on {device}; pass --hardware for a CUDA run to compare")
        return row
    row["comparable"] = True
    row["error"] = (measured_s - predicted_s) / predicted_s if predicted_s else None
    row["note"] = (f"predicted for {gpu_name or 'the profile GPU'} ({hardware_name}), measured on this CUDA device; "
                   "shown, not gated")
    return row


def header_lines(report: dict[str, Any]) -> list[str]:
    """Plain-text lines naming every input of the run (printed above the tables)."""
    m = report["model"]
    src = report.get("scaled_from")
    model = (f"{m['name']}: {m['params']:,} parameters, {m['layers']} layers, hidden {m['hidden']}, "
             f"vocab {m['vocab']}")
    if src and src.get("params") != m["params"]:
        model += f" (scaled from {src['name']}, {src['params']:,} parameters)"
    lines = [model,
             f"N={report['world_size']} ranks on {report.get('device', 'cpu')} ({report['backend']}), "
             f"{report['precision']}, micro-batch {report['micro_batch']}, sequence {report['seq_len']}, "
             f"grad-accum {report['grad_accum']}, checkpointing {report.get('checkpointing', 'none')}, "
             f"{report.get('warmup', 0)} warm-up + {report['steps']} measured step(s), "
             f"{report['comm_model']} schedule; bytes per rank"]
    ft = report.get("finetune")
    if ft:
        what = (f"LoRA r={ft['lora_r']} on {ft['lora_targets'] if isinstance(ft['lora_targets'], str) else ','.join(ft['lora_targets'])}"
                if ft.get("lora_r") else f"training {','.join(ft.get('trainable') or [])}")
        lines.append(f"fine-tuning: {what}; {ft['trainable_params']:,} trainable, {ft['frozen_params']:,} frozen "
                     "(frozen: no gradient, no optimizer state)")
    buckets = report.get("buckets") or {}
    if buckets:
        parts = [f"{k} {v['scaled']:,} (default {v['default']:,})" for k, v in buckets.items()]
        lines.append(f"buckets scaled with the model (×{report.get('bucket_scale', 1):.3g}): " + ", ".join(parts))
    return lines
