"""nandoctor.integrations: no framework is a dependency; PaddleFormers' callback runs where it is installed."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from inloop_helpers import EXAMPLES, ROOT

HAS_PF = importlib.util.find_spec("paddleformers") is not None
# A Python with paddleformers installed (e.g. a separate venv), for the end-to-end run of the example.
PF_PYTHON = os.environ.get("NANDOCTOR_PF_PYTHON")


def test_the_package_imports_without_any_framework() -> None:
    module = importlib.import_module("nandoctor.integrations")
    assert module.__doc__


@pytest.mark.skipif(importlib.util.find_spec("paddlenlp") is not None, reason="paddlenlp is installed here")
def test_paddlenlp_callback_says_what_to_install_when_absent() -> None:
    sys.modules.pop("nandoctor.integrations.paddlenlp", None)
    with pytest.raises(ImportError, match="pip install paddlenlp"):
        importlib.import_module("nandoctor.integrations.paddlenlp")


def test_the_trainer_callback_is_one_class_for_both_trainers() -> None:
    """Its behaviour imports neither library; each binding only adds the library's base class."""
    from nandoctor.integrations.trainer import TrainerWatch

    assert {"on_load_data_end", "on_substep_end", "on_optimizer_begin", "on_train_end"} <= set(vars(TrainerWatch))
    assert "paddleformers" not in sys.modules or HAS_PF


@pytest.mark.skipif(HAS_PF, reason="paddleformers is installed here")
def test_paddleformers_callback_says_what_to_install_when_absent() -> None:
    sys.modules.pop("nandoctor.integrations.paddleformers", None)
    with pytest.raises(ImportError, match="pip install paddleformers"):
        importlib.import_module("nandoctor.integrations.paddleformers")
    import nandoctor  # the rest of nandoctor is unaffected

    assert callable(nandoctor.watch)


@pytest.mark.skipif(not PF_PYTHON and not HAS_PF, reason="needs paddleformers (set NANDOCTOR_PF_PYTHON to a Python "
                    "that has it)")
def test_paddleformers_trainer_stops_at_the_first_fault(tmp_path: Path) -> None:
    python = PF_PYTHON or sys.executable
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([python, str(EXAMPLES / "paddleformers_trainer.py"), str(tmp_path / "out")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    data = json.loads((tmp_path / "out" / "nandoctor-report" / "report.json").read_text(encoding="utf-8"))
    ff = data["first_fault"]
    assert (ff["step"], ff["phase"], ff["layer"], ff["op"], ff["sample_indices"]) == (
        6, "backward", "distance", "sqrt_grad", [3])
    out = proc.stderr + proc.stdout
    assert "global_step: 7" in out and "global_step: 8" not in out  # stopped right after the faulty step
