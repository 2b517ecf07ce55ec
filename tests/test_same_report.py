"""The same report on every run (issue 35 item 4): how often the probe reads the device follows measured
timings, and the remedies' time budget the machine's load, so a test forces the read stride (NANDOCTOR_READ_EVERY)
and the time budget (NANDOCTOR_REMEDY_SECONDS; both for tests only) to two values each and asks for the same
findings (codes, severities, steps, layers, ops), verdict and remedy rows (kind, verdict, start step, threshold).
The runs: a plain SGD warmup to a too-high rate whose loss diverges and overflows at step ~150 (past the steps
read in full), and an Adam one that diverges without a NaN (its remedies replayed against the divergence)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_loss_trend import FAULTY as FAULTY_RUN
from test_loss_trend import probe

from nandoctor.engine.watcher import READ_EVERY_ENV
from nandoctor.remedies.trial import BUDGET_ENV

FAULTY = {"peak": 1.0, **FAULTY_RUN}
DIVERGING = {"peak": 1.0, "n": 200}
# the faulty run stopped before its fault: a divergence from step ~116, past the steps every stride reads in full,
# so a clip threshold from the norms read before it would follow the stride
LATE = {**FAULTY, "n": 160}


def conclusions(report: dict[str, Any]) -> dict[str, Any]:
    """What a report concludes, timings and measured figures aside."""
    return {
        "verdict": report["verdict"],
        "first_fault": report["first_fault"],
        "findings": [(f["code"], f["severity"], f["location"]["step"], f["location"]["layer"], f["location"]["op"],
                      f["location"]["batch_index"]) for f in report["findings"]],
        "remedies": [(r["remedy"], r["outcome"], r.get("start_step"), r.get("threshold"))
                     for r in report.get("remedies") or []],
    }


@pytest.mark.parametrize("case", ["faulty", "diverging", "late"])
def test_forced_read_strides_give_the_same_findings(case: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    kw = {"faulty": FAULTY, "diverging": DIVERGING, "late": LATE}[case]
    seen = []
    # every read against a budget a loaded machine would leave (0.001 s), one read in 48 against a quiet one's
    for stride, budget in (("1", "0.001"), ("48", "100000")):
        monkeypatch.setenv(READ_EVERY_ENV, stride)
        monkeypatch.setenv(BUDGET_ENV, budget)
        report = probe(tmp_path, try_fixes=True, **kw)
        assert report["details"]["remedies"]["budget_seconds"] == round(float(budget), 1)
        seen.append(conclusions(report))
    assert seen[0] == seen[1]
    codes = {f[0] for f in seen[0]["findings"]}
    assert "loss.divergence" in codes
    outcomes = {r[0]: r[1] for r in seen[0]["remedies"]}
    assert outcomes["lr_x0.1"] == "fixed"  # (the plain loops agree: tests/test_divergence_remedies.py)
    assert outcomes["grad_clip"] in ("fixed", "not_fixed")  # replayed, its threshold from every stride's norms
    if case == "faulty":
        assert seen[0]["verdict"] == "nan_found" and seen[0]["first_fault"]["step"] > 64
    if case == "late":
        assert seen[0]["verdict"] == "at_risk" and min(r[2] for r in seen[0]["remedies"] if r[2] is not None) > 64


def test_the_norm_grid_spreads_with_the_run_and_ends_quiet_windows_on_its_steps() -> None:
    """The steps every stride reads after the first 64 (the grid): every 64th to step 255, every 128th to
    511, every 256th after, so no gap is longer than half the steps before it; `next_grid`, where a quiet
    window ends, is the first of them from any step."""
    from nandoctor.engine.watcher import next_grid, on_grid

    grid = [s for s in range(1, 5000) if on_grid(s)]
    assert grid[:7] == [64, 128, 192, 256, 384, 512, 768]
    assert [s for s in grid if 1024 <= s < 2048] == [1024, 1280, 1536, 1792]
    assert all(b - a <= max(64, a // 2) for a, b in zip(grid, grid[1:]))
    assert all(next_grid(s) == min(g for g in [0, *grid] if g >= s) for s in range(grid[-1] + 1))


def test_a_guard_replayed_from_an_earlier_snapshot_applies_from_the_fault_step() -> None:
    """An update fault (or unsound live weights) replays from the ring's last snapshot before the fault, whose
    step follows the snapshots' measured spacing: a guard or clamp then applies from the fault's step, so the
    row's start and verdict are the same whichever snapshot the ring held; changes with a step of their own, and
    replays that start at the fault, are left as they are. A guard that is not active leaves the op alone."""
    import numpy as np
    import paddle

    from nandoctor.engine.op_guards import guard_for, guarded
    from nandoctor.engine.replay import Change
    from nandoctor.remedies.trial import _at_the_fault

    class Snap:  # the one field _at_the_fault reads
        def __init__(self, step: int) -> None:
            self.step = step

    guard = guard_for("log")
    for snap_step in (4, 8, 12):
        assert _at_the_fault(Change(guard=guard), Snap(snap_step), 13).from_step == 13
        assert _at_the_fault(Change(clamp_output=("head", 60.0)), Snap(snap_step), 13).from_step == 13
    assert _at_the_fault(Change(guard=guard), Snap(13), 13).from_step is None
    assert _at_the_fault(Change(lr_scale=0.1, from_step=9), Snap(8), 13).from_step == 9
    assert _at_the_fault(Change(lr_scale=0.1), Snap(8), 13).from_step is None
    zero = paddle.to_tensor(np.zeros(2, np.float32))
    on = [False]
    with guarded(guard, None, "any", active=lambda: on[0]) as hits:
        off_value = paddle.log(zero).numpy()
        on[0] = True
        on_value = paddle.log(zero).numpy()
    assert np.isneginf(off_value).all() and np.isfinite(on_value).all() and hits["calls"] == 1
