"""How a workload's batches become updates: the one thing of a workload the engine's step needs from any way
in (a spec's, or a user's loop replayed from its kept batches), apart from building it (build.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepPlan:
    """How a workload's batches become updates, besides its model, loss and optimizer: what the engine
    reads of a spec (`Workload.plan`) or of a user's loop replayed from its kept batches (inloop/history.py)."""

    accumulate: int = 1  # one optimizer step every K batches
    scheduler_by: str | None = "step"  # "step", "epoch", or None: a replay leaves the scheduler where it is
    amp_scale: float | None = None  # the GradScaler's initial loss scale when AMP is on, else None
