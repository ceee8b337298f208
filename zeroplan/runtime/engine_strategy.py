"""The interface between ``ZeroEngine``'s training step and one ZeRO stage family.

``ZeroEngine.__init__`` resolves the configuration every stage shares (``SHARED_FIELDS``), picks
ONE strategy for the stage (``engine.STRATEGIES``) and never branches on the stage again: the
training step calls the strategy's hooks in this order, per optimizer step::

    for each micro-batch:  before_forward(); forward; before_backward(); backward; after_backward()
    boundary(); <snapshot of the model states>; step()      # step() runs under torch.no_grad()

A strategy owns its buffers (flat parameters, gradient partitions, buckets, optimizer states, stage-3
fetch schedule); it reads the shared configuration, copied from the engine once, under the same
names. Implementations: ``engine_flat.Stage0Strategy``, ``engine_stage12.Stage1Strategy`` /
``Stage2Strategy``, ``engine_stage3.Stage3Strategy``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from zeroplan.runtime.engine_base import EngineBase

# what ZeroEngine.__init__ resolves once and every strategy reads (never writes)
SHARED_FIELDS = (
    "torch", "model", "zero", "comm", "meter", "stage", "ds", "grad_accum", "precision", "dtype",
    "lr", "betas", "eps", "wd", "n", "rank", "rbs", "overlap", "offload", "contiguous", "reduce_scatter_cfg",
    "multi_rank", "mixed", "units", "params", "names", "frozen", "device", "host", "mimic", "fused_adam",
    "numels", "shapes", "psi", "_opt_dev", "_hooks")


class StageStrategy(EngineBase, ABC):
    """One stage family's buffers and schedule behind the hooks the training step calls."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine  # the step counter (AdamW's bias correction) is read from it live
        for name in SHARED_FIELDS:
            setattr(self, name, getattr(engine, name))
        self.setup()

    @property
    def step_count(self) -> int:
        return self.engine.step_count

    @abstractmethod
    def setup(self) -> None:
        """Lay out the parameters, allocate the persistent buffers and optimizer states, install hooks."""

    def before_forward(self) -> None:
        """Before each micro-batch's forward."""

    def before_backward(self) -> None:
        """After the forward, before ``loss.backward()``."""

    def after_backward(self) -> None:
        """After ``loss.backward()`` of each micro-batch."""

    def boundary(self) -> None:
        """Once per optimizer step, after the last backward: the reduction not done during backward."""

    def accumulated_grad_bytes(self) -> int:
        """Gradient bytes held between the micro-steps where they exceed what the step holds (the model
        states' gradients are their largest at the end of a backward); 0 where the step holds them all."""
        return 0

    @abstractmethod
    def step(self) -> None:
        """The optimizer step and the collectives that follow it (under ``torch.no_grad()``)."""
