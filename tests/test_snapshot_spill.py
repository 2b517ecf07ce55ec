"""The snapshot ring at any model size: snapshots that do not fit the memory budget go to a temporary folder
on disk, the replays restart from them exactly as from memory, and the folder is gone after the run, also
after SIGTERM or Ctrl-C mid-run (subprocess). The budgets are forced small through the documented
environment variables (NANDOCTOR_SNAPSHOT_MEMORY_MB, NANDOCTOR_SNAPSHOT_DISK_MB)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from test_watcher import write_spec

from nandoctor.engine import snapshots, spill
from nandoctor.probe import ProbeOptions, run_probe
from nandoctor.spec import load_spec

SAMPLES = Path(__file__).resolve().parent.parent / "sample_configs"


def _rows(report) -> list[tuple]:
    return [(r["remedy"], r["outcome"], r.get("start_step"), r["steps_run"], r.get("loss_after"))
            for r in report.remedies]


def test_spilled_snapshots_replay_as_from_memory_and_their_folder_goes(tmp_path, monkeypatch):
    """lr_divergence: the gradient norm grows from step ~10 and the forward overflows at step 16; the
    learning-rate and clipping remedies restart before the growth. With no memory for snapshots they
    restart from the same steps, read from disk, with the same results."""
    spec = load_spec(SAMPLES / "lr_divergence" / "config.yaml")
    in_memory = run_probe(spec, ProbeOptions(steps=40, device="cpu"))
    assert in_memory.details["snapshots"]["disk_steps"] == []

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the spill folder's parent
    monkeypatch.setenv(spill.MEMORY_ENV, "0")
    written: list[str] = []
    save = spill.save
    monkeypatch.setattr(spill, "save", lambda folder, arr, n: written.append(save(folder, arr, n)) or written[-1])
    spilled = run_probe(spec, ProbeOptions(steps=40, device="cpu"))

    ring = spilled.details["snapshots"]
    assert ring["enabled"] and ring["memory_budget_bytes"] == 0
    assert 0 in ring["disk_steps"] and ring["disk_steps"] == ring["kept_steps"]
    assert written and all(p.endswith(".npy") for p in written)
    fault = spilled.first_fault.step
    assert fault == in_memory.first_fault.step
    by = {r["remedy"]: r for r in spilled.remedies}
    assert by["lr_x0.1"]["start_step"] < fault and by["lr_x0.1"]["outcome"] == "fixed"  # from before the growth
    assert by["grad_clip"]["start_step"] < fault and by["warmup"]["start_step"] == 0
    assert _rows(spilled) == _rows(in_memory)
    assert not any(os.path.exists(p) for p in written)  # every snapshot file and the folder are gone
    assert not list(tmp_path.glob("nandoctor-snapshots-*"))


@pytest.mark.parametrize("spilled", [False, True])
def test_a_snapshot_restores_weights_and_adams_moments_exactly(monkeypatch, tmp_path, spilled):
    """Weights, Adam's moments and the RNG come back exactly, from memory or from disk; training on from them
    repeats the same losses (dropout draws included)."""
    import paddle

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    if spilled:
        monkeypatch.setenv(spill.MEMORY_ENV, "0")
    paddle.seed(3)
    model = paddle.nn.Sequential(paddle.nn.Linear(4, 8), paddle.nn.Dropout(0.5), paddle.nn.Linear(8, 1))
    opt = paddle.optimizer.Adam(parameters=model.parameters(), learning_rate=0.01)
    x = paddle.to_tensor(np.random.default_rng(0).normal(size=(16, 4)).astype("float32"))

    def step() -> float:
        loss = (model(x) ** 2).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
        return float(loss)

    ring = snapshots.SnapshotRing.for_model(model, opt)
    step()
    snap = ring.take(1, 0, 1)
    assert bool(snap.spilled) is spilled and isinstance(snap.model, spill.Spilled) is spilled
    first = [step() for _ in range(3)]
    snapshots.restore(snap, model, opt)
    snap.rng.restore()
    assert [step() for _ in range(3)] == first
    ring.close()
    del snap
    assert not list(tmp_path.glob("nandoctor-snapshots-*"))


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_the_spill_folder_goes_when_the_probe_is_stopped_mid_run(tmp_path, sig, code):
    marker = tmp_path / "marker"
    spec = write_spec(tmp_path, data="slow_loader", data_args={"marker": str(marker)},
                      optimizer={"name": "Adam", "args": {"learning_rate": 0.01}})
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), spill.MEMORY_ENV: "0"}
    proc = subprocess.Popen([sys.executable, "-m", "nandoctor", "probe", str(spec), "--steps", "100000", "-q",
                             "--json", str(tmp_path / "r.json")], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while not (marker.exists() and list(tmp.glob("nandoctor-snapshots-*/*/*.npy"))):
        if proc.poll() is not None or time.time() > deadline:
            out, err = proc.communicate(timeout=30) if proc.poll() is None else proc.communicate()
            pytest.fail(f"no spilled snapshot before the run ended: rc={proc.returncode}\n{out}\n{err}")
        time.sleep(0.1)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, out + err
    assert (tmp_path / "r.json").is_file()
    assert not list(tmp.iterdir()), list(tmp.iterdir())  # the spill folder is gone, nothing else left


def test_with_no_room_anywhere_remedies_are_verified_on_the_failing_step_alone(monkeypatch):
    from nandoctor.report.markdown import render

    monkeypatch.setenv(spill.MEMORY_ENV, "0")
    monkeypatch.setenv(spill.DISK_ENV, "0")
    report = run_probe(load_spec(SAMPLES / "lr_divergence" / "config.yaml"), ProbeOptions(steps=40, device="cpu"))
    ring = report.details["snapshots"]
    assert ring["enabled"] is False and ring["kept_steps"] == []
    assert "remedies were verified on the failing step alone" in ring["note"]
    by = {r["remedy"]: r for r in report.remedies}
    fault = report.first_fault.step
    assert by["lr_x0.1"]["start_step"] == fault and by["grad_clip"]["start_step"] == fault
    assert by["warmup"]["outcome"] == "not_applicable"
    assert "Each remedy was replayed on the failing step alone" in render(report)
