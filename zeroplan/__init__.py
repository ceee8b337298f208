"""zeroplan: plan DeepSpeed ZeRO memory and communication before booking GPUs.

The public Python API (zeroplan/api.py; inputs in zeroplan/options.py)::

    import zeroplan

    result = zeroplan.estimate(model="llama-2-7b", gpus=8, precision="bf16")   # -> EstimateResult
    rec = zeroplan.recommend(model="llama-2-70b", hardware="dgx-h100", nodes=4)  # -> Recommendation
    report = zeroplan.check(["ds.json"], model="llama-2-70b", hardware="dgx-h100")  # -> CheckReport

Names are imported on first use (module ``__getattr__``), so ``import zeroplan`` is cheap. The
planning API is torch-free; ``zeroplan.runtime`` and ``zeroplan.bench`` need the ``bench`` extra
(torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zeroplan._version import __version__

# public name -> the module that defines it
_EXPORTS = {
    **dict.fromkeys(("estimate", "recommend", "check", "build_report", "read_nccl_log", "plan_inputs",
                     "load_model", "load_profile", "load_ds_config"), "zeroplan.api"),
    **dict.fromkeys(("CommonOptions", "PlanOptions", "RecommendOptions", "CheckOptions", "ReportOptions"),
                    "zeroplan.options"),
    **dict.fromkeys(("EstimateResult", "Plan", "ModelSummary", "ClusterSummary"), "zeroplan.core.plan"),
    **dict.fromkeys(("Recommendation", "Candidate", "CheckReport", "ConfigCheck"), "zeroplan.advice"),
    "ReportData": "zeroplan.report.sweep",
    "NcclLogReport": "zeroplan.inspect.nccl_log",
    "PlanInputs": "zeroplan.core.inputs",
    "ModelSpec": "zeroplan.specs.model",
    "HardwareProfile": "zeroplan.specs.hardware",
    "DSConfig": "zeroplan.specs.deepspeed_config",
    "InputError": "zeroplan._util",
}

__all__ = ["__version__", *_EXPORTS]

if TYPE_CHECKING:
    from zeroplan._util import InputError
    from zeroplan.advice.check import CheckReport, ConfigCheck
    from zeroplan.advice.recommend import Candidate, Recommendation
    from zeroplan.api import (
        build_report, check, estimate, load_ds_config, load_model, load_profile, plan_inputs, read_nccl_log,
        recommend,
    )
    from zeroplan.core.inputs import PlanInputs
    from zeroplan.core.plan import ClusterSummary, EstimateResult, ModelSummary, Plan
    from zeroplan.inspect.nccl_log import NcclLogReport
    from zeroplan.options import CheckOptions, CommonOptions, PlanOptions, RecommendOptions, ReportOptions
    from zeroplan.report.sweep import ReportData
    from zeroplan.specs.deepspeed_config import DSConfig
    from zeroplan.specs.hardware import HardwareProfile
    from zeroplan.specs.model import ModelSpec


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'zeroplan' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
