"""Spaced-out gradient reads and the rollback: a fault on a step whose gradients went unread is named as if
caught live (same step, phase, layer, op and samples), against a plain Paddle loop's ground truth."""

from __future__ import annotations

import numpy as np
import probe_models as pm
from probe_spec import probe

from nandoctor.findings import Phase

ZERO_BATCH, ZERO_ROW = 6, 3  # sqrt(0) in the backward of `dist` for this sample of this batch
DATA = {"zero_batch": ZERO_BATCH, "zero_rows": [ZERO_ROW], "batches": 12}


def test_a_nan_gradient_on_an_unread_step_is_named_as_if_caught_live(tmp_path, no_stats_steps):
    assert pm.deep_dist_first_nonfinite_gradient_step(DATA) == ZERO_BATCH
    report = probe(tmp_path, model="deep_dist", data_args=DATA, steps=12)
    rollback = report.details["rollback"]
    assert ZERO_BATCH in rollback["unread_steps"]
    assert rollback["found"] == {"step": ZERO_BATCH, "kind": "grad"}
    assert rollback["replayed_from_step"] <= ZERO_BATCH
    ff = report.first_fault
    assert (ff.step, ff.phase, ff.layer, ff.op) == (ZERO_BATCH, Phase.BACKWARD, "dist", "sqrt_grad")
    assert ff.sample_indices == [ZERO_ROW]
    assert [f.code.value for f in report.findings if f.severity.value == "error"] == ["grad.nonfinite"]
    assert report.timeline[-1].step == ZERO_BATCH  # nothing after the fault: those steps trained on NaN
    # the steps run end at the fault, as when it is caught live (the next test), not at the later read
    assert report.details["steps_run"] == report.run["steps_run"] == ZERO_BATCH < rollback["detected_at_step"]


def test_steps_run_end_at_a_fault_read_late_in_a_fast_loop(tmp_path, pinned_schedule):
    """A fast loop's steps are read one in k past the first 64: a NaN input row at step 130 (its ReLU hides
    it from the loss, not from the gradients) shows at a read some steps later, and the rollback names step
    130. The steps run say so too (the summary said "132 steps run" beside a fault and a timeline that end at
    130). The schedule is pinned (reads every 16th step, stats every 40th), so step 130 is surely unread: left
    to the measured stride, a loaded machine read it live, with no rollback to check (1 of 2 fresh-clone runs
    on 5 December, KeyError 'rollback')."""
    from inloop_helpers import first_nonfinite_step

    from nandoctor.report.common import summary_parts

    data = {"nan_batch": 130, "nan_rows": [2], "batches": 200}
    truth = first_nonfinite_step(pm.classifier(), pm.loader(**data), grads=True)
    assert truth == 130
    report = probe(tmp_path, model="classifier", data_args=data, steps=200)
    rollback = report.details["rollback"]
    assert truth in rollback["unread_steps"] and rollback["detected_at_step"] > truth  # read late, rolled back
    assert (report.first_fault.step, report.first_fault.phase) == (truth, Phase.DATA)
    assert report.details["steps_run"] == report.run["steps_run"] == truth
    assert report.timeline[-1].step == truth - 1  # a batch's NaN: its step is the fault, not a timeline point
    assert f"{truth} steps run" in summary_parts(report)


def test_a_nan_in_the_batch_seen_only_in_the_gradients_of_an_unread_step_is_named_as_data(tmp_path, no_stats_steps):
    """The loss stays finite (the model zeroes NaN activations) but the first layer's gradient is NaN, on
    a step whose gradients went unread: the rollback's replay finds the step, and its batch is the cause."""
    import paddle
    import probe_models as pm

    data = {"nan_batch": ZERO_BATCH, "nan_rows": [ZERO_ROW], "batches": 12}
    model = pm.nan_masking_mlp()
    x, y = pm.loader(**data)[ZERO_BATCH]
    loss = paddle.nn.functional.cross_entropy(model(paddle.to_tensor(x)), paddle.to_tensor(y).unsqueeze(-1))
    loss.backward()
    assert np.isfinite(float(loss)) and not np.isfinite(model.inp.weight.grad.numpy().astype("float64")).all()
    report = probe(tmp_path, model="nan_masking_mlp", data_args=data, steps=12)
    assert ZERO_BATCH in report.details["rollback"]["unread_steps"]
    ff = report.first_fault
    assert (ff.step, ff.phase, ff.batch_index, ff.sample_indices) == (ZERO_BATCH, Phase.DATA, ZERO_BATCH, [ZERO_ROW])
    assert [f.code.value for f in report.findings if f.severity.value == "error"] == ["data.nonfinite"]


def test_the_same_fault_caught_live_without_a_ring_reads_every_step(tmp_path, no_stats_steps):
    """--no-try-fixes keeps no snapshots, so nothing to roll back to: every step's gradients are read, and
    the fault is caught at its own step."""
    from nandoctor.probe import ProbeOptions, run_probe
    from nandoctor.spec import load_spec

    probe(tmp_path, model="deep_dist", data_args=DATA, steps=1)  # writes the spec
    spec = load_spec(tmp_path / "config.yaml")
    report = run_probe(spec, ProbeOptions(steps=12, seed=0, device="cpu", try_fixes=False))
    assert "rollback" not in report.details
    ff = report.first_fault
    assert (ff.step, ff.phase, ff.layer, ff.op) == (ZERO_BATCH, Phase.BACKWARD, "dist", "sqrt_grad")
    assert [p.step for p in report.timeline] == list(range(ZERO_BATCH + 1))
    assert all(p.grad_norm is not None for p in report.timeline[:-1])


def test_healthy_run_leaves_gradient_norms_on_read_steps_only(tmp_path, no_stats_steps):
    report = probe(tmp_path, model="deep_dist", data_args={"batches": 12}, steps=12)
    assert report.first_fault is None and "rollback" not in report.details
    read = [p.step for p in report.timeline if p.grad_norm is not None]
    assert read == [0, 1, 2, 4, 8]  # the first steps, then one in four


def test_an_update_on_an_unread_step_that_writes_nan_from_finite_gradients_stays_an_update_fault(
        tmp_path, no_stats_steps):
    """The rollback must not invent a gradient fault: with the learning rate NaN for step 6's update only,
    the replay sees finite gradients at step 6 and NaN weights right after its update."""
    from probe_spec import MODELS

    sched = {"entry": f"{MODELS}:nan_rate_at", "args": {"at": ZERO_BATCH}, "by": "step"}
    report = probe(tmp_path, model="deep_dist", data_args={"batches": 12}, steps=12,
                   optimizer={"name": "Adam", "args": {"learning_rate": 0.01}, "lr_scheduler": sched})
    assert report.details["rollback"]["found"] == {"step": ZERO_BATCH, "kind": "update"}
    ff = report.first_fault
    assert (ff.step, ff.phase, ff.op) == (ZERO_BATCH, Phase.OPTIMIZER, "adam_")
    assert [f.code.value for f in report.findings if f.severity.value == "error"] == ["update.nonfinite"]


def test_without_a_snapshot_to_replay_the_update_fault_says_which_gradients_went_unread(
        tmp_path, no_stats_steps, monkeypatch):
    """Never the claim that the gradients were finite when they were not read: the message names the
    unread steps and the flag that checks every step."""
    from nandoctor.engine.snapshots import SnapshotRing

    monkeypatch.setattr(SnapshotRing, "latest", lambda self, at_most: None)
    report = probe(tmp_path, model="deep_dist", data_args=DATA, steps=12)
    assert "no sound snapshot" in report.details["rollback"]["note"]
    finding = next(f for f in report.findings if f.code.value == "update.nonfinite")
    assert ZERO_BATCH in finding.evidence["unread_gradient_steps"]
    assert "were not read" in finding.message and "--no-try-fixes" in finding.message
    assert "the gradients were finite" not in finding.message


def test_a_signal_during_the_rollback_keeps_the_update_fault_in_a_partial_report(
        tmp_path, no_stats_steps, monkeypatch):
    from nandoctor.engine import rollback

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(rollback, "replay", interrupted)
    report = probe(tmp_path, model="deep_dist", data_args=DATA, steps=12)
    assert report.partial and "interrupted" in report.details["rollback"]["note"]
    codes = {f.code.value for f in report.findings}
    assert {"update.nonfinite", "run.interrupted"} <= codes
    assert report.remedies == []
