"""The one training step every loop that trains a spec's workload runs: the probe's loop, the rollback and
remedy replays, and each rank of `probe --nproc`.

A step is: the forward and loss (`Workload.compute_loss`: inputs by position or keyword, the output
selected, the loss; under `paddle.amp.auto_cast` when AMP is on a GPU), backward of loss / K when
accumulating over K batches (scaled by the `GradScaler` under AMP), and every K-th batch the update
(the scaler's `step`/`update` or the optimizer's `step`), `clear_grad` and the LR scheduler's step when it
steps by step; at an epoch's end, the scheduler's step when it steps by epoch. The probe's loop wraps each
of the user's calls in its own boundary (`call`), so a user's exception becomes a finding and ours does not.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from nandoctor.findings import Phase
from nandoctor.workload.plan import StepPlan
from nandoctor.workload.schedulers import lr_scheduler

__all__ = ["StepEngine", "StepPlan"]

SCHEDULER_STEP = "the LR scheduler's step()"


def _direct(_phase: Phase, fn: Callable[..., Any], *args: Any, what: str | None = None) -> Any:
    return fn(*args)


@dataclass
class StepEngine:
    """One spec's training step; `call(phase, fn, *args, what=None)` runs each of the user's calls."""

    compute_loss: Callable[[Any, dict[str, Any]], Any]
    model: Any  # what the loss calls: the model, or its DataParallel wrapper under ranks
    optimizer: Any
    accumulate: int = 1
    scheduler: Any = None
    scheduler_by: str = "step"
    scaler: Any = None
    call: Callable[..., Any] = field(default=_direct)
    fields: Any = field(default=None, repr=False)  # the batch of the last loss: an LBFGS closure recomputes it
    # decided once (again on `replace`): an update without a scaler or a closure is step and clear_grad in one
    # call through the boundary; whether the scheduler steps after each update
    _plain_update: bool = field(default=False, init=False, repr=False, compare=False)
    _step_scheduler: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._plain_update = self.scaler is None and not needs_closure(self.optimizer)
        self._step_scheduler = self.scheduler is not None and self.scheduler_by == "step"

    @classmethod
    def for_workload(cls, workload: Any, optimizer: Any, *, device: str, model: Any = None) -> StepEngine:
        """The workload's step on `device` (`workload.plan`): a GradScaler under AMP where the device has the
        kernels (not on CPU, where Paddle runs float32 and its GradScaler is inert); the autocast is the
        workload's own (`Workload.on_device`), so the replays that call its loss directly run under it too."""
        plan: StepPlan = workload.plan
        scaler = None
        if plan.amp_scale is not None and device != "cpu":
            import paddle

            scaler = paddle.amp.GradScaler(init_loss_scaling=plan.amp_scale)
        return cls(compute_loss=workload.compute_loss, model=model if model is not None else workload.model,
                   optimizer=optimizer, accumulate=plan.accumulate, scheduler=lr_scheduler(optimizer),
                   scheduler_by=plan.scheduler_by, scaler=scaler)

    def with_boundary(self, call: Callable[..., Any]) -> StepEngine:
        return replace(self, call=call)

    def fresh_scaler(self) -> StepEngine:
        """The same step with a new GradScaler at its initial scale (a replay from a snapshot: the loss
        scale the live run had then is not part of a snapshot)."""
        if self.scaler is None:
            return self
        import paddle

        return replace(self, scaler=paddle.amp.GradScaler(init_loss_scaling=self.scaler._init_loss_scaling))

    def loss(self, fields: dict[str, Any]) -> Any:
        self.fields = fields
        return self.call(Phase.FORWARD, self.compute_loss, self.model, fields)

    def backward(self, loss: Any) -> None:
        """backward of loss / K when accumulating (the mean over the K batches of one update), scaled under AMP."""
        self.call(Phase.BACKWARD, self._backward, loss)

    def _backward(self, loss: Any) -> None:
        if self.accumulate > 1:
            loss = loss / self.accumulate
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def updates_after(self, step: int) -> bool:
        """Whether the batch of `step` (counted from 0) ends an accumulation: the optimizer steps after it."""
        return (step + 1) % self.accumulate == 0

    def update(self) -> None:
        """The optimizer's step (through the scaler under AMP), clear_grad, and a per-step scheduler's step."""
        call, opt = self.call, self.optimizer
        if self._plain_update:
            call(Phase.OPTIMIZER, self._step_and_clear)
        else:
            if self.scaler is not None:
                call(Phase.OPTIMIZER, self.scaler.step, opt)
                call(Phase.OPTIMIZER, self.scaler.update)
            elif self.fields is not None and needs_closure(opt):  # LBFGS: step(closure) re-evaluates the batch
                call(Phase.OPTIMIZER, opt.step, self._closure)
            else:
                call(Phase.OPTIMIZER, opt.step)
            call(Phase.OPTIMIZER, opt.clear_grad)
        if self._step_scheduler:
            call(Phase.OPTIMIZER, self.scheduler.step, what=SCHEDULER_STEP)

    def _step_and_clear(self) -> None:
        """The optimizer's step, then clear_grad (not reached when the step raises, as in a user's loop)."""
        opt = self.optimizer
        opt.step()
        opt.clear_grad()

    def _closure(self) -> Any:
        """What a user writes for LBFGS: clear the gradients, the loss of the same batch, its backward."""
        self.optimizer.clear_grad()
        loss = self.compute_loss(self.model, self.fields)
        self._backward(loss)
        return loss

    def end_epoch(self) -> None:
        if self.scheduler is not None and self.scheduler_by == "epoch":
            self.call(Phase.OPTIMIZER, self.scheduler.step, what=SCHEDULER_STEP)


def needs_closure(optimizer: Any) -> bool:
    """Whether `optimizer.step` requires an argument (paddle.incubate.optimizer.LBFGS's closure); read once per
    optimizer class (the engine asks at every update)."""
    return _step_needs_argument(type(optimizer))


@functools.lru_cache(maxsize=64)
def _step_needs_argument(cls: type) -> bool:
    import inspect

    try:
        params = list(inspect.signature(cls.step).parameters.values())[1:]  # (self, ...)
    except (TypeError, ValueError, AttributeError):
        return False
    return any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
