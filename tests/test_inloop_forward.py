"""The watch's seam on the model's forward (nandoctor/inloop/forward.py): a forward set on the instance.

While watched, the model has no hook (Paddle's short call path) and the same signature; it trains as an
unwatched one does; a deep copy of it (an EMA or teacher model) computes with its own weights; a forward
the user set on the instance before the watch (as `paddle.jit.to_static(model)` does) is called through
and put back. Expected values come from the same loop unwatched.
"""

from __future__ import annotations

import copy
import inspect
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

import nandoctor


def _model() -> nn.Layer:
    paddle.seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))


def _batches(n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(4, 6)).astype("float32"), rng.normal(size=(4, 1)).astype("float32")) for _ in range(n)]


def _step(model: Any, batch: Any) -> Any:
    x, y = batch
    return F.mse_loss(model(x), y)


def _train(model: Any, batches: list, doctor: Any = None, between: Any = None) -> list[float]:
    """The user's loop; `between(x)` runs after each update (a teacher's forward, in training mode)."""
    opt = doctor.optimizer if doctor is not None else paddle.optimizer.SGD(0.1, parameters=model.parameters())
    losses = []
    for x, y in batches:
        x, y = paddle.to_tensor(x), paddle.to_tensor(y)
        loss = _step(model, (x, y))
        loss.backward()
        if doctor is not None:
            assert doctor.check(loss, (x, y))
        opt.step()
        opt.clear_grad()
        if between is not None:
            between(x)
        losses.append(float(loss))
    return losses


def _watch(model: Any, tmp_path: Path) -> Any:
    opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())
    return nandoctor.watch(model, opt, step_fn=_step, report_dir=tmp_path / "report")


def test_a_watched_model_has_no_hook_keeps_its_signature_and_trains_as_unwatched(tmp_path: Path) -> None:
    batches = _batches(8)
    model = _model()
    signature = inspect.signature(model.forward)
    with _watch(model, tmp_path) as doctor:
        assert not model._forward_pre_hooks and not model._forward_post_hooks  # Paddle's hook-free call
        assert inspect.signature(model.forward) == signature  # (`nandoctor run` names inputs by it)
        losses = _train(model, batches, doctor)
        assert doctor.step == len(batches) and doctor.history is not None  # every step seen, one at a time
    assert "forward" not in vars(model) and doctor.report is None
    assert losses == _train(_model(), batches)


def test_a_deep_copy_of_the_watched_model_computes_with_its_own_weights(tmp_path: Path) -> None:
    batches = _batches(8)
    model = _model()
    teacher_outputs: list[np.ndarray] = []
    with _watch(model, tmp_path) as doctor:
        teacher = copy.deepcopy(model)  # taken while watched, then trained apart
        for p in teacher.parameters():
            p.set_value(p * 0.5)
        losses = _train(model, batches, doctor, between=lambda x: teacher_outputs.append(teacher(x).numpy()))
        assert doctor.step == len(batches) and doctor.history is not None and doctor.history.ring is not None
    assert doctor.report is None and losses == _train(_model(), batches)
    # the teacher's outputs are its own forward's on its own (halved) weights, during the watch and after it
    for (x, _), out in zip(batches, teacher_outputs):
        expected = nn.Sequential.forward(teacher, paddle.to_tensor(x)).numpy()
        np.testing.assert_array_equal(out, expected)
    x = paddle.to_tensor(batches[0][0])
    np.testing.assert_array_equal(teacher(x).numpy(), nn.Sequential.forward(teacher, x).numpy())
    assert not np.allclose(teacher(x).numpy(), model(x).numpy())


def test_a_forward_set_on_the_instance_before_the_watch_is_called_through_and_put_back(tmp_path: Path) -> None:
    batches = _batches(6)
    model = _model()
    calls: list[int] = []
    own = model.forward

    def counted(*inputs: Any) -> Any:  # as paddle.jit.to_static(model) sets model.forward
        calls.append(1)
        return own(*inputs)

    model.forward = counted
    with _watch(model, tmp_path) as doctor:
        losses = _train(model, batches, doctor)
        assert doctor.step == len(batches)
    assert len(calls) == len(batches) and vars(model)["forward"] is counted
    assert losses == _train(_model(), batches)
