"""Per-step detection, apart from whoever drives the training: at most one host sync per step, before the update.

`StepWatcher` is told about each step's stages (the batch, the loss, the backward, the update) and
decides whether the step is a fault. It owns the monitor, the stats schedule, the warning tracker and
the history of updates since the parameters were last seen finite. It never calls the user's code, so
an exception out of it is nandoctor's own bug, never the user's: the driver (the probe's loop, or a
user's own loop through an in-loop API) keeps the user's calls behind its own boundary.

When a step shows a fault the optimizer has not stepped, so the parameters and optimizer state are
exactly those that produced it and the replay needs no snapshot; only the RNG state (captured in
`begin_step`) is restored. A driver that can roll back (the probe, with its snapshot ring) may leave
most steps unread (`defer_reads`): their losses wait on the device, and a read finding one of them
non-finite is a fault whose step the rollback finds by replay (engine/rollback.py).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from nandoctor.engine.monitors import StepMonitor, StepStats
from nandoctor.engine.precursors import PrecursorMonitor
from nandoctor.engine.snapshots import MIN_EVERY
from nandoctor.findings import Code, Phase
from nandoctor.tensors.finite import harmful_fields

# What the probe may add to a plain step on average (the target is 5%; keep a margin): the every-step
# detection's measured share first (~3% on a model of 300 tiny tensors), the sampled per-layer stats
# get the rest, but never less than a quarter of a percent. 1%: the loop's own bookkeeping and the snapshot
# ring (~1% of a 16 ms step) are not in the measured share, and the stats fill whatever is left (with
# steps of the probe and of a plain loop taken in turn, 3% put a 4-layer Transformer at 1.04x a step; 2%
# left a 0.3 ms step watched in its own loop at 1.05x, where the quiet steps' notes cost ~2% by themselves).
_TOTAL_BUDGET = 0.01
# A long run's records (the timeline): the most kept, and how many recent steps are always kept in full
MAX_RECORDS = 4096
RECENT_STEPS = 1024
# ... and around the steps where trouble began (an alert, a warning's step), this many steps either side are
# kept in full too, for at most MAX_MARKS such steps (the first and the latest): a bounded extra
AROUND_MARKS = 16
MAX_MARKS = 32
MAX_ARRAYS = 512  # older records keeping their per-tensor arrays (per-parameter norms, layer maxima)
_MIN_STATS_BUDGET = 0.0025
_PLAIN_SAMPLES = 3  # plain steps measured before stats may be taken on every step (StatsSchedule.want)
# With reads deferred: a read may cost this share of the step time on average (k = its cost / this share of a
# step), and at most this many steps go unread in a row (their losses are kept as device tensors). Each read
# also ends a quiet stretch (its catch-up) and widens the ring's interval to k: 0.5% put a 0.3 ms step's reads,
# catch-ups and snapshots at ~2.5% of it, 0.25% at ~1.5% (reads one in 256 there).
_READ_SHARE = 0.0025
MAX_UNREAD = 256
# Steps read in full before any is left unread: the early level of the gradient norm, and the whole of a short
# probe (the samples run 10-60 steps), keep every step's norm, so a growth is placed at its exact step there
READ_ALL_STEPS = 64
DETECT_SPAN = 256  # the steps the reads' mean cost is taken over (StatsSchedule.detect): MAX_UNREAD
# The same report on every run (issue 35): how often a step is read follows measured timings, so what is
# concluded from gradient norms may only read steps that every stride reads: the first READ_ALL_STEPS steps and
# the grid's steps after them (read whatever the stride, and a stats step too: on a 0.3 ms step each costs
# ~1.2 ms more than a quiet one, most of what the watch costs there: benchmarks/README.md, "Row 7 on fast_mlp"),
# and of those, on a model whose gradients are read one step in MIN_EVERY (defer_grads), the multiples of
# MIN_EVERY. Other steps' norms are shown in the timeline, and nothing is concluded from them
# (StepRecord.conclusive). The grid's spacing is at most half the step number, doubling as the run goes on:
# every NORM_GRID-th step to step 255, every 128th to step 511, every NORM_GRID_MAX-th after (a fixed function
# of the step: every stride and every replay of a step agree).
NORM_GRID = 64
NORM_GRID_MAX = 256


def grid_spacing(step: int) -> int:
    """The norm grid's spacing around `step`: NORM_GRID doubled while 4 times it is no further than `step`,
    up to NORM_GRID_MAX (each spacing's first step is a multiple of the next one's)."""
    spacing = NORM_GRID
    while spacing < NORM_GRID_MAX and 4 * spacing <= step:
        spacing *= 2
    return spacing


def on_grid(step: int) -> bool:
    """Whether `step` is one of the grid's: its gradient norm and stats are taken whatever the read stride."""
    return not step % NORM_GRID and not step % grid_spacing(step)


def next_grid(step: int) -> int:
    """The first grid step from `step` on."""
    spacing = grid_spacing(step)
    return -(-step // spacing) * spacing


# Tests only: the read stride forced (an integer), so a test can run one probe at two strides
READ_EVERY_ENV = "NANDOCTOR_READ_EVERY"


def forced_read_every() -> int | None:
    """The read stride a test forces through READ_EVERY_ENV, else None (the measured one)."""
    raw = os.environ.get(READ_EVERY_ENV, "").strip()
    return max(1, min(int(raw), MAX_UNREAD)) if raw.isdigit() else None


class FaultKind(str, Enum):
    """What stopped the training: one typed set for every way in (compare members, never strings)."""

    DATA = "data"  # a non-finite input value that made the step non-finite (or the model's code raise)
    NONFINITE = "nonfinite"  # a non-finite loss or gradient: localised by replay
    UPDATE = "update"  # an optimizer update wrote NaN/Inf into the parameters
    CRASH = "crash"  # the user's code raised (or called sys.exit)
    LOSS = "loss"  # a loss that cannot train: not a tensor, not a scalar, or no parameter depends on it


@dataclass
class Fault:
    """What stopped the loop, with what the report needs to name and reproduce it."""

    kind: FaultKind
    step: int
    batch_index: int | None
    epoch: int
    fields: dict[str, Any] | None = None
    rng: Any = None
    stats: StepStats | None = None
    exc: BaseException | None = None
    phase: Phase | None = None  # for crashes: where the loop was
    bad_fields: dict[str, list[int]] = field(default_factory=dict)  # data: field -> sample rows
    bad_params: list[str] = field(default_factory=list)
    grad_norm: float | None = None  # update: the norm of the step whose update did it
    update_range: tuple[int, int] | None = None  # update: the first and last step that may have done it
    code: Code | None = None  # loss: which problem (loss.not_tensor, loss.not_scalar, loss.no_grad)
    unread: list[int] = field(default_factory=list)  # update: candidate steps whose gradients were not read
    evidence: dict[str, Any] = field(default_factory=dict)  # loss: the shape, the dtype


@dataclass
class StepRecord:
    step: int
    loss: float
    grad_norm: float | None
    grad_sq: np.ndarray | None
    act_max: np.ndarray | None
    loss_scale: float | None = None
    skipped: bool | None = None
    lr: float | None = None
    batch_index: int | None = None  # the loader's position of the step's batch: what a loss spike names
    epoch: int | None = None
    # its gradient norm was read whatever the read stride (StepWatcher.conclusive): only such norms are concluded
    # from (warnings, causes); the others, read because timing allowed it, are shown in the timeline alone
    conclusive: bool = True
    # its per-layer maxima and per-parameter norms come from a stats step every run takes (step 0 or 2, an alert,
    # the grid's): only those are concluded from (float16 headroom, vanishing gradients)
    stats_fixed: bool = True


class StatsSchedule:
    """When to collect per-layer stats: step 0, every k-th step (k from measured cost), and after warnings."""

    def __init__(self) -> None:
        self.k = 1
        self.last = -10**9
        # the latest 20 of each (a long run keeps no list per step)
        self.plain: deque[float] = deque(maxlen=20)
        self.stats: deque[float] = deque(maxlen=20)
        # seconds of the reductions and the sync a plain step pays, a mean decaying over ~DETECT_SPAN steps: with
        # the reads spaced out (defer_reads: one step in up to 256), the latest 20 steps often held no read at
        # all, and the stats then took the whole budget (on a 0.3 ms step, 2% of it besides the reads' ~1.5%)
        self.detect: float | None = None
        self.alert = False
        self._fresh = 0  # plain steps recorded since k was last worked out

    def want(self, step: int) -> bool:
        if step == 0 or self.alert:
            return True
        if step == 1:  # one plain step to measure against
            return False
        if step == 2 or on_grid(step):  # and one stats step that is not the first (warm-up) step; and the
            return True  # grid's, taken whatever the measured cost (StepWatcher.stats_fixed: the same report)
        # k == 1 (stats every step) would leave no plain step to measure against, so a plain step
        # measured slow once (a first-call cost, a load spike) would keep it at 1: measure one in 16, and
        # every other step until a few plain steps were measured (under `nandoctor run` step 1 was often the
        # only one, slowed by load or what attaching left behind, and a 500-layer MLP then took stats on 30 of
        # its first 32 steps: ~3 ms a step more than the probe on the same workload)
        if self.k == 1 and (step % 16 == 0 or len(self.plain) < _PLAIN_SAMPLES and step % 2):
            return False
        return step - self.last >= self.k

    def next_stats(self, step: int) -> int:
        """The first step after `step` (which `want` did not take) that `want` takes, alerts aside."""
        return step + 1 if self.k == 1 else max(step + 1, self.last + self.k)

    def record(self, step: int, stats: bool, seconds: float, detect_seconds: float = 0.0) -> None:
        if step == 0:
            self.last = step
            return  # warm-up: allocations, first-call costs
        if stats:
            self.stats.append(seconds)
            self.last = step
        else:
            self.plain.append(seconds)
            mean = self.detect
            self.detect = detect_seconds if mean is None else mean + (detect_seconds - mean) / DETECT_SPAN
            self._fresh += 1
            # k is worked out again after each stats step and every 8th plain one: on a 0.3 ms step the
            # sums below cost more than the probe's whole per-step budget
            if self._fresh < 8:
                return
        self._work_out_k()

    def record_plain(self, seconds: list[float]) -> None:
        """Plain steps without a read, recorded together (a driver's quiet steps), as `record` would one by
        one; k is worked out once, after them."""
        if not seconds:
            return
        self.plain.extend(seconds)
        mean = self.detect  # each step without a read moves the decaying mean towards 0 (see `record`)
        self.detect = 0.0 if mean is None else mean * (1 - 1 / DETECT_SPAN) ** len(seconds)
        self._fresh += len(seconds)
        if self._fresh >= 8:
            self._work_out_k()

    def _work_out_k(self) -> None:
        self._fresh = 0
        if self.plain and self.stats:
            # min: one slow plain step (first calls, load) must not make the stats look free
            plain = min(self.plain)
            # the mean, not the median: with the reads spaced out (defer_grads, defer_reads), most plain
            # steps read nothing and the median would hide the steps that do
            detect = (self.detect or 0.0) / max(plain, 1e-9)
            budget = max(_MIN_STATS_BUDGET, _TOTAL_BUDGET - detect)
            extra = max(0.0, statistics.median(self.stats) - plain)
            self.k = max(1, math.ceil(extra / max(budget * plain, 1e-9)))


def trainable_names(model: Any) -> list[str]:
    """The parameters an optimizer would train (empty: the model cannot learn anything)."""
    return [n for n, p in model.named_parameters() if not p.stop_gradient]


class StepWatcher:
    """Detection for one model and optimizer; call the stages in order each step, `close()` at the end.

    `begin_step(step, fields)` -> `observe_loss(loss)` -> (the user's backward) -> `after_backward(loss)`
    -> (the user's optimizer step, maybe) -> `after_update(stepped)`. `observe_loss` and `after_backward`
    return a Fault or None; with a Fault the step is over and the optimizer must not step. When the
    user's code raises mid-step, `data_fault(exc)` says whether the batch was to blame.
    """

    def __init__(self, model: Any, optimizer: Any = None, *, scaler: Any = None, fp16: bool = False,
                 amp: bool = False, start_nonfinite: list[str] | None = None) -> None:
        import paddle

        from nandoctor.engine.warnings import WarningTracker

        self._tensor = paddle.Tensor  # (observe_loss, every step: no import statement there)
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler  # paddle.amp.GradScaler on a GPU with amp enabled; inert (None) on CPU
        self.monitor = StepMonitor(model, known_nonfinite=start_nonfinite)
        self.precursors = PrecursorMonitor(model)  # attention, log Z, linear RMS at fixed steps (issue 35)
        self.monitor.on_hooks_off = self.precursors.end
        self.schedule = StatsSchedule()
        self.tracker = WarningTracker(self.monitor.layer_names, self.monitor.param_names, fp16=fp16, amp=amp,
                                      learning_rate=current_lr(optimizer))
        self.records: list[StepRecord] = []
        self.thinned = False  # old records were thinned out (`_record`): the timeline has gaps there
        self.marks: list[int] = []  # steps where an alert began (`_mark`): their neighbourhood is never thinned
        self._strides = [1, 1]  # the older records kept: steps that are multiples of these (read, unread)
        self.stats_every: list[int] = []
        # updates since the parameters were last seen finite: (step, batch_index, epoch, grad_norm, fields)
        self.history: list[tuple[int, int | None, int, float | None, Any]] = []
        # ... with the batches of the entries an update fault may name (the first and the newest). A driver
        # that can read a batch back by its position (the probe, through its batch tape) turns this off: the
        # loop then holds no batch but the step's own (issue 22: 100 MB batches held two more each step).
        self.keep_update_batches = True
        self._next_stats: bool | None = None
        self._step = 0
        self._batch_index: int | None = None
        self._epoch = 0
        self._fields: dict[str, Any] | None = None
        self._rng: Any = None
        self._stats_step = False
        self._stats_fixed = False
        self._t0 = 0.0
        self._t_read = 0.0
        self._seen_backward = False
        self._last_norm: float | None = None
        self.defer_every = 1  # read the gradients on every step (defer_grads() may space the reads out)
        self.unread: set[int] = set()  # steps whose gradients were left unread
        self._read_grads = True
        # defer_reads(): the snapshot ring a rollback replays from (its interval: the longest run of unread steps)
        self._ring: Any = None
        self.read_every = 1  # steps from one host read to the next (defer_reads sets it from measured cost)
        self._read = True  # this step is read on the host
        self._next_read = True  # ... and the next one (worked out in after_update, used by begin_step)
        self._first_step: int | None = None
        self._read_seconds: list[float] = []
        # the unread steps since the last read: (step, batch_index, epoch, loss tensor, learning rate)
        # (a driver's quiet steps are taken as they are: lists beginning with these five, `quiet_steps`)
        self._pending: list[Any] = []
        self._forced = forced_read_every()
        # the gradient norms kept are those of steps on this spacing (see on_grid): a model whose gradients a
        # rolling-back driver would read one step in MIN_EVERY keeps that spacing whoever drives it
        self._grad_grid = 1 if self.monitor.small or scaler is not None else MIN_EVERY

    def conclusive(self, step: int) -> bool:
        """Whether step `step`'s gradient norm is read whatever the read stride (on_grid): the only norms
        warnings and causes read, so that every run concludes the same."""
        first = self._first_step if self._first_step is not None else step
        if step - first >= READ_ALL_STEPS and not on_grid(step):
            return False
        return self._grad_grid == 1 or step < 3 or step % self._grad_grid == 0

    def defer_grads(self, every: int) -> None:
        """Read the gradients only every `every`-th step (and on stats, alert and the first steps), for a
        model of hundreds of tensors, where fetching and reducing them is most of the probe's per-step cost.
        Only for a driver that can roll back: a NaN gradient on an unread step writes NaN into the weights,
        which the next loss or parameter check sees, and the update fault then names unread steps that
        the driver replays from a snapshot with every check on (engine/rollback.py). Not under AMP (a
        skipped overflow step needs its gradients read) nor on small models (their read is cheap)."""
        if not self.monitor.small and self.scaler is None:
            self.defer_every = max(1, every)

    def defer_reads(self, ring: Any) -> None:
        """Leave most steps without any host read: each unread step's loss stays on the device, and every
        `read_every`-th step reads them all at once with its own. `read_every` follows the measured cost of
        a read against the step's (a read may cost _READ_SHARE of the steps on average; a 0.3 ms step
        reads one in MAX_UNREAD, a 40 ms one every step), at most the snapshot `ring`'s interval (the ring then
        always holds a snapshot before the unread steps; `_pace` widens it to the reads' distance, up to
        MAX_UNREAD) from step READ_ALL_STEPS on (an unread step has no gradient norm in the timeline). A
        non-finite loss found at a read is an update fault naming the unread steps, which the rollback
        replays from the ring with every check on (engine/rollback.py). Only for a driver that can roll
        back; not under AMP."""
        if self.scaler is None:
            self._ring = ring

    def read_every_step(self) -> None:
        """Undo `defer_grads` and `defer_reads`: the driver can no longer roll back. Steps still unread are
        read with the next step (`pending`), which is read in full."""
        self.defer_every = self.read_every = 1
        self._ring = None
        self._next_read = True

    @property
    def pending(self) -> bool:
        """Unread steps' losses are waiting on the device for the next read."""
        return bool(self._pending)

    def _reads(self, step: int, stats: bool) -> bool:
        """Whether step `step` is read on the host (always, unless defer_reads). On multiples of read_every: no
        more than read_every steps go unread in a row, whenever read_every changes."""
        return (self._ring is None or stats or self.schedule.alert or step - self._first_step < READ_ALL_STEPS
                or step % self.read_every == 0 or on_grid(step))

    # ---- the stages of a step ----------------------------------------------------------------------
    def begin_step(self, step: int, fields: dict[str, Any], *, batch_index: int | None = None,
                   epoch: int = 0, rng: Any = None) -> None:
        """A batch is about to go through the model: RNG capture, stats hooks. The batch itself is judged
        only if the step goes non-finite (`data_fault`), by what it did, not by what it holds: a mask's
        intended -inf, or a NaN the model replaces, trains fine; and checking a 16 MB batch every step
        cost ~1.5% of a step, which detection on the loss and gradients already pays for."""
        self._step, self._batch_index, self._epoch, self._fields = step, batch_index, epoch, fields
        if self._first_step is None:
            self._first_step = step  # (a resumed run numbers its steps from the checkpoint's)
        stats = self._next_stats
        if stats is None:  # (the first step, or a driver that skipped after_update)
            stats = self.schedule.want(step)
            read = self._reads(step, stats)
        else:  # both were decided when the previous step ended
            read = self._next_read
        self._stats_step, self._read, self._next_stats = stats, read, None
        # a stats step every run takes, whatever the measured cost: its per-layer values may be concluded from
        self._stats_fixed = stats and (step in (0, 2) or self.schedule.alert or on_grid(step))
        # `rng`: the state from before a forward that already ran (`nandoctor run` attaches after step 0's).
        # An unread step needs none: a fault found later is replayed from the ring with its own RNG state.
        if read:
            import paddle

            self._rng = rng if rng is not None else paddle.get_rng_state()
            every = self.defer_every
            self._read_grads = every == 1 or stats or self.schedule.alert or step < 3 or step % every == 0
        else:
            self._rng, self._read_grads = rng, False
        mon = self.monitor
        if stats or mon.active or mon._hooks:  # (an unread step after a plain one has nothing to change)
            mon.begin_step(stats)
        self.precursors.begin(step)
        self._t0 = time.perf_counter()

    def attach_batch(self, fields: dict[str, Any], *, batch_index: int | None = None, epoch: int = 0) -> None:
        """The batch of a step begun without one (`begin_step(step, {})` before the forward of a user's
        own loop, the batch known only after backward)."""
        self._batch_index, self._epoch, self._fields = batch_index, epoch, fields

    def data_fault(self, exc: BaseException | None = None) -> Fault | None:
        """The step's batch, if it holds a harmful NaN/Inf (not a mask's -inf): the first cause of a step
        that went non-finite, or of the model's code raising (`exc`). Exact, on the host: a fault's cost."""
        rows = harmful_fields(self._fields)
        return self._fault(FaultKind.DATA, bad_fields=rows, exc=exc) if rows else None

    def observe_loss(self, loss: Any) -> Fault | None:
        """Before backward: a loss that cannot train (metadata only, no device work, no sync); a non-finite
        loss on an earlier, unread step (read now) came first."""
        self.precursors.end()  # the forward is over: a sampled step's hooks off
        if self.usual_loss(loss):
            return None
        fault = self._loss_fault(loss)
        return (self.flush() or fault) if fault is not None else None

    def usual_loss(self, loss: Any) -> bool:
        """A tensor that trains, of shape [] or [1]: a loss no stage has anything to say about before its read
        (metadata only, every step; the drivers' quiet steps ask it too)."""
        if type(loss) is self._tensor and not loss.stop_gradient:
            shape = loss.shape
            return not shape or shape == [1]
        return False

    def _loss_fault(self, loss: Any) -> Fault | None:
        import paddle

        if not isinstance(loss, paddle.Tensor):
            return self._fault(FaultKind.LOSS, code=Code.LOSS_NOT_TENSOR, phase=Phase.LOSS,
                               evidence={"type": type(loss).__name__})
        shape = loss.shape
        if shape and shape != [1] and math.prod(shape) != 1:  # ([] and [1]: the usual scalars, at no cost)
            shape = [int(d) for d in shape]
            return self._fault(FaultKind.LOSS, code=Code.LOSS_NOT_SCALAR, phase=Phase.LOSS,
                               evidence={"shape": shape, "dtype": str(loss.dtype).replace("paddle.", "")})
        if loss.stop_gradient:
            return self._fault(FaultKind.LOSS, code=Code.LOSS_NO_GRAD, phase=Phase.LOSS,
                               evidence={"reason": "stop_gradient", "trainable": len(self.monitor.params)})
        return None

    def read_loss(self, loss: Any) -> tuple[float, Fault | None]:
        """The loss alone on the host (one sync), for a check with no gradient to read yet: one made before
        backward, or a loop that never calls backward (loss monitoring). A non-finite loss is the step's fault
        whatever the gradients would be (the batch's when a NaN in it did it; an earlier unread step's first)."""
        value = float(loss)
        if math.isfinite(value):
            return value, None
        fault = self.flush() or self.data_fault()
        if fault is not None:
            return value, fault
        self._record(StepRecord(self._step, value, None, None, None, lr=current_lr(self.optimizer)))
        return value, self._fault(FaultKind.NONFINITE, rng=self._rng, stats=StepStats(value, None, None, None, None))

    def record_loss(self, value: float) -> None:
        """The timeline point of a step whose loss alone was read (`read_loss`) and that never reached a
        gradient read: a loop that monitors its loss without training on it."""
        self._record(StepRecord(self._step, value, None, None, None, lr=current_lr(self.optimizer)))

    def after_backward(self, loss: Any) -> Fault | None:
        """The step's one host sync, then the fault decision; a healthy step is recorded."""
        if not self._seen_backward:
            self._seen_backward = True
            mon = self.monitor
            if mon.params and all(p.grad is None for p in mon.params):  # host-side: no sync
                return self._fault(FaultKind.LOSS, code=Code.LOSS_NO_GRAD, phase=Phase.BACKWARD,
                                   evidence={"reason": "no_gradient", "trainable": len(mon.params)})
        step = self._step
        if not self._read:  # the loss waits on the device for the next read (defer_reads): no sync
            # detached (0.3 us, no device work): the loss itself would keep its step's autograd graph alive
            # until the read, and freeing ~100 graphs there cost ~8 us each (a 0.3 ms step's +1.5 ms read)
            self._pending.append((step, self._batch_index, self._epoch, loss.detach(), current_lr(self.optimizer)))
            self.unread.add(step)
            self._t_read = 0.0
            self._last_norm = None  # (an update fault names this step's norm: it was not read)
            return None
        st, fault = self._read_step(loss, step)
        if fault is not None:
            return fault
        if st.params_sum is not None:
            if not math.isfinite(st.params_sum):
                fault = self._update_fault(step)
                if fault is not None:
                    return fault
            else:
                self.history = []
                # the parameters are finite: no earlier unread step can be an update fault's cause any more
                # (and the set stays small over a long run)
                self.unread = {u for u in self.unread if u >= step}
        return self._judge(st, step)

    def _read_step(self, loss: Any, step: int) -> tuple[StepStats, Fault | None]:
        """The step's one host sync, with the losses of the unread steps before it; the stats hooks off. A
        non-finite loss among those unread steps is the fault (returned beside the stats, the read then
        untimed); else the read's cost is timed and paces the next reads (`defer_reads`)."""
        mon = self.monitor
        pending = self._pending
        t_read = time.perf_counter()
        st = mon.read(loss, full=self._stats_step, scale=getattr(self.scaler, "_scale", None),
                      grads=self._read_grads, pending=[p[3] for p in pending] if pending else None)
        if not self._read_grads:
            self.unread.add(step)
        if mon._hooks:  # a stats step's hooks off once read (not at the next step's begin), so it can be quiet
            mon.begin_step(False)
        mon.active = False
        if pending:
            fault = self._take_pending(st.pending)
            if fault is not None:
                return st, fault
        # the read's cost includes the unread steps' records it made (~1-2 us each: a read of 256 steps' losses)
        self._t_read = time.perf_counter() - t_read
        if self._ring is not None:
            self._pace()
        return st, None

    def _judge(self, st: StepStats, step: int) -> Fault | None:
        """A read step's own values, once the parameters are known fine: finite, the step is recorded (and may
        begin an alert); a gradient norm that only overflowed float32's square is recomputed first. Non-finite:
        the batch's fault when a NaN in it did it, an AMP overflow the scaler skips (recorded, no fault), or
        else the update's or the step's own (`_nonfinite_fault`)."""
        lr = current_lr(self.optimizer)
        at = {"batch_index": self._batch_index, "epoch": self._epoch, "conclusive": self.conclusive(step),
              "stats_fixed": self._stats_fixed}
        record = StepRecord(step, st.loss, st.grad_norm, st.grad_sq, st.act_max, st.loss_scale, lr=lr, **at)
        skipped = self.scaler is not None and math.isfinite(st.loss) and not st.grads_finite
        if not skipped and math.isfinite(st.loss) and not st.grads_finite and self.monitor.recheck_grads(st):
            record = StepRecord(step, st.loss, st.grad_norm, st.grad_sq, st.act_max, lr=lr, **at)  # a norm overflow
        if not math.isfinite(st.loss) or not st.grads_finite:
            fault = self.data_fault()  # a NaN in the batch did it (also what AMP would take for an overflow)
            if fault is not None:
                return fault
            if skipped:  # AMP overflow: the scaler skips this update and lowers the scale; not a fault
                record.skipped = True
            else:
                return self._nonfinite_fault(st, step, record)
        self.schedule.alert = self._keep(record)
        self._last_norm = st.grad_norm
        return None

    def _nonfinite_fault(self, st: StepStats, step: int, record: StepRecord) -> Fault:
        """A non-finite step that is neither the batch's doing nor an AMP overflow: the last update's, when it
        wrote the NaN weights that made the loss NaN too; else the step's own (recorded), localised by replay."""
        # NaN weights written by the last update make the loss NaN too: blame the update
        fault = self._update_fault(step, latest=True) if self.history else None
        if fault is not None:
            return fault
        self._record(record)
        return self._fault(FaultKind.NONFINITE, rng=self._rng, stats=st)

    def _keep(self, record: StepRecord) -> bool:
        """A read step's record kept and given to the warnings' tracker; an alert that begins here marks its
        step (kept in full however long the run). Returns whether an alert is on."""
        self._record(record)
        alert = bool(self.tracker.update(record))
        if alert and not self.schedule.alert:
            self._mark(record.step)
        return alert

    def _take_pending(self, values: Any) -> Fault | None:
        """The unread steps' losses, now read: their records (and warnings), up to the first non-finite one,
        which is a fault the rollback names exactly (`_window_fault`)."""
        pending, self._pending = self._pending, []
        bad = ~np.isfinite(values)
        end = int(bad.argmax()) if bad.any() else len(pending)
        # A record with a loss alone gives the warnings nothing but its learning rate (WarningTracker.update
        # would raise no alert for it): taken together, ~1 us a step less than one `_keep` each, on a read
        # of up to 256 of them
        records = [StepRecord(p[0], value, None, None, None, None, None, p[4], p[1], p[2])
                   for p, value in zip(pending, values[:end].tolist())]
        self.tracker.note_lrs(records)
        self._record(*records)
        return self._window_fault(pending[end][0], pending) if end < len(pending) else None

    def _window_fault(self, bad: int, pending: list[Any]) -> Fault:
        """Step `bad`, unread, had a non-finite loss: its cause is among the updates not yet checked and the
        unread steps up to it. An update fault over that range, naming them unread, so the rollback replays
        it from the ring with every check on and names the first step, and what went first, exactly."""
        from nandoctor.engine.monitors import param_nonfinite

        names = [n for n in param_nonfinite(self.model) if n not in self.monitor.start_nonfinite]
        first, batch_index, epoch = pending[0][:3]
        grad_norm = None
        if self.history and self.history[0][0] <= first:
            first, batch_index, epoch, grad_norm, _ = self.history[0]
        unread = sorted(s for s in self.unread if first <= s <= bad)
        return Fault(FaultKind.UPDATE, first, batch_index, epoch, None, bad_params=names, grad_norm=grad_norm,
                     update_range=(first, bad), unread=unread)

    def _pace(self) -> None:
        """The next read's distance from the measured cost of reads against the step time (`defer_reads`)."""
        self._read_seconds.append(self._t_read)
        del self._read_seconds[:-8]
        plain = self.schedule.plain
        if not plain:
            return
        step_s = min(plain)
        cost = statistics.median(self._read_seconds)
        k = max(1, min(math.ceil(cost / max(_READ_SHARE * step_s, 1e-9)), MAX_UNREAD))
        if self._forced is not None:
            k = self._forced
        ring = self._ring
        if k > ring.every:  # snapshots further apart (fewer of them, and longer replays on a fault), up to
            ring.widen(k)   # the ring's own limit: a read every ring interval cost ~2% of a 0.3 ms step
            k = min(k, ring.every)
        # on the gradients' own spacing, so a read reads them too (unless a test forced the stride): a multiple of
        # it, as far apart as the cost allows. Every `defer_every` steps was a read of all 300 gradients every
        # 4th step on narrow_mlp (~1.3% of its 16 ms step) for norms only the timeline shows: warnings conclude
        # from the grid's (`conclusive`)
        every = self.defer_every
        if every > 1 and k > 1 and self._forced is None:
            k = max(every, k // every * every)
        self.read_every = k

    def flush(self) -> Fault | None:
        """Read the steps still unread (the run ended, the user's code raised, a loss cannot train): their
        records, and the fault the first non-finite one of them is; with none, the weights checked once
        (exactly, on the host) when unread steps updated them since their last check, since a NaN gradient
        on the last unread step shows only in the weights (an update fault the rollback replays)."""
        if self._pending:
            from nandoctor.engine.monitors import read_losses

            fault = self._take_pending(read_losses([p[3] for p in self._pending]))
            if fault is not None:
                return fault
        if self.history and any(s >= self.history[0][0] for s in self.unread):
            return self._update_fault(self._step)
        return None

    def _record(self, *new: StepRecord) -> None:
        """Keep the step's record, in memory that stays bounded over any run length: the last RECENT_STEPS in
        full, every step around where trouble began (`_marked`), and of the older steps an evenly spaced
        sample (those whose step is a multiple of a stride that doubles as the run grows; the steps whose
        gradients were read have a stride of their own, so their norms stay spread over the whole run),
        with per-tensor arrays on at most MAX_ARRAYS of them. Warnings and causes read the recent steps;
        the report's matrices show ~200 columns anyway."""
        records = self.records
        records += new
        if len(records) <= MAX_RECORDS:
            return
        self.records = self._thinned(records)
        self.thinned = True

    def _thinned(self, records: list[StepRecord]) -> list[StepRecord]:
        """`records` once thinned (`_record`): the recent ones and those near the marks whole, a sample of the
        older ones (`_sampled`), in step order, and arrays on at most MAX_ARRAYS of the older ones."""
        older, recent = records[:-RECENT_STEPS], records[-RECENT_STEPS:]
        near = {s + d for s in self._marked() for d in range(-AROUND_MARKS, AROUND_MARKS + 1)}
        pinned = [r for r in older if r.step in near]
        # half the room left, so that the next thinning is RECENT_STEPS or more steps away
        room = max(2, MAX_RECORDS - RECENT_STEPS - len(pinned)) // 2
        kept = sorted(pinned + self._sampled(older, near, room), key=lambda r: r.step)
        _drop_some_arrays(kept, near)
        return kept + recent

    def _sampled(self, older: list[StepRecord], near: set[int], room: int) -> list[StepRecord]:
        """The older records away from the marks that fit in `room`: those on a multiple of a stride, one for
        the read steps (a third of the room) and one for the others, each doubled until its share fits."""
        read = [r for r in older if r.grad_norm is not None and r.step not in near]
        other = [r for r in older if r.grad_norm is None and r.step not in near]
        self._strides[0] = _stride(read, self._strides[0], room // 3)
        self._strides[1] = _stride(other, self._strides[1], room - room // 3)
        return ([r for r in read if r.step % self._strides[0] == 0]
                + [r for r in other if r.step % self._strides[1] == 0])

    def _mark(self, step: int) -> None:
        """An alert began at `step` (the gradient norm ten times its early level, activations near float16's
        limit): its neighbourhood stays in full in the timeline. The first and the latest MAX_MARKS // 2."""
        marks = self.marks
        marks.append(step)
        if len(marks) > MAX_MARKS:
            del marks[MAX_MARKS // 2]

    def _marked(self) -> list[int]:
        """The steps whose neighbourhood is kept in full: alerts, and the steps the warnings will name."""
        t = self.tracker
        steps = set(self.marks)
        if t.explosion is not None and t.explosion.location.step is not None:
            steps.add(t.explosion.location.step)
        steps |= {first for first, _ in t.fp16_hits.values()} | {first for first, _ in t.vanishing.values()}
        ordered = sorted(steps)
        return ordered if len(ordered) <= MAX_MARKS else ordered[:MAX_MARKS // 2] + ordered[-MAX_MARKS // 2:]

    def after_update(self, stepped: bool = True) -> None:
        """The step is over (`stepped`: the optimizer did update): timing, next schedule, parameter check."""
        step = self._step
        schedule = self.schedule
        schedule.record(step, self._stats_step, time.perf_counter() - self._t0, self._t_read)
        self._next_stats = stats = schedule.want(step + 1)
        self._next_read = read = self._reads(step + 1, stats)
        if stepped:
            # Small models: the parameter check after every update. Many-tensor models: on stats steps,
            # since it costs ~7% of a 500-layer MLP's step; a NaN weight shows in the next step's loss
            # anyway, and then an exact check names the update that wrote it (`_update_fault`).
            mon = self.monitor
            mon.after_update(check=stats or (mon.small and read))
            history = self.history
            fields = self._fields if self.keep_update_batches else None
            if fields is not None and len(history) > 1:
                # Only the first and the newest entries' batches are ever named (`_update_fault`). Kept for
                # the entries between, every batch since the last parameter check stays alive: 16 MB
                # batches on a 124-tensor model held 1.9 GB after 200 steps.
                s, b, e, n, _ = history[-1]
                history[-1] = (s, b, e, n, None)
            history.append((step, self._batch_index, self._epoch, self._last_norm, fields))
        self._note_k()

    def _note_k(self) -> None:
        every = self.stats_every
        k = self.schedule.k
        if not every or every[-1] != k:  # only the latest is read: a long run grows no list per step
            every.append(k)
            if len(every) > 64:
                del every[:-1]

    # ---- quiet steps: most steps of a fast loop, without the stages ------------------------------------
    def quiet_until(self, step: int) -> int:
        """The first step from `step` on that needs its stages (a read, stats, an alert, a snapshot of the
        ring), after `after_update` of the step before: a driver may run the steps before it quietly,
        keeping only what `quiet_steps` takes. On a 0.3 ms step the stages' Python of an unread step (~25 us
        in the watch) was most of what detection cost; what they decide does not change until then."""
        schedule = self.schedule
        mon = self.monitor
        if (self._ring is None or self._next_stats is not False or self._next_read or schedule.alert
                or mon.active or mon._hooks):  # (hooks still on: a stats step that was not read)
            return step
        every = self.read_every
        # the step before is over: its batch is not held through the window (issue 22; `quiet_steps` sets the
        # newest quiet step's)
        self._fields = None
        return min(-(-(step + 1) // every) * every, next_grid(step), schedule.next_stats(step),
                   self._ring.next_due(), self.precursors.next_due(step))

    def quiet_steps(self, steps: list[list[Any]], fields: list[Any]) -> None:
        """The bookkeeping of steps a driver ran quietly (before `quiet_until`), in one go, as begin_step,
        after_backward and after_update would have done it one step at a time: each
        `[step, batch_index, epoch, loss (detached), learning rate, start, end]`, `fields` their batches.
        The last one may still be open (`end` None: checked, not yet updated), as after `after_backward`.
        The ring gets their step times, as its `on_batch` would have measured them."""
        if not steps:
            return
        self._ring.note_steps([q[5] for q in steps])
        self._pending += steps
        self.unread.update([q[0] for q in steps])
        last = steps[-1]
        done = steps if last[6] is not None else steps[:-1]
        history = self.history
        if done:
            entries = [(q[0], q[1], q[2], None, None) for q in done]
            if self.keep_update_batches:  # only the first and the newest entries keep their batch
                if len(history) > 1:
                    s, b, e, n, _ = history[-1]
                    history[-1] = (s, b, e, n, None)
                if not history:
                    entries[0] = (*entries[0][:4], fields[0])
                entries[-1] = (*entries[-1][:4], fields[len(done) - 1])
            history += entries
        self.schedule.record_plain([q[6] - q[5] for q in done])
        self._step, self._batch_index, self._epoch, self._fields = last[0], last[1], last[2], fields[-1]
        self._stats_step = self._read = self._read_grads = False
        self._rng, self._next_stats, self._t0, self._t_read, self._last_norm = None, None, last[5], 0.0, None
        if last[6] is not None:  # the last one updated: what after_update decides for the next step
            self._next_stats = stats = self.schedule.want(last[0] + 1)
            self._next_read = read = self._reads(last[0] + 1, stats)
            mon = self.monitor
            mon.after_update(check=stats or (mon.small and read))
        self._note_k()

    def finish(self) -> Fault | None:
        """After the last step: the unread steps read, the last update checked once more (one or two syncs)."""
        fault = self.flush()
        if fault is not None:
            return fault
        if not self.history:
            return None
        total = self.monitor.read_pending_params()
        if total is None or not math.isfinite(total):
            return self._update_fault(self._step + 1)
        return None

    def close(self) -> None:
        """Detach every hook (always, in finally, before any replay)."""
        self.monitor.begin_step(False)
        self.monitor.close()
        self.precursors.close()

    def release_batches(self) -> None:
        """Let go of the batches kept for naming a fault (the step's, the updates'): the driver's loop is over
        and a fault holds its own batch; the replays after the loop read theirs (issue 22). Positions and
        norms stay."""
        self._fields = None
        self.history = [(s, b, e, n, None) for s, b, e, n, _ in self.history]

    def warnings(self, fault: Fault | None) -> list[Any]:
        """The warning findings; an explosion reported at or after a fault is that fault, not a warning."""
        out = self.tracker.findings()
        if fault is not None and fault.kind != FaultKind.CRASH:
            out = [f for f in out if f.code != Code.GRAD_EXPLOSION or (f.location.step or 0) < fault.step]
        return out + self.precursors.findings(fault.step if fault is not None else None, self.tracker.lrs)

    # ---- helpers --------------------------------------------------------------------------------
    def _fault(self, kind: FaultKind, **kw: Any) -> Fault:
        return Fault(kind, self._step, self._batch_index, self._epoch, self._fields, **kw)

    def _update_fault(self, step: int, latest: bool = False) -> Fault | None:
        """Parameters are (maybe) non-finite before `step`: if an exact check confirms it, the update that
        did it is among `history` (the updates since they were last seen finite). With one candidate it
        is that one; else the last (`latest`: the loss just went non-finite, so the weights were still
        fine one step earlier) or the first."""
        from nandoctor.engine.monitors import param_nonfinite

        # entries that were non-finite before training (a NaN row the run trains on) are not an update's doing
        names = [n for n in param_nonfinite(self.model) if n not in self.monitor.start_nonfinite]
        trainable = set(self.monitor.param_names)
        names = [n for n in names if n in trainable] or names
        history = self.history
        if not names or not history:
            return None
        first, batch_index, epoch, grad_norm, fields = history[-1] if latest else history[0]
        last = history[-1][0]
        unread = sorted(s for s in self.unread if first <= s <= last)
        return Fault(FaultKind.UPDATE, first, batch_index, epoch, fields, bad_params=names, grad_norm=grad_norm,
                     update_range=(first, last), unread=unread)


def _stride(records: list[StepRecord], stride: int, room: int) -> int:
    """The smallest power-of-two multiple of `stride` that leaves at most `room` of `records` (by step)."""
    while sum(1 for r in records if r.step % stride == 0) > max(room, 1) and stride < 2**40:
        stride *= 2
    return stride


def _drop_some_arrays(kept: list[StepRecord], near: set[int]) -> None:
    """Per-tensor arrays (per-parameter norms, layer maxima) kept on at most about MAX_ARRAYS of the thinned
    records away from the marks: over that, in place, every other one's go."""
    with_arrays = [i for i, r in enumerate(kept) if r.step not in near
                   and (r.grad_sq is not None or r.act_max is not None)]
    if len(with_arrays) > MAX_ARRAYS:  # every other one's arrays go (the oldest stretch thins most)
        for i in with_arrays[1::2]:
            r = kept[i]
            kept[i] = StepRecord(r.step, r.loss, r.grad_norm, None, None, r.loss_scale, r.skipped, r.lr, r.batch_index,
                                 r.epoch, r.conclusive)


def current_lr(optimizer: Any) -> float | None:
    """The learning rate the next update uses (host-side: a float or the scheduler's last value)."""
    if optimizer is None:
        return None
    lr = getattr(optimizer, "_learning_rate", None)
    if type(lr) is float:  # what Paddle's get_lr returns for a fixed rate, without its call (~1 us a step)
        return lr
    try:
        return float(optimizer.get_lr())
    except Exception:  # noqa: BLE001 - an optimizer without get_lr: no lr in the timeline
        return None
