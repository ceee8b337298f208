"""zeroplan.advice: what to do with the analytic core's plans.

- ``recommend(inputs, ...) -> Recommendation`` (advice/recommend.py): search ZeRO stage × offload ×
  micro-batch × checkpointing × buckets, rank capacity first then useful throughput, explain.
- ``run_check(patterns, ...) -> CheckReport`` / ``check_config(path, ...) -> ConfigCheck``
  (advice/check.py): the CI gate's rules (ZP0xx–ZP3xx plus the DeepSpeed reader's DS0xx).

Submodules are imported on first use so ``import zeroplan.advice`` stays cheap.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Recommendation", "Candidate", "run_check", "check_config", "CheckReport", "ConfigCheck", "CHECK_RULES"]

# ``recommend`` and ``check`` are also submodule names: import the function from
# ``zeroplan.advice.recommend`` (``from zeroplan.advice.recommend import recommend``).
_WHERE = {
    "Recommendation": "recommend", "Candidate": "recommend",
    "run_check": "check", "check_config": "check", "CheckReport": "check", "ConfigCheck": "check",
    "CHECK_RULES": "check",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"zeroplan.advice.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'zeroplan.advice' has no attribute {name!r}")
