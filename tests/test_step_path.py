"""The probe's step path with what the spec fixes decided once (issue 23: a 0.3 ms step's own Python).

`data.inputs` set, the loss path is a closure specialised at build time (`workload._specialised`); a
tuple batch of a length already named is named without re-checking (`BatchLayout.fields`); a plain
update is one call through the boundary (`StepEngine.update`). Each must give what a plain Paddle loop
computes on the same batch, and take the checked path (same messages) whenever a batch is unusual.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from nandoctor.engine.step import StepEngine
from nandoctor.errors import SpecError
from nandoctor.findings import Phase
from nandoctor.spec import load_spec
from nandoctor.workload.build import build_optimizer, build_workload

MODELS = '''\
import paddle
import paddle.nn as nn


class Out:
    def __init__(self, logits):
        self.logits = logits


def build_model(kind="plain"):
    paddle.seed(0)

    class M(nn.Layer):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 2)

        def forward(self, x, scale=None):
            logits = self.lin(x if scale is None else x * scale)
            if kind == "tuple":
                return logits, x
            if kind == "object":
                return Out(logits)
            return logits

    return M()
'''

DATA = "def build_loader():\n    return []\n"

LOSS = "import paddle\n\ndef mse(out, y):\n    return paddle.nn.functional.mse_loss(out[:, 0], y.astype('float32'))\n"


def _workload(tmp_path: Path, inputs: str | None, *, kind: str = "plain", output: str = "",
              loss: str = "{builtin: cross_entropy}") -> object:
    (tmp_path / "models.py").write_text(MODELS)
    (tmp_path / "data.py").write_text(DATA)
    (tmp_path / "losses.py").write_text(LOSS)
    extra = f", inputs: {inputs}" if inputs is not None else ""
    out = f", output: {output}" if output else ""
    config = tmp_path / "config.yaml"
    config.write_text(textwrap.dedent(f"""\
        version: 1
        model: {{entry: "models.py:build_model", args: {{kind: {kind}}}{out}}}
        data: {{entry: "data.py:build_loader", fields: [x, y, s], label: y{extra}}}
        loss: {loss}
        optimizer: {{name: SGD, args: {{learning_rate: 0.1}}}}
        """))
    return build_workload(load_spec(config))


def _batch(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(4, 3)).astype("float32"), rng.integers(0, 2, size=4).astype("int64"),
            np.float32(2.0) * np.ones((4, 3), "float32"))


def _plain(model: object, x: object, y: object, scale: object = None) -> float:
    """The loss a user's own loop computes on the same batch."""
    x = paddle.to_tensor(x)
    logits = model(x) if scale is None else model(x, scale=paddle.to_tensor(scale))
    return float(F.cross_entropy(logits, paddle.to_tensor(np.asarray(y, "int64")).unsqueeze(-1)))


@pytest.mark.parametrize("inputs", ["[x]", "{x: x}", "{x: x, scale: s}"])
def test_specialised_loss_is_the_plain_loops_loss(tmp_path: Path, inputs: str):
    w = _workload(tmp_path, inputs)
    for i in range(3):
        x, y, s = _batch(i)
        forms = [(x, y), (paddle.to_tensor(x), paddle.to_tensor(y)),  # numpy, tensors
                 (x.tolist(), y.astype("int32")),  # a list input: the checked path; an int32 label: cast
                 (x, y.tolist()), (x, y.astype("uint8"))]  # a list label, a byte label
        for fx, fy in forms:
            fields = w.layout.fields((fx, fy, s), i)
            got = float(w.compute_loss(w.model, fields))
            want = _plain(w.model, x, y, s if "scale" in inputs else None)
            assert got == pytest.approx(want, rel=1e-6), (inputs, type(fx), type(fy))


@pytest.mark.parametrize("kind, output", [("tuple", "0"), ("object", "logits")])
def test_specialised_output_selector(tmp_path: Path, kind: str, output: str):
    w = _workload(tmp_path, "[x]", kind=kind, output=output)
    x, y, s = _batch(0)
    plain = _workload(tmp_path, None).model  # the same seeded weights, returning the logits as they are
    assert float(w.compute_loss(w.model, w.layout.fields((x, y, s), 0))) == pytest.approx(_plain(plain, x, y),
                                                                                         rel=1e-6)


def test_specialised_loss_entry(tmp_path: Path):
    w = _workload(tmp_path, "[x]", loss='{entry: "losses.py:mse"}')
    x, y, s = _batch(1)
    want = float(F.mse_loss(w.model(paddle.to_tensor(x))[:, 0], paddle.to_tensor(y).astype("float32")))
    assert float(w.compute_loss(w.model, w.layout.fields((x, y, s), 0))) == pytest.approx(want, rel=1e-6)


def test_mistakes_keep_the_checked_paths_messages(tmp_path: Path):
    w = _workload(tmp_path, "[x]")
    x, y, s = _batch(0)
    with pytest.raises(SpecError, match=r"field 'x' holds text \(a list of str\)"):
        w.compute_loss(w.model, {"x": ["a", "b"], "y": y, "s": s})
    with pytest.raises(ValueError, match="incompatible array data type"):  # Paddle's own, as in a plain loop
        w.compute_loss(w.model, {"x": x, "y": y.astype("uint32"), "s": s})
    with pytest.raises(KeyError, match="'y'"):  # a batch without its label: the generic path's KeyError
        w.compute_loss(w.model, {"x": x, "s": s})
    with pytest.raises(SpecError, match="needs the model's output to be one Tensor"):
        tup = _workload(tmp_path, "[x]", kind="tuple")
        tup.compute_loss(tup.model, tup.layout.fields((x, y, s), 0))
    with pytest.raises(SpecError, match="pick a position from 0 to 1"):
        bad = _workload(tmp_path, "[x]", kind="tuple", output="5")
        bad.compute_loss(bad.model, bad.layout.fields((x, y, s), 0))


def test_named_batches_still_checked_by_length(tmp_path: Path):
    w = _workload(tmp_path, "[x]")
    x, y, s = _batch(0)
    assert list(w.layout.fields((x, y, s), 0)) == ["x", "y", "s"]
    again = w.layout.fields([x, y, s], 1)  # a list of the same length: named the same, values its own
    assert list(again) == ["x", "y", "s"] and again["x"] is x and again["s"] is s
    with pytest.raises(SpecError, match="batch 7 from data.py:build_loader has 2 parts"):
        w.layout.fields((x, y), 7)


def test_plain_update_is_step_then_clear_grad_and_its_phase(tmp_path: Path):
    w = _workload(tmp_path, "[x]")
    opt = build_optimizer(load_spec(tmp_path / "config.yaml"), w.model)
    seen: list[tuple[Phase, str | None]] = []

    def boundary(phase: Phase, fn: object, *args: object, what: str | None = None) -> object:
        seen.append((phase, what))
        return fn(*args)

    engine = StepEngine.for_workload(w, opt, device="cpu").with_boundary(boundary)
    x, y, s = _batch(0)
    before = [p.numpy().copy() for p in w.model.parameters()]
    loss = engine.loss(w.layout.fields((x, y, s), 0))
    engine.backward(loss)
    grads = [p.grad.numpy().copy() for p in w.model.parameters()]
    engine.update()
    lr = opt.get_lr()
    for p, b, g in zip(w.model.parameters(), before, grads):  # what a plain loop's SGD step does
        np.testing.assert_allclose(p.numpy(), b - lr * g, rtol=1e-6, atol=1e-7)
        assert p.grad is None or not np.any(p.grad.numpy())  # and clear_grad ran
    assert all(phase in (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER) and what is None for phase, what in seen)
