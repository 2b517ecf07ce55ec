"""A NaN made inside a layer that never reaches the loss: relu hides it (Paddle's relu(NaN) is 0), or the loss
ignores the row that holds it. The loss stays finite and the gradients go NaN. The finding says what was seen,
the non-finite value inside that layer and what kept it from the loss, never that the forward pass was
finite; the probe and the in-loop watch agree.

Ground truth: a plain Paddle loop (Adam, as the probe trains) with forward hooks, read on the host in float64:
the step, the finite loss, the NaN gradients, and the rows whose value went NaN inside the layer (its output,
or with the relu inside it, its Linear's output below -1 under the sqrt)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import paddle
import probe_models as pm
import pytest
import yaml
from inloop_helpers import first_hooked_fault

import nandoctor
from nandoctor.probe import ProbeOptions, run_probe
from nandoctor.spec import load_spec

ROW = 5
DATA = {"scale": 0.1, "spike_batch": 3, "spike_rows": [ROW], "batches": 6}
IGNORED = {**DATA, "label_batch": 3, "label_row": ROW, "label_value": -100}  # that row's label is padding
LR = 0.01


def _batches(data: dict) -> list[tuple[paddle.Tensor, paddle.Tensor]]:
    return [(paddle.to_tensor(x), paddle.to_tensor(y)) for x, y in pm.loader(**data)]


def _step(model: paddle.nn.Layer, batch: tuple) -> paddle.Tensor:
    return pm.ce_ignore(model(batch[0]), batch[1])


@pytest.fixture(scope="module", params=["inside", "after", "none"])
def truth(request: pytest.FixtureRequest) -> dict:
    relu = request.param
    data = IGNORED if relu == "none" else DATA
    model = pm.hidden_nan(relu)
    found = first_hooked_fault(model, _batches(data), _step,
                               paddle.optimizer.Adam(learning_rate=LR, parameters=model.parameters()))
    assert found is not None and np.isfinite(found["loss"]) and found["bad_grads"]
    if relu == "inside":  # no layer's output is NaN: the NaN lives inside root, between its Linear and its relu
        assert found["bad_layers"] == []
        rows = sorted({int(r) for r in np.argwhere(found["outputs"]["root.fc"] + 1.0 < 0)[:, 0]})
    else:  # root's output is NaN; relu after it hides it, or (none) the model's output holds it too
        assert found["bad_layers"][0] == "root" and ("head" in found["bad_layers"]) == (relu == "none")
        rows = found["bad_rows"]
    assert rows == [ROW]
    return {**found, "relu": relu, "data": data, "rows": rows}


def _assert_says_hidden(report, truth: dict) -> None:
    ff = report.first_fault
    assert (ff.step, ff.layer, ff.sample_indices) == (truth["step"], "root", truth["rows"])
    finding = next(f for f in report.findings if f.severity.value == "error")
    text = finding.message
    loss = f"{truth['loss']:.4g}"
    if truth["relu"] == "inside":  # seen as a NaN gradient; the NaN its forward op made inside root is said too
        assert finding.code.value == "grad.nonfinite" and ff.op == "sqrt_grad"
        assert f"The loss was finite ({loss}) but the forward pass was not" in text
        assert "the same op, sqrt, made NaN inside layer root, and a later op hid it from the loss" in text
        assert "relu turns NaN into 0" in text
        assert finding.evidence["hidden_forward_op"] == "sqrt"
        assert finding.advice[0].startswith("sqrt of a negative number")  # first: the forward's own fault
    else:
        assert finding.code.value == "activation.nonfinite" and ff.op == "sqrt"
        assert "Layer root's forward output became NaN/Inf" in text
        if truth["relu"] == "after":
            assert f"The loss stayed finite ({loss}): a later op in the model hid them" in text
            assert "relu turns NaN into 0" in text
        else:
            assert f"The loss stayed finite ({loss}): the model's output held them too, and the loss left" in text
    assert not any("forward pass was finite" in a for a in [text, *finding.advice])


def test_watch_says_the_nan_was_hidden_inside_the_layer(truth: dict, tmp_path: Path) -> None:
    model = pm.hidden_nan(truth["relu"])
    opt = paddle.optimizer.Adam(learning_rate=LR, parameters=model.parameters())
    with nandoctor.watch(model, opt, step_fn=_step, report_dir=tmp_path / "rep") as doctor:
        for batch in _batches(truth["data"]):
            loss = _step(model, batch)
            loss.backward()
            if not doctor.check(loss, batch):
                break
            opt.step()
            opt.clear_grad()
    _assert_says_hidden(doctor.report, truth)


def test_probe_says_the_nan_was_hidden_inside_the_layer(truth: dict, tmp_path: Path) -> None:
    raw = {"version": 1, "model": {"entry": f"{pm.__file__}:hidden_nan", "args": {"relu": truth["relu"]}},
           "data": {"entry": f"{pm.__file__}:loader", "args": truth["data"], "fields": ["x", "label"],
                    "label": "label"},
           "loss": {"entry": f"{pm.__file__}:ce_ignore"}, "optimizer": {"name": "Adam", "args": {"learning_rate": LR}}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
    report = run_probe(load_spec(tmp_path / "config.yaml"), ProbeOptions(steps=6, seed=0, device="cpu",
                                                                        try_fixes=False))
    _assert_says_hidden(report, truth)
