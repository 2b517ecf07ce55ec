"""`doctor.check(loss)` called before `loss.backward()`: not a loss that cannot train, but a loop in that
order. The loss is checked at `check()`, the gradients at `optimizer.step()`, and a faulty update is still not
applied. A loop that never calls backward (it monitors the loss) has its NaN loss answered False by that check."""

from __future__ import annotations

import contextlib

import numpy as np
import paddle
import pytest
from inloop_helpers import first_hooked_fault

import nandoctor


class Distance(paddle.nn.Layer):
    """sqrt of a squared distance: its gradient is NaN where a pair is equal (distance 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = paddle.nn.Linear(4, 4)

    def forward(self, a: paddle.Tensor, b: paddle.Tensor) -> paddle.Tensor:
        return paddle.sqrt(((self.proj(a) - self.proj(b)) ** 2).sum(axis=-1))


def _batches(n: int, bad: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        a = rng.normal(size=(8, 4)).astype("float32")
        b = rng.normal(size=(8, 4)).astype("float32")
        if i == bad:
            b[5] = a[5]
        out.append((a, b))
    return out


def _first_nonfinite_grad_step(batches: list) -> int | None:
    """Ground truth: a plain loop, gradients read on the host in float64."""
    paddle.seed(0)
    model = Distance()
    opt = paddle.optimizer.SGD(learning_rate=0.01, parameters=model.parameters())
    for step, (a, b) in enumerate(batches):
        model(paddle.to_tensor(a), paddle.to_tensor(b)).mean().backward()
        if not all(np.isfinite(p.grad.numpy().astype("float64")).all() for p in model.parameters()):
            return step
        opt.step()
        opt.clear_grad()
    return None


@pytest.mark.parametrize("bad", [None, 3])
def test_check_before_backward_checks_gradients_at_the_update(tmp_path, bad) -> None:
    batches = _batches(6, -1 if bad is None else bad)
    expected = _first_nonfinite_grad_step(batches)
    assert expected == bad
    paddle.seed(0)
    model = Distance()
    opt = paddle.optimizer.SGD(learning_rate=0.01, parameters=model.parameters())
    doctor = nandoctor.watch(model, opt, step_fn=lambda m, batch: m(batch["a"], batch["b"]).mean(),
                             report_dir=tmp_path / "rep")
    with doctor:
        for a, b in batches:
            fields = {"a": paddle.to_tensor(a), "b": paddle.to_tensor(b)}
            loss = model(fields["a"], fields["b"]).mean()
            ok = doctor.check(loss, fields)  # before backward, as some loops do
            loss.backward()
            before = [p.numpy().copy() for p in model.parameters()]
            opt.step()
            opt.clear_grad()
            if not ok or doctor.fault is not None:
                # the faulty update was not applied
                assert all(np.array_equal(x, p.numpy()) for x, p in zip(before, model.parameters()))
                break
    report = doctor.report
    if expected is None:
        assert report is None and doctor.fault is None
        return
    assert report is not None and report.first_fault is not None
    ff = report.first_fault
    assert (ff.step, ff.phase.value, ff.op) == (expected, "backward", "sqrt_grad")
    assert all(f.code.value != "loss.no_grad" for f in report.findings)
    assert all(np.isfinite(p.numpy()).all() for p in model.parameters())


class Rooted(paddle.nn.Layer):
    """`root` takes sqrt of its input (NaN for a negative value), `head` classifies: a NaN loss from the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.root = paddle.nn.Sequential(paddle.nn.Linear(4, 4), _Sqrt())
        self.head = paddle.nn.Linear(4, 3)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.head(self.root(x))


class _Sqrt(paddle.nn.Layer):
    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return paddle.sqrt(x + 4.0)


def _ce(model: paddle.nn.Layer, batch: tuple) -> paddle.Tensor:
    return paddle.nn.functional.cross_entropy(model(batch[0]), batch[1])


def _class_batches(n: int, bad: int, row: int) -> list[tuple[paddle.Tensor, paddle.Tensor]]:
    rng = np.random.default_rng(1)
    out = []
    for i in range(n):
        x = rng.normal(size=(8, 4)).astype("float32") * 0.1
        if i == bad:
            x[row] = 400.0  # the first Linear's output goes far below -4 somewhere in this row: sqrt of a negative
        out.append((paddle.to_tensor(x), paddle.to_tensor(rng.integers(0, 3, size=(8, 1)))))
    return out


@pytest.mark.parametrize("with_optimizer,step_fn,evaluation",
                         [(True, True, False), (False, True, False), (True, False, False), (True, True, True)])
def test_a_loop_that_never_calls_backward_gets_its_nan_loss_answered(tmp_path, with_optimizer, step_fn,
                                                                     evaluation) -> None:
    """check(loss) each step, no backward, no update (loss monitoring; `evaluation`: the model in eval mode,
    the loss computed under paddle.no_grad()): the check of the step whose loss is NaN returns False, and the
    report names that step, and with step_fn the phase and layer a plain loop's forward hooks saw (it used to
    return True, waiting for an optimizer.step() that never came; under no_grad, a loss.no_grad at step 0)."""
    batches = _class_batches(8, bad=4, row=6)
    paddle.seed(0)
    truth = first_hooked_fault(Rooted(), batches, _ce)
    assert truth is not None and truth["step"] == 4 and not np.isfinite(truth["loss"])
    assert truth["bad_layers"][0] == "root.1" and truth["bad_rows"] == [6]
    paddle.seed(0)
    model = Rooted()
    opt = paddle.optimizer.Adam(parameters=model.parameters()) if with_optimizer else None
    if evaluation:
        model.eval()
    answers = []
    with nandoctor.watch(model, opt, step_fn=_ce if step_fn else None, report_dir=tmp_path / "rep") as doctor:
        for batch in batches:
            with paddle.no_grad() if evaluation else contextlib.nullcontext():
                loss = _ce(model, batch)
            answers.append(doctor.check(loss, batch))
            if not answers[-1]:
                break
    assert answers == [True] * truth["step"] + [False]
    report = doctor.report
    assert report is not None and report.first_fault is not None
    ff = report.first_fault
    assert ff.step == truth["step"] and ff.batch_index == truth["step"]
    if step_fn:  # replayed: where the forward went non-finite, and by which sample
        assert (ff.phase.value, ff.layer, ff.op, ff.sample_indices) == ("forward", "root.1", "sqrt", truth["bad_rows"])
    else:  # detection only: the loss, at its step
        assert ff.phase.value == "loss" and report.findings[0].code.value == "loss.nonfinite"
    assert all(f.code.value != "loss.no_grad" for f in report.findings)
    # the steps before the fault are in the timeline with the losses the loop computed
    assert [p.step for p in report.timeline][:truth["step"]] == list(range(truth["step"]))


def test_check_before_backward_answers_a_nan_loss_at_the_check(tmp_path) -> None:
    """check() before backward, then backward and step as the loop has them: a NaN loss makes that check return
    False and the update the loop still calls is not applied."""
    batches = _class_batches(8, bad=3, row=2)
    paddle.seed(0)
    model = Rooted()
    truth = first_hooked_fault(model, batches, _ce, paddle.optimizer.SGD(learning_rate=0.01,
                                                                        parameters=model.parameters()))
    assert truth is not None and truth["step"] == 3 and not np.isfinite(truth["loss"])
    paddle.seed(0)
    model = Rooted()
    opt = paddle.optimizer.SGD(learning_rate=0.01, parameters=model.parameters())
    with nandoctor.watch(model, opt, step_fn=_ce, report_dir=tmp_path / "rep") as doctor:
        for step, batch in enumerate(batches):
            loss = _ce(model, batch)
            ok = doctor.check(loss, batch)
            assert ok == (step < truth["step"])
            loss.backward()
            before = [p.numpy().copy() for p in model.parameters()]
            opt.step()
            opt.clear_grad()
            if not ok:
                assert all(np.array_equal(x, p.numpy()) for x, p in zip(before, model.parameters()))
                break
    ff = doctor.report.first_fault
    assert (ff.step, ff.phase.value, ff.layer, ff.sample_indices) == (3, "forward", "root.1", truth["bad_rows"])
