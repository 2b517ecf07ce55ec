"""`nandoctor run` over the user's own `python -m paddle.distributed.launch` (2 CPU ranks, gloo): a rank killed
by SIGKILL, and a rank that hangs, are named as `probe --nproc` names them (`rank.killed`, `rank.hung`, the
rank, its step and phase), the run exits 1 with the report written, and no process of the launch and no
temporary folder of nandoctor's is left behind. Before, the killed rank's launch ended in the launcher's
own exit status with no report, and a hung rank was called healthy after gloo gave up on it.

The script (tests/run_scripts/ranks.py) prints "rank R step S" after each update: the step a rank stopped at
is read from what its own log says it finished, and the other rank is seen waiting for it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from inloop_helpers import ROOT

from nandoctor.report.json import schema_path

SCRIPT = ROOT / "tests" / "run_scripts" / "ranks.py"
LIMIT = 120  # seconds: a launch left hanging fails the test instead of CI
HANG = 5  # NANDOCTOR_RANK_HANG_SECONDS in the hang case: far below gloo's own timeout (about 30 s)


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "FLAGS_", "NANDOCTOR_"))}
    (tmp_path / "tmp").mkdir()
    return {**env, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp_path / "tmp"), **extra}


def _launch(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """`nandoctor run --json r.json --bundle bundle -- python -m paddle.distributed.launch --nproc_per_node 2
    ranks.py ARGS`."""
    cmd = [sys.executable, "-m", "nandoctor", "run", "--json", str(tmp_path / "r.json"), "--bundle",
           str(tmp_path / "bundle"), "-q", "--",
           sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2", "--log_dir",
           str(tmp_path / "log"), str(SCRIPT), *args]
    try:
        return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=LIMIT,
                              env=_env(tmp_path, **env))
    except subprocess.TimeoutExpired:
        pytest.fail(f"nandoctor run over 2 ranks did not finish in {LIMIT} s: {_logs(tmp_path)}")


def _logs(tmp_path: Path) -> str:
    return "\n".join(p.read_text(errors="replace")[-3000:] for p in sorted((tmp_path / "log").glob("workerlog.*")))


def _steps_done(tmp_path: Path, rank: int) -> list[int]:
    """The steps a rank's own log says it finished (updated)."""
    text = (tmp_path / "log" / f"workerlog.{rank}").read_text(errors="replace")
    return [int(s) for s in re.findall(rf"^rank {rank} step (\d+)$", text, re.M)]


def _left_running(tmp_path: Path) -> list[str]:
    """Live processes of this test's launch: the launcher's command line and every rank's environment
    (PADDLE_LOG_DIR, TMPDIR) hold tmp_path."""
    needle = str(tmp_path).encode()
    left = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if needle not in (entry / "cmdline").read_bytes() + (entry / "environ").read_bytes():
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            left.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
    return left


@pytest.mark.parametrize(("how", "where", "code"), [("kill", "data", "rank.killed"),
                                                     ("hang", "forward", "rank.hung")])
def test_a_rank_that_is_killed_or_hangs_is_named(tmp_path: Path, how: str, where: str, code: str) -> None:
    """Rank 1 SIGKILLs itself before its model is called at step 3, or hangs inside its model's forward at
    step 3, while rank 0 waits for it in DataParallel's gradient all-reduce (rank 0 has begun step 3's
    backward: the hung rank is the one behind)."""
    proc = _launch(tmp_path, how, "1", "3", where, **({"NANDOCTOR_RANK_HANG_SECONDS": str(HANG)}
                                                      if how == "hang" else {}))
    assert not _left_running(tmp_path)
    assert not list((tmp_path / "tmp").glob("nandoctor-*")), "nandoctor run left its temporary folder"
    assert proc.returncode == 1, proc.stderr[-3000:] + _logs(tmp_path)
    data = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    jsonschema.validate(data, json.loads(schema_path().read_text(encoding="utf-8")))
    stopped_at = max(_steps_done(tmp_path, 1)) + 1  # the step rank 1 began and never finished
    assert stopped_at == 3 and max(_steps_done(tmp_path, 0)) + 1 == stopped_at  # rank 0 waited in it
    assert data["verdict"] == "crashed"
    first = data["findings"][0]
    assert first["code"] == code and first["severity"] == "error"
    assert first["message"].startswith("Rank 1 of 2 ")
    ff = data["first_fault"]
    assert (ff["rank"], ff["step"], ff["phase"]) == (1, stopped_at, where)
    assert (first["location"]["rank"], first["location"]["step"]) == (1, stopped_at)
    assert data["details"]["first_rank"] == 1 and data["run"]["world_size"] == 2
    fates = {r["rank"]: r["fate"] for r in data["details"]["ranks"]}
    if how == "kill":
        assert "without a Python exception" in first["message"] and "SIGKILL" in first["message"]
        assert fates[0] == "stopped after rank 1 died"
    else:
        assert f"no rank made progress for {HANG} s" in first["message"]
        assert fates[0] is None and fates[1] == f"no progress for {HANG} s at step {stopped_at}, {where}"
    assert f"{code} at rank 1, step {stopped_at}, {where}" in proc.stdout + proc.stderr
    bundled = json.loads((tmp_path / "bundle" / "report.json").read_text(encoding="utf-8"))
    assert (bundled["findings"][0]["code"], bundled["first_fault"]) == (code, ff)


def test_ranks_resting_together_after_training_are_not_hung(tmp_path: Path) -> None:
    """Both ranks stand still together for 2.5x the hang limit after their last step (an evaluation or a
    checkpoint save of the script's own): under `nandoctor run` that is not a hang; the run is healthy,
    exits 0, and both ranks finish."""
    proc = _launch(tmp_path, "rest", "-1", "-1", "data", "7.5", NANDOCTOR_RANK_HANG_SECONDS="3")
    assert proc.returncode == 0, proc.stderr[-3000:] + _logs(tmp_path)
    data = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    assert data["verdict"] == "healthy" and data["first_fault"] is None
    assert _steps_done(tmp_path, 0) == _steps_done(tmp_path, 1) == list(range(8))
    assert "rank 1 rested" in (tmp_path / "log" / "workerlog.1").read_text(errors="replace")
    assert not _left_running(tmp_path)


@pytest.mark.parametrize("when", ["teardown", "atexit"])
def test_a_rank_that_segfaults_after_its_python_exit_leaves_the_run_healthy(tmp_path: Path, when: str) -> None:
    """Rank 0 dies of SIGSEGV once its whole Python exit is done (a C exit handler, run in exit() where
    Paddle's C++ static destructors run, as in a flaky run of the test above): the training and the report
    are complete, so the run stays healthy and exits 0, and says why the launcher's status (245, -11) is not
    its own. The same crash one step earlier, in an atexit handler of the script's (before the rank's exit
    was done), is still the launch's failure. The launcher's own status, read in the test, is the truth."""
    proc = _launch(tmp_path, when, "0")
    assert "LAUNCH INFO" in proc.stdout + proc.stderr and "Exit code -11" in proc.stdout + proc.stderr
    assert _steps_done(tmp_path, 0) == _steps_done(tmp_path, 1) == list(range(8))
    assert not _left_running(tmp_path)
    data = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    said = "died of SIGSEGV after its script had ended and its report was written"
    if when == "teardown":
        assert proc.returncode == 0, proc.stderr[-3000:] + _logs(tmp_path)
        assert data["verdict"] == "healthy" and data["first_fault"] is None
        assert said in proc.stderr and "not the launcher's 245" in proc.stderr
    else:
        assert proc.returncode != 0 and said not in proc.stderr
        assert data["verdict"] != "healthy"


def test_a_hang_that_gloo_timed_out_first_names_the_rank_behind() -> None:
    """With the default limit (600 s) gloo gives up first (about 30 s on CPU): the waiting rank 0 dies of it
    (its log ends in a gloo error), then the launcher stops the hung rank 1. What the parent saw in such a
    run of ranks.py (hang 1 3, 36 s: too slow for a test) names rank 1 as hung, not rank 0 as killed (as
    probe --nproc did before)."""
    from nandoctor.findings import Mode, Phase
    from nandoctor.parallel.distributed import rank_failure
    from nandoctor.parallel.rank_progress import Ending, Position

    ending = Ending(2, died=[0, 1], in_collective={0},
                    positions={0: Position(3, Phase.BACKWARD, 11), 1: Position(3, Phase.DATA, 12)})
    data = rank_failure({}, ending, mode=Mode.RUN, device="cpu").to_dict()
    first = data["findings"][0]
    assert (first["code"], data["first_fault"]["rank"], data["first_fault"]["step"]) == ("rank.hung", 1, 3)
    assert first["message"].startswith("Rank 1 of 2 stopped moving at step 3, data: ")
    assert "until it timed out, and rank 0 died of it" in first["message"]
    # a rank killed first is still the killed one, whatever dies of it after
    ending = Ending(2, died=[1, 0], in_collective={0},
                    positions={0: Position(3, Phase.BACKWARD, 11), 1: Position(3, Phase.DATA, 12)})
    data = rank_failure({}, ending, mode=Mode.RUN, device="cpu").to_dict()
    assert (data["findings"][0]["code"], data["first_fault"]["rank"]) == ("rank.killed", 1)


_RANK = '''
import os, subprocess, sys
from nandoctor.findings import Phase
from nandoctor.parallel.rank_progress import launched_rank

writer = launched_rank()
writer.at(5, Phase.FORWARD)
pid = os.fork()
if pid == 0:  # a DataLoader worker, say: shares the mapping, must not move the rank
    launched_rank().at(99, Phase.BACKWARD)
    os._exit(0)
os.waitpid(pid, 0)
from nandoctor.parallel.rank_progress import read_positions
where = read_positions(os.environ["NANDOCTOR_RANK_PROGRESS"])[1]
print(where.step, where.phase.value, flush=True)
# a program the rank starts inherits the variables: it finds the rank's file held and writes nothing
child = subprocess.run([sys.executable, "-c", "from nandoctor.parallel.rank_progress import launched_rank; "
                        "print(launched_rank() is None)"], capture_output=True, text=True)
print(child.stdout.strip(), flush=True)
'''


def test_only_the_rank_itself_moves_its_position(tmp_path: Path) -> None:
    """A rank's forked child (a DataLoader worker) and a program it starts (both inherit the launcher's
    variables) never write the rank's position: the parent would take a worker's pid for the rank's, or
    its step for the rank's. The rank's own exit marks it out of its loop (not a death)."""
    from nandoctor.parallel.rank_progress import ENV, read_positions

    folder = tmp_path / "progress"
    folder.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), ENV: str(folder), "PADDLE_TRAINER_ID": "1",
           "PADDLE_TRAINERS_NUM": "2"}
    proc = subprocess.Popen([sys.executable, "-c", _RANK], env=env, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.split("\n") == ["5 forward", "True", ""]
    where = read_positions(folder)[1]
    assert (where.pid, where.step, where.phase) == (proc.pid, 5, None)
    assert json.loads((folder / "rank-1.json").read_text(encoding="utf-8"))["world"] == 2
