"""A NaN made inside a layer and hidden from the loss by relu (Paddle's relu(NaN) is 0): the loss stays finite
and the gradients go NaN. The finding says what was seen, the non-finite value inside that layer, hidden
before the loss, and never that the forward pass was finite; the probe and the in-loop watch agree.

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

DATA = {"scale": 0.1, "spike_batch": 3, "spike_rows": [5], "batches": 6}
LR = 0.01


def _ce(model: paddle.nn.Layer, batch: tuple) -> paddle.Tensor:
    return paddle.nn.functional.cross_entropy(model(batch[0]), batch[1].unsqueeze(-1))


def _batches() -> list[tuple[paddle.Tensor, paddle.Tensor]]:
    return [(paddle.to_tensor(x), paddle.to_tensor(y)) for x, y in pm.loader(**DATA)]


@pytest.fixture(scope="module", params=[True, False], ids=["relu_inside", "relu_after"])
def truth(request: pytest.FixtureRequest) -> dict:
    relu_inside = request.param
    model = pm.hidden_nan(relu_inside)
    found = first_hooked_fault(model, _batches(), _ce, paddle.optimizer.Adam(learning_rate=LR,
                                                                            parameters=model.parameters()))
    assert found is not None and np.isfinite(found["loss"]) and found["bad_grads"]
    if relu_inside:  # no layer's output is NaN: the NaN lives inside root, between its Linear and its relu
        assert found["bad_layers"] == []
        under = found["outputs"]["root.fc"] + 1.0
        rows = sorted({int(r) for r in np.argwhere(under < 0)[:, 0]})
    else:
        assert found["bad_layers"][0] == "root"
        rows = found["bad_rows"]
    assert rows == [5]
    return {**found, "relu_inside": relu_inside, "rows": rows}


def _assert_says_hidden(report, truth: dict) -> None:
    ff = report.first_fault
    assert (ff.step, ff.layer, ff.sample_indices) == (truth["step"], "root", truth["rows"])
    finding = next(f for f in report.findings if f.severity.value == "error")
    text = finding.message
    if truth["relu_inside"]:  # seen as a NaN gradient; the forward's NaN made in root is named with its op
        assert finding.code.value == "grad.nonfinite" and ff.op == "sqrt_grad"
        assert "made in the forward pass" in text and "in layer root (op sqrt)" in text
        assert finding.evidence["hidden_forward_op"] == "sqrt"
        assert finding.advice[0].startswith("sqrt of a negative number")  # not sqrt_grad's "at 0"
    else:
        assert finding.code.value == "activation.nonfinite" and ff.op == "sqrt"
        assert "Layer root's forward output became NaN/Inf" in text
    assert "hid" in text and "relu turns NaN into 0" in text
    assert f"loss stayed finite ({truth['loss']:.4g})" in text
    assert not any("forward pass was finite" in a for a in [text, *finding.advice])


def test_watch_says_the_nan_was_hidden_inside_the_layer(truth: dict, tmp_path: Path) -> None:
    model = pm.hidden_nan(truth["relu_inside"])
    opt = paddle.optimizer.Adam(learning_rate=LR, parameters=model.parameters())
    with nandoctor.watch(model, opt, step_fn=_ce, report_dir=tmp_path / "rep") as doctor:
        for batch in _batches():
            loss = _ce(model, batch)
            loss.backward()
            if not doctor.check(loss, batch):
                break
            opt.step()
            opt.clear_grad()
    _assert_says_hidden(doctor.report, truth)


def test_probe_says_the_nan_was_hidden_inside_the_layer(truth: dict, tmp_path: Path) -> None:
    raw = {"version": 1, "model": {"entry": f"{pm.__file__}:hidden_nan", "args": {"relu_inside": truth["relu_inside"]}},
           "data": {"entry": f"{pm.__file__}:loader", "args": DATA, "fields": ["x", "label"], "label": "label"},
           "loss": {"builtin": "cross_entropy"}, "optimizer": {"name": "Adam", "args": {"learning_rate": LR}}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
    report = run_probe(load_spec(tmp_path / "config.yaml"), ProbeOptions(steps=6, seed=0, device="cpu",
                                                                        try_fixes=False))
    _assert_says_hidden(report, truth)
