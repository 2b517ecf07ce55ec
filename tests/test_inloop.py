"""nandoctor.watch in a plain Paddle loop: the same first fault as `nandoctor probe`, and nothing left behind.

Ground truth for the two sample workloads is the probe's (itself checked against Paddle's tensor checker
in float64 by tests/test_probe_samples.py); the loop here is the plain loop a user writes, built from the
sample's own model.py and data.py.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from inloop_helpers import example_module, fault_of, probe_first_fault, sample_module

import nandoctor
from nandoctor.report.console import render_text

# What tests/test_probe_samples.py established for these samples (tensor checker + float64 on the host).
SQRT = {"step": 6, "phase": "backward", "layer": "head.distance", "op": "sqrt_grad", "batch_index": 6,
        "sample_indices": [3]}
LOG = {"step": 12, "phase": "loss", "layer": None, "op": "log", "batch_index": 12, "sample_indices": [3, 11]}


def _sqrt_step(model: Any, batch: Any) -> Any:
    a, b, target = (paddle.to_tensor(v) for v in batch)
    out = model(a, b)
    return F.mse_loss(out, target.reshape(out.shape))


def _log_step(model: Any, batch: Any) -> Any:
    loss_mod = sample_module("log_of_zero", "loss")
    x, y = (paddle.to_tensor(v) for v in batch)
    return loss_mod.bce_loss(model(x), y)


def _sqrt_loop(tmp_path: Path, *, on_fault: str = "stop", step_fn: Any = _sqrt_step, accumulate: int = 1,
               scheduler: bool = False, fail_at: int | None = None, report_dir: Path | None = None
               ) -> tuple[Any, Any, Any]:
    paddle.seed(0)
    model = sample_module("sqrt_at_zero", "model").build_model(in_features=10, dim=8)
    data = sample_module("sqrt_at_zero", "data").build_loader(batches=20, batch_size=8, bad_batch=6,
                                                              duplicate_sample=3)
    lr: Any = 0.003
    if scheduler:
        lr = paddle.optimizer.lr.StepDecay(learning_rate=0.003, step_size=2, gamma=0.5)
    opt = paddle.optimizer.Adam(learning_rate=lr, parameters=model.parameters())
    doctor = nandoctor.watch(model, opt, step_fn=step_fn, report_dir=report_dir or tmp_path / "report",
                             on_fault=on_fault, fields=["a", "b", "target"])
    with doctor:
        for i, batch in enumerate(data):
            if fail_at is not None and i == fail_at:
                raise KeyError("the user's loop broke")
            loss = _sqrt_step(model, batch)
            (loss / accumulate).backward()
            ok = doctor.check(loss, batch)
            if not ok and on_fault == "stop":
                break
            if (i + 1) % accumulate == 0:
                opt.step()
                opt.clear_grad()
                if scheduler:
                    lr.step()
    return doctor, model, opt


def _hooks(model: Any) -> int:
    """The hooks on the model and its layers, and a forward set on any of their instances (the watch's seam)."""
    return sum(len(layer._forward_pre_hooks) + len(layer._forward_post_hooks) + ("forward" in vars(layer))
               for layer in [model, *model.sublayers()])


def test_plain_loop_names_the_same_first_fault_as_the_probe(tmp_path: Path) -> None:
    expected = probe_first_fault("sqrt_at_zero")
    assert {k: expected[k] for k in SQRT} == SQRT
    doctor, model, opt = _sqrt_loop(tmp_path)
    assert fault_of(doctor.report) == expected  # parameter included
    assert doctor.step == 7
    # the report folder: JSON and Markdown with the same fault, the batch and the pre-step state
    folder = tmp_path / "report"
    data = json.loads((folder / "report.json").read_text(encoding="utf-8"))
    assert data["verdict"] == "nan_found" and data["first_fault"] == doctor.report.to_dict()["first_fault"]
    markdown = (folder / "report.md").read_text(encoding="utf-8")
    assert "head.distance" in markdown
    # titled by what ran; no exit status, since nandoctor does not end the user's process
    assert markdown.startswith("# nandoctor.watch: ") and "exit status" not in markdown
    text = render_text(doctor.report)
    assert text.startswith("nandoctor.watch: ") and "Exit status" not in text and "--markdown" not in text
    batch = np.load(folder / "batch.npz", allow_pickle=False)
    assert sorted(batch.files) == ["a", "b", "target"]
    np.testing.assert_array_equal(batch["a"][3], batch["b"][3])  # the duplicate pair
    assert (folder / "state.npz").is_file() and (folder / "rng_state.json").is_file()
    assert "model.py:" in (doctor.report.details.get("source") or "")  # the sample's own source line
    # everything undone: hooks, the optimizer's wrapper, the checker
    assert _hooks(model) == 0
    assert "step" not in vars(opt)


def test_loss_phase_fault_matches_the_probe(tmp_path: Path) -> None:
    expected = probe_first_fault("log_of_zero")
    assert {k: expected[k] for k in LOG} == LOG
    paddle.seed(0)
    model = sample_module("log_of_zero", "model").build_model(in_features=8, hidden=16)
    data = sample_module("log_of_zero", "data").build_loader(batches=40, batch_size=16, bad_batch=12,
                                                             bad_samples=(3, 11))
    opt = paddle.optimizer.Adam(learning_rate=0.01, parameters=model.parameters())
    with nandoctor.watch(model, opt, step_fn=_log_step, report_dir=tmp_path / "r", fields=["x", "y"]) as doctor:
        for batch in data:
            loss = _log_step(model, batch)
            loss.backward()
            if not doctor.check(loss, batch):
                break
            opt.step()
            opt.clear_grad()
    assert fault_of(doctor.report) == expected


def test_healthy_loop_finds_nothing_and_writes_nothing(tmp_path: Path) -> None:
    plain = example_module("plain_loop")
    assert plain.main(healthy=True, report_dir=str(tmp_path / "report")) == 0
    assert not (tmp_path / "report").exists()


def test_example_script_reports_and_returns_1(tmp_path: Path) -> None:
    plain = example_module("plain_loop")
    assert plain.main(report_dir=str(tmp_path / "report")) == 1
    data = json.loads((tmp_path / "report" / "report.json").read_text(encoding="utf-8"))
    assert {k: data["first_fault"][k] for k in ("step", "phase", "layer", "op", "sample_indices")} == {
        "step": 6, "phase": "backward", "layer": "distance", "op": "sqrt_grad", "sample_indices": [3]}


def test_hooks_are_removed_when_the_loop_raises(tmp_path: Path) -> None:
    paddle.seed(0)
    with pytest.raises(KeyError):
        _sqrt_loop(tmp_path, fail_at=3)
    # the model of the failed loop is gone with the frame; build one and watch it the same way
    model = sample_module("sqrt_at_zero", "model").build_model()
    opt = paddle.optimizer.Adam(learning_rate=0.003, parameters=model.parameters())
    before = _hooks(model)
    with pytest.raises(ValueError):
        with nandoctor.watch(model, opt, report_dir=tmp_path / "r"):
            assert _hooks(model) > before and "step" in vars(opt)
            raise ValueError("boom")
    assert _hooks(model) == before and "step" not in vars(opt)


def test_on_fault_raise(tmp_path: Path) -> None:
    with pytest.raises(nandoctor.NonFiniteError) as info:
        _sqrt_loop(tmp_path, on_fault="raise")
    assert fault_of(info.value.report)["layer"] == "head.distance"
    assert "step 6" in str(info.value)


def test_on_fault_skip_step_trains_on_with_finite_parameters(tmp_path: Path) -> None:
    doctor, model, _ = _sqrt_loop(tmp_path, on_fault="skip_step")
    assert doctor.skipped == [6] and doctor.step == 20  # the loop went on to the end
    assert fault_of(doctor.report)["sample_indices"] == [3]
    for name, p in model.named_parameters():
        assert bool(paddle.isfinite(p).all()), name
    assert len(doctor.watcher.records) == 20  # 19 healthy steps and the faulty one


def test_detection_only_without_step_fn(tmp_path: Path) -> None:
    doctor, _, _ = _sqrt_loop(tmp_path, step_fn=None)
    ff = fault_of(doctor.report)
    assert (ff["step"], ff["phase"], ff["layer"], ff["op"]) == (6, "backward", None, None)
    assert ff["parameter"] is not None  # the first parameter whose gradient is NaN
    assert "step_fn" in doctor.report.findings[0].message


def test_gradient_accumulation_and_lr_scheduler(tmp_path: Path) -> None:
    doctor, _, _ = _sqrt_loop(tmp_path, accumulate=2, scheduler=True)
    ff = fault_of(doctor.report)
    assert (ff["step"], ff["layer"], ff["op"], ff["sample_indices"]) == (6, "head.distance", "sqrt_grad", [3])
    lrs = [p.lr for p in doctor.report.timeline]
    # one update every 2 batches, the scheduler halving every 2 updates: lr per batch as the optimizer saw it
    assert lrs[:6] == pytest.approx([0.003, 0.003, 0.003, 0.003, 0.0015, 0.0015])


def test_warnings_are_logged_as_they_happen(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A layer beyond float16's range is logged at the step it happens, and the report carries it."""
    paddle.seed(0)
    model = paddle.nn.Sequential(paddle.nn.Linear(4, 4), paddle.nn.Linear(4, 1))
    with paddle.no_grad():
        model[0].weight.set_value(paddle.full([4, 4], 3.0e4))
    opt = paddle.optimizer.SGD(learning_rate=0.0, parameters=model.parameters())
    x = paddle.ones([2, 4])
    with caplog.at_level(logging.WARNING, logger="nandoctor"):
        with nandoctor.watch(model, opt, report_dir=tmp_path / "r") as doctor:
            for _ in range(3):
                loss = model(x).mean()
                loss.backward()
                assert doctor.check(loss, x)
                opt.step()
                opt.clear_grad()
    assert any("beyond float16" in r.getMessage() and "0" in r.getMessage() for r in caplog.records)
    codes = {f.code.value for f in doctor.report.findings}
    assert "precision.fp16_overflow" in codes
    assert (tmp_path / "r" / "report.json").is_file()
    assert math.isfinite(doctor.report.timeline[0].loss)


def test_grad_scaler_loop(tmp_path: Path) -> None:
    """The AMP loop shape (scale, backward, check, scaler.step, update): same first fault; on CPU the scaler
    is inert (paddle-notes), so this checks the wiring, not float16 numerics."""
    paddle.seed(0)
    model = sample_module("sqrt_at_zero", "model").build_model(in_features=10, dim=8)
    data = sample_module("sqrt_at_zero", "data").build_loader(batches=20, batch_size=8, bad_batch=6,
                                                              duplicate_sample=3)
    opt = paddle.optimizer.Adam(learning_rate=0.003, parameters=model.parameters())
    scaler = paddle.amp.GradScaler(init_loss_scaling=1024)
    with nandoctor.watch(model, opt, step_fn=_sqrt_step, scaler=scaler, report_dir=tmp_path / "r",
                         fields=["a", "b", "target"]) as doctor:
        for batch in data:
            loss = _sqrt_step(model, batch)
            scaler.scale(loss).backward()
            if not doctor.check(loss, batch):
                break
            scaler.step(opt)
            scaler.update()
            opt.clear_grad()
    ff = fault_of(doctor.report)
    assert (ff["step"], ff["layer"], ff["op"], ff["sample_indices"]) == (6, "head.distance", "sqrt_grad", [3])


def test_an_additive_mask_in_the_checked_batch_trains_on_and_a_nan_in_x_is_named(tmp_path: Path) -> None:
    """A Llama-style batch carries its causal mask as 0 / -inf on purpose: that is no fault (it used to stop
    training at step 0). A NaN planted in x at step 3 still is, named as data, by its sample."""
    from probe_models import mask_loader, masked_attention

    for nan_batch, expected in ((-1, None), (3, {"step": 3, "phase": "data", "sample_indices": [2]})):
        model = masked_attention()
        opt = paddle.optimizer.Adam(learning_rate=0.01, parameters=model.parameters())
        with nandoctor.watch(model, opt, report_dir=tmp_path / f"r{nan_batch}") as doctor:
            for batch in mask_loader(nan_batch=nan_batch, nan_row=2):
                x, mask, y = (paddle.to_tensor(batch[k]) for k in ("x", "mask", "label"))
                loss = F.cross_entropy(model(x, mask), y)
                loss.backward()
                if not doctor.check(loss, batch):
                    break
                opt.step()
                opt.clear_grad()
        if expected is None:
            assert doctor.report is None and doctor.step == 6
        else:
            ff = doctor.report.to_dict()["first_fault"]
            assert {k: ff[k] for k in expected} == expected
            assert [f.location.field for f in doctor.report.findings if f.code.value == "data.nonfinite"] == ["x"]


class _RaisesAt(paddle.nn.Layer):
    """A Linear whose forward raises at one call, as a shape bug in a user's layer does."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.fc = paddle.nn.Linear(4, 1)
        self.calls, self.at = 0, at

    def forward(self, x: Any) -> Any:
        self.calls += 1
        if self.calls == self.at + 1:
            raise ValueError("a reshape that does not fit this batch")
        return self.fc(x)


def _crashing_loop(tmp_path: Path, *, model_at: int = -1, loader_at: int = -1, between_at: int = -1) -> Any:
    paddle.seed(0)
    net = paddle.nn.Sequential(_RaisesAt(model_at))
    opt = paddle.optimizer.SGD(learning_rate=0.01, parameters=net.parameters())

    def batches() -> Any:
        rng = np.random.default_rng(0)
        for i in range(6):
            if i == loader_at:
                raise KeyError("fish")
            yield rng.normal(size=(4, 4)).astype("float32"), rng.normal(size=(4, 1)).astype("float32")

    doctor = None
    with pytest.raises((ValueError, KeyError, RuntimeError)):
        with nandoctor.watch(net, opt, report_dir=tmp_path / "r") as doctor:
            for i, (x, y) in enumerate(batches()):
                loss = F.mse_loss(net(paddle.to_tensor(x)), paddle.to_tensor(y))
                loss.backward()
                assert doctor.check(loss, (x, y))
                opt.step()
                opt.clear_grad()
                if i == between_at:
                    raise RuntimeError("a logging callback failed")
    return doctor


def test_an_exception_in_the_loop_is_reported_where_it_came_from(tmp_path: Path) -> None:
    """The probe's user_code.error, at the step and phase the exception came out of; the exception still
    reaches the caller. Code between steps that is not the training's is not blamed on a phase."""
    doctor = _crashing_loop(tmp_path / "model", model_at=3)
    ff = fault_of(doctor.report)
    assert (ff["step"], ff["phase"], ff["layer"]) == (3, "forward", "0")
    assert doctor.report.findings[0].code.value == "user_code.error"
    assert json.loads((tmp_path / "model" / "r" / "report.json").read_text(encoding="utf-8"))["verdict"] == "crashed"
    doctor = _crashing_loop(tmp_path / "loader", loader_at=2)
    ff = fault_of(doctor.report)
    assert (ff["step"], ff["phase"], ff["layer"]) == (2, "data", None)
    assert "KeyError" in doctor.report.findings[0].message
    doctor = _crashing_loop(tmp_path / "between", between_at=1)
    assert doctor.report is None and not (tmp_path / "between" / "r").exists()


def test_nothing_of_nandoctors_raises_inside_the_users_loop(tmp_path: Path) -> None:
    """A step_fn that raises when nandoctor replays it, and a report_dir that cannot be written: check()
    still returns False at the fault (the loop stops as asked) and says why, instead of raising into the loop."""
    def flaky_step(model: Any, batch: Any) -> Any:  # (the loop trains with _sqrt_step: this runs in replays)
        raise RuntimeError("a global counter the step did not expect")

    doctor, _, _ = _sqrt_loop(tmp_path, step_fn=flaky_step)
    ff = fault_of(doctor.report)
    assert (ff["step"], ff["phase"], ff["layer"]) == (6, "backward", None)  # what the step's numbers say
    assert "your step_fn raised RuntimeError" in doctor.report.details["replay_failed"]
    assert "flaky_step" in doctor.report.details["replay_failed"]

    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder", encoding="utf-8")
    doctor, _, _ = _sqrt_loop(tmp_path, report_dir=blocker / "report")
    assert fault_of(doctor.report)["op"] == "sqrt_grad" and doctor.step == 7


