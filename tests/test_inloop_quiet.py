"""nandoctor.watch's quiet steps (issue 23): between reads, stats steps and snapshots, the watch only notes a
step (its loss, batch and times) and does the step's bookkeeping when the window ends. The same loop with
quiet steps turned off is the reference: the timeline, the steps left unread, the update history, the stats
steps and the batches kept for a replay must be the same; a stats step's hooks never stay on through quiet
steps; and the user's code raising in a quiet step is named at that step and phase."""

from __future__ import annotations

from typing import Any

import paddle
import paddle.nn.functional as F
import probe_models as pm
import pytest

import nandoctor
from nandoctor.engine.watcher import READ_ALL_STEPS, StepWatcher
from nandoctor.findings import Phase

STEPS = READ_ALL_STEPS + 150


def _step(model: Any, batch: Any) -> Any:
    x, y = (paddle.to_tensor(v) for v in batch)
    return F.cross_entropy(model(x), y.unsqueeze(-1))


def _train(batches: list, tmp_path: Any, model: Any = None) -> tuple[Any, list[dict[str, Any]]]:
    """docs/ways-in.md's loop; per step: the check's answer, whether it was quiet, whether stats hooks were on."""
    model = model or pm.classifier("dist")
    opt = paddle.optimizer.Adam(learning_rate=0.01, parameters=model.parameters())
    seen = []
    with nandoctor.watch(model, opt, step_fn=_step, report_dir=tmp_path / "report", fields=["x", "label"]) as doctor:
        for i, batch in enumerate(batches):
            loss = _step(model, batch)
            loss.backward()
            ok = doctor.check(loss, batch)
            quiet = bool(doctor._quiet) and doctor._quiet[-1][0] == i
            seen.append({"ok": ok, "quiet": quiet, "hooks": bool(doctor.watcher.monitor._hooks)})
            opt.step()
            opt.clear_grad()
    return doctor, seen


def _state(doctor: Any) -> dict[str, Any]:
    w = doctor.watcher
    return {"timeline": [(r.step, r.loss, r.grad_norm, r.act_max is not None) for r in w.records],
            "unread": sorted(w.unread), "history": [h[:4] for h in w.history], "k": w.stats_every,
            "kept": sorted(doctor.history.kept) if doctor.history.ring is not None else None,
            "plain_steps_timed": len(w.schedule.plain), "steps": doctor.step}


def _run_twice(tmp_path: Any, monkeypatch: Any, batches: list) -> tuple[Any, list, Any, list]:
    quiet_doctor, quiet_seen = _train(batches, tmp_path / "quiet")
    monkeypatch.setattr(StepWatcher, "quiet_until", lambda self, step: step)
    loud_doctor, loud_seen = _train(batches, tmp_path / "loud")
    return quiet_doctor, quiet_seen, loud_doctor, loud_seen


def test_quiet_steps_leave_the_same_record_as_the_stages_step_by_step(tmp_path, pinned_schedule, monkeypatch):
    batches = pm.loader(batches=STEPS)
    quiet_doctor, quiet_seen, loud_doctor, loud_seen = _run_twice(tmp_path, monkeypatch, batches)
    assert sum(s["quiet"] for s in quiet_seen) > STEPS // 2  # most steps past the first READ_ALL_STEPS
    assert not any(s["quiet"] for s in loud_seen)
    assert quiet_doctor.report is None and loud_doctor.report is None
    assert _state(quiet_doctor) == _state(loud_doctor)
    assert any(t[3] for t in _state(quiet_doctor)["timeline"][READ_ALL_STEPS:])  # stats steps came


def test_a_stats_steps_hooks_are_off_before_the_next_quiet_step(tmp_path, pinned_schedule):
    """The hooks a stats step attached come off at the next step's begin: quiet steps, which skip it, wait
    for that step. (They stayed on through a whole quiet window: per-layer reductions on every step and a
    list of layer maxima growing until the next read.)"""
    _, seen = _train(pm.loader(batches=STEPS), tmp_path)
    assert any(s["quiet"] for s in seen)
    assert not [i for i, s in enumerate(seen) if s["quiet"] and s["hooks"]]


def test_a_nan_in_a_quiet_window_is_named_as_with_every_stage_run(tmp_path, pinned_schedule, monkeypatch):
    fault_step = READ_ALL_STEPS + 2 * pinned_schedule + 5  # inside a quiet window, not on a read
    batches = pm.loader(batches=fault_step + 30, zero_batch=fault_step, zero_rows=[2])
    quiet_doctor, quiet_seen, loud_doctor, loud_seen = _run_twice(tmp_path, monkeypatch, batches)
    assert quiet_seen[fault_step]["quiet"] and quiet_seen[fault_step]["ok"] is True
    quiet_ff, loud_ff = quiet_doctor.report.first_fault, loud_doctor.report.first_fault
    assert (quiet_ff.step, quiet_ff.phase, quiet_ff.layer, quiet_ff.op, quiet_ff.sample_indices) == (
        fault_step, Phase.BACKWARD, "dist", "sqrt_grad", [2])
    assert quiet_ff.to_dict() == loud_ff.to_dict()
    assert [s["ok"] for s in quiet_seen] == [s["ok"] for s in loud_seen]  # the same read found it


class _RaisesAt(paddle.nn.Layer):
    """The classifier, raising in its forward on one step (a shape the user's code does not handle)."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.inner = pm.classifier("plain")
        self.at, self.calls = at, 0

    def forward(self, x: Any) -> Any:
        self.calls += 1
        if self.calls == self.at + 1:
            raise ValueError("the user's forward broke")
        return self.inner(x)


def test_the_users_code_raising_in_a_quiet_step_is_named_at_that_step(tmp_path, pinned_schedule, monkeypatch):
    at = READ_ALL_STEPS + pinned_schedule + 3
    import json

    reports = []
    for name in ("quiet", "loud"):
        if name == "loud":
            monkeypatch.setattr(StepWatcher, "quiet_until", lambda self, step: step)
        model = _RaisesAt(at)
        with pytest.raises(ValueError):
            _train(pm.loader(batches=at + 10), tmp_path / name, model=model)
        reports.append((tmp_path / name / "report" / "report.json").read_text(encoding="utf-8"))

    quiet, loud = (json.loads(r) for r in reports)
    assert (quiet["first_fault"]["step"], quiet["first_fault"]["phase"]) == (at, "forward")
    assert quiet["first_fault"] == loud["first_fault"]
    assert [f["code"] for f in quiet["findings"]] == [f["code"] for f in loud["findings"]]
    assert "user_code.error" in [f["code"] for f in quiet["findings"]]


def test_a_summary_mid_run_reads_the_steps_still_unread(tmp_path, pinned_schedule):
    """`doctor.summary()` before the loop ends: every step trained is on its timeline (the ones not yet read
    are read for it), and a NaN among them is the run's fault, named at its step."""
    model = pm.classifier("dist")
    opt = paddle.optimizer.Adam(learning_rate=0.01, parameters=model.parameters())
    fault_step = READ_ALL_STEPS + pinned_schedule + 5  # between reads and stats steps (every 16 and 40)
    steps = fault_step + 3  # the run's last steps wait on the device
    batches = pm.loader(batches=steps + 10, zero_batch=fault_step, zero_rows=[2])
    with nandoctor.watch(model, opt, step_fn=_step, report_dir=tmp_path / "report", fields=["x", "label"]) as doctor:
        for i, batch in enumerate(batches[:steps]):
            loss = _step(model, batch)
            loss.backward()
            assert doctor.check(loss, batch)
            opt.step()
            opt.clear_grad()
            if i == fault_step - 1:
                healthy = doctor.summary()
                assert healthy.first_fault is None and doctor.report is None
                assert [p.step for p in healthy.timeline] == list(range(fault_step))
        report = doctor.summary()
    assert report is doctor.report and report.first_fault.step == fault_step
    assert (report.first_fault.op, report.first_fault.sample_indices) == ("sqrt_grad", [2])
    assert (tmp_path / "report" / "report.json").is_file()
