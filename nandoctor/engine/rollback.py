"""Rollback: name the first fault exactly when the gradients of the steps that could have caused it went unread.

With a snapshot ring, the probe reads a many-tensor model's gradients only one step in a few
(`StepWatcher.defer_grads`: on a model of hundreds of tensors, fetching and reducing them is most of the
probe's per-step cost). A NaN gradient on an unread step shows up one step later, as NaN weights written
by that step's update (or the NaN loss they cause), and blaming the update would be wrong: the gradient
was the fault. So the probe restores the newest sound snapshot at or before the candidate steps and
replays them with every check on (`remedy_replay.replay(record=True)`); the first step that fails there,
and what failed (the loss, a gradient or the update itself), becomes the fault, localised as if it had
been caught live.
"""

from __future__ import annotations

import math
import time
from typing import Any

from nandoctor.engine.monitors import StepStats
from nandoctor.engine.replay import Change, replay
from nandoctor.engine.snapshots import SnapshotRing
from nandoctor.engine.watcher import Fault, FaultKind, StepRecord
from nandoctor.tensors.finite import harmful_fields

ROLLBACK_SECONDS = 300.0  # a replay slower than this keeps the update fault (with a note) rather than hang


def needs_rollback(fault: Fault | None, ring: SnapshotRing | None) -> bool:
    """An update fault whose candidate steps include a step with unread gradients, and a ring to replay from."""
    return (fault is not None and fault.kind == FaultKind.UPDATE and bool(fault.unread) and ring is not None
            and ring.disabled is None and fault.update_range is not None)


def rollback(res: Any, workload: Any, optimizer: Any, ring: SnapshotRing) -> dict[str, Any]:
    """Replace `res.fault` (and trim `res.records`) by the first fault the replay finds; returns what the
    report's details say about it. The weights are left as the replay left them: before the failing
    step's update for a loss or gradient fault (what localisation replays), after it for an update one."""
    fault = res.fault
    first, last = fault.update_range
    snap = ring.latest(first)
    info: dict[str, Any] = {"detected_at_step": res.start_step + res.steps_run, "unread_steps": fault.unread,
                            "candidate_steps": [first, last]}
    if snap is None:
        info["note"] = "no sound snapshot before the candidate steps: the update fault stands"
        return info
    t0 = time.perf_counter()
    try:
        rep = replay(workload, optimizer, ring, snap, last + 1, Change(), t0 + ROLLBACK_SECONDS, record=True)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the partial report keeps the update fault as it stands
        res.interrupted = True
        info["note"] = "interrupted during the replay: the update fault stands"
        return info
    info.update(replayed_from_step=snap.step, steps_replayed=rep.steps_run + (rep.failed is not None),
                seconds=round(time.perf_counter() - t0, 3))
    failed = rep.failed
    if failed is None:
        why = rep.error or ("the replay ran out of time" if rep.cut else "the replay stayed finite")
        info["note"] = f"{why}: the update fault stands"
        return info
    info["found"] = {"step": failed.step, "kind": failed.kind}
    if failed.kind == "update":
        res.fault = Fault(FaultKind.UPDATE, failed.step, failed.batch_index, failed.epoch, failed.fields,
                          bad_params=failed.params or fault.bad_params, update_range=(failed.step, failed.step))
        res.records = [r for r in res.records if r.step <= failed.step]
        _steps_to_fault(res)
        return info
    bad_data = harmful_fields(failed.fields)
    if bad_data:  # a NaN in that step's batch made its gradients non-finite (its loss stayed finite)
        res.fault = Fault(FaultKind.DATA, failed.step, failed.batch_index, failed.epoch, failed.fields,
                          bad_fields=bad_data)
        res.records = [r for r in res.records if r.step < failed.step]
        _steps_to_fault(res)
        return info
    grad_norm = math.nan if failed.kind == "grad" else None
    stats = StepStats(failed.loss, None, grad_norm, None, None)
    res.fault = Fault(FaultKind.NONFINITE, failed.step, failed.batch_index, failed.epoch, failed.fields,
                      rng=failed.rng, stats=stats)
    res.records = [r for r in res.records if r.step < failed.step]
    res.records.append(StepRecord(failed.step, failed.loss, grad_norm, None, None))
    _steps_to_fault(res)
    return info


def _steps_to_fault(res: Any) -> None:
    """`res.steps_run` ends at the fault the replay named, as when a live read finds it: the steps before a
    loss, gradient or data fault, through an update fault's own step. The steps after it that ran unread
    until the read found the NaN are undone (`detected_at_step` says where that read was); counted, the report
    said "132 steps run" beside a fault and a timeline that end at step 130."""
    fault = res.fault
    res.steps_run = min(res.steps_run, fault.step + (fault.kind == FaultKind.UPDATE) - res.start_step)


def read_batch(workload: Any, ring: SnapshotRing | None, epoch: int, batch_index: int) -> dict[str, Any] | None:
    """The named fields of the batch the loop trained on at (epoch, batch_index), read back through the probe's
    batch tape (a kept batch, or a fresh loader made with that epoch's RNG and checked against the kept ones):
    the loop's watcher keeps the positions of the updates an update fault may name, not their batches (issue
    22). None when it cannot be read the same way (no tape, the epoch's RNG let go, a stream, the loader raised);
    the training's RNG is as it was."""
    from nandoctor.engine.batch_tape import END
    from nandoctor.engine.snapshots import RngState

    tape = ring.batches if ring is not None else None
    if tape is None or ring.disabled is not None or epoch not in ring.epoch_rng:
        return None
    saved = RngState.now()
    batches = tape.read(epoch, batch_index, ring.epoch_rng)
    try:
        e, b, batch = next(batches, (None, None, END))
    except Exception:  # noqa: BLE001 - the user's loader raised on a re-read: the bundle goes without the batch
        return None
    finally:
        batches.close()
        saved.restore()
    if batch is END or (e, b) != (epoch, batch_index) or tape.stream is not None:
        return None
    return workload.layout.fields(batch, batch_index)
