"""`nandoctor run` on a script whose fault is in its own loss code (not in the model): the step, phase, op,
source line and samples come from a checked second pass, and the files the script writes stay as the real
run wrote them.

The expected answer comes from a plain Paddle loop over the script's own functions, with Paddle's tensor
checker on (the step and op) and each sample of the failing batch replayed alone (the samples).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import pytest
from inloop_helpers import ROOT
from run_truth import run_script

SCRIPT = ROOT / "tests" / "run_scripts" / "loss_code.py"
LINE = {"log": "return -(y * paddle.log(p)", "sqrt": "return paddle.sqrt(", "weight": "w = paddle.sqrt("}


def _script() -> Any:
    return run_script(SCRIPT)


def _finite_grads(model: Any) -> bool:
    return all(p.grad is None or bool(np.isfinite(p.grad.numpy().astype("float64")).all())
               for p in model.parameters())


def ground_truth(kind: str) -> dict[str, Any]:
    """The first step whose loss code the checker stops in, its op, and the samples that fault alone."""
    from paddle.amp import debugging

    script = _script()
    config = debugging.TensorCheckerConfig(enable=True, debug_mode=debugging.DebugMode.CHECK_NAN_INF_AND_ABORT)
    debugging.enable_tensor_checker(config)  # before the script seeds: its own paddle.seed(0) still holds
    try:
        model, opt = script.build()
        for step in range(8):
            x, y = script.batch(kind, step)
            loss = None
            try:  # the script's train_step, in two halves: which one the checker stops in is the phase
                loss = script.loss_of(kind, model(paddle.to_tensor(x)), paddle.to_tensor(y))
                loss.backward()
            except RuntimeError as exc:
                op = re.search(r"op=(\w+)", str(exc)).group(1)
                phase = "loss" if loss is None else "backward"
                break
            opt.step()
            opt.clear_grad()
        else:
            raise AssertionError("the plain loop never went non-finite")
    finally:
        debugging.disable_tensor_checker()
    for p in model.parameters():
        p.clear_gradient()
    samples = []
    for i in range(len(x)):  # the parameters are those of the failing step: the loop never updated on it
        loss = script.train_step(kind, model, x[i:i + 1], y[i:i + 1])
        if not np.isfinite(float(loss)) or not _finite_grads(model):
            samples.append(i)
        for p in model.parameters():
            p.clear_gradient()
    return {"step": step, "phase": phase, "layer": None, "op": op, "sample_indices": samples}


def _run(tmp_path: Path, kind: str) -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
    cmd = [sys.executable, "-m", "nandoctor", "run", "--json", "r.json", "--", sys.executable, str(SCRIPT), kind]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    return proc, json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("kind", ["log", "sqrt", "weight"])
def test_a_fault_in_the_loss_code_is_named_with_its_op_line_and_samples(tmp_path: Path, kind: str) -> None:
    """The samples come from the checked pass's bisection through the loss function it caught, each named
    sample faulting alone: for `weight` every row of the gradient at the model's output is NaN (the weighted
    mean divides by the sum of the weights), and sample 2 alone is the cause (issue 34, item 3)."""
    expected = ground_truth(kind)
    assert expected["op"] == {"log": "log", "sqrt": "sqrt_grad", "weight": "sqrt"}[kind] and expected["sample_indices"]
    proc, data = _run(tmp_path, kind)
    assert proc.returncode == 1, proc.stderr[-3000:]
    ff = data["first_fault"]
    assert {k: ff[k] for k in expected} == expected
    finding = data["findings"][0]
    assert finding["code"] == {"loss": "loss.nonfinite", "backward": "grad.nonfinite"}[expected["phase"]]
    source = finding["evidence"]["source"]  # "…/loss_code.py:36 in loss_of": the script's own line
    file, rest = source.rsplit(":", 1)
    assert Path(file).name == SCRIPT.name and rest.endswith(" in loss_of")
    assert LINE[kind] in SCRIPT.read_text(encoding="utf-8").splitlines()[int(rest.split()[0]) - 1]
    assert "checked second pass" in " ".join(finding["evidence"]["notes"])
    assert finding["evidence"]["samples_scope"] == "samples" and "loss function" in finding["message"]
    # the real run stopped before the faulty update; the checked pass wrote nothing of the user's
    log = (tmp_path / "train.log").read_text(encoding="utf-8").splitlines()
    assert [line.split()[1] for line in log] == [str(s) for s in range(expected["step"])]
    saved = paddle.load(str(tmp_path / "ckpt" / "model.pdparams"))
    assert all(np.isfinite(v.numpy()).all() for v in saved.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "r.json", "train.log"]


def test_an_inline_loss_names_no_sample_and_says_why(tmp_path: Path) -> None:
    """The weighted mean written inline in the loop: no function of the loss to call on part of the batch, and
    every row of the gradient at the model's output is NaN, so no sample can be confirmed as a cause: none is
    named (null, not tried apart), and the report says why, with the plain loop's step and op."""
    expected = ground_truth("inline")
    assert expected["sample_indices"] == [2]  # the cause, which nandoctor run cannot confirm here
    proc, data = _run(tmp_path, "inline")
    assert proc.returncode == 1, proc.stderr[-3000:]
    ff = data["first_fault"]
    assert {k: ff[k] for k in ("step", "phase", "op")} == {k: expected[k] for k in ("step", "phase", "op")}
    assert ff["sample_indices"] is None
    finding = data["findings"][0]
    assert finding["evidence"]["samples_reason"] == "loss_code_not_replayed"
    assert "samples_scope" not in finding["evidence"]
    assert "No sample is named as a cause: your loss code is not a function" in finding["message"]
    assert "every row of batch 4" in finding["message"]


def test_sandbox_keeps_the_users_files_and_still_reads_its_own_writes(tmp_path: Path) -> None:
    """The checked pass's write redirection, in a child process: files written, appended, renamed and
    removed there leave the user's folder as it was, and the child reads back what it wrote."""
    (tmp_path / "log.txt").write_text("real run\n", encoding="utf-8")
    (tmp_path / "keep.bin").write_bytes(b"checkpoint")
    code = f"""
import os, sys
sys.path.insert(0, {str(ROOT)!r})
from pathlib import Path
from nandoctor.engine.sandbox import redirect_writes
redirect_writes(Path({str(tmp_path / 'own' / 'mirror')!r}), exempt=Path({str(tmp_path / 'own')!r}))
with open("log.txt", "a") as f:
    f.write("replay\\n")
assert open("log.txt").read() == "real run\\nreplay\\n"
os.makedirs("ckpt", exist_ok=True)
Path("ckpt/new.txt").write_text("x")
os.replace("keep.bin", "moved.bin")
os.remove("log.txt")
Path({str(tmp_path / 'own' / 'answer.json')!r}).write_text("ok")
print("done")
"""
    (tmp_path / "own").mkdir()
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "done", proc.stderr[-2000:]
    assert (tmp_path / "log.txt").read_text(encoding="utf-8") == "real run\n"
    assert (tmp_path / "keep.bin").read_bytes() == b"checkpoint"
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "moved.bin").exists()
    assert (tmp_path / "own" / "answer.json").read_text(encoding="utf-8") == "ok"  # the exempt folder


def test_the_model_side_of_the_same_script_needs_no_second_pass(tmp_path: Path) -> None:
    """A fault inside the model (examples/unmodified_loop.py's sqrt in a layer) is replayed, not re-run."""
    cmd = [sys.executable, "-m", "nandoctor", "run", "--json", "r.json", "--", sys.executable,
           str(ROOT / "examples" / "unmodified_loop.py")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    finding = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))["findings"][0]
    assert finding["location"]["layer"] == "distance"
    assert "checked second pass" not in json.dumps(finding)


def test_the_in_process_sandbox_puts_every_function_back() -> None:
    """Replays in this process run inside it: afterwards open, io.open and os's file functions are Python's."""
    import builtins
    import io

    from nandoctor.engine.sandbox import redirected

    names = ("open", "remove", "unlink", "rename", "replace", "mkdir", "makedirs", "rmdir")
    before = (builtins.open, io.open, *(getattr(os, n) for n in names))
    with redirected(None):
        assert builtins.open is not before[0]
    assert (builtins.open, io.open, *(getattr(os, n) for n in names)) == before
