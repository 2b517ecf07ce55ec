"""Spaced-out reads for `nandoctor.watch`, as the probe has them: a snapshot ring, the batches since its
older snapshot, and the rollback that replays them when a fault began on a step that was not read.

Two reads are spaced out. On a model of hundreds of tensors, fetching and reducing every gradient is most
of the watch's per-step cost (~2.5% of a 20 ms step on a 300-tensor MLP): they are read one step in four
(`StepWatcher.defer_grads`). On a fast step (a tiny MLP's 0.3 ms) the loss's own host read is a third of
the step: past the first READ_ALL_STEPS steps most steps are not read at all, their losses left on the
device until a later read takes them together (`StepWatcher.defer_reads`); `check()` returns True for
such a step without knowing its loss. Either way a NaN on a step that was not read goes into the weights
and shows at a later read, as a NaN loss or NaN weights. The probe then restores a snapshot and replays
the steps from its loader (engine/rollback.py); a user's loop has no loader nandoctor could remake, so
this keeps the checked batches since the ring's older snapshot (host references, no copies) and replays
them through the user's `step_fn`, naming the first faulty step as if caught live. It is only switched
on where such a replay can stand in for the live check: a `step_fn` to replay with, one optimizer step
per batch (no gradient accumulation), no AMP scaler, no ranks to agree with, and `on_fault` other than
"skip_step" (which promises that no faulty update is ever applied), and only while the kept batches stay
small.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from nandoctor.engine.loop import DEFER_EVERY, LoopResult
from nandoctor.engine.snapshots import MIN_EVERY, SnapshotRing, tensor_nbytes
from nandoctor.engine.watcher import Fault, StepWatcher
from nandoctor.workload.plan import StepPlan
from nandoctor.workload.schedulers import lr_scheduler

log = logging.getLogger("nandoctor")

KEPT_BYTES = 64 * 2**20  # the batches kept for a replay, all together (on the device for device tensors)
MIN_INTERVAL = 16  # snapshots needed more often than this (large batches): read every step instead


class StepHistory:
    """The ring, the kept batches and the rollback for one watch; `None` of it costs anything when off."""

    def __init__(self, model: Any, optimizer: Any, watcher: StepWatcher,
                 namer: Callable[[Any], tuple[dict[str, Any], Callable[[dict], Any]]]) -> None:
        import paddle

        self.model = model
        self.namer = namer  # the user's batch -> (its named fields, their rebuild): the doctor's FieldNamer
        self.optimizer = optimizer
        self.watcher = watcher
        self._tensor = paddle.Tensor
        self.ring: SnapshotRing | None = SnapshotRing.for_model(model, optimizer)
        if not self.ring.memory_only():  # a model whose snapshots do not fit in memory: read every step
            self.ring = None
        # step -> (fields, rebuild, nbytes) of each batch kept (a tuple: one is made every step); a quiet step's
        # tuple batch is kept as (batch, None, nbytes) until a replay names it (`keep_quiet`)
        self.kept: dict[int, tuple[dict[str, Any], Callable[[dict], Any], int]] = {}
        self.kept_bytes = 0
        self.closing = False  # off() was called with losses still unread: the ring stays until they are read
        sched = lr_scheduler(optimizer)  # where the loop's scheduler stood at step 0 (see _scheduler_by)
        self._sched_start = int(sched.last_epoch) if sched is not None else None
        # the step whose kept batch the rollback's replay is running through step_fn, else None: a step_fn
        # that keeps per-step state of its own (`nandoctor run`'s recorded gradients) takes that step's
        self.replaying: int | None = None

    def off(self, why: str) -> None:
        """Back to reading every step, for good (no unread step can come after this). Losses still waiting
        on the device are read with the next step: the ring and the batches stay until then, so that a
        fault among them is still replayed (`keep` drops them)."""
        if self.ring is not None:
            log.debug("nandoctor: every step read from now on: %s", why)
        self.watcher.read_every_step()
        if self.watcher.pending:
            self.closing = True
            return
        self._drop()

    def _drop(self) -> None:
        self.ring = None
        self.closing = False
        self.kept.clear()
        self.kept_bytes = 0

    def begin(self, step: int) -> None:
        """Before step `step`'s forward: the ring's snapshot when one is due, then the batches it frees."""
        ring = self.ring
        if ring is None or self.closing:
            return
        saves = ring.saves
        ring.on_batch(step, 0, step)
        if ring.saves != saves and len(ring.ring) == ring.ring.maxlen:
            # the older ring snapshot: a rollback replays from it at the earliest (`kept` is in step order:
            # `keep`, `keep_quiet`)
            self.kept_bytes -= drop_before(self.kept, ring.ring[0].step, 2)

    def room(self) -> int:
        """Bytes of batches that may still be kept before the watch goes back to reading every step."""
        return 2 * KEPT_BYTES - self.kept_bytes

    def keep(self, step: int, fields: dict[str, Any], rebuild: Callable[[dict], Any], size: int | None = None
             ) -> None:
        """A checked step's batch, for a replay; on the first, whether batches this size may be kept.
        `size`: its `batch_nbytes`, when already known."""
        ring = self.ring
        if ring is None:
            return
        if self.closing and not self.watcher.pending:  # the last unread losses were read, finite
            self._drop()
            return
        if size is None:
            size = batch_nbytes(fields.values(), self._tensor)
        if not self.kept and step == 0:
            if not fields:
                self.off("check() was given no batch, so there is none to replay")
                return
            if size and KEPT_BYTES // (2 * size) < MIN_INTERVAL:
                self.off(f"batches of {size / 2**20:.1f} MB are too large to keep for a replay")
                return
            ring.max_every = max(MIN_EVERY, KEPT_BYTES // (2 * max(size, 1)))
            self.watcher.defer_grads(DEFER_EVERY)
            # no more steps unread in a row than the ring's interval: a snapshot before them is always held
            self.watcher.defer_reads(ring)
        elif size > self.room() and not self.closing:  # the batches grew (longer sequences)
            self.off(f"the batches kept for a replay passed {2 * KEPT_BYTES / 2**20:.0f} MB")
            if not self.closing:
                return  # (else this step went unread: its batch is kept for the replay of the pending steps)
        self.kept[step] = (fields, rebuild, size)
        self.kept_bytes += size

    def keep_quiet(self, steps: list[list[Any]], batches: list[Any],
                   named: list[tuple[dict[str, Any], Callable[[dict], Any]] | None]) -> None:
        """The batches of a window of quiet steps (`Doctor._settle`), as `keep` takes them one by one:
        `steps` the doctor's notes of them (the step first, the batch's size last), `named` the batches
        already named. The others, when they are tuples, are kept as they came and named only if a replay
        reads them (`_named`): a tuple cannot change after its step, and naming every batch was ~2 us of
        the watch's ~25 us on a 0.3 ms step. A list or dict could be refilled by the loader: named now."""
        kept = self.kept
        for q, batch, name in zip(steps, batches, named):
            step, size = q[0], q[-1]
            if self.ring is None or self.closing or size > self.room():
                self.keep(step, *(name or self.namer(batch)), size)  # (rare: `keep` decides what happens)
                continue
            if name is not None:
                kept[step] = (name[0], name[1], size)
            elif type(batch) is tuple:
                kept[step] = (batch, None, size)
            else:
                kept[step] = (*self.namer(batch), size)
            self.kept_bytes += size

    def _named(self, step: int) -> tuple[dict[str, Any], Callable[[dict], Any]]:
        """The kept batch of `step` as named fields and their rebuild (named now if `keep_quiet` left it)."""
        fields, rebuild, size = self.kept[step]
        if rebuild is None:
            fields, rebuild = self.namer(fields)
            self.kept[step] = (fields, rebuild, size)
        return fields, rebuild

    def rebuilds(self) -> dict[int, Callable[[dict], Any]]:
        """id(fields) -> the rebuild of that kept batch: a replayed batch back in the user's own shape."""
        return {id(fields): rebuild for fields, rebuild in map(self._named, list(self.kept))}

    def rollback(self, fault: Fault, step_fn: Callable[[Any, Any], Any], default_rebuild: Callable[[dict], Any],
                 steps_run: int) -> tuple[Fault, dict[str, Any] | None, int]:
        """The fault the replay of the kept steps finds first, what the report's details say about it, and the
        steps run up to it (`steps_run`: those checked, fewer once the fault is named earlier); `fault` itself
        when there is nothing to replay (the watcher's records are trimmed to match)."""
        from nandoctor.engine import rollback

        if not rollback.needs_rollback(fault, self.ring):
            return fault, None, steps_run
        res = LoopResult(records=self.watcher.records, fault=fault, steps_run=steps_run)
        info = rollback.rollback(res, self.replay_workload(step_fn, default_rebuild, steps_run), self.optimizer,
                                  self.ring)
        self.watcher.records = res.records  # (Ctrl-C during the replay: the update fault stands, noted in info)
        return res.fault, info, res.steps_run

    def replay_workload(self, step_fn: Callable[[Any, Any], Any], default_rebuild: Callable[[dict], Any],
                        steps_run: int) -> Any:
        """What the probe's replay drives: the kept batches as a loader (its position is the step), the
        user's `step_fn` as the loss, and the user's scheduler stepped per step when the loop did so."""
        kept = self.kept
        rebuilds = self.rebuilds()  # (every kept batch named)
        steps = {id(kept[s][0]): s for s in kept}

        def make_loader() -> Iterator[Any]:
            return iter([kept[s][0] if s in kept else None for s in range(max(kept, default=-1) + 1)])

        def fields(batch: Any, index: int) -> dict[str, Any]:
            if batch is None:
                raise LookupError(f"the batch of step {index} was not kept for a replay")
            return batch

        def compute_loss(model: Any, f: dict[str, Any]) -> Any:
            self.replaying = steps.get(id(f))
            try:
                return step_fn(model, rebuilds.get(id(f), default_rebuild)(f))
            finally:
                self.replaying = None

        return KeptBatches(model=self.model, compute_loss=compute_loss, make_loader=make_loader,
                           layout=_KeptLayout(fields), plan=StepPlan(scheduler_by=self._scheduler_by(steps_run)))

    def _scheduler_by(self, steps_run: int) -> str | None:
        """"step" when the loop's LR scheduler advanced once per step since the first (a replay then
        steps it too), else None (an epoch scheduler holds still over the few steps a replay covers)."""
        sched = lr_scheduler(self.optimizer)
        if sched is None or self._sched_start is None:
            return None
        return "step" if steps_run > 0 and int(sched.last_epoch) - self._sched_start >= steps_run else None


@dataclass
class _KeptLayout:
    """The kept batches are fields already: the replay's `layout.fields` only checks one was kept."""

    fields: Callable[[Any, int], dict[str, Any]]


@dataclass
class KeptBatches:
    """A user's loop as the probe's rollback replays it (engine/rollback.py reads these and nothing more):
    the kept batches as a loader, the user's step_fn as the loss, one update per batch (StepPlan)."""

    model: Any
    compute_loss: Callable[[Any, dict[str, Any]], Any]
    make_loader: Callable[[], Iterator[Any]]
    layout: _KeptLayout
    plan: StepPlan


def drop_before(entries: dict[int, tuple], oldest: int, size: int) -> int:
    """Drop the entries of `entries` (step -> a tuple whose item `size` is its bytes, in step order) before step
    `oldest`; the bytes they held. Only the oldest end is looked at: a scan of every entry grew with the run
    (a 0.3 ms step's ring keeps thousands)."""
    freed = 0
    while entries:
        first = next(iter(entries))
        if first >= oldest:
            break
        freed += entries.pop(first)[size]
    return freed


def batch_nbytes(values: Iterable[Any], tensor: type) -> int:
    """The memory a batch's arrays and tensors (its fields' `values`) keep alive (`tensor`: paddle.Tensor),
    in bytes, without a copy or a sync. Every step, so a tensor's is its allocation's size, one call
    (`_holder_size`; a view keeps its whole buffer alive): its shape and element size were three calls,
    ~3 us a batch of two."""
    total = 0
    for value in values:
        if isinstance(value, tensor):
            try:
                total += value._holder_size()
            except AttributeError:  # (a Paddle without it)
                total += tensor_nbytes(value)
        elif isinstance(value, np.ndarray):
            total += value.nbytes
    return total
