"""Findings: what config readers and the `check` gate report, with stable rule IDs."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

__all__ = ["Severity", "Finding", "SEVERITY_ORDER"]

Severity = Literal["error", "warning", "info"]
SEVERITY_ORDER = {"info": 0, "warning": 1, "error": 2}


class Finding(BaseModel):
    """One observation. ``key`` is a dotted path into the input (e.g.
    ``zero_optimization.reduce_bucket_size``) or empty when it concerns the whole plan."""

    model_config = ConfigDict(defer_build=True)

    rule_id: str  # stable, e.g. "ZP101"
    severity: Severity
    message: str
    key: str = ""
    file: str = ""
    value: str | None = None
