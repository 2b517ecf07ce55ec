"""One remedy replay: restore a snapshot, apply the change, train on and watch for NaN/Inf.

The replay drives the user's own loader, loss, backward and optimizer like the probe's loop, but from a
snapshot's step and loader position and with one change applied (a clip threshold, a learning-rate
factor or warmup, samples dropped from one batch, an op guard, re-initialised weights). It checks the
loss and the gradient norm every step (two host syncs: replays are not the probe's hot path) and stops
at the first non-finite value, at `end_step` or at its deadline. The optimizer's clip and learning rate
are put back afterwards; the caller restores the weights.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nandoctor.engine.batch_source import END, BatchSource
from nandoctor.engine.batch_tape import BatchTape
from nandoctor.engine.model_changes import ChangeNotMade, InModel, QKProjection, changed_model
from nandoctor.engine.op_guards import Guard, guarded
from nandoctor.engine.op_watch import OpWatch, clamped_output, watching
from nandoctor.engine.snapshots import Snapshot, SnapshotRing, restore
from nandoctor.tensors.sizes import subset


@dataclass
class Change:
    """What a remedy changes for its replay (all optional; the default is the unchanged run)."""

    lr_scale: float = 1.0
    warmup_steps: int = 0  # the learning rate ramps linearly from 0 over steps 0..warmup_steps-1
    # the rate a warmup ramps to when it replaces the run's own (a longer warmup to the same peak: the rate at step
    # s < warmup_steps is warmup_peak * s / warmup_steps, the run's own after); None: the run's rate times the ramp
    warmup_peak: float | None = None
    clip_norm: float | None = None
    drop: tuple[int, int, list[int]] | None = None  # (epoch, batch_index, rows) left out of that batch
    drop_nonfinite: bool = False  # leave out every sample holding NaN/Inf, in every batch (a loader filter)
    drop_records: frozenset[int] = frozenset()  # dataset indices left out wherever the sampler yields them
    drop_fingerprints: frozenset[str] = frozenset()  # with no sampler: records named by their values' hash
    guard: Guard | None = None
    source: str | None = None  # where the guarded op was created ("model.py:13 in forward")
    guard_scope: str = "line"  # op_guards.guarded: "line", "within" (the line's call) or "any"
    guard_limit: float | None = None  # the clamp's bound when searched (exp: 60, then tighter), else the rule's
    reinit_rows: dict[str, list[int]] = field(default_factory=dict)  # parameter -> rows drawn afresh (NaN rows)
    reinit: dict[str, float] = field(default_factory=dict)  # parameter name -> std to draw it from
    clamp_output: tuple[str, float] | None = None  # (layer, bound): its output clipped where it is made
    z_loss: tuple[str, float] | None = None  # (head layer, coefficient): loss + coef * mean(logsumexp(out)^2)
    qk_norm: tuple[QKProjection, ...] = ()  # the q/k projections whose outputs are layer-normed per head
    # The learning-rate, clip, z-loss and qk-norm changes apply from this step on; the steps before it replay
    # the run as it was.
    # A remedy meant to start where the growth began starts exactly there, from whichever snapshot the ring
    # happened to hold before it (their spacing follows measured timings: the same report on every run)
    from_step: int | None = None


@dataclass
class FailedStep:
    """The step a replay stopped at, as the probe's loop would have seen it (kept with `record=True`):
    what went non-finite first (`loss`, `grad` or `update`), the batch and the RNG state before its forward."""

    kind: str
    step: int
    epoch: int
    batch_index: int
    fields: dict[str, Any]
    rng: Any
    loss: float
    params: list[str] = field(default_factory=list)  # update: the parameters it turned non-finite


@dataclass
class Replay:
    start_step: int
    steps_run: int = 0
    finite: bool = True
    failed_at: int | None = None
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    cut: bool = False  # stopped by the deadline before end_step
    error: str | None = None  # the user's code raised during the replay
    guard_calls: int | None = None
    guard_sites: dict[str, int] = field(default_factory=dict)  # line that made the op -> firings that mattered
    still_nonfinite: dict[str, int] = field(default_factory=dict)  # parameter -> NaN/Inf values at the end
    ended: bool = False  # the data ran out (a loader that cannot be re-made)
    dropped: list[tuple[int, int | None, int, list[int]]] = field(default_factory=list)  # (epoch, batch, step, rows)
    dropped_records: list[list[Any]] = field(default_factory=list)  # the records (or fingerprints) of each drop
    failed: FailedStep | None = None  # with record=True: the step it stopped at
    data_note: str | None = None  # why the replay's data ended early (a loader that cannot be re-read the same way)
    not_applicable: str | None = None  # the change cannot be made on this optimizer (in `.error` too), and why
    observed: list[tuple[int, float]] = field(default_factory=list)  # (step, largest input) of a watched op
    # a watched op's other lines whose input overflowed too -> (the largest input, the layer it came out of)
    overflows: dict[str, tuple[float, str | None]] = field(default_factory=dict)
    source_layer: str | None = None  # the layer a watched op's overflowing input came out of
    clamp_hits: int = 0  # forwards where `clamp_output` changed a value
    qk_hits: int = 0  # projection outputs `qk_norm` normalised
    # (step, fingerprint) of the batch the training read there (the fault's), to check the replay reads it too
    expect: tuple[int, str] | None = None
    other_data_at: int | None = None  # the step where the replay read another batch than the training did
    # with `sample` (a precursor monitor): its series, (quantity, layer) -> [(step, value)], on the steps it sampled
    precursors: dict[tuple[str, str], list[tuple[int, float]]] = field(default_factory=dict)


class NotApplicable(Exception):
    """The replay cannot make this change (or drive this optimizer): not the user's error, and not a verdict."""


def replay(workload: Any, optimizer: Any, ring: SnapshotRing, snap: Snapshot, end_step: int, change: Change,
           deadline: float, record: bool = False, watch: tuple[Guard, str | None, int] | None = None,
           expect: tuple[int, str] | None = None, sample: Any | None = None) -> Replay:
    """Train from `snap` to `end_step` with `change`; never raises for the user's errors (they go in `.error`).
    `record`: keep the failing step's batch and RNG state (`.failed`) and check the weights after every
    update too, so the step that went non-finite first is named exactly (the rollback's replay). `watch`
    (a guard's op, source line and the fault's step): record each step's largest input to that op at that
    line, and from the fault's step its other calls that overflow and the layer the value comes from
    (op_watch.py), changing nothing. `expect`
    (step, fingerprint): the batch the training read at that step, checked (`.other_data_at`). `sample`: a
    precursor monitor (engine/precursors.py) opened around each step's forward, its series in `.precursors`."""
    t0 = time.perf_counter()
    out = Replay(snap.step, expect=expect)
    now = [snap.step]  # the step running, for what `watch` records
    start = change.from_step if change.from_step is not None and change.from_step > snap.step else None
    restore(snap, workload.model, optimizer)
    _reinit(workload.model, change.reinit)
    _reinit_rows(workload.model, change.reinit_rows)
    seen, clamped, qk_hits = OpWatch(), [0], [0]
    try:
        def changing() -> bool:  # the change's own steps (Change.from_step), for the guard and the clamp
            return start is None or now[0] >= start

        with _optimizer_changed(optimizer, change, start) as set_factor, _guard(change, changing) as hits, \
                _watched(workload.model, watch, now, seen), \
                clamped_output(workload.model, change.clamp_output, clamped, changing), \
                changed_model(workload.model, change.z_loss, change.qk_norm, start) as in_model:
            qk_hits = in_model.qk_hits
            _run(workload, optimizer, ring, snap, end_step, change, deadline, (set_factor, in_model, sample), out,
                 record, now)
            if hits is not None:
                out.guard_calls, out.guard_sites = hits["calls"], dict(hits["sites"])
        out.still_nonfinite = _held(workload.model)
    except KeyboardInterrupt:
        raise
    except (NotApplicable, ChangeNotMade) as exc:
        out.not_applicable = out.error = str(exc)
        out.finite = False
    except Exception as exc:  # noqa: BLE001 - the user's code (or a subset it cannot take) raised
        out.error = f"{type(exc).__name__}: {exc}"[:300]
        out.finite = False
        out.failed_at = snap.step + out.steps_run
    finally:
        with contextlib.suppress(Exception):
            optimizer.clear_grad()
        out.precursors = _sampled(sample)
    out.observed, out.overflows, out.source_layer = seen.observed, seen.others, seen.layer
    out.clamp_hits, out.qk_hits = clamped[0], qk_hits[0]
    out.seconds = time.perf_counter() - t0
    if start is not None:
        _from_change(out, start)
    return out


def _from_change(out: Replay, start: int) -> None:
    """The replay as if it had begun at `start` (Change.from_step): the unchanged steps before it (the run's
    own, replayed to get there) are not the remedy's, so its losses, steps and start are counted from there."""
    before = min(start - out.start_step, out.steps_run)
    if out.failed_at is not None and out.failed_at < start:
        return  # the run as it was failed before the change began: reported as it happened
    out.losses = out.losses[before:]
    out.steps_run -= before
    out.start_step = start


def _run(w: Any, opt: Any, ring: SnapshotRing, snap: Snapshot, end_step: int, change: Change, deadline: float,
         changed: tuple[Any, InModel, Any], out: Replay, record: bool, now: list[int]) -> None:
    """Train from `snap` to `end_step` with `change` into `out`; `changed`: the optimizer's and the model's
    changes, set before each step, and the precursor monitor opened around each forward (None: none); `now[0]`:
    the step running."""
    import paddle

    from nandoctor.engine.step import StepEngine

    # the loop's own step (engine/loop.py); a fresh GradScaler: a snapshot does not hold the live loss scale
    engine = StepEngine.for_workload(w, opt, device=str(paddle.get_device())).fresh_scaler()
    named = [(n, p) for n, p in w.model.named_parameters() if not p.stop_gradient]
    params = [p for _, p in named]
    before = _nonfinite_counts(params)  # NaN the weights already held (a corrupt checkpoint) is not new

    def late(_step: int) -> bool:  # checked before each batch is drawn
        out.cut = time.perf_counter() > deadline
        return out.cut

    feed = _batches(w, ring, snap, end_step, engine.end_epoch, late)
    set_factor, in_model, sample = changed
    opt.clear_grad()
    try:
        for step, epoch, batch_index, batch in feed:
            now[0] = step
            records = ring.batches.records.get((epoch, batch_index)) if ring.batches is not None else None
            fields = w.layout.fields(batch, batch_index)
            if out.expect is not None and step == out.expect[0]:
                _check_same(out, ring, (epoch, batch_index), batch, fields)
            fields = _changed_fields(fields, change, epoch, batch_index, step, out, records)
            set_factor(step)
            in_model.begin(step)
            here = (step, epoch, batch_index, fields, paddle.get_rng_state()) if record else None
            loss = _forward(engine, fields, sample, step)
            value = float(loss.detach().astype("float32").reshape([]))  # the user's own loss, without a z-loss
            if not math.isfinite(value):
                _failed(out, step, "loss", here, value)
                return
            engine.backward(in_model.loss(loss))
            grads = [p.grad for p in params if p.grad is not None]
            if grads and _any_nonfinite(grads):
                _failed(out, step, "grad", here, value)  # (not a norm: a finite 1e24 gradient squares to inf)
                return
            out.losses.append(value)
            if engine.updates_after(step):
                engine.update()
                if record and _update_failed(out, step, here, value, named, before):
                    return
            out.steps_run += 1
            # the step's batch (a subset: a copy), its loss and gradients let go before the next batch is drawn:
            # a plain loop holds one batch then, and a 100 MB batch or a large model's gradients count
            batch = fields = here = loss = grads = engine.fields = None
        _data_ended(out, feed, ring)
        after = _nonfinite_counts(params)
        if out.steps_run and any(n > b for n, b in zip(after, before)):
            out.finite, out.failed_at = False, feed.step  # the last update wrote (more) NaN/Inf
    finally:
        feed.close()  # a DataLoader's worker processes end with the replay


def _forward(engine: Any, fields: dict[str, Any], sample: Any | None, step: int) -> Any:
    """The step's loss, its forward sampled by the precursor monitor when there is one (its hooks off before the
    backward)."""
    if sample is None:
        return engine.loss(fields)
    sample.begin(step)
    loss = engine.loss(fields)
    sample.end()
    return loss


def _sampled(sample: Any | None) -> dict[tuple[str, str], list[tuple[int, float]]]:
    """The monitor's series, its hooks off (whatever stopped the replay): {} without one, or if reading failed."""
    if sample is None:
        return {}
    try:
        sample.close()
        sample.read()
    except Exception:  # noqa: BLE001 - ours: a replay without its samples is judged without them
        return {}
    return sample.series


def _check_same(out: Replay, ring: SnapshotRing, pos: tuple[int, int], batch: Any, fields: dict[str, Any]) -> None:
    """Whether the replay reads, at the expected step, the batch the training read there: a loader re-read (a
    stream, an unseeded order) may give other data, and a replay of other data says nothing about the
    training's fault. The training's own kept batch needs no check; another is hashed (once per replay)."""
    if ring.batches is not None and ring.batches.read_by_training(pos, batch):
        return
    from nandoctor.tensors.fingerprint import batch_fingerprint

    seen = batch_fingerprint(fields)
    if seen is not None and out.expect is not None and seen != out.expect[1]:
        out.other_data_at = out.expect[0]


def _data_ended(out: Replay, feed: BatchSource, ring: SnapshotRing) -> None:
    """The data ran out before `end_step`: an epoch without a batch, or the kept batches ended and the loader
    cannot give the same ones again (the tape says why)."""
    if feed.ended:
        out.ended = True
        out.data_note = getattr(ring.batches, "stream", None) if feed.exhausted else None


def _update_failed(out: Replay, step: int, here: tuple[Any, ...] | None, loss: float,
                   named: list[tuple[str, Any]], before: list[int]) -> bool:
    """With `record`: whether the update turned weights (more) non-finite; the replay stops there, naming them."""
    counts = _nonfinite_counts([p for _, p in named])
    if not any(n > b for n, b in zip(counts, before)):
        return False
    _failed(out, step, "update", here, loss, [n for (n, _), c, b in zip(named, counts, before) if c > b])
    return True


def _failed(out: Replay, step: int, kind: str, here: tuple[Any, ...] | None, loss: float,
            params: list[str] | None = None) -> None:
    """The replay stops at `step`; `here` (step, epoch, batch, fields, RNG state) when it records the failure."""
    out.finite, out.failed_at = False, step
    if here is not None:
        out.failed = FailedStep(kind, *here, loss, params or [])


def _changed_fields(fields: dict[str, Any], change: Change, epoch: int, batch_index: int, step: int,
                    out: Replay, records: list[int] | None = None) -> dict[str, Any]:
    """The batch as the remedy sees it: the offending records left out wherever they come (by dataset
    index, or by their values' fingerprint where no sampler names them), the offending samples left out of
    their batch, or every sample holding NaN/Inf left out of every batch (a loader filter); what was dropped
    is recorded."""
    ids = _record_ids(fields, change, records)
    if ids is not None:
        wanted = change.drop_records if change.drop_records and records is not None else change.drop_fingerprints
        drop = {i for i, r in enumerate(ids) if r in wanted}
        if drop:
            fields = subset(fields, [i for i in range(_rows(fields)) if i not in drop])
            out.dropped.append((epoch, batch_index, step, sorted(drop)))
            out.dropped_records.append(sorted(ids[i] for i in drop))
    elif change.drop is not None and (epoch, batch_index) == change.drop[:2]:
        drop = set(change.drop[2])
        fields = subset(fields, [i for i in range(_rows(fields)) if i not in drop])
        out.dropped.append((epoch, batch_index, step, sorted(drop)))
    if change.drop_nonfinite:
        bad = _nonfinite_rows(fields)
        if bad:
            fields = subset(fields, [i for i in range(_rows(fields)) if i not in bad])
            out.dropped.append((epoch, batch_index, step, sorted(bad)))
    return fields


def _record_ids(fields: dict[str, Any], change: Change, records: list[int] | None) -> list[Any] | None:
    """What names each sample of the batch for a records remedy: the sampler's dataset indices, else (no
    sampler) the fingerprint of its values; None for any other change."""
    if change.drop_records and records is not None:
        return records
    if change.drop_fingerprints:
        from nandoctor.tensors.fingerprint import row_fingerprints

        return row_fingerprints(fields)
    return None


def _batches(w: Any, ring: SnapshotRing, snap: Snapshot, end_step: int, end_epoch: Any, late: Any) -> BatchSource:
    """The replay's batches from the snapshot's position to `end_step`: the batches the probe kept
    (batch_tape.py) where there are any, else a fresh loader at the position. No boundary: the replay's
    caller makes any exception the replay's error."""
    tape = ring.batches
    if tape is not None:
        return BatchSource(end_step, start=snap.step, positions=_kept(tape, ring, snap), end_epoch=end_epoch,
                           before_step=late)
    return BatchSource(end_step, start=snap.step, make_loader=w.make_loader, resume=lambda: _loader_at(w, ring, snap),
                       user=False, end_epoch=end_epoch, before_step=late)


def _kept(tape: BatchTape, ring: SnapshotRing, snap: Snapshot) -> Generator[tuple[int, int, Any], None, None]:
    """The tape's (epoch, batch_index, batch) from the snapshot's position, the step's RNG restored first."""
    snap.rng.restore()
    yield from tape.read(snap.epoch, snap.batch_index, ring.epoch_rng)


def _loader_at(w: Any, ring: SnapshotRing, snap: Snapshot) -> tuple[int, int, Iterator[Any]]:
    """A fresh loader at the snapshot's position: the epoch's RNG restored before it is made (its shuffle
    order), the batches before the position skipped, then the step's own RNG restored."""
    rng = ring.epoch_rng.get(snap.epoch)
    if rng is not None:
        rng.restore()
    it = iter(w.make_loader())
    for _ in range(snap.batch_index):
        if next(it, END) is END:
            break
    snap.rng.restore()
    return snap.epoch, snap.batch_index, it


@contextlib.contextmanager
def _optimizer_changed(opt: Any, change: Change, start: int | None = None) -> Iterator[Any]:
    """The clip threshold and a learning-rate factor for the replay; both put back on exit. Yields
    `set_factor(step)`, to call before each step (warmup ramps with the step). `start`: neither applies
    before this step."""
    import paddle

    from nandoctor.workload.schedulers import lr_scheduler

    name = type(opt).__name__
    sched = lr_scheduler(opt)
    changes_lr = change.lr_scale != 1.0 or bool(change.warmup_steps)
    if changes_lr and sched is None and not (callable(getattr(opt, "get_lr", None))
                                             and callable(getattr(opt, "set_lr", None))):
        raise NotApplicable(f"the optimizer ({name}) has no get_lr/set_lr to change its learning rate through (not "
                            "a paddle.optimizer.Optimizer): change the rate in your own optimizer")
    missing = object()
    clip = getattr(opt, "_grad_clip", missing)
    if change.clip_norm is not None and clip is missing:
        raise NotApplicable(f"the optimizer ({name}) has no gradient clip to set (not a paddle.optimizer.Optimizer): "
                            "clip in your own step, e.g. paddle.nn.ClipGradByGlobalNorm on the (param, grad) pairs")
    base = float(opt.get_lr()) if changes_lr and sched is None else None
    if change.clip_norm is not None and start is None:
        opt._grad_clip = paddle.nn.ClipGradByGlobalNorm(float(change.clip_norm))

    def factor(step: int) -> float:
        if start is not None and step < start:
            return 1.0
        f = change.lr_scale
        if change.warmup_steps and step < change.warmup_steps:  # as paddle.optimizer.lr.LinearWarmup from 0
            f *= step / change.warmup_steps
        return f

    def set_factor(step: int) -> None:
        if start is not None and step >= start and change.clip_norm is not None and opt._grad_clip is clip:
            opt._grad_clip = paddle.nn.ClipGradByGlobalNorm(float(change.clip_norm))
        if change.warmup_peak is not None and step < change.warmup_steps:  # a warmup in place of the run's own
            _set_rate(opt, sched, change.warmup_peak * step / change.warmup_steps)
            return
        f = 1.0 if change.warmup_peak is not None else factor(step)
        if sched is None:
            if base is not None:
                opt.set_lr(base * f)
        elif f != 1.0:  # the scheduler's own value for this step, scaled (its next step recomputes it)
            sched.last_lr = float(sched.get_lr()) * f

    try:
        yield set_factor
    finally:
        if clip is not missing:
            opt._grad_clip = clip
        if base is not None:
            opt.set_lr(base)


def _set_rate(opt: Any, sched: Any, rate: float) -> None:
    """This step's learning rate set outright: the scheduler's value (its next step recomputes it), else the
    optimizer's own."""
    if sched is None:
        opt.set_lr(rate)
    else:
        sched.last_lr = float(rate)


@contextlib.contextmanager
def _guard(change: Change, active: Callable[[], bool]) -> Iterator[dict[str, int] | None]:
    if change.guard is None:
        yield None
        return
    with guarded(change.guard, change.source, change.guard_scope, change.guard_limit, active=active) as hits:
        yield hits


@contextlib.contextmanager
def _watched(model: Any, watch: tuple[Guard, str | None, int] | None, now: list[int],
             seen: OpWatch) -> Iterator[None]:
    if watch is None:
        yield
        return
    with watching(model, watch[0], watch[1], now, seen, from_step=watch[2]):
        yield


def _reinit(model: Any, stds: dict[str, float]) -> None:
    """Draw the named weights afresh from N(0, std) (a seeded generator of our own, not the user's RNG)."""
    if not stds:
        return
    gen = np.random.default_rng(0)
    for name, p in model.named_parameters():
        if name in stds:
            arr = gen.normal(0.0, stds[name], size=[int(d) for d in p.shape])
            p.set_value(arr.astype(str(p.dtype).replace("paddle.", "")))


def _any_nonfinite(tensors: list[Any]) -> bool:
    """One finiteness value per tensor, reduced per shape (grouped.py): a replay of a many-tensor model
    checks every step's gradients, and two ops per tensor cost ~600 ops a step on 300 tensors."""
    import paddle

    from nandoctor.tensors.grouped import all_finite_rows, per_tensor

    with paddle.no_grad():
        return bool((per_tensor(tensors, all_finite_rows) < 0.5).any())


def _nonfinite_counts(params: list[Any]) -> list[int]:
    """How many NaN/Inf values each tensor holds. One finiteness flag per tensor on the device (one sync; a
    boolean temporary a quarter of one tensor at a time), and a count only for a tensor that has any, read
    a chunk at a time: counting on the device casts to int64, a temporary twice each float32 tensor's size
    (+128 MB for a 4096 x 4096 weight, at the start and end of every replay)."""
    import paddle

    from nandoctor.tensors.finite import nonfinite_count

    if not params:
        return []
    with paddle.no_grad():
        finite = paddle.stack([paddle.isfinite(p).all() for p in params]).numpy()
    return [0 if ok else nonfinite_count(p) for p, ok in zip(params, finite)]


def _held(model: Any) -> dict[str, int]:
    """Trainable weights still holding NaN/Inf after the replay -> how many values."""
    named = [(n, p) for n, p in model.named_parameters() if not p.stop_gradient]
    return {n: c for (n, _), c in zip(named, _nonfinite_counts([p for _, p in named])) if c}


def _reinit_rows(model: Any, rows: dict[str, list[int]]) -> None:
    """Draw the named rows of a weight afresh from N(mean, std) of its finite values (what a practitioner
    does for a NaN row of an embedding table); a seeded generator of our own, not the user's RNG."""
    if not rows:
        return
    gen = np.random.default_rng(0)
    for name, p in model.named_parameters():
        if name in rows:
            arr = p.numpy().copy()
            good = arr[np.isfinite(arr)]
            mean, std = (float(good.mean()), float(good.std())) if good.size else (0.0, 0.02)
            idx = np.asarray(rows[name], dtype=np.int64)
            arr[idx] = gen.normal(mean, std or 0.02, size=arr[idx].shape).astype(arr.dtype)
            p.set_value(arr)


def _nonfinite_rows(fields: dict[str, Any]) -> set[int]:
    """The samples a loader filter would drop: those holding a harmful NaN/Inf (a mask's -inf is kept).
    Each field is read a chunk of rows at a time (batches.harmful_rows), never copied whole."""
    from nandoctor.tensors.convert import to_numpy
    from nandoctor.tensors.finite import harmful_rows

    n = _rows(fields)
    arrays = [v if hasattr(v, "shape") else to_numpy(v) for v in fields.values()]  # (a list: as numpy)
    return {i for arr in arrays if arr is not None and len(arr.shape) > 0 and int(arr.shape[0]) == n
            for i in harmful_rows(arr)}


def _rows(fields: dict[str, Any]) -> int:
    from nandoctor.tensors.sizes import batch_size

    return batch_size(fields) or 0

