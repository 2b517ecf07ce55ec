"""A layer unfrozen mid-run (a backbone after warm-up) trains from then on: its gradients count from the
step it is unfrozen, so its first NaN gradient is named at that step, not at the next step's loss."""

from __future__ import annotations

import numpy as np
import paddle

import nandoctor

UNFREEZE_AT = 3


class Gated(paddle.nn.Layer):
    """`gate` starts frozen; its weight holds a 0, where sqrt(w * w) has a NaN gradient (inf * 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = paddle.nn.Linear(4, 4)
        self.gate = paddle.nn.Linear(4, 4)
        w = self.gate.weight.numpy()
        w[0, 0] = 0.0
        self.gate.weight.set_value(w)
        for p in self.gate.parameters():
            p.stop_gradient = True

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.body(x) + 1e-3 * paddle.sqrt(self.gate.weight * self.gate.weight).sum()


def _batches(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=(8, 4)).astype("float32"), "y": rng.normal(size=(8, 4)).astype("float32")}
            for _ in range(n)]


def _loss(model: paddle.nn.Layer, batch: dict) -> paddle.Tensor:
    return ((model(batch["x"]) - batch["y"]) ** 2).mean()


def _tensors(batch: dict) -> dict:
    return {k: paddle.to_tensor(v) for k, v in batch.items()}


def _plain_first_nonfinite_gradient(batches: list) -> tuple[int, str] | None:
    """Ground truth: a plain loop; every gradient there is read on the host in float64."""
    paddle.seed(0)
    model = Gated()
    opt = paddle.optimizer.SGD(learning_rate=0.01, parameters=model.parameters())
    for step, batch in enumerate(batches):
        if step == UNFREEZE_AT:
            model.gate.weight.stop_gradient = False
        _loss(model, _tensors(batch)).backward()
        for name, p in model.named_parameters():
            if p.grad is not None and not np.isfinite(p.grad.numpy().astype("float64")).all():
                return step, name
        opt.step()
        opt.clear_grad()
    return None


def test_a_layer_unfrozen_mid_run_is_watched_from_then_on(tmp_path) -> None:
    batches = _batches(8)
    expected = _plain_first_nonfinite_gradient(batches)
    assert expected == (UNFREEZE_AT, "gate.weight")
    paddle.seed(0)
    model = Gated()
    opt = paddle.optimizer.SGD(learning_rate=0.01, parameters=model.parameters())
    with nandoctor.watch(model, opt, step_fn=_loss, report_dir=tmp_path / "rep") as doctor:
        for step, batch in enumerate(batches):
            if step == UNFREEZE_AT:
                model.gate.weight.stop_gradient = False
            fields = _tensors(batch)
            loss = _loss(model, fields)
            loss.backward()
            if not doctor.check(loss, fields):
                break
            opt.step()
            opt.clear_grad()
    ff = doctor.report.first_fault
    assert (ff.step, ff.phase.value, ff.op, ff.parameter) == (expected[0], "backward", "sqrt_grad", expected[1])
    assert np.isfinite(model.gate.weight.numpy()).all()  # the faulty update was not applied
