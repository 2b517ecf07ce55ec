"""nandoctor.watch on a many-tensor model reads the gradients one step in four (inloop/history.py); a NaN
gradient on an unread step is still named as if caught live, against a plain Paddle loop's ground truth.
Where a replay could not stand in for the live check, every step is read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F
import probe_models as pm
import pytest

import nandoctor
from nandoctor.findings import Phase

ZERO_BATCH, ZERO_ROW = 6, 3  # sqrt(0) in the backward of `dist` for this sample of this batch
DATA = {"zero_batch": ZERO_BATCH, "zero_rows": [ZERO_ROW], "batches": 12}


def _step(model: Any, batch: Any) -> Any:
    x, y = (paddle.to_tensor(v) for v in batch)
    return F.cross_entropy(model(x), y.unsqueeze(-1))


def _loop(tmp_path: Path, *, step_fn: Any = _step, on_fault: str = "stop", accumulate: int = 1,
          batches: list | None = None, model: Any = None) -> tuple[Any, list[int]]:
    """The user's own loop on deep_dist; returns the doctor and the steps whose update was applied."""
    model = model or pm.deep_dist()
    opt = paddle.optimizer.Adam(parameters=model.parameters(), learning_rate=0.01)
    stepped: list[int] = []
    with nandoctor.watch(model, opt, step_fn=step_fn, report_dir=tmp_path / "report", on_fault=on_fault,
                         fields=["x", "label"]) as doctor:
        for i, batch in enumerate(batches if batches is not None else pm.loader(**DATA)):
            loss = _step(model, batch)
            (loss / accumulate).backward()
            if not doctor.check(loss, batch):
                if on_fault == "stop":
                    break
            if (i + 1) % accumulate == 0:
                opt.step()
                opt.clear_grad()
                stepped.append(i)
    return doctor, stepped


def test_a_nan_gradient_on_an_unread_step_of_the_users_loop_is_named_as_if_caught_live(tmp_path, no_stats_steps):
    assert pm.deep_dist_first_nonfinite_gradient_step(DATA) == ZERO_BATCH
    doctor, _ = _loop(tmp_path)
    assert ZERO_BATCH in doctor.watcher.unread  # the fault's step really went unread
    rollback = doctor.report.details["rollback"]
    assert rollback["found"] == {"step": ZERO_BATCH, "kind": "grad"}
    assert rollback["replayed_from_step"] <= ZERO_BATCH
    ff = doctor.report.first_fault
    assert (ff.step, ff.phase, ff.layer, ff.op) == (ZERO_BATCH, Phase.BACKWARD, "dist", "sqrt_grad")
    assert ff.sample_indices == [ZERO_ROW]
    assert [f.code.value for f in doctor.report.findings if f.severity.value == "error"] == ["grad.nonfinite"]
    assert doctor.report.timeline[-1].step == ZERO_BATCH  # the step after it trained on NaN weights: not shown
    # the steps run end at the fault, as a live check's would: the updates after it were undone
    assert doctor.report.run["steps_run"] == doctor.step == ZERO_BATCH < rollback["detected_at_step"]
    assert (tmp_path / "report" / "report.json").is_file()


def test_the_same_loop_without_step_fn_reads_every_step_and_names_the_step(tmp_path, no_stats_steps):
    doctor, stepped = _loop(tmp_path, step_fn=None)
    assert not doctor.watcher.unread
    assert "rollback" not in doctor.report.details
    ff = doctor.report.first_fault
    assert (ff.step, ff.phase) == (ZERO_BATCH, Phase.BACKWARD)
    assert stepped == list(range(ZERO_BATCH))  # stopped before the faulty update


def test_skip_step_reads_every_step_so_no_faulty_update_is_applied(tmp_path, no_stats_steps):
    doctor, stepped = _loop(tmp_path, on_fault="skip_step")
    assert not doctor.watcher.unread
    assert doctor.skipped == [ZERO_BATCH]
    assert all(np.isfinite(p.numpy()).all() for p in doctor.model.parameters())


def test_gradient_accumulation_switches_the_spaced_reads_off(tmp_path, no_stats_steps):
    healthy = pm.loader(batches=12)
    doctor, _ = _loop(tmp_path, accumulate=2, batches=healthy)
    assert doctor.report is None
    assert not doctor.watcher.unread and doctor.history.ring is None


def test_a_healthy_deep_loop_reads_on_the_gradients_stride_and_keeps_only_the_batches_a_replay_needs(
        tmp_path, no_stats_steps, monkeypatch):
    import nandoctor.inloop.history as history

    size = 8 * 6 * 4 + 8 * 8  # one batch of pm.loader: x float32 (8, 6) and the int64 labels
    monkeypatch.setattr(history, "KEPT_BYTES", 2 * size * history.MIN_INTERVAL)  # snapshots every <= 16 steps
    doctor, _ = _loop(tmp_path, batches=pm.loader(batches=80))
    assert doctor.report is None
    unread = doctor.watcher.unread
    # a many-tensor model's gradients are read one step in four: a read falls on such a step (a multiple of
    # four, as far apart as the read's cost allows), so it reads the gradients too
    read = set(range(80)) - unread
    assert len(unread) >= 50 and not unread & {0, 1, 2} and all(s % 4 == 0 for s in read - {0, 1, 2})
    ring = doctor.history.ring
    assert ring.every <= history.MIN_INTERVAL and len(ring.ring) == 2
    assert min(doctor.history.kept) == ring.ring[0].step  # nothing older than the older snapshot
    assert len(doctor.history.kept) <= 2 * history.MIN_INTERVAL + 1


def test_large_batches_are_not_kept_and_every_step_is_read(tmp_path, no_stats_steps, monkeypatch):
    import nandoctor.inloop.history as history

    monkeypatch.setattr(history, "KEPT_BYTES", 1024)  # a batch here is 256 bytes: 2 x 16 of them are more
    doctor, _ = _loop(tmp_path, batches=pm.loader(batches=12))
    assert doctor.report is None and not doctor.watcher.unread and doctor.history.ring is None


def test_a_check_without_the_batch_reads_every_step(tmp_path, no_stats_steps):
    model = pm.deep_dist()
    opt = paddle.optimizer.Adam(parameters=model.parameters(), learning_rate=0.01)
    with nandoctor.watch(model, opt, step_fn=_step, report_dir=tmp_path / "report") as doctor:
        for batch in pm.loader(batches=12):
            _step(model, batch).backward()
            assert doctor.check(_step(model, batch))
            opt.step()
            opt.clear_grad()
    assert not doctor.watcher.unread and doctor.history.ring is None


def test_batches_that_grow_past_the_budget_stop_the_spaced_reads(tmp_path, no_stats_steps, monkeypatch):
    import nandoctor.inloop.history as history

    size = 8 * 6 * 4 + 8 * 8
    monkeypatch.setattr(history, "KEPT_BYTES", 2 * size * history.MIN_INTERVAL)
    batches = pm.loader(batches=30)
    batches[10:] = [(np.tile(x, (40, 1)), np.tile(y, 40)) for x, y in batches[10:]]  # 40x the rows from step 10
    doctor, _ = _loop(tmp_path, batches=batches)
    assert doctor.report is None and doctor.history.ring is None and not doctor.history.kept
    assert doctor.watcher.unread and max(doctor.watcher.unread) < 12  # read every step once it stopped


@pytest.mark.parametrize(("room", "kept"), [(2, True), (1, False)])
def test_tensor_batches_are_sized_by_the_memory_they_keep(tmp_path, no_stats_steps, monkeypatch, room, kept):
    """A batch of tensors counts its arrays' bytes: with room for MIN_INTERVAL such batches twice over it is
    kept for a replay, with half that room not (as batches of numpy arrays of the same bytes)."""
    import nandoctor.inloop.history as history

    batches = pm.loader(batches=12)
    size = sum(a.nbytes for a in batches[0])
    monkeypatch.setattr(history, "KEPT_BYTES", room * size * history.MIN_INTERVAL)
    doctor, _ = _loop(tmp_path, batches=[tuple(paddle.to_tensor(a) for a in b) for b in batches])
    assert doctor.report is None and (doctor.history.ring is not None) == kept
    if kept:
        assert doctor.history.kept_bytes == size * len(doctor.history.kept) > 0
