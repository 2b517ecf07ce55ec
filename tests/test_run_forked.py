"""Child processes that train after the parent (issue 22 §2): `nandoctor run` watches each child that trains
on its own (multiprocessing with fork and with spawn) and reports the first fault of any process, naming
the child (pid, position among the children) in the finding's message and in `details.process`.

The expected fault comes from a plain Paddle loop of the faulting worker's own training, in this process,
with Paddle's tensor checker (tests/run_truth.py). Before this change the children's NaN went unreported
and `nandoctor run` exited 0 (the forked children inherited the parent's finished watch, and
multiprocessing ends a child with os._exit: no atexit, no report).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import paddle
import pytest
from inloop_helpers import ROOT
from run_truth import first_backward_fault, nandoctor_run, run_script

SCRIPT = ROOT / "tests" / "run_scripts" / "forked.py"
KEYS = ("step", "phase", "layer", "op", "parameter", "sample_indices")


def _script() -> Any:
    return run_script(SCRIPT)


def ground_truth(capfd: pytest.CaptureFixture, worker: int = 2, groups: bool = False) -> dict[str, Any]:
    """The bad worker's training, alone, as its process runs it."""
    script = _script()
    script.BAD_WORKER = worker
    model, opt = script.build(worker)
    if groups:
        opt = script.Groups(model)
    loss_fn = paddle.nn.MSELoss()

    def phases() -> Any:
        for step in range(script.STEPS):
            x, y = (paddle.to_tensor(a) for a in script.batch(worker, step, False))
            yield (step, model, opt, lambda x=x, y=y: loss_fn(model(x), y),
                   lambda i, x=x, y=y: loss_fn(model(x[i:i + 1]), y[i:i + 1]), len(x))

    return first_backward_fault(phases(), SCRIPT, capfd, opt.clear_grad)[1]


def _run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
    return nandoctor_run(SCRIPT, list(args), tmp_path)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_the_first_fault_of_a_child_process_is_reported(tmp_path: Path, method: str,
                                                        capfd: pytest.CaptureFixture) -> None:
    expected = ground_truth(capfd)
    assert expected["sample_indices"]
    proc, data = _run(tmp_path, method)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert {k: data["first_fault"][k] for k in KEYS} == expected
    pids = dict(re.findall(r"worker (\d) pid (\d+)", proc.stdout))
    process = data["details"]["process"]
    assert process["pid"] == int(pids["2"]) and process["parent_pid"] == int(pids["0"])
    assert process["child"] == 2 and process["start"] == method  # the second child the parent started
    error = next(f for f in data["findings"] if f["severity"] == "error")
    assert error["message"].startswith(f"In child process pid {pids['2']} ")
    assert f"(child 2, {'forked' if method == 'fork' else 'spawned by multiprocessing'} from pid {pids['0']})" in (
        error["message"])
    # the faulty worker stopped at its fault (before the update); the others trained to the end
    assert f"worker 2 step {expected['step']} " not in proc.stdout
    assert "worker 3 step 7 " in proc.stdout and "training finished" in proc.stdout
    assert not list(tmp_path.glob("*.pid*"))  # the children's results stay in nandoctor's own folder


def test_healthy_children_exit_0(tmp_path: Path) -> None:
    proc, data = _run(tmp_path, "fork", "--healthy")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert data["verdict"] == "healthy" and data["first_fault"] is None
    assert "training finished" in proc.stdout


def test_a_pool_worker_reports_and_the_pool_finishes(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """A Pool's worker is not stopped at its fault (its task would be lost, and the pool would wait for it
    forever): the report is written at the fault, the faulty update dropped, and the script ends."""
    expected = ground_truth(capfd)
    proc, data = _run(tmp_path, "fork", "--pool")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert {k: data["first_fault"][k] for k in KEYS} == expected
    assert "PoolWorker" in data["details"]["process"]["name"] and "training finished" in proc.stdout
    assert "worker 2 step 7 loss nan" not in proc.stdout  # the faulty update was not applied


def test_models_trained_one_after_another_in_one_process(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """The workers' training in turn, in the command's own process: each new optimizer's model is found (the
    class patch comes back for it) and its steps count from its first update."""
    expected = ground_truth(capfd)
    proc, data = _run(tmp_path, "inline")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert {k: data["first_fault"][k] for k in KEYS} == expected
    assert data["details"]["models"] == ["Net"] * 3 and "process" not in data["details"]
    assert f"worker 2 step {expected['step']} " not in proc.stdout and "worker 3 " not in proc.stdout


def test_a_script_that_runs_the_training_as_a_new_program(tmp_path: Path) -> None:
    """A wrapper script whose only work is to start the training with subprocess: the training process's
    report is the run's, healthy or not (the wrapper itself trains nothing)."""
    wrapper = tmp_path / "wrapper.py"
    run = f"subprocess.run([sys.executable, {str(SCRIPT)!r}, 'inline', *sys.argv[1:]])"
    wrapper.write_text(f"import subprocess, sys\nsys.exit({run}.returncode)\n", encoding="utf-8")
    cmd = [sys.executable, "-m", "nandoctor", "run", "--json", "r.json", "--", sys.executable, str(wrapper)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    for extra, code, verdict in ((["--healthy"], 0, "healthy"), ([], 1, "nan_found")):
        proc = subprocess.run(cmd + extra, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == code, proc.stderr[-3000:]
        data = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
        assert data["verdict"] == verdict and data["details"]["process"]["start"] == "exec"


def test_many_models_one_after_another_keep_a_bounded_number_of_watches(tmp_path: Path,
                                                                         capfd: pytest.CaptureFixture) -> None:
    """13 models trained in turn (a sweep): at most 8 are watched at once, the least recently stepped let go,
    and the 13th's fault is still named, at its own step."""
    expected = ground_truth(capfd, worker=12)
    proc, data = _run(tmp_path, "inline", "--bad", "12")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert {k: data["first_fault"][k] for k in KEYS} == expected
    assert data["details"]["models"] == ["Net"] * 13
    assert next(f for f in data["findings"] if f["severity"] == "error")["message"].startswith("In Net (model 13 of 13")


def test_one_model_two_optimizers_is_one_model(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """Parameter groups in two optimizers: both watched, and the report speaks of one model (no 'model 1 of 2')."""
    expected = ground_truth(capfd, groups=True)
    proc, data = _run(tmp_path, "groups")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert {k: data["first_fault"][k] for k in KEYS} == expected
    assert "models" not in data["details"]
    assert not next(f for f in data["findings"] if f["severity"] == "error")["message"].startswith("In ")



def raised_where() -> tuple[int, str]:
    """The step at which the bad worker's own code raises (its model's calls before it), and the innermost
    layer whose forward it raised in (forward hooks: entered and never returned), from the worker's training
    run here with --raise."""
    script = _script()
    model, _ = script.build(script.BAD_WORKER)
    calls: list[int] = []
    entered: list[str] = []
    def returned(_layer: Any, _args: Any, _out: Any) -> None:  # (a hook's return value would replace the output)
        entered.pop()

    model.register_forward_pre_hook(lambda _l, _a: calls.append(1))
    for name, layer in model.named_sublayers():
        layer.register_forward_pre_hook(lambda _l, _a, n=name: entered.append(n))
        layer.register_forward_post_hook(returned)
    script.build = lambda worker: (model, paddle.optimizer.Adam(learning_rate=0.01, parameters=model.parameters()))
    argv = sys.argv
    sys.argv = [str(SCRIPT), "--raise"]
    try:
        script.train(script.BAD_WORKER, False)
    except ValueError:
        return len(calls) - 1, entered[-1]
    finally:
        sys.argv = argv
    raise AssertionError("the worker did not raise")


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_child_whose_own_code_raises_is_named(tmp_path: Path, method: str) -> None:
    """multiprocessing prints a child's exception and exits it 1, never calling sys.excepthook: the child's
    run() is watched instead, and its user_code.error names the child, the step and the layer."""
    step, layer = raised_where()
    proc, data = _run(tmp_path, method, "--raise")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert data["verdict"] == "crashed"
    ff = data["first_fault"]
    assert (ff["step"], ff["phase"], ff["layer"]) == (step, "forward", layer)
    error = next(f for f in data["findings"] if f["severity"] == "error")
    assert error["code"] == "user_code.error" and error["message"].startswith("In child process pid ")
    assert data["details"]["process"]["child"] == 2
    assert "Traceback" in proc.stderr and "ValueError" in proc.stderr  # multiprocessing still prints it
