"""A model whose input is a library object with state (a pgl-like Graph that must be in tensor state when the
model is called), under `nandoctor run` and `nandoctor.watch`; and how many more times replays call the user's
code than their training did (issue 34 items 1, 8 and 11).

The expected answer comes from a plain Paddle loop over the script's own functions (tests/run_scripts/
graph_input.py) with Paddle's tensor checker around each backward (tests/run_truth.py): the step and op, the
layer and source line from the line Paddle printed as the op's creator, the first parameter whose gradient is
NaN/Inf and the samples that fault alone. The extra calls are counted by the script's own model (its forward
counts every call) and by the user's step_fn in the watch test. Before the fix nandoctor called the graph's
`numpy()` (a duck-typed "array"), which turned the graph back to numpy in place, as pgl's does: the replay then
met a graph the model refused, and the report named no layer, op, source or samples, blamed the loss, and
printed Paddle's "To copy construct" warning on the script's stderr (pgl's numpy() calls to_tensor on a tensor).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import paddle
import pytest
from inloop_helpers import ROOT
from run_truth import first_backward_fault, nandoctor_run, run_script

SCRIPT = ROOT / "tests" / "run_scripts" / "graph_input.py"
KEYS = ("step", "phase", "layer", "op", "parameter", "sample_indices")
COPY_WARNING = "To copy construct from a tensor"


def ground_truth(capfd: pytest.CaptureFixture) -> dict[str, Any]:
    """The first fault of the script's own loop, with the source line, from a plain Paddle loop."""
    script = run_script(SCRIPT)
    model, opt = script.build()

    def phases() -> Any:
        for step in range(script.STEPS):
            x, y = (paddle.to_tensor(a) for a in script.batch("fault", step))
            graph = script.label_graph(step).tensor()
            yield (step, model, opt, lambda g=graph, xx=x, yy=y: script.loss_of(model, g, xx, yy),
                   lambda i, g=graph, xx=x, yy=y: script.loss_of(model, g, xx[i:i + 1], yy[i:i + 1]), len(x))

    _, fault = first_backward_fault(phases(), SCRIPT, capfd, opt.clear_grad, with_source=True)
    return fault


def _run(tmp_path: Path, kind: str) -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
    return nandoctor_run(SCRIPT, [kind], tmp_path, columns=200)


def _extra_calls(stdout: str) -> int:
    """The model's forward calls beyond the loop's own, as the script counted them."""
    loop, total = map(int, re.search(r"model called (\d+) times by the loop, (\d+) in all", stdout).groups())
    return total - loop


def test_run_names_the_fault_of_a_model_called_on_a_graph(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """The replay hands the model the graph as the script did (still in tensor state): step, phase, layer, op,
    parameter, source and samples as the plain loop has them, and no warning of ours on the script's stderr."""
    expected = ground_truth(capfd)
    assert expected["sample_indices"] and expected["layer"]
    proc, data = _run(tmp_path, "fault")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert {k: data["first_fault"][k] for k in KEYS} == {k: expected[k] for k in KEYS}
    assert data["details"]["source"] == expected["source"]
    assert "replay_failed" not in data["details"]
    assert COPY_WARNING not in proc.stderr and COPY_WARNING not in proc.stdout
    # the replays' calls of the model, counted by the model itself
    extra = _extra_calls(proc.stdout)
    assert extra > 0 and data["details"]["replay_calls"] == {"count": extra, "code": "your model"}
    assert f"called your model {extra} more times than your training did" in proc.stdout
    assert f"called your model {extra} more times" in (tmp_path / "r.md").read_text(encoding="utf-8")


def test_a_replay_that_fails_is_said_in_run_terms_and_as_nandoctors_limit(tmp_path: Path,
                                                                          capfd: pytest.CaptureFixture) -> None:
    """The script hands the graph back to numpy after backward, before the update: the replay's call of the
    model (as the script made it) raises. The report says that call, what it raised and where, as a limit of
    the replay; it does not blame the loss, nor name a step_fn the user never wrote."""
    expected = ground_truth(capfd)
    proc, data = _run(tmp_path, "release")
    assert proc.returncode == 1, proc.stderr[-3000:]
    ff = data["first_fault"]
    assert (ff["step"], ff["phase"]) == (expected["step"], expected["phase"])
    why = data["details"]["replay_failed"]
    assert "LabelGraphNet(graph, x)" in why and "graph_input.py" in why and "in loss_of" in why  # the call site
    assert "ValueError: You must call Graph.tensor() first" in why and "in forward" in why
    assert "not an error in your code" in why and "step_fn" not in why
    error = next(f for f in data["findings"] if f["severity"] == "error")
    assert why.rstrip(".") in error["message"]
    assert "neither a paddle.nn.Layer" not in error["message"] and "the loss is" not in error["message"]
    assert "LabelGraphNet(graph, x)" in proc.stdout  # the console says it too
    extra = _extra_calls(proc.stdout)
    assert extra == 1 and data["details"]["replay_calls"] == {"count": 1, "code": "your model"}


def test_watch_counts_the_extra_calls_of_step_fn(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """`nandoctor.watch` with a step_fn that counts its own calls, the graph in the batch given to check():
    the report says how many more times than the loop step_fn ran (the loop calls it once a step)."""
    import nandoctor

    expected = ground_truth(capfd)
    script = run_script(SCRIPT)
    model, opt = script.build()
    calls = [0]

    def step_fn(net: Any, batch: Any) -> Any:
        calls[0] += 1
        graph, x, y = batch
        return script.loss_of(net, graph, x, y)

    doctor = nandoctor.watch(model, opt, step_fn=step_fn, report_dir=tmp_path / "report")
    loop_calls = 0
    for step in range(script.STEPS):
        x, y = (paddle.to_tensor(a) for a in script.batch("fault", step))
        batch = (script.label_graph(step).tensor(), x, y)
        loss = step_fn(model, batch)
        loop_calls += 1
        loss.backward()
        if not doctor.check(loss, batch):
            break
        opt.step()
        opt.clear_grad()
    doctor.close()
    report = doctor.report
    assert report is not None and report.first_fault is not None
    ff = report.first_fault
    assert {k: getattr(ff, k) for k in KEYS if k != "phase"} == {k: expected[k] for k in KEYS if k != "phase"}
    assert ff.phase.value == expected["phase"]
    assert report.details["source"] == f"run_scripts/{expected['source']}"  # (relative to step_fn's folder)
    extra = calls[0] - loop_calls
    assert extra > 0 and report.details["replay_calls"] == {"count": extra, "code": "your step_fn"}
    markdown = (tmp_path / "report" / "report.md").read_text(encoding="utf-8")
    assert f"called your step_fn {extra} more times than your training did" in markdown
