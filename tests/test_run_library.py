"""An op made, or an exception raised, inside an installed library's layer: `nandoctor run` and
`nandoctor.watch` name the user's line that called into the library (the script's model call) and the
library line that made the op or raised (issue 34, items 2 and 11).

The script (tests/run_scripts/library_op.py) builds its model from tests/run_libs/site-packages/nd_runlib:
library code to nandoctor, as an installed package is. Before, `nandoctor run` named the script's
`opt.step()` as the op's source: its replay runs inside the optimizer's step, and no line of the user's runs
inside a library model's forward.

The expected answer comes from a plain Paddle loop over the script's own functions: with Paddle's tensor
checker in abort mode around each backward and FLAGS_call_stack_level=3, the step, the op, and the stack
Paddle prints for the op's creation (its innermost frame in the script, in the library); each sample of the
failing batch replayed alone for the samples; for the exception, its own traceback.
"""

from __future__ import annotations

import re
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import paddle
import pytest
from inloop_helpers import ROOT
from run_truth import bad_params, innermost_under, nandoctor_run, printed_frames, run_script

import nandoctor

SCRIPT = ROOT / "tests" / "run_scripts" / "library_op.py"
LIBRARY = ROOT / "tests" / "run_libs" / "site-packages"
KEYS = ("step", "phase", "layer", "op", "parameter", "sample_indices")
STEPS = 6


def _tensors(x: Any, y: Any) -> tuple[paddle.Tensor, paddle.Tensor]:
    return paddle.to_tensor(x), paddle.to_tensor(y)


def _line(frame: tuple[Path, int, str], root: Path) -> str:
    """'nd_runlib/layers.py:16 in forward': a frame as the report names a library line."""
    return f"{frame[0].relative_to(root.resolve()).as_posix()}:{frame[1]} in {frame[2]}"


def _op_truth(capfd: pytest.CaptureFixture) -> dict[str, Any]:
    """The first backward fault of a plain loop, the two lines of the op's creation stack, and its samples."""
    from paddle.amp import debugging

    script = run_script(SCRIPT)
    model, opt = script.build("log")
    checker = debugging.TensorCheckerConfig(enable=True, debug_mode=debugging.DebugMode.CHECK_NAN_INF_AND_ABORT)
    old = paddle.get_flags(["FLAGS_call_stack_level"])
    paddle.set_flags({"FLAGS_call_stack_level": 3})
    found = None
    try:
        for step in range(STEPS):
            batch = _tensors(*script.batch(step))
            loss = script.loss_of(model, batch)
            capfd.readouterr()
            debugging.enable_tensor_checker(checker)
            try:
                loss.backward()
            except RuntimeError as exc:
                found = step, batch, re.search(r"op=(\w+)", str(exc)).group(1), capfd.readouterr()
                break
            finally:
                debugging.disable_tensor_checker()
            opt.step()
            opt.clear_grad()
    finally:
        paddle.set_flags(old)
    assert found is not None, "the plain loop never went non-finite"
    step, (x, y), op, printed = found
    frames = printed_frames(printed.out + printed.err)
    user, lib = innermost_under(frames, SCRIPT.parent), innermost_under(frames, LIBRARY)
    owners = [n for n, layer in model.named_sublayers()
              if Path(sys.modules[type(layer).__module__].__file__).resolve() == lib[0]]
    opt.clear_grad()
    script.loss_of(model, (x, y)).backward()
    bad = bad_params(model)
    opt.clear_grad()
    samples = []
    for row in range(int(x.shape[0])):
        script.loss_of(model, (x[row:row + 1], y[row:row + 1])).backward()
        if bad_params(model):
            samples.append(row)
        opt.clear_grad()
    assert len(owners) == 1, owners
    return {"step": step, "phase": "backward", "layer": owners[0], "op": op, "parameter": bad[0] if bad else None,
            "sample_indices": samples, "user": user, "library": _line(lib, LIBRARY)}


def _forward_truth() -> dict[str, Any]:
    """The first forward fault of a plain loop under the checker in abort mode: its step, op, the innermost
    frame of the abort's traceback in the script and in the library, and the samples whose output alone is
    NaN/Inf."""
    from paddle.amp import debugging

    script = run_script(SCRIPT)
    model, opt = script.build("fwd")
    checker = debugging.TensorCheckerConfig(enable=True, debug_mode=debugging.DebugMode.CHECK_NAN_INF_AND_ABORT)
    found = None
    for step in range(STEPS):
        batch = _tensors(*script.batch(step))
        debugging.enable_tensor_checker(checker)
        try:
            loss = script.loss_of(model, batch)
        except RuntimeError as exc:
            found = step, batch, exc
            break
        finally:
            debugging.disable_tensor_checker()
        loss.backward()
        opt.step()
        opt.clear_grad()
    assert found is not None, "the plain loop never went non-finite"
    step, (x, _), exc = found
    frames = [(Path(f.filename).resolve(), f.lineno, f.name) for f in traceback.extract_tb(exc.__traceback__)]
    with paddle.no_grad():
        samples = [row for row in range(int(x.shape[0]))
                   if not bool(paddle.isfinite(model(x[row:row + 1])).all())]
    return {"step": step, "phase": "forward", "op": re.search(r"op=(\w+)", str(exc)).group(1),
            "sample_indices": samples, "user": innermost_under(frames, SCRIPT.parent),
            "library": _line(innermost_under(frames, LIBRARY), LIBRARY)}


def _raise_truth() -> dict[str, Any]:
    """The plain loop's exception: its step, the innermost frame of its traceback in the script and in the
    library."""
    script = run_script(SCRIPT)
    model, opt = script.build("raise")
    for step in range(STEPS):
        try:
            script.loss_of(model, _tensors(*script.batch(step))).backward()
        except ValueError as exc:
            frames = [(Path(f.filename).resolve(), f.lineno, f.name) for f in traceback.extract_tb(exc.__traceback__)]
            return {"step": step, "user": innermost_under(frames, SCRIPT.parent),
                    "library": _line(innermost_under(frames, LIBRARY), LIBRARY)}
        opt.step()
        opt.clear_grad()
    raise AssertionError("the plain loop never raised")


def _run(tmp_path: Path, kind: str) -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
    """`nandoctor run -- python library_op.py KIND`: a process, as the run's child is what is checked."""
    return nandoctor_run(SCRIPT, [kind], tmp_path)


def _watch(tmp_path: Path, kind: str) -> dict[str, Any]:
    """The same script's functions under `nandoctor.watch`, with its loss_of as step_fn."""
    script = run_script(SCRIPT)
    model, opt = script.build(kind)
    doctor = nandoctor.watch(model, opt, step_fn=script.loss_of, report_dir=tmp_path / "watch")
    with pytest.raises((ValueError, nandoctor.NonFiniteError)) if kind == "raise" else _nothing(), doctor:
        for step in range(STEPS):
            batch = _tensors(*script.batch(step))
            loss = script.loss_of(model, batch)
            loss.backward()
            if not doctor.check(loss, batch):
                break
            opt.step()
            opt.clear_grad()
    assert doctor.report is not None
    return doctor.report.to_dict()


class _nothing:  # noqa: N801 - a do-nothing context, beside pytest.raises
    def __enter__(self) -> None:
        return None

    def __exit__(self, *_exc: object) -> bool:
        return False


def _source_at(source: str) -> tuple[str, int, str]:
    """'…/library_op.py:42 in loss_of' -> ('library_op.py', 42, 'loss_of')."""
    head, _, func = source.partition(" in ")
    file, _, line = head.rpartition(":")
    return Path(file).name, int(line), func


def test_an_op_made_in_a_library_names_the_model_call_and_the_library_line(tmp_path: Path,
                                                                            capfd: pytest.CaptureFixture) -> None:
    expected = _op_truth(capfd)
    user, library = expected.pop("user"), expected.pop("library")
    assert expected["op"] == "log_grad" and expected["sample_indices"] == [1, 4]
    assert "model(x)" in SCRIPT.read_text(encoding="utf-8").splitlines()[user[1] - 1]
    proc, data = _run(tmp_path, "log")
    assert proc.returncode == 1, proc.stderr[-3000:]
    watched = _watch(tmp_path, "log")
    for report in (data, watched):
        assert {k: report["first_fault"][k] for k in KEYS} == expected
        finding = report["findings"][0]
        assert _source_at(finding["evidence"]["source"]) == (SCRIPT.name, user[1], user[2])
        assert finding["evidence"]["library_source"] == library == report["details"]["library_source"]
        assert f"created at {library}, in library code your line {finding['evidence']['source']}" in finding["message"]
    assert "opt.step()" not in SCRIPT.read_text(encoding="utf-8").splitlines()[
        _source_at(data["findings"][0]["evidence"]["source"])[1] - 1]


def test_a_forward_op_made_in_a_library_names_the_model_call_and_the_library_line(tmp_path: Path) -> None:
    """The same for an op whose forward output is the fault: the line comes from the replay's line tracer,
    which now follows the library's lines too, not from a printed stack."""
    expected = _forward_truth()
    user, library = expected.pop("user"), expected.pop("library")
    assert expected["op"] == "log" and expected["sample_indices"] == [1, 4]
    proc, data = _run(tmp_path, "fwd")
    assert proc.returncode == 1, proc.stderr[-3000:]
    watched = _watch(tmp_path, "fwd")
    for report in (data, watched):
        assert {k: report["first_fault"][k] for k in expected} == expected
        assert report["first_fault"]["layer"] == "1"  # LogScale, the library's layer
        finding = report["findings"][0]
        assert _source_at(finding["evidence"]["source"]) == (SCRIPT.name, user[1], user[2])
        assert finding["evidence"]["library_source"] == library


def test_a_crash_inside_a_library_names_the_users_call_and_the_raising_line(tmp_path: Path) -> None:
    expected = _raise_truth()
    user = expected["user"]
    proc, data = _run(tmp_path, "raise")
    assert proc.returncode == 1, proc.stderr[-3000:]
    watched = _watch(tmp_path, "raise")
    for report in (data, watched):
        finding = next(f for f in report["findings"] if f["code"] == "user_code.error")
        assert report["first_fault"]["step"] == expected["step"]
        assert _source_at(finding["evidence"]["origin"]) == (SCRIPT.name, user[1], user[2])
        assert finding["evidence"]["library_origin"] == expected["library"]
        assert f"raised inside library code at {expected['library']}" in finding["message"]


_MODEL = '''import sys

import paddle

sys.path.insert(0, {lib!r})
from nd_runlib.layers import Strict  # noqa: E402


class Net(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc, self.strict, self.head = paddle.nn.Linear(4, 8, bias_attr=False), Strict(), paddle.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.strict(self.fc(x)))  # the user's call into the library


def build_model():
    paddle.seed(0)
    return Net()
'''

_DATA = '''import numpy as np


def build_loader():
    batches = []
    for step in range(6):
        rng = np.random.default_rng(step)
        x = rng.normal(size=(6, 4)).astype("float32")
        if step == 3:
            x[[1, 4]] = 0.0
        batches.append((x, rng.integers(0, 3, size=(6,)).astype("int64")))
    return batches
'''

_CONFIG = '''version: 1
model: {entry: "model.py:build_model"}
data: {entry: "data.py:build_loader", fields: [x, y], label: y}
loss: {builtin: cross_entropy}
optimizer: {name: Adam, args: {learning_rate: 0.01}}
'''


def test_the_probe_names_the_raising_library_line_too(tmp_path: Path) -> None:
    """The same library check raising under `nandoctor probe`: the crash finding names the user's model line
    and the library line, as a plain call of the model on that batch raises them."""
    from nandoctor.probe import ProbeOptions, run_probe
    from nandoctor.spec import load_spec

    (tmp_path / "model.py").write_text(_MODEL.format(lib=str(LIBRARY)), encoding="utf-8")
    (tmp_path / "data.py").write_text(_DATA, encoding="utf-8")
    (tmp_path / "config.yaml").write_text(_CONFIG, encoding="utf-8")
    model_mod, data_mod = run_script(tmp_path / "model.py"), run_script(tmp_path / "data.py")
    x, _ = data_mod.build_loader()[3]
    with pytest.raises(ValueError) as raised:
        model_mod.build_model()(paddle.to_tensor(x))
    frames = [(Path(f.filename).resolve(), f.lineno, f.name) for f in traceback.extract_tb(raised.value.__traceback__)]
    user, library = innermost_under(frames, tmp_path), _line(innermost_under(frames, LIBRARY), LIBRARY)
    report = run_probe(load_spec(tmp_path / "config.yaml"), ProbeOptions(steps=6, seed=0, device="cpu")).to_dict()
    finding = next(f for f in report["findings"] if f["code"] == "user_code.error")
    assert report["first_fault"]["step"] == 3 and finding["location"]["layer"] == "strict"
    assert _source_at(finding["evidence"]["origin"]) == ("model.py", user[1], user[2])
    assert finding["evidence"]["library_origin"] == library
    assert f"raised inside library code at {library}" in finding["message"]
