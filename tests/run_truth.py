"""Ground truth for `nandoctor run`'s multi-model and child-process tests: a plain Paddle loop over a test
script's own functions, with Paddle's tensor checker in abort mode around each backward.

`first_backward_fault` trains phase after phase (a phase: a model, its optimizer and its loss) until a
backward aborts, and answers what the report must say: the step and op (the checker's), the layer (the
sublayer whose class's forward holds the script line Paddle printed as the op's creator, with
FLAGS_call_stack_level=3, in the script's folder; None for the model's own forward), the parameter (the first in
`named_parameters()` order whose gradient is NaN/Inf when that backward runs again without the checker)
and the samples (each row of the batch alone, on the same parameters).
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import pytest

# (step, model, optimizer, loss of the whole batch, loss of one row of it, rows)
Phase = tuple[int, Any, Any, Callable[[], Any], Callable[[int], Any], int]


def run_script(path: Path) -> Any:
    """A test script of tests/run_scripts/ imported as a module (its functions are the ground truth's),
    with its folder on sys.path as when Python runs it (the scripts import their shared layers from it)."""
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    spec = importlib.util.spec_from_file_location(f"_run_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bad_params(model: Any) -> list[str]:
    return [n for n, p in model.named_parameters()
            if p.grad is not None and not np.isfinite(p.grad.numpy().astype("float64")).all()]


def first_backward_fault(phases: Iterable[Phase], script: Path, capfd: pytest.CaptureFixture,
                         clear: Callable[[], None]) -> tuple[Any, dict[str, Any]]:
    """(the faulting model, the first fault's step/phase/layer/op/parameter/sample_indices). `clear()`
    clears every optimizer's gradients (a GAN's generator loss backpropagates into both models)."""
    from paddle.amp import debugging

    checker = debugging.TensorCheckerConfig(enable=True, debug_mode=debugging.DebugMode.CHECK_NAN_INF_AND_ABORT)
    old = paddle.get_flags(["FLAGS_call_stack_level"])
    paddle.set_flags({"FLAGS_call_stack_level": 3})
    found = None
    try:
        for step, model, opt, loss_of, row_loss, rows in phases:
            opt.clear_grad()
            loss = loss_of()
            capfd.readouterr()
            debugging.enable_tensor_checker(checker)
            try:
                loss.backward()
            except RuntimeError as exc:
                found = (step, model, loss_of, row_loss, rows, re.search(r"op=(\w+)", str(exc)).group(1),
                         capfd.readouterr())
                break
            finally:
                debugging.disable_tensor_checker()
            opt.step()
    finally:
        paddle.set_flags(old)
    assert found is not None, "the plain loop never went non-finite"
    step, model, loss_of, row_loss, rows, op, printed = found
    frames = [(Path(f).resolve(), int(n))
              for f, n, fn in re.findall(r'File "([^"]+)", line (\d+), in (\S+)', printed.out + printed.err)
              if Path(f).resolve().parent == script.resolve().parent and fn == "forward"]
    assert frames, printed.err[-2000:]

    def owns(layer: Any) -> bool:
        file, line = frames[-1]
        lines, first = inspect.getsourcelines(type(layer).forward)
        return (Path(inspect.getsourcefile(type(layer).forward)).resolve() == file
                and first <= line < first + len(lines))

    owners = [n for n, layer in [("", model), *model.named_sublayers()] if owns(layer)]
    assert len(owners) == 1, owners
    clear()  # the failing backward again, without the checker: the parameters are those it faulted with
    loss_of().backward()
    bad = bad_params(model)
    clear()
    samples = []
    for row in range(rows):
        row_loss(row).backward()
        if bad_params(model):
            samples.append(row)
        clear()
    return model, {"step": step, "phase": "backward", "layer": owners[0] or None, "op": op,
                   "parameter": bad[0] if bad else None, "sample_indices": samples}


# (step, the model's forward, the loss code on its output, the loss of one row of the batch, rows)
LossStep = tuple[int, Callable[[], Any], Callable[[Any], Any], Callable[[int], Any], int]


def first_loss_code_fault(steps: Iterable[LossStep], model: Any, opt: Any) -> dict[str, Any]:
    """For a fault in loss code written as functions: the first step that Paddle's tensor checker (abort mode)
    stops in, its phase ("loss" when the loss code's forward stops, else "backward") and op, and the samples
    whose loss or gradients alone are non-finite (each row replayed on the parameters of that step, which the
    loop never updated). The model's own layers are not where it is: layer None."""
    from paddle.amp import debugging

    checker = debugging.TensorCheckerConfig(enable=True, debug_mode=debugging.DebugMode.CHECK_NAN_INF_AND_ABORT)
    found = None
    for step, forward, loss_of, row_loss, rows in steps:
        loss = None
        debugging.enable_tensor_checker(checker)
        try:
            loss = loss_of(forward())
            loss.backward()
        except RuntimeError as exc:
            found = (step, "loss" if loss is None else "backward", re.search(r"op=(\w+)", str(exc)).group(1),
                     row_loss, rows)
            break
        finally:
            debugging.disable_tensor_checker()
        opt.step()
        opt.clear_grad()
    assert found is not None, "the plain loop never went non-finite"
    step, phase, op, row_loss, rows = found
    opt.clear_grad()
    samples = []
    for row in range(rows):
        loss = row_loss(row)
        loss.backward()
        if not np.isfinite(float(loss)) or bad_params(model):
            samples.append(row)
        opt.clear_grad()
    return {"step": step, "phase": phase, "layer": None, "op": op, "sample_indices": samples}
