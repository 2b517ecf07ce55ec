"""The probe on tiny in-memory models, one planted fault per phase: where it is found and what is reported."""

from __future__ import annotations

import math

from probe_spec import MODELS, codes, probe

from nandoctor.findings import Phase


def test_healthy_model_gives_no_finding_and_a_full_timeline(tmp_path):
    calls = []
    report = probe(tmp_path, steps=10, progress=lambda done, total, what: calls.append((done, total, what)))
    assert report.findings == [] and report.first_fault is None
    assert report.verdict.value == "healthy" and report.exit_code == 0
    assert [p.step for p in report.timeline] == list(range(10))
    assert all(math.isfinite(p.loss) and p.grad_norm > 0 for p in report.timeline)
    assert ("probe step" in calls[-1][2]) and calls[-1][:2] == (10, 10)
    act = report.details["activation_max"]
    assert "body.0" in act["layers"] and 0 in act["steps"]
    assert len(act["values"]) == len(act["layers"]) and len(act["values"][0]) == len(act["steps"])
    grads = report.details["grad_norms"]
    assert grads["parameters"][0] == "body.0.weight" and len(grads["steps"]) == 10
    # the global norm is the root of the summed per-parameter squares
    col = [row[0] for row in grads["values"]]
    assert math.isclose(math.sqrt(sum(v * v for v in col)), report.timeline[0].grad_norm, rel_tol=1e-4)
    assert report.details["steps_run"] == 10 and report.run["seed"] == 0 and report.run["device"] == "cpu"


def test_loader_shorter_than_steps_starts_a_new_epoch(tmp_path):
    report = probe(tmp_path, data_args={"batches": 3}, steps=7)
    assert report.findings == []
    assert report.details["steps_run"] == 7 and report.details["epochs"] == 3


def test_nan_in_data_is_named_as_data_before_its_update(tmp_path):
    report = probe(tmp_path, data_args={"nan_batch": 2, "nan_rows": [1, 4]})
    ff = report.first_fault
    assert (ff.step, ff.phase, ff.batch_index, ff.sample_indices) == (2, Phase.DATA, 2, [1, 4])
    [f] = report.findings
    assert f.code.value == "data.nonfinite" and f.location.field == "x"
    assert "loss or gradients NaN/Inf" in f.message and "before any update" in f.message
    assert len(report.timeline) == 2  # steps 0 and 1 trained, step 2 was not applied


def test_nan_the_model_replaces_is_not_a_fault(tmp_path):
    """The batch is judged by what it did: a NaN the user's model turns into a number trains fine."""
    report = probe(tmp_path, model_args={"kind": "clean"}, data_args={"nan_batch": 2, "nan_rows": [1, 4]})
    assert report.findings == [] and report.verdict.value == "healthy"


def test_nan_in_data_that_makes_the_model_raise_is_named_as_data(tmp_path):
    report = probe(tmp_path, model_args={"kind": "guard"}, data_args={"nan_batch": 2, "nan_rows": [3]})
    ff = report.first_fault
    assert (ff.step, ff.phase, ff.batch_index, ff.sample_indices) == (2, Phase.DATA, 2, [3])
    [f] = report.findings
    assert f.code.value == "data.nonfinite" and "raised ValueError: the input holds NaN" in f.message


def test_an_additive_mask_in_the_batch_is_not_a_fault_and_a_nan_beside_it_is(tmp_path):
    data = {"entry": f"{MODELS}:mask_loader", "inputs": ["x", "mask"], "label": "label"}
    report = probe(tmp_path, model="masked_attention", extra={"data": data})
    assert report.findings == [] and report.verdict.value == "healthy"
    data["args"] = {"nan_batch": 3, "nan_row": 2}
    report = probe(tmp_path, model="masked_attention", extra={"data": data})
    ff = report.first_fault
    assert (ff.step, ff.phase, ff.sample_indices) == (3, Phase.DATA, [2])
    assert [f.location.field for f in report.findings] == ["x"]  # not the mask


def test_nan_in_tensor_data_is_caught_on_the_device(tmp_path):
    report = probe(tmp_path, data_args={"nan_batch": 3, "nan_rows": [2], "tensors": True})
    ff = report.first_fault
    assert (ff.step, ff.phase, ff.sample_indices) == (3, Phase.DATA, [2])


def test_nan_parameter_before_training(tmp_path):
    report = probe(tmp_path, model_args={"nan_param": "head.bias", "nan_whole": True})  # every step reads it
    ff = report.first_fault
    assert (ff.step, ff.phase, ff.parameter, ff.batch_index) == (None, Phase.PARAMS, "head.bias", None)
    assert codes(report) == {"param.nonfinite"} and report.timeline == []


def test_forward_fault_names_layer_op_and_samples(tmp_path):
    report = probe(tmp_path, model_args={"kind": "log"}, data_args={"zero_batch": 3, "zero_rows": [2, 5]})
    ff = report.first_fault
    assert (ff.step, ff.phase, ff.layer, ff.op, ff.batch_index, ff.sample_indices) == (
        3, Phase.FORWARD, "feat", "log", 3, [2, 5])
    assert codes(report, "error") == {"activation.nonfinite"}
    off = report.details["offending_tensor"]
    assert off["num_inf"] > 0 and off["shape"] == [8, 6]
    assert report.verdict.value == "nan_found"


def test_loss_fault_outside_every_layer(tmp_path):
    report = probe(tmp_path, step="step_log_of_input", data_args={"zero_batch": 1, "zero_rows": [6]})
    ff = report.first_fault
    assert (ff.step, ff.phase, ff.layer, ff.op, ff.sample_indices) == (1, Phase.LOSS, None, "log", [6])
    assert codes(report, "error") == {"loss.nonfinite"}


def test_whole_batch_fault_names_no_samples(tmp_path):
    report = probe(tmp_path, step="step_masked_mean", data_args={"label_batch": 2, "label_row": -1,
                                                                 "label_value": 0})
    ff = report.first_fault
    assert (ff.step, ff.phase, ff.op, ff.sample_indices) == (2, Phase.LOSS, "divide", [])


def test_backward_fault_names_layer_op_and_parameter(tmp_path):
    report = probe(tmp_path, model_args={"kind": "dist"}, data_args={"zero_batch": 4, "zero_rows": [3]})
    ff = report.first_fault
    assert (ff.step, ff.phase, ff.layer, ff.op, ff.parameter, ff.sample_indices) == (
        4, Phase.BACKWARD, "dist", "sqrt_grad", "dist.w", [3])
    assert codes(report, "error") == {"grad.nonfinite"}
    assert math.isfinite(report.timeline[-1].loss) and not math.isfinite(report.timeline[-1].grad_norm)


def test_optimizer_update_fault_is_reported_at_the_step_that_did_it(tmp_path):
    report = probe(tmp_path, data_args={"zero_col": 2},
                   optimizer={"name": "Adam", "args": {"learning_rate": 0.01, "epsilon": 0.0}})
    ff = report.first_fault
    assert (ff.step, ff.phase, ff.op, ff.parameter, ff.batch_index) == (0, Phase.OPTIMIZER, "adam_",
                                                                         "body.0.weight", 0)
    [f] = [f for f in report.findings if f.code.value == "update.nonfinite"]
    assert f.evidence["parameters"] == ["body.0.weight"] and math.isfinite(f.evidence["grad_norm"])


def test_interrupt_returns_a_partial_report(tmp_path):
    report = probe(tmp_path, data={"loader": "loader"}["loader"], data_args={"interrupt_at": 3}, steps=6)
    assert report.partial and "run.interrupted" in codes(report, "info")
    assert len(report.timeline) == 3 and report.first_fault is None


def test_replays_leave_the_model_untouched(tmp_path):
    """The fault step never reaches optimizer.step, and replays/bisection restore buffers and gradients."""
    report = probe(tmp_path, model_args={"kind": "log"}, data_args={"zero_batch": 0, "zero_rows": [1]})
    assert report.first_fault.step == 0
    state = report.artifacts["model_state"]
    import probe_models

    fresh = probe_models.classifier("log")
    for name, value in fresh.state_dict().items():
        assert (state[name] == value.numpy()).all(), name


def test_deep_model_samples_per_parameter_stats_but_checks_every_step(tmp_path, pinned_schedule):
    """Hundreds of tensors: the loss every step, the global gradient norm on the first steps and then one in
    four (a fault on the others is rolled back: test_rollback.py), per-parameter norms and layer maxima
    on stats steps. The stats schedule is pinned (steps 0 and 2 in 12): measured, a load spike on step 1
    can make stats look free (k = 1), and then every step is a stats step and reads every gradient."""
    report = probe(tmp_path, model="deep_mlp", steps=12)
    assert report.findings == []
    read = {p.step for p in report.timeline if p.grad_norm is not None}
    assert read == {0, 1, 2, 4, 8}  # the first three steps (0 and 2 the stats steps), then one in four
    assert all(math.isfinite(p.grad_norm) for p in report.timeline if p.grad_norm is not None)
    assert all(math.isfinite(p.loss) for p in report.timeline)
    assert len(report.timeline) == 12 and 0 in report.details["grad_norms"]["steps"]
    assert len(report.details["grad_norms"]["parameters"]) <= 64  # downsampled to the largest rows
    grads = report.details["grad_norms"]
    assert grads["steps"] == [0, 2]  # per-parameter norms only on the stats steps
    full = probe(tmp_path, model="deep_mlp", model_args={"layers": 20}, steps=2)  # 42 tensors: every step
    col = [row[0] for row in full.details["grad_norms"]["values"]]
    assert math.isclose(math.sqrt(sum(v * v for v in col)), full.timeline[0].grad_norm, rel_tol=1e-4)


def test_deep_model_update_fault_is_still_found(tmp_path):
    report = probe(tmp_path, model="deep_mlp", data_args={"zero_col": 2}, steps=6,
                   optimizer={"name": "Adam", "args": {"learning_rate": 0.01, "epsilon": 0.0}})
    ff = report.first_fault
    assert (ff.step, ff.phase, ff.op, ff.parameter) == (0, Phase.OPTIMIZER, "adam_", "0.weight")


def test_grouped_gradient_norms_match_numpy():
    """The stacked-by-shape reductions of a many-tensor model give the same norms as numpy, per parameter."""
    import numpy as np
    import paddle
    import probe_models

    from nandoctor.engine.monitors import StepMonitor

    model = probe_models.deep_mlp(60, 8)  # 122 tensors: the grouped path
    mon = StepMonitor(model)
    try:
        assert not mon.small
        loss = model(paddle.randn([4, probe_models.FEATURES])).sum()
        loss.backward()
        full, light = mon.read(loss, full=True), mon.read(loss, full=False)
        expect = np.array([float((p.grad.numpy().astype("float64") ** 2).sum()) for p in mon.params])
        assert np.allclose(full.grad_sq, expect, rtol=1e-4)
        assert math.isclose(full.grad_norm, math.sqrt(expect.sum()), rel_tol=1e-4)
        assert math.isclose(light.grad_norm, full.grad_norm, rel_tol=1e-4) and light.grad_sq is None
    finally:
        mon.close()


def test_stats_schedule_spends_what_detection_leaves_of_the_budget():
    """Fed made-up durations (no clock): stats every k-th step, k from the measured costs."""
    from nandoctor.engine.loop import StatsSchedule
    from nandoctor.engine.watcher import _MIN_STATS_BUDGET, _TOTAL_BUDGET

    def k_for(detect: float) -> int:
        sched = StatsSchedule()
        assert sched.want(0) and not sched.want(1) and sched.want(2)
        sched.record(0, True, 1.0)
        for step in range(1, 12):
            sched.record(step, step == 2, 0.020 if step == 2 else 0.010, detect)
        return sched.k

    step = 0.010  # the made-up plain step; a stats step costs one more of it
    assert k_for(0.0) in (round(1 / _TOTAL_BUDGET), round(1 / _TOTAL_BUDGET) + 1)  # the whole budget for stats
    half = round(2 / _TOTAL_BUDGET)
    assert k_for(_TOTAL_BUDGET / 2 * step) in (half, half + 1)  # detection takes half: the other half for stats
    floor = round(1 / _MIN_STATS_BUDGET)
    assert k_for(0.5 * step) in (floor, floor + 1)  # detection takes 50% of the step: stats still get the floor
    sched = StatsSchedule()
    sched.alert = True
    assert sched.want(57)  # after a warning sign, stats on every step


def test_many_tensor_model_checks_parameters_after_every_update():
    """The parameter check is queued after every update, not only before sampled stats steps, so an update
    that writes NaN into a deep model's weights is seen at the very next read (and named at its own step)."""
    import numpy as np
    import paddle
    import probe_models

    from nandoctor.engine.monitors import StepMonitor

    model = probe_models.deep_mlp(60, 8)  # 122 tensors: the grouped path
    mon = StepMonitor(model)
    try:
        assert not mon.small
        for poisoned in (False, True):
            loss = model(paddle.randn([4, probe_models.FEATURES])).sum()
            loss.backward()
            if poisoned:
                p = mon.params[57]
                paddle.assign(paddle.full(p.shape, float("nan"), p.dtype), p)
            mon.after_update()  # as the loop calls it after every optimizer.step()
            stats = mon.read(loss, full=False)
            assert stats.params_sum is not None
            assert np.isfinite(stats.params_sum) != poisoned
            model.clear_gradients()
    finally:
        mon.close()
