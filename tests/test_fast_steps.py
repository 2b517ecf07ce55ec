"""Reads left on the device (issue 23, 1): with the snapshot ring on, a small model's steps go unread but one in
k, their losses kept as device tensors; a fault on an unread step is still named at its exact step, phase,
layer, op and samples (the rollback replays the unread steps), against a plain Paddle loop's ground truth
and against the same probe reading every step (`--no-try-fixes`)."""

from __future__ import annotations

import numpy as np
import paddle
import probe_models as pm
import pytest
from inloop_helpers import first_nonfinite_step
from probe_spec import probe

from nandoctor.engine.watcher import READ_ALL_STEPS
from nandoctor.findings import Phase
from nandoctor.probe import ProbeOptions, run_probe
from nandoctor.spec import load_spec

FAULT_STEP, FAULT_ROW = READ_ALL_STEPS + 13, 2
BATCHES = FAULT_STEP + 20


@pytest.fixture
def reads_spaced(monkeypatch, no_stats_steps):
    """Reads as far apart as the ring allows (a read's measured cost against a millisecond step would
    already space them out; pinned here so the fault's step is surely unread)."""
    from nandoctor.engine import watcher

    monkeypatch.setattr(watcher, "_READ_SHARE", 1e-9)


def _live(tmp_path, steps=BATCHES, **kw):
    """The same spec probed with every step read (no ring: nothing to roll back to)."""
    tmp_path.mkdir()
    probe(tmp_path, steps=1, **kw)  # writes the spec
    return run_probe(load_spec(tmp_path / "config.yaml"), ProbeOptions(steps=steps, seed=0, device="cpu",
                                                                       try_fixes=False))


def _where(report):
    ff = report.first_fault
    return ff.step, ff.phase, ff.layer, ff.op, ff.sample_indices


def test_a_backward_fault_on_an_unread_step_of_a_small_model_is_named_as_if_caught_live(tmp_path, reads_spaced):
    data = {"zero_batch": FAULT_STEP, "zero_rows": [FAULT_ROW], "batches": BATCHES}
    assert first_nonfinite_step(pm.classifier("dist"), pm.loader(**data), grads=True) == FAULT_STEP
    report = probe(tmp_path, model="classifier", model_args={"kind": "dist"}, data_args=data, steps=BATCHES)
    rollback = report.details["rollback"]
    assert FAULT_STEP in rollback["unread_steps"]  # the step's loss and gradients were never read live
    assert rollback["found"] == {"step": FAULT_STEP, "kind": "grad"}
    assert _where(report) == (FAULT_STEP, Phase.BACKWARD, "dist", "sqrt_grad", [FAULT_ROW])
    live = _live(tmp_path / "live", model="classifier", model_args={"kind": "dist"}, data_args=data, steps=BATCHES)
    assert "rollback" not in live.details and _where(live) == _where(report)
    assert report.timeline[-1].step == FAULT_STEP
    assert [p.step for p in report.timeline] == list(range(FAULT_STEP + 1))


def test_a_nan_batch_on_an_unread_step_is_named_as_data_at_its_step(tmp_path, reads_spaced):
    data = {"nan_batch": FAULT_STEP, "nan_rows": [FAULT_ROW], "batches": BATCHES}
    assert first_nonfinite_step(pm.classifier(), pm.loader(**data), grads=True) == FAULT_STEP
    report = probe(tmp_path, data_args=data, steps=BATCHES)
    assert FAULT_STEP in report.details["rollback"]["unread_steps"]
    ff = report.first_fault
    assert (ff.step, ff.phase, ff.batch_index, ff.sample_indices) == (FAULT_STEP, Phase.DATA, FAULT_STEP, [FAULT_ROW])
    assert [f.code.value for f in report.findings if f.severity.value == "error"] == ["data.nonfinite"]
    live = _live(tmp_path / "live", data_args=data, steps=BATCHES)
    assert (live.first_fault.step, live.first_fault.phase, live.first_fault.sample_indices) == (
        ff.step, ff.phase, ff.sample_indices)


def test_a_fault_in_the_last_unread_steps_is_read_when_the_run_ends(tmp_path, reads_spaced):
    """The run stops two steps after the fault, before any later read: the end of the run reads them."""
    data = {"zero_batch": FAULT_STEP, "zero_rows": [FAULT_ROW], "batches": BATCHES}
    report = probe(tmp_path, model="classifier", model_args={"kind": "dist"}, data_args=data,
                   steps=FAULT_STEP + 2)
    assert FAULT_STEP in report.details["rollback"]["unread_steps"]
    assert _where(report) == (FAULT_STEP, Phase.BACKWARD, "dist", "sqrt_grad", [FAULT_ROW])


def test_healthy_small_model_reads_one_step_in_k_and_keeps_every_loss(tmp_path, reads_spaced):
    report = probe(tmp_path, data_args={"batches": BATCHES}, steps=BATCHES)
    assert report.first_fault is None and "rollback" not in report.details
    assert [p.step for p in report.timeline] == list(range(BATCHES))  # every step's loss, read later
    read = [p.step for p in report.timeline if p.grad_norm is not None]
    # the early steps in full, then one in k
    assert read[:READ_ALL_STEPS] == list(range(READ_ALL_STEPS)) and len(read) < READ_ALL_STEPS + 10
    plain = pm.classifier()
    opt = paddle.optimizer.Adam(learning_rate=0.01, parameters=plain.parameters())
    losses = []
    for x, y in pm.loader(batches=BATCHES):
        loss = paddle.nn.functional.cross_entropy(plain(paddle.to_tensor(x)), paddle.to_tensor(y).unsqueeze(-1))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
    np.testing.assert_allclose([p.loss for p in report.timeline], losses, rtol=1e-6)


CRASHING = '''
import probe_models as pm


def build_model():
    return pm.classifier("dist", crash_at_batch_size=5)


def build_loader(batches, zero_batch, zero_row):
    out = pm.loader(batches=batches, zero_batch=zero_batch, zero_rows=[zero_row])
    x, y = out[zero_batch + 1]
    out[zero_batch + 1] = (x[:5], y[:5])  # the model's code raises on this batch (a wrong reshape)
    return out
'''


def test_a_crash_right_after_an_unread_fault_reads_it_first(tmp_path, reads_spaced):
    """The user's code raises on the step after the NaN gradient, before any read: the unread step is read
    when the loop stops, and its fault, not the crash, is the first fault."""
    import yaml

    (tmp_path / "crashing.py").write_text(CRASHING, encoding="utf-8")
    spec = {"version": 1, "model": {"entry": "crashing.py:build_model"},
            "data": {"entry": "crashing.py:build_loader", "fields": ["x", "label"], "label": "label",
                     "args": {"batches": BATCHES, "zero_batch": FAULT_STEP, "zero_row": FAULT_ROW}},
            "loss": {"builtin": "cross_entropy"}, "optimizer": {"name": "Adam", "args": {"learning_rate": 0.01}}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    report = run_probe(load_spec(tmp_path / "config.yaml"), ProbeOptions(steps=BATCHES, seed=0, device="cpu"))
    assert FAULT_STEP in report.details["rollback"]["unread_steps"]
    assert _where(report) == (FAULT_STEP, Phase.BACKWARD, "dist", "sqrt_grad", [FAULT_ROW])
    assert "user_code.error" not in {f.code.value for f in report.findings}


def test_the_probes_quiet_steps_give_the_report_of_every_stage_run(tmp_path, pinned_schedule, monkeypatch):
    """The probe's loop runs most steps quietly (StepWatcher.quiet_until) and the watcher catches up at each
    window's end: the same timeline, stats steps, rollback and first fault as with every stage run."""
    from nandoctor.engine.watcher import StepWatcher

    fault_step = READ_ALL_STEPS + 2 * pinned_schedule + 5  # inside a quiet window, not on a read
    data = {"zero_batch": fault_step, "zero_rows": [FAULT_ROW], "batches": fault_step + 30}
    calls = []
    quiet_steps = StepWatcher.quiet_steps
    monkeypatch.setattr(StepWatcher, "quiet_steps", lambda self, steps, fields: (
        calls.append(len(steps)), quiet_steps(self, steps, fields)))
    (tmp_path / "quiet").mkdir()
    (tmp_path / "loud").mkdir()
    reports = [probe(tmp_path / "quiet", model="classifier", model_args={"kind": "dist"}, data_args=data,
                     steps=fault_step + 30)]
    assert sum(calls) > 2 * pinned_schedule  # most steps past READ_ALL_STEPS went quietly
    monkeypatch.setattr(StepWatcher, "quiet_until", lambda self, step: step)
    reports.append(probe(tmp_path / "loud", model="classifier", model_args={"kind": "dist"}, data_args=data,
                         steps=fault_step + 30))
    quiet, loud = ([(p.step, p.loss, p.grad_norm) for p in r.timeline] for r in reports)
    assert quiet == loud and quiet[-1][0] == fault_step
    assert reports[0].details["stats_every"] == reports[1].details["stats_every"]
    for r in reports:
        r.details["rollback"].pop("seconds", None)
    assert reports[0].details["rollback"] == reports[1].details["rollback"]
    assert reports[0].first_fault.to_dict() == reports[1].first_fault.to_dict()
    assert _where(reports[0]) == (fault_step, Phase.BACKWARD, "dist", "sqrt_grad", [FAULT_ROW])
