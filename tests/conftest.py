"""Shared pytest set-up: the --update-golden option and the fixtures every test file may use.

Kept small on purpose; helpers add fixtures here with small edits.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parent
GOLDEN_DIR = TESTS_DIR / "golden"
# Test-only helper modules (report_samples.py ...) import as top-level names.
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))


# The files that take longest (seconds of one worker, measured on the 2-core machine), started first so that
# no long file is left to run alone at the end while the other worker idles; the rest keep their order.
SLOW_FIRST = ("test_distributed.py", "test_remedy_truth.py", "test_benchmarks.py", "test_report_schema.py",
              "test_probe_samples.py", "test_run_ranks.py", "test_signals.py", "test_run_command.py",
              "test_run_forked.py", "test_long_run.py", "test_run_gan.py", "test_remedies.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`make test`: `-n auto --dist loadgroup`), the tests of one file run on one worker,
    so what a file trains once (a module fixture) is trained once; the parity file, which is half the suite,
    is spread by sample config instead (each config's probe is cached per worker and shared by its tests).
    The slowest files go first (SLOW_FIRST)."""
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))  # stable: a file's order is kept
    for item in items:
        group = item.path.name
        if group == "test_parity.py" and hasattr(item, "callspec"):
            group += "::" + str(item.callspec.params.get("name", ""))
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="Rewrite tests/golden/ from the current output instead of comparing.")


@pytest.fixture
def golden(request: pytest.FixtureRequest):
    """golden(name, text): compare text with tests/golden/<name>, or rewrite it under --update-golden."""
    update = request.config.getoption("--update-golden")

    def check(name: str, text: str) -> None:
        path = GOLDEN_DIR / name
        if update:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            return
        assert path.exists(), f"no golden file {path}; run pytest --update-golden to create it"
        expected = path.read_text(encoding="utf-8")
        assert text == expected, f"output differs from {path}; if intended, run pytest --update-golden"

    return check


# --- $TMPDIR stays as the suite found it --------------------------------------------------------------
# The session (nandoctor, Paddle, reproduce.py subprocesses, pytest's own tmp_path) writes temporary files
# into a private folder, set here before any test runs and inherited by subprocesses. At the end, anything
# left in it but pytest's tmp_path tree is a leak and fails the session; then the folder goes, so
# `make test` leaves $TMPDIR as it found it (pytest's tmp_path folders included).
_SESSION_TMP = tempfile.mkdtemp(prefix="nandoctor-tests-", dir=tempfile.gettempdir())
# The fixture below removes it, but only when some test ran: a `-k` that selects nothing, a collection
# error or an interrupted session would leave it behind. atexit removes it in every case.
atexit.register(shutil.rmtree, _SESSION_TMP, ignore_errors=True)
os.environ["TMPDIR"] = _SESSION_TMP
tempfile.tempdir = _SESSION_TMP


@pytest.fixture(scope="session", autouse=True)
def tmpdir_left_clean():
    """Fail the session when nandoctor (or a test) left files in $TMPDIR."""
    yield
    leftovers = sorted(name for name in os.listdir(_SESSION_TMP) if not name.startswith("pytest-of-"))
    shutil.rmtree(_SESSION_TMP, ignore_errors=True)
    assert not leftovers, f"files left in $TMPDIR by this test session: {leftovers}"


SAMPLES_DIR = str(TESTS_DIR.parent / "sample_configs")


@pytest.fixture(autouse=True)
def fresh_sample_modules():
    """Each test imports the samples' own modules afresh, as a new process would. A sample's module holds
    state (stream_loader's read position): a test that ran a sample before, on the same worker, would
    otherwise leave it moved on for the next (test_remedy_truth ran the stream to its end, and a later
    probe of it on that worker found no batch)."""
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(SAMPLES_DIR):
            del sys.modules[name]
    yield


@pytest.fixture
def no_stats_steps():
    """Per-layer stats (which also read the gradients) only at step 0, so later steps of a many-tensor
    model go unread but one in four (the rollback tests)."""
    from nandoctor.engine.watcher import StatsSchedule

    orig = StatsSchedule.want, StatsSchedule.next_stats
    StatsSchedule.want = lambda self, step: step == 0  # type: ignore[method-assign]
    StatsSchedule.next_stats = lambda self, step: 2**62  # type: ignore[method-assign]
    yield
    StatsSchedule.want, StatsSchedule.next_stats = orig  # type: ignore[method-assign]


PINNED_EVERY, PINNED_STATS_EVERY = 16, 40


@pytest.fixture
def pinned_schedule(monkeypatch):
    """Reads and snapshots every PINNED_EVERY steps past the first READ_ALL_STEPS, stats every
    PINNED_STATS_EVERY, whatever the machine's speed: two runs compared make the same decisions (the quiet
    steps' tests)."""
    from nandoctor.engine import snapshots, watcher

    monkeypatch.setattr(watcher, "_READ_SHARE", 1e-9)
    monkeypatch.setattr(watcher, "MAX_UNREAD", PINNED_EVERY)
    monkeypatch.setattr(snapshots.SnapshotRing, "_interval", lambda self, took: PINNED_EVERY)

    def fixed_k(self) -> None:
        self._fresh, self.k = 0, PINNED_STATS_EVERY

    monkeypatch.setattr(watcher.StatsSchedule, "_work_out_k", fixed_k)
    return PINNED_EVERY
