"""Remedies for a loss that diverged without a NaN (issue 35, item 3), against plain Paddle loops.

The run: the small regression MLP of tests/trend_models.py, Adam warmed up over 60 steps to a too-high peak
(1.0), whose loss falls and then rises several-fold without a NaN (`loss.divergence`). The probe replays the
step-size remedies from where the rise began to its last step. The truth: a plain Paddle loop (the probe's
seeding and order of calls; tests/test_loss_trend.plain_losses) with the remedy's change made from the same step on
the same weights (the learning rate x0.1, the gradients clipped at the row's threshold, a warmup twice as long
to the same peak), and without any change. Whether each plain loop diverged is read from its own losses in
float64 by the contract's words (the median of the last steps at least 3x the lowest 5-step median), and the
probe's verdicts must match; the replayed losses must be the plain loop's. The 10x lower twin gets no replay.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_loss_trend import of_code, plain_losses, probe

from nandoctor.engine.warnings import CLIP_FACTOR

PEAK, TWIN, STEPS, WARMUP = 1.0, 0.1, 160, 60


def diverged(losses: np.ndarray) -> bool:
    """The plain loop's own verdict: non-finite, or its last 10 steps' median at least 3x its lowest 5-step
    median (a several-fold rise above the minimum that stays)."""
    x = np.asarray(losses, dtype=np.float64)
    if not np.isfinite(x).all():
        return True
    smooth = np.median(np.lib.stride_tricks.sliding_window_view(x, 5), axis=1)
    return bool(np.median(x[-10:]) >= 3 * smooth.min())


def rows(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["remedy"]: r for r in report["remedies"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("divrem")
    norms: list[float] = []
    return {"diverging": probe(tmp, PEAK, try_fixes=True, n=STEPS), "twin": probe(tmp, TWIN, try_fixes=True, n=STEPS),
            "truth": plain_losses(PEAK, n=STEPS, grad_norms=norms), "norms": norms}


def check_against(row: dict[str, Any], truth: np.ndarray, start: int) -> None:
    """The row's replay is the plain loop's from `start` (its steps, its last losses) and its verdict that
    loop's."""
    assert row["start_step"] == start and row["steps_run"] == STEPS - start
    assert row["loss_after"] == pytest.approx(float(np.mean(truth[-3:])), rel=1e-4)
    assert row["outcome"] == ("not_fixed" if diverged(truth) else "fixed"), (row["note"], truth[-10:])


def test_the_run_diverges_and_the_control_reproduces_it(runs: dict[str, Any]) -> None:
    truth, report = runs["truth"], runs["diverging"]
    assert diverged(truth) and np.isfinite(truth).all()  # a divergence without a NaN
    assert report["verdict"] == "at_risk" and report["first_fault"] is None
    info = report["details"]["remedies"]
    assert info["of"] == "loss.divergence" and info["control"]["reproduced"] is True
    assert info["end_step"] == STEPS and info["time_limit_hit"] is False
    assert info["replayed_steps"] <= info["step_budget"]


def test_lower_rate_from_the_rise_is_verified_as_the_plain_loop_says(runs: dict[str, Any]) -> None:
    [found] = of_code(runs["diverging"], "loss.divergence")
    start = found["location"]["step"]
    row = rows(runs["diverging"])["lr_x0.1"]
    truth = plain_losses(PEAK, n=STEPS, lr_x=(start, 0.1))
    assert not diverged(truth)  # the change prevents the divergence in a plain loop
    check_against(row, truth, start)
    assert row["outcome"] == "fixed"
    assert row["change"].startswith("optimizer.args.learning_rate: 0.1")  # YAML for a spec
    assert any(a.startswith("Verified by replay (lr_x0.1): optimizer.args.learning_rate") for a in found["advice"])


def test_clipping_at_the_norms_before_the_rise_matches_the_plain_loop(runs: dict[str, Any]) -> None:
    [found] = of_code(runs["diverging"], "loss.divergence")
    start = found["location"]["step"]
    row = rows(runs["diverging"])["grad_clip"]
    # the threshold: CLIP_FACTOR x the median of the gradient norms before the rise (all read: < 64 steps)
    assert start < 64
    expected = CLIP_FACTOR * float(np.median(runs["norms"][:start]))
    assert row["threshold"] == pytest.approx(expected, rel=5e-3)  # (the change text's 3 significant digits)
    truth = plain_losses(PEAK, n=STEPS, clip=(start, row["threshold"]))
    check_against(row, truth, start)


def test_a_longer_warmup_matches_the_plain_loop(runs: dict[str, Any]) -> None:
    row = rows(runs["diverging"])["warmup"]
    assert row["spec_change"] == {"optimizer.lr_scheduler.warmup": {"steps": 2 * WARMUP, "start_lr": 0.0}}
    truth = plain_losses(PEAK, n=STEPS, warmup=2 * WARMUP, start_lr=0.0)
    assert row["start_step"] == 0 and row["steps_run"] == STEPS
    assert row["loss_after"] == pytest.approx(float(np.mean(truth[-3:])), rel=1e-4)
    assert row["outcome"] == ("not_fixed" if diverged(truth) else "fixed"), (row["note"], truth[-10:])


def test_a_warmup_too_long_to_judge_is_not_tried(tmp_path: Path) -> None:
    """100 steps: a 120-step warmup would leave no step at the peak, so no verdict is claimed for it."""
    report = probe(tmp_path, PEAK, try_fixes=True, n=100)
    row = rows(report)["warmup"]
    assert row["outcome"] == "not_applicable" and "--steps" in row["note"] and row["steps_run"] == 0
    assert rows(report)["lr_x0.1"]["outcome"] == "fixed"


def test_the_lower_rate_twin_gets_no_replay(runs: dict[str, Any]) -> None:
    twin = runs["twin"]
    assert twin["verdict"] == "healthy" and not twin.get("remedies")
    assert "remedies" not in twin["details"]


LATE = {"warmup": 200, "n": 160, "optimizer": "SGD", "start_lr": 0.01}  # diverges from step ~116 (no NaN by 160)


def test_a_late_divergence_clips_at_the_norms_every_stride_reads(tmp_path: Path) -> None:
    """A rise past the steps read in full (64): the clip threshold is CLIP_FACTOR x the median of the norms of the
    steps every read stride reads before it (the first 64 and step 64: engine/watcher.py), the plain loop's norms
    at those steps; each verdict is the plain loop's with the change from the same step."""
    report = probe(tmp_path, PEAK, try_fixes=True, **LATE)
    [found] = of_code(report, "loss.divergence")
    start = found["location"]["step"]
    assert start > 64 and report["details"]["remedies"]["control"]["reproduced"] is True
    norms: list[float] = []
    unchanged = plain_losses(PEAK, **LATE, grad_norms=norms)
    assert diverged(unchanged) and np.isfinite(unchanged).all()
    row = rows(report)["grad_clip"]
    assert row["threshold"] == pytest.approx(CLIP_FACTOR * float(np.median(norms[:65])), rel=5e-3)
    check_against(row, plain_losses(PEAK, **LATE, clip=(start, row["threshold"])), start)
    check_against(rows(report)["lr_x0.1"], plain_losses(PEAK, **LATE, lr_x=(start, 0.1)), start)


def test_the_growth_begins_at_an_earlier_precursor() -> None:
    """An attention-logit growth that began before the loss rose is where the step-size remedies restart; one
    that began after it, or a spike, is not."""
    from nandoctor.findings import Code, Finding, Location, Report, Severity
    from nandoctor.remedies.divergence import diverged as divergence_of
    from nandoctor.remedies.divergence import growth_step

    def warning(code: Code, step: int) -> Finding:
        return Finding(code, Severity.WARNING, "", Location(step=step), {})

    report = Report(command="probe")
    report.findings = [warning(Code.LOSS_DIVERGENCE, 40), warning(Code.ATTENTION_LOGIT_GROWTH, 52),
                       warning(Code.LOSS_SPIKE, 10)]
    found = divergence_of(report)
    assert found is not None and growth_step(report, found) == 40
    report.findings.append(warning(Code.ACTIVATION_NORM_GROWTH, 28))
    assert growth_step(report, found) == 28
    report.findings.append(Finding(Code.GRAD_NONFINITE, Severity.ERROR, "", Location(step=60), {}))
    assert divergence_of(report) is None  # a fault's remedies are trial.py's


def test_the_bounds_are_said_never_judged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step budget too small for a replay leaves it untried, saying so (the same on every machine); the
    safety time limit stops the replays with a note, never a 'did not help'."""
    from nandoctor.remedies import trial

    monkeypatch.setattr(trial, "REPLAY_STEPS_FACTOR", 2)  # room for the control and one replay (100 steps each)
    report = probe(tmp_path, PEAK, try_fixes=True, n=100)
    by = rows(report)
    assert by["lr_x0.1"]["outcome"] == "fixed"
    assert by["grad_clip"]["outcome"] == "not_applicable" and "step budget" in by["grad_clip"]["note"]
    monkeypatch.setattr(trial, "REPLAY_STEPS_FACTOR", 8)
    monkeypatch.setattr(trial, "SAFETY_MIN_SECONDS", 0.0)
    monkeypatch.setenv(trial.BUDGET_ENV, "0")
    report = probe(tmp_path, PEAK, try_fixes=True, n=100)
    assert all(r["outcome"] == "not_applicable" for r in report["remedies"])
    assert report["details"]["remedies"]["time_limit_hit"] is True
    assert report["details"]["remedies"]["control"]["reproduced"] is None
    assert any("safety time limit" in (r["note"] or "") for r in report["remedies"])
