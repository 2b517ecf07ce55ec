"""A bounded ring of training-state snapshots off the device, so a remedy can restart before a fault.

A divergence overflows many steps after it began; replaying only the failing step cannot test a lower
learning rate or clipping there. The ring keeps the parameters and buffers, the optimizer's accumulators,
the LR scheduler's state, the RNG states and the loader position (epoch, batch) every `every` steps, plus
the state before the first step (pinned: warmup and re-initialisation restart from it). Snapshots are
rare (the interval grows until their measured cost is <= 0.5% of the step time) and off the device:
in host memory within a budget, else in a temporary folder on disk (spill.py); a model too large for
either gets no ring, and a note that remedies were verified on the failing step alone.
"""

from __future__ import annotations

import math
import random
import statistics
import time
import weakref
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nandoctor.engine import spill
from nandoctor.tensors.grouped import STACK_MAX_NUMEL, by_shape, host_copies
from nandoctor.workload.schedulers import lr_scheduler

MAX_SNAPSHOTS = 2  # besides the pinned first one: enough to reach 2 intervals (>= 8 steps) before a fault
MIN_EVERY = 4
COST_SHARE = 0.005  # the ring may cost this share of the step time on average


@dataclass
class RngState:
    paddle: Any
    numpy: Any
    python: Any

    @classmethod
    def now(cls) -> RngState:
        import paddle

        return cls(paddle.get_rng_state(), np.random.get_state(), random.getstate())

    def restore(self) -> None:
        import paddle

        paddle.set_rng_state(self.paddle)
        np.random.set_state(self.numpy)
        random.setstate(self.python)


@dataclass(eq=False)  # identity, not value: the ring tracks the snapshots it handed out in a WeakSet
class Snapshot:
    """The state right before step `step` (batch `batch_index` of epoch `epoch`) was computed. Its arrays
    are in memory, or (`spilled`) .npy files read back one at a time (spill.Spilled)."""

    step: int
    epoch: int
    batch_index: int
    model: Mapping[str, np.ndarray]
    accumulators: dict[str, Mapping[str, np.ndarray]]
    scheduler: dict[str, Any] | None
    rng: RngState
    nbytes: int = 0
    nonfinite: int = 0  # NaN/Inf values in the weights (a NaN row the run trains around counts from step 0)
    spilled: bool = False


@dataclass
class SnapshotRing:
    model: Any
    optimizer: Any
    every: int = MIN_EVERY
    disabled: str | None = None  # why there is no ring (a note for the report)
    max_every: int = 10**6  # the longest interval (the in-loop watch keeps every batch in between)
    first: Snapshot | None = None
    ring: deque[Snapshot] = field(default_factory=lambda: deque(maxlen=MAX_SNAPSHOTS))
    epoch_rng: dict[int, RngState] = field(default_factory=dict)  # the RNG as each epoch's loader was made
    seconds: float = 0.0
    saves: int = 0
    budget: spill.Budget = field(default_factory=lambda: spill.Budget(0, 0))
    skipped: int = 0  # periodic snapshots left out: no room in memory or on disk
    batches: Any = None  # the probe's BatchTape (batch_tape.py): the batches its replays read
    _folder: spill.SpillFolder = field(default_factory=spill.SpillFolder)
    _live: weakref.WeakSet[Snapshot] = field(default_factory=weakref.WeakSet)  # every snapshot still held
    _last_t: float | None = None
    _last_saved: int = 0
    _last_took: float | None = None  # seconds the newest snapshot took
    # the latest step times (the interval is worked out from their median) and how many were timed in all:
    # a long run keeps no list per step
    _step_times: deque[float] = field(default_factory=lambda: deque(maxlen=20))
    _steps_timed: int = 0
    _groups: tuple[list[Any], dict[tuple[Any, ...], list[int]]] | None = None  # the last tensors (weakly), groups

    @classmethod
    def for_model(cls, model: Any, optimizer: Any) -> SnapshotRing:
        ring = cls(model, optimizer)
        size = sum(tensor_nbytes(p) for p in model.state_dict().values())
        ring.budget = spill.Budget.now()
        if ring._place(size) is None:  # not even the weights before the first step fit anywhere
            ring.disabled = (f"no room for a snapshot of the model's weights (~{size / 2**20:.0f} MB, with "
                             f"Adam's state ~{3 * size / 2**20:.0f} MB; room: {ring.budget.text()}): no state "
                             "ring was kept, so remedies were verified on the failing step alone")
        return ring

    def memory_only(self) -> bool:
        """Never spill (the watch: a snapshot every few dozen steps written to disk would cost the user's
        loop far more than its share); True if snapshots with Adam's state (~3x the weights) fit in memory."""
        self.budget.disk = 0
        size = sum(tensor_nbytes(p) for p in self.model.state_dict().values())
        return self.disabled is None and 3 * size <= self.budget.memory

    def close(self) -> None:
        """Drop the snapshots and remove the spill folder (also done at exit)."""
        self.first = None
        self.ring.clear()
        self._folder.close()

    def _held(self, spilled: bool, freeing: Snapshot | None = None) -> int:
        return sum(s.nbytes for s in list(self._live) if s.spilled == spilled and s is not freeing)

    def _place(self, size: int, freeing: Snapshot | None = None) -> str | None:
        """"memory", "disk" or None: where a snapshot of `size` bytes fits beside those still held."""
        if self._held(False, freeing) + size <= self.budget.memory:
            return "memory"
        if self._held(True, freeing) + size <= self.budget.disk:
            return "disk"
        return None

    def on_epoch(self, epoch: int) -> None:
        """The loader for `epoch` is about to be made: its order may come from the RNG, so keep that."""
        if self.disabled is None:
            self.epoch_rng[epoch] = RngState.now()
            keep = {s.epoch for s in self.ring} | {epoch, 0}
            self.epoch_rng = {e: r for e, r in self.epoch_rng.items() if e in keep}

    def widen(self, every: int) -> None:
        """Snapshots at least `every` steps apart (at most `max_every`): a driver reading its steps that far
        apart needs none closer (StepWatcher._pace)."""
        self.every = max(self.every, min(every, self.max_every))

    def next_due(self) -> int:
        """The earliest step whose `on_batch` may take a snapshot (a later one when the interval grows)."""
        return self._last_saved + self.every if self.disabled is None else 2**62

    def note_steps(self, starts: list[float]) -> None:
        """Steps that began at these `perf_counter` times before `next_due()` and had no `on_batch` (the
        watch's quiet steps): their times, as `on_batch` would have measured them."""
        if not starts:
            return
        last = self._last_t
        times = self._step_times
        for now in starts:
            if last is not None:
                times.append(now - last)
            last = now
        self._steps_timed += len(starts) - (self._last_t is None)
        self._last_t = last

    def on_batch(self, step: int, epoch: int, batch_index: int) -> None:
        """Before step `step`: a snapshot on step 0 and every `every` steps (host copies)."""
        now = time.perf_counter()
        if self._last_t is not None:
            self._step_times.append(now - self._last_t)
            self._steps_timed += 1
        self._last_t = now
        if self.disabled is not None or (step > 0 and step - self._last_saved < self.every):
            return
        if step > 0 and self._last_took is not None and self._step_times:
            # Due by the first interval, which was set before any step time was known: judge it by the
            # cost of the snapshot before the first step now. That one held no optimizer state yet; Adam's
            # two moments make the next ~3x larger. On a model whose snapshot costs many steps, this one
            # waits for its turn instead of costing ~2% of a 60-step run.
            took = self._last_took * (3 if self._last_saved == 0 else 1)
            self.every = max(self.every, self._interval(took))
            if step - self._last_saved < self.every:
                return
        self._last_saved = step
        oldest = self.ring[0] if step > 0 and len(self.ring) == self.ring.maxlen else None
        if self._place(self._state_nbytes(), oldest) is None:
            self.skipped += 1  # no room beside the older ones: they stay
            return
        if oldest is not None:
            self.ring.popleft()  # first, so the two never take room together
        snap = self.take(step, epoch, batch_index)
        took = time.perf_counter() - now
        self._last_took = took
        self.seconds += took
        self.saves += 1
        self._last_t += took  # the step time measured next excludes the snapshot itself
        if step == 0:
            self.first = snap
        else:
            self.ring.append(snap)
        if self._step_times:
            self.every = max(self.every, self._interval(took))

    def _interval(self, took: float) -> int:
        """Steps between snapshots so that one costing `took` seconds stays within COST_SHARE of the steps."""
        per_step = statistics.median(self._step_times)
        return max(MIN_EVERY, min(math.ceil(took / max(COST_SHARE * per_step, 1e-9)), self.max_every))

    def _tensors(self) -> tuple[list[tuple[str, str]], list[Any], list[str]]:
        state = self.model.state_dict()
        per_acc = getattr(self.optimizer, "_accumulators", {})
        keys = [("model", k) for k in state] + [(name, p) for name, per in per_acc.items() for p in per]
        tensors = [*state.values(), *(t for per in per_acc.values() for t in per.values())]
        return keys, tensors, list(per_acc)

    def _state_nbytes(self) -> int:
        return sum(tensor_nbytes(t) for t in self._tensors()[1])

    def take(self, step: int, epoch: int, batch_index: int) -> Snapshot:
        """A snapshot of the state now: in memory if it fits the budget, else on disk if that has room,
        else in memory all the same (the caller needs it: the state to put back after the remedies)."""
        keys, tensors, acc_names = self._tensors()
        # the same tensors as last time (the usual case): the same groups. Weak references: the optimizer's
        # old moments (a remedy replay from the first step makes fresh ones) must not live on here
        last = self._groups
        if last is None or len(last[0]) != len(tensors) or any(r() is not t for r, t in zip(last[0], tensors)):
            self._groups = ([weakref.ref(t) for t in tensors], by_shape(tensors))
        groups = self._groups[1]
        to_disk = self._place(sum(tensor_nbytes(t) for t in tensors)) == "disk"
        model: dict[str, Any] = {}
        accs: dict[str, dict[str, Any]] = {name: {} for name in acc_names}
        nbytes = bad = 0
        folder = self._folder.new_dir() if to_disk else None
        for idx, arrays in _host_groups(tensors, groups, one_group=not to_disk):
            for i, arr in zip(idx, arrays):
                kind, key = keys[i]
                nbytes += arr.nbytes
                if kind == "model" and arr.dtype.kind == "f":
                    bad += int((~np.isfinite(arr)).sum())
                (model if kind == "model" else accs[kind])[key] = (
                    spill.save(folder, arr, i) if folder is not None else arr)
        sched = lr_scheduler(self.optimizer)
        state = sched.state_dict() if sched is not None else None
        if folder is not None:
            owner = spill.Spilled(model)
            spill.forget_with(owner, folder)  # the files go with the last reference to them
            model_map: Mapping[str, np.ndarray] = owner
            acc_maps: dict[str, Mapping[str, np.ndarray]] = {n: spill.Spilled(p, owner) for n, p in accs.items()}
        else:
            model_map, acc_maps = model, accs
        snap = Snapshot(step, epoch, batch_index, model_map, acc_maps, state, RngState.now(), nbytes, bad,
                        spilled=folder is not None)
        self._live.add(snap)
        return snap

    def sound(self, snap: Snapshot) -> bool:
        """No more NaN/Inf in the weights than before the first step (the training itself added none)."""
        return snap.nonfinite <= (self.first.nonfinite if self.first is not None else 0)

    def latest(self, at_most: int) -> Snapshot | None:
        """The newest finite snapshot taken at or before step `at_most`."""
        cands = [s for s in [self.first, *self.ring] if s is not None and s.step <= at_most and self.sound(s)]
        return max(cands, key=lambda s: s.step) if cands else None

    def summary(self) -> dict[str, Any]:
        snaps = [s for s in [self.first, *self.ring] if s is not None]
        # statistics, not numpy: np.median imports numpy.ma on first use (9 ms, at the end of every probe)
        per_step = statistics.median(self._step_times) if self._step_times else None
        return {"enabled": self.disabled is None, "note": self.disabled, "every": self.every,
                "kept_steps": [s.step for s in snaps], "bytes": sum(s.nbytes for s in snaps),
                "disk_steps": [s.step for s in snaps if s.spilled],
                "memory_budget_bytes": self.budget.memory, "disk_budget_bytes": self.budget.disk,
                "skipped": self.skipped,
                "capacity": (self.ring.maxlen or 0) + 1, "saves": self.saves,
                "seconds": round(self.seconds, 4),
                "share_of_run": round(self.seconds / max(per_step * self._steps_timed, 1e-9), 4)
                if per_step else None}


def restore(snap: Snapshot, model: Any, optimizer: Any) -> None:
    """Put the weights, buffers, optimizer accumulators and scheduler back as they were at `snap`."""
    import collections

    if snap.spilled:  # one array read from disk at a time, straight into its tensor
        state = model.state_dict()
        for k, arr in snap.model.items():
            if k in state:
                state[k].set_value(arr)
    else:
        model.set_state_dict(dict(snap.model))
    accs = getattr(optimizer, "_accumulators", None)
    if accs is not None:
        if not snap.accumulators:  # before the first update: the optimizer makes fresh accumulators
            optimizer._accumulators = collections.defaultdict(dict)
            if hasattr(optimizer, "_already_create_accumulator"):
                optimizer._already_create_accumulator = set()
        else:
            for name, per in snap.accumulators.items():
                for pname, arr in per.items():
                    if pname in accs.get(name, {}):
                        accs[name][pname].set_value(arr)
    sched = lr_scheduler(optimizer)
    if sched is not None and snap.scheduler is not None:
        sched.set_state_dict(dict(snap.scheduler))


def _host_groups(tensors: list[Any], groups: dict[tuple[Any, ...], list[int]],
                 one_group: bool) -> Iterator[tuple[list[int], list[np.ndarray]]]:
    """(indices, host arrays) of the tensors: all at once for an in-memory snapshot (one device-to-host
    copy per shape group), group by group for a spilled one, each large tensor alone, so that no more
    than one group's arrays are in memory while they are written."""
    if one_group:
        yield list(range(len(tensors))), host_copies(tensors, groups)
        return
    for idx in groups.values():
        if len(idx) > 1 and math.prod(tensors[idx[0]].shape) * len(idx) <= STACK_MAX_NUMEL:
            yield idx, host_copies([tensors[i] for i in idx])
        else:
            for i in idx:
                yield [i], [tensors[i].numpy()]  # written at once: no second copy of a large tensor


def tensor_nbytes(t: Any) -> int:
    try:
        return int(math.prod(int(d) for d in t.shape)) * int(t.element_size())
    except Exception:  # noqa: BLE001 - an odd buffer: count it as 4 bytes a value
        return int(math.prod(int(d) for d in t.shape)) * 4
