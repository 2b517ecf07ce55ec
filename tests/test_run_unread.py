"""`nandoctor run` at the probe's cost (issue 36): past the first steps, most steps are not read on the host,
and a fault on an unread step is still named at its exact step, phase, layer, op, parameter and samples: the
rollback replays the unread steps from what was recorded of them (the batch; the RNG state; for loss code
written as functions, the gradient that came back to the model's outputs and the loss).

The script (run_scripts/unread.py) spaces the reads as far as the ring allows under `nandoctor run`, so the
fault's step is surely unread, and counts the host reads. The expected answers come from a plain Paddle loop
over the script's own functions with Paddle's tensor checker on (run_truth.py), not from nandoctor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import paddle
import pytest
from inloop_helpers import ROOT
from run_truth import first_backward_fault, first_loss_code_fault, run_script

from nandoctor.engine.watcher import READ_ALL_STEPS

SCRIPT = ROOT / "tests" / "run_scripts" / "unread.py"
KEYS = ("step", "phase", "layer", "op", "parameter", "sample_indices")


def _batches(script: Any, kind: str) -> Any:
    """The script's batches as tensors, with what it does between steps done in its order."""
    for step in range(script.FAULT + 20):
        x, y = script.batch(kind, step)
        script.between_steps(kind)
        yield step, paddle.to_tensor(x), paddle.to_tensor(y)


def model_truth(kind: str, capfd: pytest.CaptureFixture) -> dict[str, Any]:
    script = run_script(SCRIPT)
    model, opt, loss_layer = script.build(kind)

    def phases() -> Any:
        for step, x, y in _batches(script, kind):
            yield (step, model, opt, lambda x=x, y=y: script.loss_of(kind, model(x), y, loss_layer),
                   lambda i, x=x, y=y: script.loss_of(kind, model(x[i:i + 1]), y[i:i + 1], loss_layer), len(x))

    return first_backward_fault(phases(), SCRIPT, capfd, opt.clear_grad)[1]


def loss_code_truth(kind: str) -> dict[str, Any]:
    script = run_script(SCRIPT)
    model, opt, _ = script.build(kind)
    steps = ((step, lambda x=x: model(x), lambda out, y=y: script.loss_of(kind, out, y, None),
              lambda i, x=x, y=y: script.loss_of(kind, model(x[i:i + 1]), y[i:i + 1], None), len(x))
             for step, x, y in _batches(script, kind))
    return first_loss_code_fault(steps, model, opt)


def _run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
    cmd = [sys.executable, "-m", "nandoctor", "run", "--json", "r.json", "--", sys.executable, str(SCRIPT), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert (tmp_path / "r.json").is_file(), proc.stderr[-3000:]
    return proc, json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))


def _unread_and_found(data: dict[str, Any], step: int) -> None:
    """The fault's step was never read live: a later read found its trace and the rollback named it."""
    rollback = data["details"]["rollback"]
    assert step in rollback["unread_steps"] and rollback["found"]["step"] == step
    assert rollback["detected_at_step"] > step


@pytest.mark.parametrize("kind", ["dist", "dist_fn", "dropout"])
def test_a_model_fault_on_an_unread_step_is_named_as_a_plain_loop_finds_it(tmp_path: Path, kind: str,
                                                                         capfd: pytest.CaptureFixture) -> None:
    """A loss layer (replayed as it is), a loss written as functions (the recorded output gradients
    backpropagated again) and dropout with random draws between steps (each step's own RNG state)."""
    expected = model_truth(kind, capfd)
    assert expected["step"] > READ_ALL_STEPS and expected["sample_indices"]
    proc, data = _run(tmp_path, kind)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert {k: data["first_fault"][k] for k in KEYS} == expected
    _unread_and_found(data, expected["step"])


@pytest.mark.parametrize("kind", ["log", "sqrt"])
def test_a_loss_code_fault_on_an_unread_step_is_named_at_its_step_phase_op_and_samples(tmp_path: Path,
                                                                                     kind: str) -> None:
    """The loss code cannot be replayed; its recorded loss and output gradients make the rollback fail where
    the step did, with the phase the step had (a NaN loss, or a finite loss with an inf gradient)."""
    expected = loss_code_truth(kind)
    assert expected["step"] > READ_ALL_STEPS and expected["sample_indices"]
    proc, data = _run(tmp_path, kind)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert {k: data["first_fault"][k] for k in expected} == expected
    _unread_and_found(data, expected["step"])


def test_a_healthy_run_is_not_read_every_step(tmp_path: Path) -> None:
    """Past the steps read in full, the host reads are a few (the ring's interval apart), and the report's
    timeline still has every step's loss."""
    steps = READ_ALL_STEPS + 300
    proc, data = _run(tmp_path, "healthy", str(steps))
    assert proc.returncode == 0, proc.stderr[-3000:]
    reads = int((tmp_path / "reads.txt").read_text(encoding="utf-8"))
    assert READ_ALL_STEPS <= reads <= READ_ALL_STEPS + (steps - READ_ALL_STEPS) // 16, reads
    assert data["verdict"] == "healthy"
    assert [p["step"] for p in data["timeline"]] == list(range(steps))
    assert all(p["loss"] is not None for p in data["timeline"])


@pytest.mark.parametrize("kind", ["healthy", "drop_ok"])
def test_the_rng_state_is_taped_only_where_a_step_draws_random_numbers(tmp_path: Path, kind: str) -> None:
    """A replay needs a step's RNG state only when the step draws random numbers (dropout); on CPU the state is
    the Mersenne twister's 5 KB, kept for every unread step. Truth: whether a plain Paddle step of the script's
    model, loss and backward moves the generator's state."""
    script = run_script(SCRIPT)
    model, _, loss_layer = script.build(kind)
    x, y = (paddle.to_tensor(a) for a in script.batch(kind, 0))
    before = [state.__getstate__() for state in paddle.get_rng_state()]
    script.loss_of(kind, model(x), y, loss_layer).backward()
    draws = [state.__getstate__() for state in paddle.get_rng_state()] != before
    assert draws == (kind == "drop_ok")
    proc, data = _run(tmp_path, kind, str(READ_ALL_STEPS + 100))
    assert proc.returncode == 0 and data["verdict"] == "healthy", proc.stderr[-3000:]
    taped = json.loads((tmp_path / "taped.json").read_text(encoding="utf-8"))
    assert taped["steps"] > 0
    assert taped["with_rng"] == (taped["steps"] if draws else 0)
