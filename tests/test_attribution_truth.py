"""The first fault's op, layer and samples, and the growth before it, against a plain Paddle loop (issue 21).

The expected answers come from outside nandoctor: each sample config is trained by the parity suite's plain
script (tests/parity/plain_train.py: its YAML reading, model call, loss and optimizer; nandoctor never
imported there), one step at a time with Paddle's tensor checker in abort mode (the step and the first op
that output NaN/Inf), then the failing step replayed with forward hooks that see keyword arguments (the
innermost layer that turned finite inputs into a non-finite output; none when the model's own forward did)
and each sample, each half and each rest-of-batch replayed alone (the samples). Gradient norms are summed
on the host in float64.

- log_inf_before_nan: log(|x|.sum()) * x on all-zero records: log's -inf comes first, multiply's NaN after;
- root_forward_sqrt: sqrt in the root model's own forward, its NaN handed to `head` by keyword;
- whole_batch_overflow: a steady x100-per-step loss divergence on a 64-sample batch: no strict subset is
  special, and the growth starts at step 0.
"""

from __future__ import annotations

import json
import math
import random
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import pytest
import yaml
from typer.testing import CliRunner

from nandoctor.cli import app

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_configs"
sys.path.insert(0, str(ROOT / "tests" / "parity"))
import plain_train  # noqa: E402 - the parity suite's plain script, a sibling folder of this file


class Plain:
    """A sample config's workload built by the plain script: model, optimizer, batches, loss."""

    def __init__(self, name: str) -> None:
        config = SAMPLES / name / "config.yaml"
        self.raw = yaml.safe_load(config.read_text(encoding="utf-8"))
        base = config.parent
        paddle.set_device("cpu")
        seed = int((self.raw.get("probe") or {}).get("seed", 0))
        paddle.seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        self.data = self.raw["data"]
        self.batches = list(plain_train.load_entry(self.data["entry"], base)(**(self.data.get("args") or {})))
        self.compute = plain_train.loss_of(self.raw, base)
        self.model = plain_train.load_entry(self.raw["model"]["entry"], base)(**(self.raw["model"].get("args") or {}))
        self.optimizer, _, _, _ = plain_train.build_optimizer(self.raw, self.model, config, base)
        self.model.train()

    def fields(self, step: int) -> dict[str, Any]:
        return plain_train.name_fields(self.batches[step % len(self.batches)], self.data)

    def loss(self, fields: dict[str, Any]) -> Any:
        return self.compute(self.model, fields)

    def grads_finite(self) -> bool:
        return all(p.grad is None or bool(np.isfinite(p.grad.numpy().astype("float64")).all())
                   for p in self.model.parameters())

    def grad_norm64(self) -> float:
        return math.sqrt(sum(float((p.grad.numpy().astype("float64") ** 2).sum())
                             for p in self.model.parameters() if p.grad is not None))

    def faults(self, fields: dict[str, Any], rows: list[int]) -> bool:
        """The step replayed on these rows alone: a non-finite loss or gradient (parameters untouched)."""
        part = {k: v[rows] for k, v in fields.items()}
        try:
            loss = self.loss(part)
            if not bool(np.isfinite(np.float64(loss.numpy())).all()):
                return True
            loss.backward()
            return not self.grads_finite()
        finally:
            self.optimizer.clear_grad()


def checked_run(name: str, steps: int) -> tuple[Plain, int, str, list[float]]:
    """Train under the tensor checker (abort mode) until it stops: (workload at the failing step's start,
    step, op, float64 gradient norms of the steps before)."""
    from paddle.amp import debugging

    debugging.enable_tensor_checker(debugging.TensorCheckerConfig(
        enable=True, debug_mode=debugging.DebugMode.CHECK_NAN_INF_AND_ABORT))
    try:
        w = Plain(name)  # built after enabling: the checker's own reseed comes before the workload's
        norms: list[float] = []
        for step in range(steps):
            try:
                loss = w.loss(w.fields(step))
                loss.backward()
            except RuntimeError as exc:
                op = re.search(r"op=(\w+)", str(exc))
                assert op is not None, exc
                w.optimizer.clear_grad()
                return w, step, op.group(1), norms
            norms.append(w.grad_norm64())
            w.optimizer.step()
            w.optimizer.clear_grad()
    finally:
        debugging.disable_tensor_checker()
    raise AssertionError(f"{name}: the plain loop never went non-finite in {steps} steps")


def layer_that_made_it(w: Plain, fields: dict[str, Any]) -> str | None:
    """The innermost sublayer call whose output was non-finite while its inputs (keyword ones too) were
    finite; None when no sublayer did (the model's own forward, or the loss)."""
    made: list[str] = []
    hooks = []

    def finite(value: Any) -> bool:
        if isinstance(value, paddle.Tensor):
            return not paddle.is_floating_point(value) or bool(paddle.isfinite(value).all())
        if isinstance(value, (list, tuple)):
            return all(finite(v) for v in value)
        if isinstance(value, dict):
            return all(finite(v) for v in value.values())
        return True

    for name, layer in w.model.named_sublayers():
        def post(_layer: Any, args: Any, kwargs: Any, out: Any, _n: str = name) -> None:
            if not finite(out) and finite(args) and finite(kwargs):
                made.append(_n)
        hooks.append(layer.register_forward_post_hook(post, with_kwargs=True))
    try:
        with paddle.no_grad():
            w.loss(fields)
    finally:
        for h in hooks:
            h.remove()
    return made[0] if made else None


def probe(name: str, tmp_path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / f"{name}.json"
    result = CliRunner().invoke(app, ["probe", str(SAMPLES / name / "config.yaml"), "--no-try-fixes", "--device",
                                      "cpu", "--json", str(out), *extra])
    assert out.is_file(), result.output
    return result.exit_code, json.loads(out.read_text(encoding="utf-8"))


def error_finding(report: dict[str, Any]) -> dict[str, Any]:
    return next(f for f in report["findings"] if f["severity"] == "error")


@pytest.mark.parametrize("name", ["log_inf_before_nan", "root_forward_sqrt"])
def test_first_nonfinite_op_and_its_layer(name: str, tmp_path: Path) -> None:
    """The op is the checker's (the first op whose output was NaN/Inf: log, not the multiply that made NaN of
    its -inf), the layer the hooks' (none for the root model's own forward, not the `head` it feeds), the
    samples those that fault alone while the rest of the batch does not."""
    w, step, op, _ = checked_run(name, 20)
    fields = w.fields(step)
    layer = layer_that_made_it(w, fields)
    n = len(next(iter(fields.values())))
    samples = [i for i in range(n) if w.faults(fields, [i])]
    assert samples and not w.faults(fields, [i for i in range(n) if i not in samples])
    code, report = probe(name, tmp_path)
    assert code == 1
    ff = report["first_fault"]
    assert (ff["step"], ff["phase"], ff["layer"], ff["op"], ff["sample_indices"]) == (
        step, "forward", layer, op, samples)
    f = error_finding(report)
    if name == "log_inf_before_nan":
        assert (op, layer) == ("log", "scale")  # the plain loop's own answer, as the config says
        assert f["evidence"]["nan_op"] == "multiply" and "(op log," in f["message"]
        assert any(re.search(r"\blog\b", a) for a in f["advice"]), f["advice"]  # log's advice, not a generic one
    else:
        assert (op, layer) == ("sqrt", None)
        assert "model's own forward" in f["message"] and "head" not in f["message"]
        source = f["evidence"]["source"]  # the root's forward, where the sqrt is
        lines = (SAMPLES / name / "model.py").read_text(encoding="utf-8").splitlines()
        assert "paddle.sqrt(" in lines[int(source.split(":")[1].split()[0]) - 1]


def test_whole_batch_overflow_is_not_sample_specific(tmp_path: Path) -> None:
    """Every sample alone is finite, yet either half of the batch overflows alone, and so does the rest of
    it without the other half: no strict subset is special. No samples in the first fault, the finding says
    so, and nothing for a skip list (remedies read location.sample_indices)."""
    w, step, op, _ = checked_run("whole_batch_overflow", 40)
    fields = w.fields(step)
    n = len(next(iter(fields.values())))
    assert n == 64
    assert not any(w.faults(fields, [i]) for i in range(n))
    assert w.faults(fields, list(range(32))) and w.faults(fields, list(range(32, 64)))
    code, report = probe("whole_batch_overflow", tmp_path)
    assert code == 1
    ff = report["first_fault"]
    assert (ff["step"], ff["phase"], ff["op"], ff["sample_indices"]) == (step, "loss", op, [])
    f = error_finding(report)
    assert f["location"]["sample_indices"] == []
    assert f["evidence"]["samples_scope"] == "not_sample_specific" and "not sample-specific" in f["message"].lower()


def _growth_start(norms: list[float]) -> int:
    """Where the final run of rising norms begins (the plain reading of "where the growth starts")."""
    i = len(norms) - 1
    while i > 0 and norms[i - 1] < norms[i]:
        i -= 1
    return i


def test_growth_start_and_its_figures_agree_with_the_timeline(tmp_path: Path) -> None:
    """A run stopped before the overflow (10 steps): the tracker's grad.explosion is the report's. It starts
    where the float64 norms of the plain loop start rising (step 0 here, a steady ~10x per step), and every
    figure in it is one of the timeline's (the start's norm and the level it is measured against agree)."""
    _, _, _, norms = checked_run("whole_batch_overflow", 40)
    start = _growth_start(norms[:10])
    assert start == 0 and all(b / a > 5 for a, b in zip(norms[:9], norms[1:10]))
    code, report = probe("whole_batch_overflow", tmp_path, "--steps", "10")
    assert code == 0 and report["first_fault"] is None
    [g] = [f for f in report["findings"] if f["code"] == "grad.explosion"]
    assert g["location"]["step"] == start
    timeline = {p["step"]: p["grad_norm"] for p in report["timeline"]}
    ev = g["evidence"]
    assert ev["norm_at_start"] == pytest.approx(norms[start], rel=1e-4)
    assert ev["norm_at_start"] == pytest.approx(timeline[start], rel=1e-9)
    assert ev["norm_now"] == pytest.approx(timeline[ev["step_now"]], rel=1e-9)
    assert ev["early_norm"] == ev["typical_grad_norm"] == pytest.approx(norms[start], rel=1e-4)
    assert ev["clip_threshold"] == pytest.approx(1.5 * ev["typical_grad_norm"])
    # the message's figures are the evidence's, as printed (3 significant digits)
    shown = {float(x) for x in re.findall(r"\d\.\d+e[+-]\d+|\d+(?:\.\d+)?", g["message"]) if "e" in x}
    assert {float(f"{ev['norm_at_start']:.3g}"), float(f"{ev['norm_now']:.3g}")} <= shown, g["message"]
    assert f"at step {start}" in g["message"]


def test_tracker_growth_starts_where_the_plain_loops_norms_start_rising() -> None:
    """The warning tracker fed the plain loop's own float64 norms (a steady ~10x per step from step 0): the
    growth starts at step 0, not where the norm passed twice the first steps' median (that median, step 2's
    norm, sits inside the growth); "early" and "typical" are one figure, the norm the growth started from."""
    from types import SimpleNamespace

    from nandoctor.engine.warnings import WarningTracker

    _, _, _, norms = checked_run("whole_batch_overflow", 40)
    tracker = WarningTracker([], [], fp16=False, amp=False, learning_rate=0.0061)
    for step, norm in enumerate(norms[:10]):
        tracker.update(SimpleNamespace(step=step, lr=0.0061, grad_norm=norm, act_max=None, grad_sq=None))
    g = tracker.explosion
    assert g is not None and g.location.step == _growth_start(norms[:10]) == 0
    ev = g.evidence
    assert ev["norm_at_start"] == norms[0] and ev["early_norm"] == ev["typical_grad_norm"] == norms[0]
    assert ev["norm_now"] == norms[ev["step_now"]] and ev["growth"] == pytest.approx(ev["norm_now"] / norms[0])
    assert f"{norms[0]:.3g}" in g.message and f"{ev['norm_now']:.3g}" in g.message
    assert any(f"({norms[0]:.3g})" in a for a in g.advice)  # the advice's "typical norm" is the same figure


class _Records(paddle.io.Dataset):
    """whole_batch_overflow's batches one record at a time; fit(batch_size=64, shuffle=False) rebuilds them."""

    def __init__(self, batches: list[tuple[np.ndarray, np.ndarray]]) -> None:
        self.items = [(x[i], y[i]) for x, y in batches for i in range(len(x))]

    def __getitem__(self, i: int) -> Any:
        return self.items[i]

    def __len__(self) -> int:
        return len(self.items)


def test_hapi_fit_divergence_is_not_sample_specific_and_grows_from_step_0(tmp_path: Path) -> None:
    """The same divergence under `paddle.Model.fit` with NanDoctorCallback: the first fault names no
    samples, the growth starts where the plain loop's float64 norms start rising, and every gradient norm
    the report holds before the fault is finite and the plain loop's (float32 squares would overflow at
    norms above ~1.8e19; the gradients were finite)."""
    from paddle.static import InputSpec

    from nandoctor.hapi import NanDoctorCallback

    w, step, op, norms = checked_run("whole_batch_overflow", 40)
    paddle.seed(0)
    plain = Plain("whole_batch_overflow")
    model = paddle.Model(plain.model, inputs=[InputSpec([None, 4], "float32", "x")],
                         labels=[InputSpec([None, 1], "float32", "y")])
    model.prepare(plain.optimizer, paddle.nn.MSELoss())
    cb = NanDoctorCallback(report_dir=tmp_path / "report")
    model.fit(_Records(plain.batches), epochs=1, batch_size=64, shuffle=False, verbose=0, callbacks=[cb])
    data = json.loads((tmp_path / "report" / "report.json").read_text(encoding="utf-8"))
    ff = data["first_fault"]
    assert (ff["step"], ff["op"], ff["sample_indices"]) == (step, op, [])
    f = error_finding(data)
    assert f["evidence"]["samples_scope"] == "not_sample_specific"
    [g] = [f for f in data["findings"] if f["code"] == "grad.explosion"]
    assert g["location"]["step"] == _growth_start(norms) == 0
    timeline = {p["step"]: p["grad_norm"] for p in data["timeline"]}
    for s in range(step):
        if timeline.get(s) is not None:
            assert isinstance(timeline[s], float) and timeline[s] == pytest.approx(norms[s], rel=1e-3), s


def test_backward_op_made_in_the_root_forward_is_the_roots(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """sqrt at a duplicate pair, in the root model's own forward: the backward's sqrt_grad is inf. Which
    layer's forward made the op comes from Paddle itself: with FLAGS_call_stack_level=3 the checker prints
    the stack that created it, and the innermost frame in the sample's model.py lies in the forward of one
    class only (the root's here). The gradient hooks alone would name head.proj, which shares ea."""
    import inspect

    from paddle.amp import debugging

    name = "root_forward_sqrt"
    config = SAMPLES / name / "backward.yaml"
    raw = yaml.safe_load(config.read_text(encoding="utf-8"))
    base = config.parent
    paddle.seed(0)
    data = raw["data"]
    batches = plain_train.load_entry(data["entry"], base)(**data["args"])
    model = plain_train.load_entry(raw["model"]["entry"], base)(**raw["model"]["args"])
    optimizer, _, _, _ = plain_train.build_optimizer(raw, model, config, base)
    compute = plain_train.loss_of(raw, base)
    old = paddle.get_flags(["FLAGS_call_stack_level"])
    paddle.set_flags({"FLAGS_call_stack_level": 3})
    try:
        for i, batch in enumerate(batches):
            fields = plain_train.name_fields(batch, data)
            loss = compute(model, fields)
            capfd.readouterr()
            debugging.enable_tensor_checker(debugging.TensorCheckerConfig(
                enable=True, debug_mode=debugging.DebugMode.CHECK_NAN_INF_AND_ABORT))
            try:
                loss.backward()
            except RuntimeError as exc:
                step, op = i, re.search(r"op=(\w+)", str(exc)).group(1)
                printed = capfd.readouterr()
                break
            finally:
                debugging.disable_tensor_checker()
            optimizer.step()
            optimizer.clear_grad()
        else:
            raise AssertionError("the plain loop never went non-finite")
    finally:
        paddle.set_flags(old)
    model_file = str((base / "model.py").resolve())
    frames = [int(n) for f, n, fn in re.findall(r'File "([^"]+)", line (\d+), in (\S+)', printed.out + printed.err)
              if str(Path(f).resolve()) == model_file and fn == "forward"]
    assert frames, printed.err[-2000:]
    line = frames[-1]

    def owns(layer: Any) -> bool:
        lines, first = inspect.getsourcelines(type(layer).forward)
        return first <= line < first + len(lines)

    owners = [n for n, layer in [("", model), *model.named_sublayers()] if owns(layer)]
    assert owners == [""]  # the root's own forward made it, no sublayer's
    samples = []
    for row in range(len(fields["a"])):
        part = {k: v[row:row + 1] for k, v in fields.items()}
        optimizer.clear_grad()
        compute(model, part).backward()
        if not all(p.grad is None or bool(np.isfinite(p.grad.numpy().astype("float64")).all())
                   for p in model.parameters()):
            samples.append(row)
    optimizer.clear_grad()
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["probe", str(config), "--no-try-fixes", "--device", "cpu", "--json", str(out)])
    assert result.exit_code == 1, result.output
    report = json.loads(out.read_text(encoding="utf-8"))
    ff = report["first_fault"]
    assert (ff["step"], ff["phase"], ff["layer"], ff["op"], ff["sample_indices"]) == (
        step, "backward", None, op, samples)
    f = error_finding(report)
    assert "in the model's own forward" in f["message"] and "loss or step code" not in f["message"]
    assert f["evidence"]["source"].endswith(f"model.py:{line} in forward")
