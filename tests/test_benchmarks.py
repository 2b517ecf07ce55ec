"""`benchmarks/run.py --quick` runs every row end to end and prints the one table; no timing is asserted.

Also checks what makes the ratios fair: the plain loop trains exactly what nandoctor trains (same
losses step for step), and the quick configs still point at the committed model code.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
sys.path.insert(0, str(BENCH))

from harness import workloads  # noqa: E402
from harness.table import Row, render  # noqa: E402

EXPECTED_ROWS = (
    [("1", w) for w in workloads.TRAINING] + [("2", w) for w in workloads.TRAINING]
    + [("3", "transformer"), ("4", "transformer"), ("5", "scan_data")]
    + [("6", w) for w in workloads.TRAINING] + [("6", "scan_data")]
    + [("7", w) for w in workloads.TRAINING]
    + [("8", workloads.LONG_RUN)] * 3
    + [("9", w) for w in workloads.TRAINING]
    + [("10", w) for w in workloads.TRAINING]
)


# A hang guard, not a timing: the quick run took 100 s on this 2-core machine at load average 3-4 and 336 s at
# 8 (two busy processes beside it), where the old 300 s limit failed it. Past the harness's own limits for a
# hung child (1200 s; 1800 s for an in-process row), so that a hung child is ended and said by the harness.
LIMIT = 2400


@pytest.fixture(scope="module")
def quick_output(tmp_path_factory: pytest.TempPathFactory) -> subprocess.CompletedProcess:
    # run.py's nandoctor-bench-* folder in pytest's tree: a run stopped at the limit leaves it there, not in the
    # session's $TMPDIR (a leak that failed the session's teardown besides this test)
    env = {**os.environ, "TMPDIR": str(tmp_path_factory.mktemp("bench_tmp"))}
    proc = subprocess.Popen([sys.executable, str(BENCH / "run.py"), "--quick"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=LIMIT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # run.py and the pairs it started: none left on the cores
        out, err = proc.communicate()
        pytest.fail(f"benchmarks/run.py --quick did not finish in {LIMIT} s; its last words:\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def table_rows(stdout: str) -> list[list[str]]:
    """The body rows of the printed table, split on runs of two or more spaces."""
    import re

    lines = stdout.splitlines()
    rules = [i for i, ln in enumerate(lines) if ln.startswith("-----")]
    assert len(rules) == 3, f"expected a table with header and body rules:\n{stdout}"
    return [re.split(r"\s{2,}", ln.strip()) for ln in lines[rules[1] + 1:rules[2]]]


def test_quick_prints_one_table_with_every_row_measured(quick_output: subprocess.CompletedProcess) -> None:
    assert quick_output.returncode == 0, quick_output.stderr[-3000:]
    out = quick_output.stdout
    headers = [ln for ln in out.splitlines() if ln.split()[:2] == ["#", "measure"]]
    assert len(headers) == 1 and "target" in headers[0] and "result" in headers[0], out
    rows = table_rows(out)
    assert [(r[0], r[2]) for r in rows] == EXPECTED_ROWS
    for r in rows:
        # every row measured something and judged it (pass, MISS, or info for the anchor): none failed to run
        assert r[6] in ("pass", "MISS", "info"), f"row not measured: {r}"
        assert r[4].endswith(("x", " s", " KB", " MB")), r
    assert "1 pair(s) per row" in out and "machine:" in out


def test_probe_and_plain_loop_train_the_same_thing(tmp_path: Path) -> None:
    """Same seed, model, data, loss and optimizer: the probe's loss timeline equals the plain loop's."""
    from nandoctor.probe import ProbeOptions, run_probe
    from nandoctor.spec import load_spec

    w = workloads.load("deep_mlp", True, tmp_path)
    report = run_probe(load_spec(w.config), ProbeOptions(steps=5, seed=0, device="cpu"))
    assert report.verdict.value == "healthy"
    out = tmp_path / "plain.json"
    subprocess.run([sys.executable, str(w.plain), str(w.config), "--steps", "5", "--json", str(out)],
                   check=True, capture_output=True, timeout=120)
    import json

    plain = json.loads(out.read_text())["loss"]
    probe = [p.loss for p in report.timeline]
    assert probe == pytest.approx(plain, rel=1e-5)


FLOOR_STEPS = 160  # past the first 64 steps, which `run` reads every one of: the rest may go unread


@pytest.fixture(scope="module")
def plain_fast_mlp(tmp_path_factory: pytest.TempPathFactory) -> tuple[workloads.Workload, list[float]]:
    """fast_mlp's quick config and the plain script's losses over FLOOR_STEPS steps (one run for both floors)."""
    import json

    folder = tmp_path_factory.mktemp("floor")
    w = workloads.load("fast_mlp", True, folder)
    subprocess.run([sys.executable, str(w.plain), str(w.config), "--steps", str(FLOOR_STEPS), "--json",
                    str(folder / "plain.json")], check=True, capture_output=True, timeout=120)
    return w, json.loads((folder / "plain.json").read_text())["loss"]


@pytest.mark.parametrize("mode", ["seams", "tape", "bare"])
def test_the_floor_trains_what_the_plain_script_trains_and_keeps_its_steps(
        plain_fast_mlp: tuple[workloads.Workload, list[float]], tmp_path: Path, mode: str) -> None:
    """benchmarks/floor.py's seams leave the training as it was (same losses step for step), and its tape keeps
    every step's inputs, loss and output gradient; under `nandoctor run` (`bare`), some unread steps' and never
    more than the steps after the first 64, which `run` reads: a floor that trained differently, or kept
    nothing, would measure nothing."""
    import json

    from nandoctor.engine.watcher import READ_ALL_STEPS

    w, plain = plain_fast_mlp
    run = [sys.executable, "-m", "nandoctor", "run", "--json", str(tmp_path / "run.json"), "--"]
    floor = subprocess.run([*(run if mode == "bare" else []), sys.executable, str(BENCH / "floor.py"), "--child",
                            mode, str(w.plain), str(w.config), "--steps", str(FLOOR_STEPS), "--json",
                            str(tmp_path / "floor.json")], check=True, capture_output=True, text=True, timeout=120)
    kept = int(re.search(r"floor: (\d+) step\(s\) kept", floor.stderr)[1])
    if mode == "bare":
        assert 0 < kept <= FLOOR_STEPS - READ_ALL_STEPS
    else:
        assert kept == (FLOOR_STEPS if mode == "tape" else 0)
    assert json.loads((tmp_path / "floor.json").read_text())["loss"] == pytest.approx(plain, rel=1e-6)


def test_quick_configs_point_at_the_committed_code(tmp_path: Path) -> None:
    for name in (*workloads.TRAINING, "scan_data"):
        w = workloads.load(name, True, tmp_path)
        raw = w.settings
        for block in ("model", "data"):
            file = Path(raw[block]["entry"].split(":")[0])
            assert file.is_absolute() and file == workloads.ROOT / name / "model.py"
        assert w.plain.is_file()
    fault = workloads.load("transformer", True, tmp_path, fault=True).settings
    assert fault["data"]["args"]["empty_sample_at"] == workloads.QUICK_FAULT["empty_sample_at"]


def test_table_judges_targets_both_ways() -> None:
    rows = [Row("1 whole process", "w", "s", 1.2, "x", "<= 1.10"),
            Row("5 scan throughput", "w", "s", 0.9, "x", ">= 0.80"),
            Row("4 localisation", "w", "s", None, "s", "<= 30", "why"),
            Row("3 anchor", "w", "s", 18.0, "x", "")]
    assert [r.status for r in rows] == ["MISS", "pass", "n/a", "info"]
    text = render(rows, "head")
    assert "1 pass, 1 miss, 1 not measured, 1 info" in text


def test_pairs_alone_keep_each_result_with_its_command_whatever_ran_first(tmp_path: Path) -> None:
    """`procs.run_alone` runs A and B one after the other, B first on every other pair: each pair's `a` is
    still A's run and `b` B's, `{run}` names the pair (runs on two cores write apart), and B on a pair
    where it ran first ended before A began."""
    from harness import procs

    def command(side: str) -> list[str]:
        return [sys.executable, "-c", "import sys, time; open(sys.argv[1], 'w').write(repr(time.time())); "
                f"print('{side}')", str(tmp_path / f"{side}_{{run}}.txt")]

    paired = procs.run_alone(command("A"), command("B"), 4, tag="t")
    assert [r.stdout.strip() for r in paired.a] == ["A"] * 4 and [r.stdout.strip() for r in paired.b] == ["B"] * 4
    assert all(r.returncode == 0 and r.cpu_seconds > 0 for r in paired.a + paired.b)
    ended = {(side, i): float((tmp_path / f"{side}_t{i}.txt").read_text()) for side in "AB" for i in range(4)}
    assert all(ended[("A", i)] < ended[("B", i)] for i in (0, 2))  # A first on even pairs
    assert all(ended[("B", i)] < ended[("A", i)] for i in (1, 3))  # B first on odd ones
