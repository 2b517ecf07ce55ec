"""The step watcher apart from the loop, the user-code boundary, losses that cannot train, accumulation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import paddle
import pytest
import yaml

from nandoctor.engine.watcher import FaultKind, StepWatcher
from nandoctor.findings import Code, Phase
from nandoctor.probe import ProbeOptions, run_probe
from nandoctor.spec import load_spec

MODELS = Path(__file__).resolve().parent / "watcher_models.py"


def write_spec(tmp_path: Path, *, model_args: dict | None = None, data: str = "batches",
               data_args: dict | None = None, step: str | None = None, optimizer: dict | None = None) -> Path:
    raw: dict[str, Any] = {
        "version": 1,
        "model": {"entry": f"{MODELS}:classifier", "args": model_args or {}},
        "data": {"entry": f"{MODELS}:{data}", "args": data_args or {}, "fields": ["x", "label"], "label": "label"},
        "optimizer": optimizer or {"name": "SGD", "args": {"learning_rate": 0.1}},
    }
    if step is not None:
        raw["step"] = {"entry": f"{MODELS}:{step}"}
    else:
        raw["loss"] = {"builtin": "cross_entropy"}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def probe(tmp_path: Path, steps: int = 6, spec_edit: Any = None, **kw: Any):
    spec = load_spec(write_spec(tmp_path, **kw))
    if spec_edit is not None:
        spec_edit(spec)
    return run_probe(spec, ProbeOptions(steps=steps, seed=0, device="cpu"))


def codes(report) -> set[str]:
    return {getattr(f.code, "value", f.code) for f in report.findings}


# --- the watcher without a Workload: model + optimizer + fields in, as an in-loop API would use it ----------

def test_watcher_driven_by_a_hand_written_loop_names_the_nonfinite_step():
    paddle.seed(0)
    model = paddle.nn.Sequential(paddle.nn.Linear(4, 8), paddle.nn.ReLU(), paddle.nn.Linear(8, 1))
    opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    watch = StepWatcher(model, opt)
    rng = np.random.default_rng(0)
    fault = None
    try:
        for step in range(6):
            x = paddle.to_tensor(rng.normal(size=(8, 4)).astype("float32"))
            fields = {"x": x}
            watch.begin_step(step, fields, batch_index=step)
            loss = model(x).mean()
            if step == 4:
                loss = loss + paddle.log(paddle.zeros([1])).sum()  # -inf, outside any layer
            fault = watch.observe_loss(loss)
            assert fault is None
            loss.backward()
            fault = watch.after_backward(loss)
            if fault is not None:
                break
            opt.step()
            opt.clear_grad()
            watch.after_update(stepped=True)
    finally:
        watch.close()
    assert fault is not None and fault.kind is FaultKind.NONFINITE and fault.kind == "nonfinite"
    assert (fault.step, fault.batch_index) == (4, 4) and fault.rng is not None
    assert [r.step for r in watch.records] == [0, 1, 2, 3, 4]
    assert all(r.lr == pytest.approx(0.1) for r in watch.records)


def _one_step(model: Any, fields: dict[str, Any], loss_of: Any) -> Any:
    """One checked step of a fresh watcher (no update): its fault, or None."""
    watch = StepWatcher(model, paddle.optimizer.SGD(learning_rate=0.0, parameters=model.parameters()))
    try:
        watch.begin_step(0, fields)
        loss = loss_of(fields)
        loss.backward()
        return watch.after_backward(loss)
    finally:
        watch.close()
        model.clear_gradients()


@pytest.mark.parametrize("as_tensor", [False, True])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_watcher_names_the_data_rows_whose_nan_or_inf_made_the_step_nonfinite(value, as_tensor):
    paddle.seed(0)
    model = paddle.nn.Linear(4, 1)
    x = np.ones((2000, 4), "float32")  # 8000 values, where the old per-step check read only their sum
    x[7, 2] = x[1999, 3] = value
    fault = _one_step(model, {"x": paddle.to_tensor(x) if as_tensor else x},
                      lambda f: model(paddle.to_tensor(f["x"])).mean())
    assert fault is not None and fault.kind is FaultKind.DATA and fault.bad_fields == {"x": [7, 1999]}


def test_watcher_reads_a_bfloat16_field_as_numbers_not_as_its_raw_bits():
    paddle.seed(0)
    model = paddle.nn.Linear(4, 1)
    x = np.ones((5, 4), "float32")
    x[3, 0] = np.nan
    xb = paddle.to_tensor(x).astype("bfloat16")  # its numpy() is uint16: a NaN there is just a number
    fault = _one_step(model, {"x": xb}, lambda f: model(f["x"].astype("float32")).mean())
    assert fault is not None and fault.kind is FaultKind.DATA and fault.bad_fields == {"x": [3]}


def test_watcher_judges_a_batch_by_what_it_did_not_by_what_it_holds():
    """A NaN the model replaces, or an additive mask's intended -inf, trains fine: not a fault (it used to
    stop a healthy run at step 0). When such a step does go NaN for another reason, the mask is not
    blamed; a NaN beside the mask is, by its own rows only."""
    paddle.seed(0)
    model = paddle.nn.Linear(4, 4)
    x = np.ones((3, 4), "float32")
    x[1, 2] = np.nan
    mask = np.triu(np.full((3, 4, 4), -np.inf, "float32"), 1)  # 0 on and below the diagonal, -inf above

    def attend(f: dict[str, Any], bad: bool = False) -> Any:
        h = model(paddle.nan_to_num(paddle.to_tensor(f["x"])))
        att = paddle.nn.functional.softmax(h.unsqueeze(1) + paddle.to_tensor(f["mask"]), axis=-1)
        loss = att.mean()
        return loss + paddle.log(paddle.zeros([1])).sum() if bad else loss

    assert _one_step(model, {"x": x, "mask": mask}, attend) is None
    fault = _one_step(model, {"x": np.ones((3, 4), "float32"), "mask": mask}, lambda f: attend(f, bad=True))
    assert fault is not None and fault.kind is FaultKind.NONFINITE
    nan_mask = mask.copy()
    nan_mask[2, 0, 0] = np.nan
    fault = _one_step(model, {"x": np.ones((3, 4), "float32"), "mask": nan_mask}, attend)
    assert fault is not None and fault.kind is FaultKind.DATA and fault.bad_fields == {"mask": [2]}


def test_watcher_never_blames_a_finite_batch_for_an_overflow():
    paddle.seed(0)
    model = paddle.nn.Linear(4, 1)
    x = np.full((2000, 4), 3.0e38, "float32")  # every value finite; the Linear's sums overflow
    fault = _one_step(model, {"x": x}, lambda f: model(paddle.to_tensor(f["x"])).mean())
    assert fault is not None and fault.kind is FaultKind.NONFINITE and not fault.bad_fields


def test_watcher_keeps_no_batch_alive_between_parameter_checks():
    """A many-tensor model's parameters are checked only before stats steps; the updates in between are
    remembered to name the one that wrote a NaN, but only the first and the newest of their batches: a
    16 MB batch a step on a 124-tensor model held 1.9 GB after 200 steps when all of them were kept."""
    import weakref

    paddle.seed(0)
    model = paddle.nn.Sequential(*[paddle.nn.Linear(4, 4) for _ in range(60)])  # 120 tensors: "many"
    opt = paddle.optimizer.SGD(learning_rate=0.01, parameters=model.parameters())
    watch = StepWatcher(model, opt)
    assert not watch.monitor.small
    watch.schedule.want = lambda step: step == 0  # no stats step, so no parameter check, after step 0
    refs = []
    try:
        for step in range(12):
            x = paddle.randn([8, 4])
            refs.append(weakref.ref(x))
            watch.begin_step(step, {"x": x}, batch_index=step)
            loss = model(x).mean()
            loss.backward()
            assert watch.after_backward(loss) is None
            opt.step()
            opt.clear_grad()
            watch.after_update(stepped=True)
            del x, loss
        alive = [i for i, r in enumerate(refs) if r() is not None]
        assert len(watch.history) >= 10  # the updates since the last check are all still there
        assert alive == [watch.history[0][0], 11], alive  # the first candidate's batch, and the newest
    finally:
        watch.close()


# --- nandoctor's own failures are not the user's -------------------------------------------------------

def test_internal_failure_in_the_watcher_propagates_and_is_not_blamed_on_the_user(tmp_path, monkeypatch):
    def broken(self, loss):
        raise ZeroDivisionError("a bug in nandoctor's bookkeeping")

    monkeypatch.setattr(StepWatcher, "after_backward", broken)
    with pytest.raises(ZeroDivisionError, match="bookkeeping"):
        probe(tmp_path)


def test_all_frozen_model_is_a_no_trainable_finding_not_an_optimizer_crash(tmp_path):
    report = probe(tmp_path, model_args={"frozen": True})
    assert codes(report) == {"model.no_trainable"}
    [f] = report.findings
    assert "all frozen" in f.message and "stop_gradient" in f.message and f.severity.value == "error"
    assert report.verdict.value == "crashed" and report.exit_code == 1 and report.timeline == []


# --- losses that cannot train -------------------------------------------------------------------------

def test_non_scalar_loss_is_named_with_its_shape(tmp_path):
    report = probe(tmp_path, step="step_per_sample")
    assert codes(report) == {"loss.not_scalar"}
    [f] = report.findings
    assert "[8]" in f.message and ".mean()" in f.message and f.location.step == 0
    assert f.evidence["shape"] == [8] and report.exit_code == 1
    assert report.first_fault.phase == Phase.LOSS


def test_detached_loss_is_a_no_grad_finding(tmp_path):
    report = probe(tmp_path, step="step_detached")
    assert codes(report) == {"loss.no_grad"}
    [f] = report.findings
    assert "stop_gradient" in f.message and "detach" in f.message and f.evidence["reason"] == "stop_gradient"


def test_loss_that_no_parameter_influences_is_a_no_grad_finding(tmp_path):
    report = probe(tmp_path, step="step_constant")
    assert codes(report) == {"loss.no_grad"}
    [f] = report.findings
    assert f.evidence["reason"] == "no_gradient" and "no trainable parameter has a gradient" in f.message
    assert f.location.phase == Phase.BACKWARD


def test_loader_calling_sys_exit_is_a_user_code_finding(tmp_path):
    report = probe(tmp_path, data="exiting_loader", data_args={"after": 2, "code": 3})
    assert Code.USER_CODE_ERROR in {f.code for f in report.findings}
    f = next(f for f in report.findings if f.code == Code.USER_CODE_ERROR)
    assert "SystemExit" in f.message and f.location.phase == Phase.DATA and f.location.step == 2
    assert report.verdict.value == "crashed"


# --- gradient accumulation and the LR scheduler -------------------------------------------------------

def _hand_built(captured: dict, decay_every: int = 1):
    """build_optimizer replaced by a hand-built SGD on a StepDecay schedule; keeps the model for the test."""
    def build(spec, model):
        captured["model"] = model
        sched = paddle.optimizer.lr.StepDecay(learning_rate=0.1, step_size=decay_every, gamma=0.5)
        captured["sched"] = sched
        return paddle.optimizer.SGD(learning_rate=sched, parameters=model.parameters())
    return build


def _set(accumulate: int, by: str = "step"):
    from nandoctor.spec import SchedulerSpec

    def edit(spec):
        spec.optimizer.accumulate_steps = accumulate
        spec.optimizer.lr_scheduler = SchedulerSpec(name="StepDecay", args={"step_size": 1, "gamma": 0.5}, by=by)
    return edit


def test_accumulation_steps_every_k_batches_and_the_scheduler_after_each_update(tmp_path, monkeypatch):
    from watcher_models import batches, classifier

    import nandoctor.probe as probe_mod

    captured: dict = {}
    monkeypatch.setattr(probe_mod, "build_optimizer", _hand_built(captured))
    report = probe(tmp_path, steps=6, spec_edit=_set(2))
    assert report.findings == [] and [p.step for p in report.timeline] == list(range(6))
    # updates after batches 1, 3, 5; the scheduler halves the rate after each update
    assert [p.lr for p in report.timeline] == pytest.approx([0.1, 0.1, 0.05, 0.05, 0.025, 0.025])
    assert report.to_dict()["timeline"][2]["lr"] == pytest.approx(0.05)

    # ground truth: a plain Paddle loop with the same accumulation (backward of loss / 2, step every 2)
    model = classifier()
    sched = paddle.optimizer.lr.StepDecay(learning_rate=0.1, step_size=1, gamma=0.5)
    opt = paddle.optimizer.SGD(learning_rate=sched, parameters=model.parameters())
    for i, (x, y) in enumerate(batches(6)):
        out = model(paddle.to_tensor(x))
        loss = paddle.nn.functional.cross_entropy(out, paddle.to_tensor(y).unsqueeze(-1))
        (loss / 2).backward()
        if i % 2 == 1:
            opt.step()
            opt.clear_grad()
            sched.step()
    for (name, want), got in zip(model.state_dict().items(), captured["model"].state_dict().values()):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)


def test_scheduler_by_epoch_steps_at_each_epoch_end(tmp_path, monkeypatch):
    import nandoctor.probe as probe_mod

    monkeypatch.setattr(probe_mod, "build_optimizer", _hand_built({}))
    report = probe(tmp_path, steps=7, data_args={"n": 3}, spec_edit=_set(1, by="epoch"))
    assert report.findings == []
    assert [p.lr for p in report.timeline] == pytest.approx([0.1] * 3 + [0.05] * 3 + [0.025])


def test_fault_under_accumulation_names_the_right_batch_and_samples(tmp_path):
    report = probe(tmp_path, steps=8, model_args={"log": True}, data_args={"zero_batch": 3, "zero_rows": [2, 5]},
                   spec_edit=lambda spec: setattr(spec.optimizer, "accumulate_steps", 2))
    ff = report.first_fault
    assert (ff.step, ff.batch_index, ff.sample_indices) == (3, 3, [2, 5])
    assert ff.phase == Phase.FORWARD and ff.op == "log"
    assert [p.step for p in report.timeline][:3] == [0, 1, 2]


def test_loss_that_is_not_a_tensor_names_the_step_and_what_to_return(tmp_path):
    report = probe(tmp_path, step="step_float")
    assert codes(report) == {"loss.not_tensor"}
    [f] = report.findings
    assert "step.entry" in f.message and "step_float" in f.message and "is a float" in f.message
    assert ".item()" in f.message and f.location.phase == Phase.LOSS and f.location.step == 0
    assert report.verdict.value == "crashed" and report.exit_code == 1


def test_a_long_run_keeps_bounded_records_and_every_recent_step(monkeypatch) -> None:
    """Memory constant per step: over many steps the records are thinned (old ones evenly spaced over the
    run, per-tensor arrays on a bounded number of them), the recent ones kept in full; the report says so."""
    import nandoctor
    from nandoctor.engine import watcher as watcher_module

    monkeypatch.setattr(watcher_module, "MAX_RECORDS", 64)
    monkeypatch.setattr(watcher_module, "RECENT_STEPS", 16)
    monkeypatch.setattr(watcher_module, "MAX_ARRAYS", 4)
    paddle.seed(0)
    model = paddle.nn.Linear(4, 1)
    opt = paddle.optimizer.SGD(learning_rate=0.01, parameters=model.parameters())
    steps = 500
    with nandoctor.watch(model, opt, report_dir=None) as doctor:
        for _ in range(steps):
            loss = (model(paddle.randn([8, 4])) ** 2).mean()
            loss.backward()
            assert doctor.check(loss)
            opt.step()
            opt.clear_grad()
        records = doctor.watcher.records
        assert len(records) <= 64 and len(doctor.watcher.stats_every) <= 64
        assert [r.step for r in records[-16:]] == list(range(steps - 16, steps))  # the recent steps, all
        steps_kept = [r.step for r in records]
        assert steps_kept == sorted(steps_kept) and steps_kept[0] == 0
        # evenly spaced over the whole run (every step that is a multiple of a stride), not the oldest
        # stretch thinned most; the steps that aged out of the recent window since the last thinning follow
        stride = steps_kept[1] - steps_kept[0]
        spaced = [s for s in steps_kept if s % stride == 0]
        assert spaced == list(range(0, spaced[-1] + 1, stride)) and len(spaced) >= 4
        # the thinned part keeps per-tensor arrays on at most MAX_ARRAYS records (one more may have aged since)
        with_arrays = [r.step for r in records if r.step in spaced and r.grad_sq is not None]
        assert len(with_arrays) <= 4 + 1 < len(spaced)
    report = doctor.summary()
    assert report.details["timeline_thinned"]["steps_run"] == steps
    assert len(report.timeline) == len(records)
