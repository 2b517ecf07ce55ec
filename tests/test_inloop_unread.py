"""nandoctor.watch leaves most steps unread where it can roll back (issue 23): past the first READ_ALL_STEPS
steps, `check()` returns True without reading the step's loss, which waits on the device for a later read.
A fault found there is traced back to its exact first step, phase, layer, op and samples: the same answer
as `nandoctor probe` and as a plain Paddle loop with the tensor checker; and the user's model and
optimizer are left as docs/ways-in.md promises (as they were before the faulty step's update)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F
import probe_models as pm
import pytest
from inloop_helpers import fault_of, first_nonfinite_step
from probe_spec import probe
from run_truth import first_backward_fault

import nandoctor
from nandoctor.engine.watcher import READ_ALL_STEPS
from nandoctor.findings import Phase

FAULT_STEP, FAULT_ROW = READ_ALL_STEPS + 13, 2  # unread: reads fall on multiples of READ_EVERY from then on
READ_EVERY = 16
BATCHES = FAULT_STEP + 20
ZERO = {"zero_batch": FAULT_STEP, "zero_rows": [FAULT_ROW], "batches": BATCHES}  # sqrt(0) in `dist`'s backward


@pytest.fixture
def reads_spaced(monkeypatch, no_stats_steps):
    """Reads and snapshots every READ_EVERY steps past READ_ALL_STEPS, whatever the machine's speed (the
    measured costs would space them out anyway; pinned so that the fault's step is surely unread)."""
    from nandoctor.engine import snapshots, watcher

    monkeypatch.setattr(watcher, "_READ_SHARE", 1e-9)
    monkeypatch.setattr(watcher, "MAX_UNREAD", READ_EVERY)  # (else the reads would widen the ring's interval)
    monkeypatch.setattr(snapshots.SnapshotRing, "_interval", lambda self, took: READ_EVERY)


def _step(model: Any, batch: Any) -> Any:
    x, y = (paddle.to_tensor(v) for v in batch)
    return F.cross_entropy(model(x), y.unsqueeze(-1))


def _loop(tmp_path: Path, batches: list, *, model: Any = None, on_fault: str = "stop",
          raise_at: int | None = None) -> tuple[Any, dict[int, bool], Any, Any]:
    """The user's loop as docs/ways-in.md shows it (Adam, lr 0.01, as the probe's spec); returns the doctor,
    each step's check() answer, the model and the optimizer."""
    model = model or pm.classifier("dist")
    opt = paddle.optimizer.Adam(learning_rate=0.01, parameters=model.parameters())
    answers: dict[int, bool] = {}
    with nandoctor.watch(model, opt, step_fn=_step, report_dir=tmp_path / "report", on_fault=on_fault,
                         fields=["x", "label"]) as doctor:
        for i, batch in enumerate(batches):
            if i == raise_at:
                raise KeyError("the user's loop broke")
            loss = _step(model, batch)
            loss.backward()
            answers[i] = doctor.check(loss, batch)
            if not answers[i] and on_fault == "stop":
                break
            opt.step()
            opt.clear_grad()
    return doctor, answers, model, opt


def _plain_until(step: int, batches: list) -> tuple[Any, Any]:
    """A plain Paddle loop trained on the first `step` batches: the state right before step `step`."""
    model = pm.classifier("dist")
    opt = paddle.optimizer.Adam(learning_rate=0.01, parameters=model.parameters())
    for batch in batches[:step]:
        _step(model, batch).backward()
        opt.step()
        opt.clear_grad()
    return model, opt


def _truth(batches: list, capfd: Any) -> dict[str, Any]:
    """The first fault as Paddle's tensor checker finds it in a plain loop (tests/run_truth.py)."""
    model = pm.classifier("dist")
    opt = paddle.optimizer.Adam(learning_rate=0.01, parameters=model.parameters())

    def phases() -> Any:
        for step, (x, y) in enumerate(batches):
            def whole(x=x, y=y) -> Any:
                return _step(model, (x, y))

            def row(r: int, x=x, y=y) -> Any:
                return _step(model, (x[r:r + 1], y[r:r + 1]))

            yield step, model, opt, whole, row, len(x)

    return first_backward_fault(phases(), Path(pm.__file__), capfd, opt.clear_grad)[1]


def test_a_nan_on_an_unread_step_is_named_as_the_probe_and_the_tensor_checker_name_it(tmp_path, reads_spaced,
                                                                                       capfd):
    batches = pm.loader(**ZERO)
    assert first_nonfinite_step(pm.classifier("dist"), batches, grads=True) == FAULT_STEP
    doctor, answers, _, _ = _loop(tmp_path, batches)
    # the contract of check(): True on the unread faulty step (its loss was never read there), False at the
    # read that found the NaN, a few steps later
    assert answers[FAULT_STEP] is True and answers[max(answers)] is False and max(answers) > FAULT_STEP
    assert max(answers) % READ_EVERY == 0
    rollback = doctor.report.details["rollback"]
    assert FAULT_STEP in rollback["unread_steps"] and rollback["found"] == {"step": FAULT_STEP, "kind": "grad"}
    watched = fault_of(doctor.report)
    assert (watched["step"], watched["phase"], watched["layer"], watched["op"], watched["sample_indices"]) == (
        FAULT_STEP, "backward", "dist", "sqrt_grad", [FAULT_ROW])
    (tmp_path / "probe").mkdir()
    probed = fault_of(probe(tmp_path / "probe", model="classifier", model_args={"kind": "dist"}, data_args=ZERO,
                            steps=BATCHES))
    assert watched == probed
    truth = _truth(batches, capfd)
    assert {k: watched[k] for k in truth} == truth
    assert [p.step for p in doctor.report.timeline] == list(range(FAULT_STEP + 1))  # every loss, read late
    assert (tmp_path / "report" / "report.json").is_file()


def test_the_users_model_and_optimizer_are_left_as_before_the_faulty_update(tmp_path, reads_spaced):
    """docs/ways-in.md: "The weights are left as they were before that step's update": the updates after the
    faulty step, made before any read could refuse them, are undone, the optimizer's moments too."""
    batches = pm.loader(**ZERO)
    doctor, _, model, opt = _loop(tmp_path, batches)
    assert doctor.report.first_fault.step == FAULT_STEP
    plain_model, plain_opt = _plain_until(FAULT_STEP, batches)
    for (name, p), q in zip(model.named_parameters(), plain_model.parameters()):
        assert np.isfinite(p.numpy()).all(), name
        np.testing.assert_allclose(p.numpy(), q.numpy(), rtol=1e-6, atol=1e-7, err_msg=name)
    ours, theirs = opt.state_dict(), plain_opt.state_dict()
    compared = 0
    for p, q in zip(model.parameters(), plain_model.parameters()):  # the keys hold each model's internal names
        for key in [k for k in theirs if k.startswith(q.name + "_")]:
            mine = ours[p.name + key[len(q.name):]]
            np.testing.assert_allclose(np.asarray(mine), np.asarray(theirs[key]), rtol=1e-6, atol=1e-7, err_msg=key)
            compared += 1
    assert compared >= 2 * len(plain_model.parameters())  # both of Adam's moments of every parameter
    assert "step" not in vars(opt)  # the step wrapper is gone after close()


def test_on_fault_raise_raises_at_the_read_and_names_the_unread_step(tmp_path, reads_spaced):
    with pytest.raises(nandoctor.NonFiniteError) as caught:
        _loop(tmp_path, pm.loader(**ZERO), on_fault="raise")
    assert f"step {FAULT_STEP}" in str(caught.value)
    ff = caught.value.report.first_fault
    assert (ff.step, ff.phase, ff.layer, ff.op) == (FAULT_STEP, Phase.BACKWARD, "dist", "sqrt_grad")


def test_a_fault_in_the_last_unread_steps_is_found_when_the_watch_closes(tmp_path, reads_spaced):
    """The loop ends two steps after the NaN gradient, before any read: close() reads them."""
    doctor, answers, _, _ = _loop(tmp_path, pm.loader(**ZERO)[:FAULT_STEP + 2])
    assert all(answers.values())  # every check said True: nothing was read after the fault
    assert doctor.report is not None and doctor.report.details["rollback"]["found"]["step"] == FAULT_STEP
    ff = doctor.report.first_fault
    assert (ff.step, ff.phase, ff.layer, ff.op, ff.sample_indices) == (
        FAULT_STEP, Phase.BACKWARD, "dist", "sqrt_grad", [FAULT_ROW])


def test_a_crash_right_after_an_unread_fault_reports_the_fault_first(tmp_path, reads_spaced):
    """The user's loop raises on the step after the NaN gradient, before any read: the unread steps are
    read as the exception leaves the watch, and the fault, not the crash, is the first fault."""
    with pytest.raises(KeyError):
        _loop(tmp_path, pm.loader(**ZERO), raise_at=FAULT_STEP + 1)
    written = json.loads((tmp_path / "report" / "report.json").read_text(encoding="utf-8"))
    ff = written["first_fault"]
    assert (ff["step"], ff["phase"], ff["layer"], ff["op"]) == (FAULT_STEP, "backward", "dist", "sqrt_grad")
    assert "user_code.error" not in {f["code"] for f in written["findings"]}


def test_a_nan_batch_on_an_unread_step_is_named_as_data_at_its_step(tmp_path, reads_spaced):
    data = {"nan_batch": FAULT_STEP, "nan_rows": [FAULT_ROW], "batches": BATCHES}
    batches = pm.loader(**data)
    assert first_nonfinite_step(pm.classifier(), batches, grads=True) == FAULT_STEP
    doctor, answers, _, _ = _loop(tmp_path, batches, model=pm.classifier())
    assert answers[FAULT_STEP] is True and FAULT_STEP in doctor.report.details["rollback"]["unread_steps"]
    ff = doctor.report.first_fault
    assert (ff.step, ff.phase, ff.batch_index, ff.sample_indices) == (FAULT_STEP, Phase.DATA, FAULT_STEP, [FAULT_ROW])
    assert [f.code.value for f in doctor.report.findings if f.severity.value == "error"] == ["data.nonfinite"]


def test_a_healthy_loop_reads_one_step_in_k_and_keeps_every_loss(tmp_path, reads_spaced):
    batches = pm.loader(batches=BATCHES)
    doctor, answers, _, _ = _loop(tmp_path, batches, model=pm.classifier())
    assert all(answers.values()) and doctor.report is None
    unread = doctor.watcher.unread
    assert not unread & set(range(READ_ALL_STEPS)) and len(doctor.history.kept) <= 2 * READ_EVERY + 1
    summary = doctor.summary()
    assert [p.step for p in summary.timeline] == list(range(BATCHES))  # every loss, read when the watch closed
    read = [p.step for p in summary.timeline if p.grad_norm is not None]
    assert read[:READ_ALL_STEPS] == list(range(READ_ALL_STEPS))
    assert read[READ_ALL_STEPS:] == [s for s in range(READ_ALL_STEPS, BATCHES) if s % READ_EVERY == 0]
    plain = pm.classifier()
    opt = paddle.optimizer.Adam(learning_rate=0.01, parameters=plain.parameters())
    losses = []
    for batch in batches:
        loss = _step(plain, batch)
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    np.testing.assert_allclose([p.loss for p in summary.timeline], losses, rtol=1e-6)


def test_skip_step_still_reads_every_step(tmp_path, reads_spaced):
    """skip_step promises that no faulty update is applied: no step may go unread."""
    doctor, answers, model, _ = _loop(tmp_path, pm.loader(**ZERO), on_fault="skip_step")
    assert not doctor.watcher.unread and doctor.history is None
    assert answers[FAULT_STEP] is False and doctor.skipped[0] == FAULT_STEP
    assert all(np.isfinite(p.numpy()).all() for p in model.parameters())


def test_a_fault_still_unread_when_the_batches_outgrow_the_budget_is_still_named(tmp_path, reads_spaced, monkeypatch):
    """Batches grow past what may be kept on the step after the NaN gradient, itself unread: the watch goes
    back to reading every step, but keeps its ring and batches until the waiting losses are read, so the
    fault they hold is still replayed and named at its step."""
    import nandoctor.inloop.history as history

    size = 8 * 6 * 4 + 8 * 8  # one batch of pm.loader: x float32 (8, 6) and the int64 labels
    monkeypatch.setattr(history, "KEPT_BYTES", 2 * size * history.MIN_INTERVAL)
    batches = pm.loader(**ZERO)
    x, y = batches[FAULT_STEP + 1]
    batches[FAULT_STEP + 1] = (np.tile(x, (40, 1)), np.tile(y, 40))  # 40x the rows: past twice the budget
    doctor, answers, _, _ = _loop(tmp_path, batches)
    assert answers[FAULT_STEP] is True and answers[FAULT_STEP + 1] is True  # both unread
    assert max(answers) == FAULT_STEP + 2 and answers[FAULT_STEP + 2] is False  # read at once, not at a multiple
    assert doctor.history.closing and FAULT_STEP in doctor.history.kept  # kept for the replay of the waiting steps
    assert doctor.report.details["rollback"]["found"] == {"step": FAULT_STEP, "kind": "grad"}
    ff = doctor.report.first_fault
    assert (ff.step, ff.phase, ff.layer, ff.op, ff.sample_indices) == (
        FAULT_STEP, Phase.BACKWARD, "dist", "sqrt_grad", [FAULT_ROW])
