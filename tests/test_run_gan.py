"""Two models, two optimizers (a GAN): `nandoctor run` and two `nandoctor.watch` calls name the first fault
of either model, with its step, phase, layer, op, parameter and samples (issue 22 §2).

The expected answer comes from a plain Paddle loop over the script's own functions (tests/run_scripts/
gan.py) with Paddle's tensor checker around each backward (tests/run_truth.py): the step, the op and which
model's backward it was, the layer from the line Paddle printed as the op's creator, the first parameter
whose gradient is NaN/Inf, and the samples that fault alone. Before the fix the generator's fault (the second
optimizer's) was applied and missed: the report named step 5's data, the NaN the generator's update had made.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import paddle
import pytest
from in_process import run_in_process
from inloop_helpers import ROOT
from run_truth import first_backward_fault, run_script

from nandoctor.report.json import schema_path

SCRIPT = ROOT / "tests" / "run_scripts" / "gan.py"
KEYS = ("step", "phase", "layer", "op", "parameter", "sample_indices")


def _script() -> Any:
    return run_script(SCRIPT)


def ground_truth(kind: str, capfd: pytest.CaptureFixture) -> tuple[str, dict[str, Any]]:
    """(the faulting model's class, its first fault) from a plain loop of the script's own functions, in the
    script's order: D's update, then G's. D's batch is real and fake stacked: row i of it is real[i]."""
    gan = _script()
    g, d, opt_g, opt_d = gan.build()

    def phases() -> Any:
        for step in range(gan.STEPS):
            real, z = gan.batch(kind, step)
            t_real, t_z = paddle.to_tensor(real), paddle.to_tensor(z)
            yield (step, d, opt_d, lambda r=t_real, zz=t_z: gan.d_loss(g, d, r, zz),
                   lambda i, r=t_real, zz=t_z: gan.d_loss(g, d, r[i:i + 1], zz[i:i + 1]), len(real))
            yield (step, g, opt_g, lambda zz=t_z: gan.g_loss(g, d, zz),
                   lambda i, zz=t_z: gan.g_loss(g, d, zz[i:i + 1]), len(z))

    def clear() -> None:
        opt_d.clear_grad()
        opt_g.clear_grad()

    model, fault = first_backward_fault(phases(), SCRIPT, capfd, clear)
    return type(model).__name__, fault


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}


def _run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
    cmd = [sys.executable, "-m", "nandoctor", "run", "--json", "r.json", "--", sys.executable, str(SCRIPT), *args]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=_env())
    assert (tmp_path / "r.json").is_file(), proc.stderr[-3000:]
    data = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    jsonschema.validate(data, json.loads(schema_path().read_text(encoding="utf-8")))
    return proc, data


@pytest.mark.parametrize("kind", ["g", "g0", "d"])
def test_run_names_the_first_fault_of_either_model(tmp_path: Path, kind: str, capfd: pytest.CaptureFixture) -> None:
    """G's fault is the second optimizer's: before every optimizer was watched it went unseen. At step 0 (g0)
    G is found at that very update, from the calls kept of it: the latest, whose output got the gradient."""
    model, expected = ground_truth(kind, capfd)
    assert model == {"g": "Generator", "g0": "Generator", "d": "Discriminator"}[kind] and expected["sample_indices"]
    proc, data = _run(tmp_path, kind)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert {k: data["first_fault"][k] for k in KEYS} == expected
    assert data["details"]["model"] == model
    assert data["details"]["models"] == ["Discriminator", "Generator"]  # in the order their optimizers stepped
    error = next(f for f in data["findings"] if f["severity"] == "error")
    assert error["message"].startswith(f"In {model} (model ")
    assert f"step {expected['step']} loss_d" not in proc.stdout  # stopped before that step's updates ended


def test_a_healthy_gan_exits_0(tmp_path: Path) -> None:
    proc, data = _run(tmp_path, "healthy")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert data["verdict"] == "healthy" and data["first_fault"] is None
    assert data["details"]["models"] == ["Discriminator", "Generator"]
    assert "training finished" in proc.stdout


@pytest.mark.parametrize("kind", ["g", "d"])
def test_two_watch_calls_in_one_script(tmp_path: Path, kind: str, capfd: pytest.CaptureFixture) -> None:
    """`nandoctor.watch` once per model: the faulting model's doctor writes its own report folder. The script
    runs in this process, as `python gan.py KIND --watch` would (its report and exit status are what count)."""
    model, expected = ground_truth(kind, capfd)
    proc = run_in_process(SCRIPT, [kind, "--watch"], tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    folder = {"Generator": "report_g", "Discriminator": "report_d"}[model]
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder]
    data = json.loads((tmp_path / folder / "report.json").read_text(encoding="utf-8"))
    assert {k: data["first_fault"][k] for k in KEYS} == expected
