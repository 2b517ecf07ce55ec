"""Replays re-run the user's code (the failing step's localisation, the sample bisection, the rollback and
remedy replays): a file that code writes must end up as the training wrote it, not as a replay did."""

from __future__ import annotations

from pathlib import Path

import yaml

from nandoctor.probe import ProbeOptions, run_probe
from nandoctor.spec import load_spec

CODE = '''
import numpy as np
import paddle

CALLS = []


def build_model():
    return paddle.nn.Linear(4, 3)


def batches():
    rng = np.random.default_rng(0)
    out = []
    for b in range(12):
        x = rng.normal(size=(6, 4)).astype("float32")
        hit = np.ones((6, 1), dtype="float32")
        if b == 5:
            hit[2] = 0.0  # sample 2 hits its target exactly: sqrt(0), an inf gradient
        out.append((x, hit))
    return out


def step(model, batch):
    """The forward and loss, and what a user's step also does: a log line per call, a checkpoint every third."""
    CALLS.append(1)
    out = model(batch["x"])
    target = out.detach() + batch["hit"]
    with open("train.log", "a") as log:
        log.write(f"call {len(CALLS)}\\n")
    if len(CALLS) % 3 == 0:
        paddle.save(model.state_dict(), "ckpt.pdparams")
        with open("ckpt_call.txt", "w") as f:
            f.write(str(len(CALLS)))
    return paddle.sqrt(((out - target) ** 2).sum(axis=1)).mean()
'''


def test_replays_leave_the_users_files_as_the_training_wrote_them(tmp_path: Path) -> None:
    (tmp_path / "user.py").write_text(CODE, encoding="utf-8")
    spec_path = tmp_path / "config.yaml"
    spec_path.write_text(yaml.safe_dump({
        "version": 1, "model": {"entry": "user.py:build_model"},
        "data": {"entry": "user.py:batches", "fields": ["x", "hit"]}, "step": {"entry": "user.py:step"},
        "optimizer": {"name": "SGD", "args": {"learning_rate": 0.1}}}), encoding="utf-8")
    import os

    cwd = os.getcwd()
    os.chdir(tmp_path)  # the user's code writes relative to where it runs
    try:
        report = run_probe(load_spec(spec_path), ProbeOptions(steps=12, seed=0, device="cpu"))
    finally:
        os.chdir(cwd)
    ff = report.first_fault
    assert (ff.step, ff.phase.value, ff.op) == (5, "backward", "sqrt_grad")
    assert report.remedies, "the remedy replays ran (they call step() many times)"
    # the training called step() 6 times (steps 0-5, stopping before step 5's update); the replays many more
    log = (tmp_path / "train.log").read_text(encoding="utf-8").splitlines()
    assert log == [f"call {i}" for i in range(1, 7)]
    assert (tmp_path / "ckpt_call.txt").read_text(encoding="utf-8") == "6"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == [
        "ckpt.pdparams", "ckpt_call.txt", "config.yaml", "train.log", "user.py"]
    assert not [f for f in report.findings if f.code.value == "replay.side_effects"]
