"""Ctrl-C and SIGTERM in a real `nandoctor` process: exit 130/143, a partial report with verdict
`interrupted`, loader workers stopped, no native stack dump (subprocess tests)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_watcher import write_spec

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status  # a zombie has exited (its parent, gone, cannot reap it)


def _start(tmp_path: Path, command: str, data: str, extra: list[str], model: str = "", **data_args):
    marker = tmp_path / "marker"
    if model:
        spec = write_spec(tmp_path, data=data, model_args={"marker": str(marker)})
        spec.write_text(spec.read_text(encoding="utf-8").replace(":classifier", f":{model}"), encoding="utf-8")
    else:
        spec = write_spec(tmp_path, data=data, data_args={"marker": str(marker), **data_args})
    args = [sys.executable, "-m", "nandoctor", command, str(spec), "--json", str(tmp_path / "r.json"),
            "--markdown", str(tmp_path / "r.md"), "-q", *extra]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while not marker.exists():
        if proc.poll() is not None or time.time() > deadline:
            out, err = proc.communicate(timeout=30) if proc.poll() is None else proc.communicate()
            pytest.fail(f"the run ended or hung before the marker: rc={proc.returncode}\n{out}\n{err}")
        time.sleep(0.1)
    return proc


def _finish(proc: subprocess.Popen, sig: int, tmp_path: Path) -> tuple[int, str, dict]:
    children = _children(proc.pid)
    proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the run did not stop after the signal")
    assert "Traceback" not in err and "C++ Traceback" not in err and "Error Message Summary" not in err, err
    data = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    assert (tmp_path / "r.md").read_text(encoding="utf-8").startswith("# nandoctor")
    deadline = time.time() + 30
    while any(_alive(c) for c in children) and time.time() < deadline:
        time.sleep(0.2)
    assert not [c for c in children if _alive(c)], "loader workers outlived nandoctor"
    return proc.returncode, out + err, data


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_probe_stopped_by_a_signal_writes_a_partial_interrupted_report(tmp_path, sig, code):
    proc = _start(tmp_path, "probe", "slow_loader", ["--steps", "100000"])
    rc, output, data = _finish(proc, sig, tmp_path)
    assert rc == code, output
    assert data["verdict"] == "interrupted" and data["partial"] is True
    [f] = [f for f in data["findings"] if f["code"] == "run.interrupted"]
    assert ("SIGTERM" if sig == signal.SIGTERM else "Ctrl-C") in f["message"]
    assert len(data["timeline"]) >= 3


def test_probe_with_dataloader_workers_alive_stops_them(tmp_path):
    proc = _start(tmp_path, "probe", "worker_loader", ["--steps", "100000"])
    assert len(_children(proc.pid)) >= 2  # the two DataLoader workers are running
    rc, output, data = _finish(proc, signal.SIGTERM, tmp_path)
    assert rc == 143, output
    assert data["verdict"] == "interrupted" and data["partial"] is True


def test_scan_stopped_by_sigterm(tmp_path):
    proc = _start(tmp_path, "scan", "slow_loader", ["--batches", "100000"])
    rc, output, data = _finish(proc, signal.SIGTERM, tmp_path)
    assert rc == 143, output
    assert data["command"] == "scan" and data["verdict"] == "interrupted" and data["partial"] is True


@pytest.mark.parametrize("command", ["probe", "scan"])
def test_signal_during_the_model_build(tmp_path, command):
    proc = _start(tmp_path, command, "batches", [], model="slow_model")
    rc, output, data = _finish(proc, signal.SIGTERM, tmp_path)
    assert rc == 143, output
    assert data["verdict"] == "interrupted" and data["partial"] is True and data["timeline"] == []


_RESETTING_MODEL = '''
import ctypes
import signal
import sys

sys.path.insert(0, {models_dir!r})
from watcher_models import classifier  # noqa: E402,F401

# What `import paddleformers` does: SIGTERM back to the default in C, behind Python's back.
ctypes.CDLL(None).signal(int(signal.SIGTERM), ctypes.c_void_p(0))
'''


@pytest.mark.parametrize("command, extra", [("probe", ["--steps", "100000"]), ("scan", ["--batches", "100000"])])
def test_sigterm_still_reports_after_the_users_import_reset_it_in_c(tmp_path, command, extra):
    """A library imported by the user's model module resets SIGTERM at the C level while Python's
    `signal.getsignal` still shows nandoctor's handler: without re-installing it the run dies with
    status 143 and no report at all."""
    from test_watcher import MODELS

    (tmp_path / "resetting_model.py").write_text(_RESETTING_MODEL.format(models_dir=str(MODELS.parent)),
                                                encoding="utf-8")
    marker = tmp_path / "marker"
    spec = write_spec(tmp_path, data="slow_loader", data_args={"marker": str(marker)})
    spec.write_text(spec.read_text(encoding="utf-8").replace(f"{MODELS}:classifier", "resetting_model.py:classifier"),
                    encoding="utf-8")
    args = [sys.executable, "-m", "nandoctor", command, str(spec), "--json", str(tmp_path / "r.json"),
            "--markdown", str(tmp_path / "r.md"), "-q", *extra]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 180
    while not marker.exists():
        if proc.poll() is not None or time.time() > deadline:
            out, err = proc.communicate(timeout=30) if proc.poll() is None else proc.communicate()
            pytest.fail(f"the run ended or hung before the marker: rc={proc.returncode}\n{out}\n{err}")
        time.sleep(0.1)
    rc, output, data = _finish(proc, signal.SIGTERM, tmp_path)
    assert rc == 143, output
    assert data["verdict"] == "interrupted" and data["partial"] is True
    [f] = [f for f in data["findings"] if f["code"] == "run.interrupted"]
    assert "SIGTERM" in f["message"]


RUN_SCRIPT = Path(__file__).resolve().parent / "run_scripts" / "checkpoint_on_signal.py"


def _run_watched(tmp_path: Path, *extra: str) -> subprocess.Popen:
    """`nandoctor run` on the checkpointing script, once it trains; a private TMPDIR to see what is left."""
    import os

    (tmp_path / "tmp").mkdir()
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "NANDOCTOR_GRACE_SECONDS": "20",
           "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.Popen([sys.executable, "-m", "nandoctor", "run", "--json", str(tmp_path / "r.json"), "--",
                             sys.executable, str(RUN_SCRIPT), *extra], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (tmp_path / "started").exists():
        if proc.poll() is not None or time.time() > deadline:
            pytest.fail(f"the script ended or hung before training: {proc.communicate(timeout=30)}")
        time.sleep(0.1)
    return proc


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_run_passes_the_signal_to_the_script_and_lets_it_save(tmp_path: Path, sig: int, status: int) -> None:
    """SIGTERM or SIGINT to `nandoctor run` alone (as timeout, Slurm or a CI cancel send it) reaches the script
    once; its handler's one-second checkpoint save completes (no SIGKILL 0.25 s later); the report is partial;
    nothing of nandoctor's is left in TMPDIR."""
    proc = _run_watched(tmp_path)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == status, err[-3000:]
    assert (tmp_path / "ckpt.txt").read_text(encoding="utf-8").startswith("saved at step")
    data = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    assert data["partial"] is True and data["verdict"] == "interrupted" and data["timeline"]
    assert [f["code"] for f in data["findings"]] == ["run.interrupted"]
    assert "passed to the script" in err
    assert list((tmp_path / "tmp").iterdir()) == []


def test_run_without_a_handler_in_the_script_still_writes_the_partial_report(tmp_path: Path) -> None:
    proc = _run_watched(tmp_path, "--no-handler")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    data = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    assert data["partial"] is True and len(data["timeline"]) >= 4
    assert list((tmp_path / "tmp").iterdir()) == []


def test_run_says_when_the_script_was_killed(tmp_path: Path) -> None:
    """A script killed by SIGKILL (the OOM killer) is exit 137 with a message, not the shell's 247."""
    proc = _run_watched(tmp_path, "--kill-self", "6")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 137, err[-3000:]
    assert "killed by SIGKILL" in err and "out-of-memory" in err


def test_run_stopped_after_its_script_ended_still_leaves_nothing_in_tmpdir(tmp_path: Path, monkeypatch) -> None:
    """A SIGTERM that reaches `nandoctor run` after its script ended, while the script's report is merged and
    shown (a benchmark's or a CI's cancel), outside the supervisor's forwarding: exit 143 and no temporary
    folder left behind. The default action used to kill the process there, folder and all."""
    import os
    import tempfile

    from in_process import run_cli

    from nandoctor.zero_change import runner

    script = tmp_path / "train.py"
    script.write_text("import paddle\nm = paddle.nn.Linear(4, 1)\nopt = paddle.optimizer.SGD(0.1, parameters="
                      "m.parameters())\nfor _ in range(3):\n    m(paddle.randn([8, 4])).mean().backward()\n"
                      "    opt.step()\n    opt.clear_grad()\n", encoding="utf-8")
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    merge = runner.merge_children

    def merge_then_sigterm(result: Path) -> None:
        assert result.is_file()  # the script ended and wrote its report
        os.kill(os.getpid(), signal.SIGTERM)
        merge(result)

    monkeypatch.setattr(runner, "merge_children", merge_then_sigterm)
    ran = run_cli(["run", "--json", "r.json", "--", sys.executable, str(script)], tmp_path)
    assert ran.returncode == 143, ran.stderr
    assert "SIGTERM" in ran.stderr
    assert list((tmp_path / "tmp").iterdir()) == []
