"""`doctor.check(loss)` called before `loss.backward()`: not a loss that cannot train, but a loop in that
order. The gradients are checked at `optimizer.step()` instead, and a faulty update is still not applied."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

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
