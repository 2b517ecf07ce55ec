"""A bounded ring of training-state snapshots in host memory, so a remedy can restart before a fault.

A divergence overflows many steps after it began; replaying only the failing step cannot test a lower
learning rate or clipping there. The ring keeps the parameters and buffers, the optimizer's accumulators,
the LR scheduler's state, the RNG states and the loader position (epoch, batch) every `every` steps, plus
the state before the first step (pinned: warmup and re-initialisation restart from it). Snapshots are
rare (the interval grows until their measured cost is <= 0.5% of the step time) and host-only; models
above `MAX_MODEL_BYTES` get no ring and a note instead.
"""

from __future__ import annotations

import math
import operator
import random
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nandoctor.grouped import by_shape, host_copies
from nandoctor.schedulers import lr_scheduler

MAX_MODEL_BYTES = 256 * 2**20  # one snapshot (weights + optimizer state) above this: no ring
MAX_RING_BYTES = 512 * 2**20  # all snapshots together
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


@dataclass
class Snapshot:
    """The state right before step `step` (batch `batch_index` of epoch `epoch`) was computed."""

    step: int
    epoch: int
    batch_index: int
    model: dict[str, np.ndarray]
    accumulators: dict[str, dict[str, np.ndarray]]
    scheduler: dict[str, Any] | None
    rng: RngState
    nbytes: int = 0
    nonfinite: int = 0  # NaN/Inf values in the weights (a NaN row the run trains around counts from step 0)


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
    batches: Any = None  # remedy_replay.BatchTape: the batches the loop read, so replays need not re-read them
    seconds: float = 0.0
    saves: int = 0
    _last_t: float | None = None
    _last_saved: int = 0
    _last_took: float | None = None  # seconds the newest snapshot took
    _step_times: list[float] = field(default_factory=list)
    _groups: tuple[list[Any], dict[tuple[Any, ...], list[int]]] | None = None  # the last tensors, their groups

    @classmethod
    def for_model(cls, model: Any, optimizer: Any) -> SnapshotRing:
        ring = cls(model, optimizer)
        size = sum(tensor_nbytes(p) for p in model.state_dict().values())
        if size * 3 > MAX_MODEL_BYTES:  # Adam's two moments make the optimizer state ~2x the weights
            ring.disabled = (f"the model's weights and optimizer state (~{3 * size / 2**20:.0f} MB) are above the "
                             f"{MAX_MODEL_BYTES / 2**20:.0f} MB snapshot limit: no state ring was kept, so remedies "
                             "restart only from the failing step")
        else:
            ring.ring = deque(maxlen=max(1, min(MAX_SNAPSHOTS, MAX_RING_BYTES // max(3 * size, 1) - 1)))
        return ring

    def on_epoch(self, epoch: int) -> None:
        """The loader for `epoch` is about to be made: its order may come from the RNG, so keep that."""
        if self.disabled is None:
            self.epoch_rng[epoch] = RngState.now()
            keep = {s.epoch for s in self.ring} | {epoch, 0}
            self.epoch_rng = {e: r for e, r in self.epoch_rng.items() if e in keep}

    def on_batch(self, step: int, epoch: int, batch_index: int) -> None:
        """Before step `step`: a snapshot on step 0 and every `every` steps (host copies)."""
        now = time.perf_counter()
        if self._last_t is not None:
            self._step_times.append(now - self._last_t)
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
        per_step = statistics.median(self._step_times[-20:])
        return max(MIN_EVERY, min(math.ceil(took / max(COST_SHARE * per_step, 1e-9)), self.max_every))

    def take(self, step: int, epoch: int, batch_index: int) -> Snapshot:
        state = self.model.state_dict()
        per_acc = getattr(self.optimizer, "_accumulators", {})
        keys = [("model", k) for k in state] + [(name, p) for name, per in per_acc.items() for p in per]
        tensors = [*state.values(), *(t for per in per_acc.values() for t in per.values())]
        last = self._groups  # the same tensors as last time (the usual case): the same groups
        if last is None or len(last[0]) != len(tensors) or not all(map(operator.is_, last[0], tensors)):
            self._groups = (tensors, by_shape(tensors))
        arrays = host_copies(tensors, self._groups[1])
        model: dict[str, np.ndarray] = {}
        accs: dict[str, dict[str, np.ndarray]] = {name: {} for name in per_acc}
        for (kind, key), arr in zip(keys, arrays):
            (model if kind == "model" else accs[kind])[key] = arr
        sched = lr_scheduler(self.optimizer)
        nbytes = sum(a.nbytes for a in model.values()) + sum(a.nbytes for per in accs.values() for a in per.values())
        bad = sum(int((~np.isfinite(a)).sum()) for a in model.values() if a.dtype.kind == "f")
        return Snapshot(step, epoch, batch_index, model, accs, sched.state_dict() if sched is not None else None,
                        RngState.now(), nbytes, bad)

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
                "capacity": (self.ring.maxlen or 0) + 1, "saves": self.saves,
                "seconds": round(self.seconds, 4),
                "share_of_run": round(self.seconds / max(per_step * len(self._step_times), 1e-9), 4)
                if per_step else None}


def restore(snap: Snapshot, model: Any, optimizer: Any) -> None:
    """Put the weights, buffers, optimizer accumulators and scheduler back as they were at `snap`."""
    import collections

    model.set_state_dict({k: v for k, v in snap.model.items()})
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


def tensor_nbytes(t: Any) -> int:
    try:
        return int(math.prod(int(d) for d in t.shape)) * int(t.element_size())
    except Exception:  # noqa: BLE001 - an odd buffer: count it as 4 bytes a value
        return int(math.prod(int(d) for d in t.shape)) * 4
