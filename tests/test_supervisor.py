"""parallel/supervisor.py on real processes (a `python -c` that sleeps, with a child of its own in its process
group): a hang seen by the watch, or the time limit, kills the command and its group; its exit status comes
back; SIGTERM is passed on with the grace period, and the group is killed when the grace runs out; Ctrl-C
where signals are not passed on kills everything and goes on; a real RankWatch names a rank that stands still;
the looks space out while no rank has shown itself."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from nandoctor.parallel.rank_progress import ENV, RankWatch, process_alive
from nandoctor.parallel.supervisor import Supervisor

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="process groups, /proc")

# The command: does what `head` says, starts a child of its own (same process group: it inherits what `head`
# ignores), writes the child's pid, then does what `end` says.
COMMAND = """
import pathlib, signal, subprocess, sys, time
{head}
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
pathlib.Path(sys.argv[1]).write_text(str(child.pid))
{end}
"""


class FakeWatch:
    """What the supervisor asks of a RankWatch; `hang` says when a look finds none moved."""

    def __init__(self, hang=lambda: False, seen: bool = False) -> None:
        self.hang = hang
        self.ending = SimpleNamespace(seen=seen)
        self.calls: list[str] = []

    def look(self) -> bool:
        self.calls.append("look")
        return self.hang()

    def stopped(self) -> None:
        self.calls.append("stopped")

    def stop_all(self) -> None:
        self.calls.append("stop_all")


def _command(tmp_path: Path, head: str = "", end: str = "time.sleep(120)") -> list[str]:
    return [sys.executable, "-c", COMMAND.format(head=head, end=end), str(tmp_path / "child.pid")]


def _child(tmp_path: Path) -> int | None:
    try:
        return int((tmp_path / "child.pid").read_text())
    except (OSError, ValueError):
        return None


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not process_alive(pid)


@pytest.fixture
def cleanup():
    """Whatever a failed test leaves running is killed."""
    started: list[Supervisor] = []
    yield started.append
    for sup in started:
        if sup.proc.poll() is None:
            sup.proc.kill()
            sup.proc.wait()


def test_a_hang_kills_the_command_and_its_process_group(tmp_path: Path, cleanup) -> None:
    watch = FakeWatch(hang=lambda: _child(tmp_path) is not None)
    sup = Supervisor(_command(tmp_path), watch)
    cleanup(sup)
    code, stopped_by = sup.wait()
    assert (code, stopped_by) == (-signal.SIGKILL, None)
    assert sup.hung and _gone(_child(tmp_path))
    # stopped once, every process of the launch killed, and no look after the hang
    assert watch.calls[-2:] == ["stopped", "stop_all"] and watch.calls.count("stopped") == 1


def test_the_time_limit_stops_it_as_a_hang(tmp_path: Path, cleanup) -> None:
    watch = FakeWatch()
    started = time.monotonic()
    sup = Supervisor(_command(tmp_path), watch, time_limit=1.0, kill_at_end=True)
    cleanup(sup)
    assert sup.wait() == (-signal.SIGKILL, None)
    assert 1.0 < time.monotonic() - started < 30
    assert sup.hung and "stopped" in watch.calls and _gone(_child(tmp_path))


@pytest.mark.parametrize("kill_at_end", [True, False])
def test_the_exit_status_and_what_the_command_leaves_behind(tmp_path: Path, cleanup, kill_at_end: bool) -> None:
    """The command's own status comes back, after one last look; `kill_at_end` kills what it left in its group
    (probe's launcher), else that is left alone and only the ranks of a launch seen are stopped."""
    watch = FakeWatch(seen=True)
    sup = Supervisor(_command(tmp_path, end="sys.exit(3)"), watch, kill_at_end=kill_at_end)
    cleanup(sup)
    assert sup.wait() == (3, None)
    assert not sup.hung and watch.calls[-2:] == ["look", "stop_all"]
    child = _child(tmp_path)
    if kill_at_end:
        assert _gone(child)
    else:
        assert process_alive(child)
        os.kill(child, signal.SIGKILL)


def _send_when_forwarding(sup: Supervisor, tmp_path: Path, signum: int) -> threading.Thread:
    """Send `signum` to this process once the command runs and the supervisor's handlers are in place."""
    def send() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if signal.getsignal(signum) == sup._forward and _child(tmp_path) is not None:
                os.kill(os.getpid(), signum)
                return
            time.sleep(0.02)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def test_sigterm_is_passed_on_and_the_command_stops_on_its_own(tmp_path: Path, cleanup, monkeypatch) -> None:
    monkeypatch.setenv("NANDOCTOR_GRACE_SECONDS", "30")
    on_sigterm = ("def stop(*_):\n    time.sleep(0.5); pathlib.Path(sys.argv[1] + '.saved').write_text('1')\n"
                  "    sys.exit(0)\nsignal.signal(signal.SIGTERM, stop)")
    told: list[tuple[int, float]] = []
    before = signal.getsignal(signal.SIGTERM)
    sup = Supervisor(_command(tmp_path, on_sigterm), FakeWatch(), forward_signals=True,
                     on_forward=lambda s, g: told.append((s, g)))
    cleanup(sup)
    _send_when_forwarding(sup, tmp_path, signal.SIGTERM)
    assert sup.wait() == (0, signal.SIGTERM)  # its handler ran to its end: no SIGKILL after it
    assert (tmp_path / "child.pid.saved").is_file()
    assert told == [(signal.SIGTERM, 30.0)]
    assert _gone(_child(tmp_path))  # the child got SIGTERM too: the whole group was sent it
    assert signal.getsignal(signal.SIGTERM) == before


def test_the_group_is_killed_when_the_grace_runs_out(tmp_path: Path, cleanup, monkeypatch) -> None:
    monkeypatch.setenv("NANDOCTOR_GRACE_SECONDS", "1")
    watch = FakeWatch(hang=lambda: False)
    sup = Supervisor(_command(tmp_path, "signal.signal(signal.SIGTERM, signal.SIG_IGN)"), watch,
                     forward_signals=True)
    cleanup(sup)
    _send_when_forwarding(sup, tmp_path, signal.SIGTERM)
    started = time.monotonic()
    assert sup.wait() == (-signal.SIGKILL, signal.SIGTERM)
    assert time.monotonic() - started >= 1.0
    assert _gone(_child(tmp_path)) and not sup.hung  # (it ignored SIGTERM as well: killed with the group)


def test_ctrl_c_where_signals_are_not_passed_on_kills_everything(tmp_path: Path, cleanup) -> None:
    def interrupt() -> bool:
        if _child(tmp_path) is not None:
            raise KeyboardInterrupt
        return False

    watch = FakeWatch(hang=interrupt)
    sup = Supervisor(_command(tmp_path), watch)
    cleanup(sup)
    with pytest.raises(KeyboardInterrupt):
        sup.wait()
    assert sup.proc.returncode == -signal.SIGKILL and _gone(_child(tmp_path))
    assert watch.calls[-1] == "stop_all"


RANK = """
import sys, time
from nandoctor.findings import Phase
from nandoctor.parallel.rank_progress import RankProgress
RankProgress(sys.argv[1], 0).at(0, Phase.FORWARD)
time.sleep(120)
"""


def test_a_real_rank_watch_names_the_rank_that_stands_still(tmp_path: Path, cleanup, monkeypatch) -> None:
    """One rank, in a session of its own as a launcher starts it, stands at step 0's forward: after the hang
    limit it is the hung one, and it is killed (found by the variable its parent set), not left as an orphan."""
    monkeypatch.setenv("NANDOCTOR_RANK_HANG_SECONDS", "1")
    watch = RankWatch(tmp_path / "ranks", 1)
    env = {**os.environ, ENV: str(watch.folder), "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    launcher = ("import subprocess, sys\n"
                "rank = subprocess.Popen([sys.executable, '-c', sys.argv[1], sys.argv[2]], start_new_session=True)\n"
                "open(sys.argv[3], 'w').write(str(rank.pid))\nrank.wait()")
    sup = Supervisor([sys.executable, "-c", launcher, RANK, str(watch.folder), str(tmp_path / "child.pid")],
                     watch, kill_at_end=True, env=env)
    cleanup(sup)
    assert sup.wait() == (-signal.SIGKILL, None)
    assert sup.hung and watch.ending.hung and not watch.ending.died
    assert watch.ending.positions[0].step == 0
    assert _gone(_child(tmp_path))


class TimedWatch(FakeWatch):
    """A FakeWatch that notes when each look came, and shows a rank from look `rank_at` on (None: never)."""

    def __init__(self, rank_at: int | None) -> None:
        super().__init__()
        self.rank_at = rank_at
        self.times: list[float] = []

    def look(self) -> bool:
        self.times.append(time.monotonic())
        if self.rank_at is not None and len(self.times) >= self.rank_at:
            self.ending.seen = True
        return False


@pytest.mark.parametrize("rank_at", [None, 4])
def test_looks_space_out_until_a_rank_shows_itself(tmp_path: Path, cleanup, rank_at: int | None) -> None:
    """A single process (no rank ever seen): the looks space out to QUIET_LOOK_SECONDS, a few in 2 s where
    LOOK_SECONDS would make 40; once a rank shows itself they are LOOK_SECONDS apart again."""
    from nandoctor.parallel.supervisor import LOOK_SECONDS, QUIET_LOOK_SECONDS

    watch = TimedWatch(rank_at)
    started = time.monotonic()
    sup = Supervisor(_command(tmp_path, end="time.sleep(2)"), watch, kill_at_end=True)
    cleanup(sup)
    assert sup.wait() == (0, None)
    took = time.monotonic() - started  # (2 s and the command's start-up, longer on a loaded machine)
    gaps = [b - a for a, b in zip(watch.times, watch.times[1:])]
    if rank_at is None:  # 0.05, 0.1, 0.2 s, then QUIET_LOOK_SECONDS apart
        assert len(watch.times) <= 4 + took / QUIET_LOOK_SECONDS and max(gaps) >= QUIET_LOOK_SECONDS * 0.9
    else:
        later = gaps[rank_at:]
        assert len(later) >= 10 and sorted(later)[len(later) // 2] < 2 * LOOK_SECONDS
