"""Remedies for a run whose only signs are precursors (issue 35, item 3): no NaN, no several-fold divergence,
but the transformer precursors warned; the probe replays lr_x0.1, grad_clip, a longer warmup and (where the
attention logits grew) qk-layernorm from before the earliest warning began, samples the precursors on the run's
very steps in each replay, and judges each by the rule that raised the warning.

The runs: the small GPT decoders of tests/precursor_models.py warmed up over 30 steps to a 10x peak rate (0.1),
plain and with qk-layernorm, and one without a final LayerNorm (0.15: its head's log Z diverges); their
lower-LR twins (10x lower). The truth: a plain Paddle loop (run_truth.changed_from, seeded as the probe seeds)
that trains the same decoder from the same state with the remedy's change made from the row's start step (the
rate x0.1; the gradients clipped at the row's threshold; qk-layernorm switched on in the model's own code; the
loss plus its z-loss; a 60-step warmup to the same peak from step 0), recording with its own forward hooks, in
float64, the quantities the warnings measure on the steps the monitor samples (every 4th from step 4). Its
verdict, computed here: `fixed` exactly when no layer's quantity passes the rule's threshold over its early
level (log Z: the rule's three tests) and its loss stays in range (finite, no several-fold rise above its
minimum at the end, no step 3x
the median of the 32 before it, none above the highest loss before the change).

A lone loss spike (tests/trend_models.py's MLP, one batch's inputs scaled 30x at step 60, which the run recovers
from): the step-size changes replayed from 4 steps before it, each `fixed` exactly when a plain loop with that
change (tests/test_loss_trend.plain_losses) no longer has a step 3x the median of the steps before it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import paddle
import precursor_models as pm
import pytest
from run_truth import changed_from
from test_divergence_remedies import diverged
from test_loss_trend import SPIKE_AT, SPIKE_LR, SPIKE_STEPS, plain_losses
from test_loss_trend import probe as trend_probe
from test_precursors import WARMUP, probe

from nandoctor.engine import precursor_rules as rules
from nandoctor.engine.watcher import READ_EVERY_ENV
from nandoctor.findings import Report
from nandoctor.remedies.trial import BUDGET_ENV

PEAK, TWIN = 0.1, 0.01
HEAD_PEAK = 0.15  # the decoder without a final LayerNorm
QK_STEPS, ATTN_STEPS = 80, 100
EVERY = 4  # the monitor's sampled steps of a model whose attention is seen: 4, 8, 12, ...
# the rule's own thresholds, by the record's key suffix (what the warning measures)
THRESHOLD = {"attention.logit_growth": (":max", rules.ATTENTION_RATIO),
             "activation.norm_growth": (":rms", rules.RMS_RATIO), "output.logit_divergence": (":log_z", 1.0)}


def rows(report: Report) -> dict[str, dict[str, Any]]:
    return {r["remedy"]: r for r in report.remedies}


def conclusions(report: Report) -> dict[str, Any]:
    """What a report concludes, timings and measured figures aside (tests/test_same_report.py's)."""
    return {"verdict": report.verdict.value,
            "findings": [(f.code.value, f.severity.value, f.location.step, f.location.layer) for f in report.findings],
            "remedies": [(r["remedy"], r["outcome"], r.get("start_step"), r.get("threshold")) for r in report.remedies]}


def plain(steps: int, *, start: int | None = None, warmup: int = WARMUP, qk_norm_model: bool = False,
          lr_scale: float = 1.0, clip: float | None = None,
          qk_norm: bool = False, peak: float = PEAK, final_ln: bool = True,
          z_loss: bool = False) -> tuple[list[float], int | None, dict[str, list[float]]]:
    """The plain loop, seeded as the probe seeds, changed from `start` (None: never); its losses, first
    non-finite step and record of the quantities of every EVERY-th step's forward (step 0 first)."""
    paddle.seed(0)
    np.random.seed(0)
    model = pm.gpt(qk_norm=qk_norm_model, final_ln=final_ln)
    record: dict[str, list[float]] = {}
    losses, fault = changed_from(model, pm.tokens(steps), pm.cross_entropy, peak_lr=peak, warmup=warmup,
                                 start=steps if start is None else start, lr_scale=lr_scale, clip=clip,
                                 change=(lambda: pm.plain_qk_norm(model)) if qk_norm else None, record=record,
                                 record_every=EVERY,
                                 changed_loss=pm.with_z_loss(pm.cross_entropy) if z_loss else None)
    return losses, fault, record


def growths(record: dict[str, list[float]], code: str) -> dict[str, float]:
    """Each layer's largest value over its early level (the median of the samples of its first 8 steps), on the
    sampled steps, in float64 (the head's log Z: how far it got past its rule, logz_over)."""
    if code == "output.logit_divergence":
        return {"head": logz_over(np.asarray(record["head:log_z"], dtype=np.float64)[1:])}
    suffix, _ = THRESHOLD[code]
    out = {}
    for key, values in record.items():
        if key.endswith(suffix):
            x = np.asarray(values, dtype=np.float64)[1:]  # (step 0 finds the layers: not in the series)
            early = float(np.median(x[:2]))  # steps 4 and 8
            out[key[:-len(suffix)]] = float(x.max()) / early
    return out


def logz_over(x: np.ndarray) -> float:
    """How far the head's |log Z| got past its rule, as a ratio that reaches 1 where the rule fires: past 5x its
    early level and 20, and at least double the lowest sample of the 16 steps before it (samples 4 steps apart)."""
    early = float(np.median(x[:2]))
    floor = max(rules.LOGZ_RATIO * early, rules.LOGZ_FLOOR)
    worst = 0.0
    for i in range(1, len(x)):
        lowest = float(x[max(0, i - rules.LOGZ_DOUBLING_STEPS // EVERY):i].min())
        worst = max(worst, min(x[i] / floor, x[i] / (2 * lowest)))
    return worst


def loss_in_range(losses: list[float], start: int) -> bool:
    x = np.asarray(losses, dtype=np.float64)
    if not np.isfinite(x).all() or diverged(x):
        return False
    if start < len(x) and x[start:].max() > x[:start + 1].max():
        return False
    return not any(x[i] >= 3 * np.median(x[max(0, i - 50):i]) for i in range(32, len(x)))


def truth_fixed(truth: tuple[list[float], int | None, dict[str, list[float]]], codes: set[str], start: int) -> bool:
    losses, fault, record = truth
    quiet = all(max(growths(record, c).values()) < THRESHOLD[c][1] for c in codes)
    return fault is None and quiet and loss_in_range(losses, start)


def check_row(row: dict[str, Any], truth: tuple[list[float], int | None, dict[str, list[float]]], codes: set[str],
              start: int, steps: int) -> None:
    """The row's replay is the plain loop's (its start, its steps, its last losses) and its verdict the loop's."""
    assert row["start_step"] == start and row["steps_run"] == steps - start
    assert row["loss_after"] == pytest.approx(float(np.mean(truth[0][-3:])), rel=1e-3)
    assert row["outcome"] == ("fixed" if truth_fixed(truth, codes, start) else "not_fixed"), (row["note"], codes)


@pytest.fixture(scope="module")
def qk_run(tmp_path_factory: pytest.TempPathFactory) -> list[Report]:
    """The qk-layernorm decoder probed twice: every read against a loaded machine's remedy budget, and one read in
    48 against a quiet one's (the same conclusions are asked for)."""
    tmp = tmp_path_factory.mktemp("qkrem")
    out = []
    with pytest.MonkeyPatch.context() as mp:
        for stride, budget in (("1", "0.001"), ("48", "100000")):
            mp.setenv(READ_EVERY_ENV, stride)
            mp.setenv(BUDGET_ENV, budget)
            out.append(probe(tmp, peak=PEAK, steps=QK_STEPS, qk_norm=True))
    return out


@pytest.fixture(scope="module")
def head_run(tmp_path_factory: pytest.TempPathFactory) -> Report:
    return probe(tmp_path_factory.mktemp("headrem"), peak=HEAD_PEAK, steps=ATTN_STEPS, final_ln=False)


@pytest.fixture(scope="module")
def attn_run(tmp_path_factory: pytest.TempPathFactory) -> Report:
    return probe(tmp_path_factory.mktemp("attnrem"), peak=PEAK, steps=ATTN_STEPS)


def warned(report: Report) -> dict[str, Any]:
    return {f.code.value: f for f in report.findings}


def test_the_same_rows_at_any_read_stride_and_budget(qk_run: list[Report]) -> None:
    assert conclusions(qk_run[0]) == conclusions(qk_run[1])
    assert qk_run[0].remedies and qk_run[0].details["remedies"]["budget_seconds"] == 0.0


def test_qk_layernorm_decoder_growth_remedies_match_plain_loops(qk_run: list[Report]) -> None:
    """Only a precursor (FC2's output RMS) and no divergence: the warning's rule, replayed with each change,
    agrees with a plain loop with that change; the unchanged plain loop grows past the threshold, as the
    control did again."""
    report = qk_run[0]
    found = warned(report)
    assert set(found) == {"activation.norm_growth"} and report.first_fault is None
    f = found["activation.norm_growth"]
    start = f.location.step
    info = report.details["remedies"]
    assert info["control"]["reproduced"] is True and info["growth_step"] == start
    assert info["replayed_steps"] <= info["step_budget"]
    unchanged = plain(QK_STEPS, qk_norm_model=True)
    assert growths(unchanged[2], "activation.norm_growth")[f.location.layer] >= rules.RMS_RATIO
    assert not diverged(np.asarray(unchanged[0]))  # (a precursor alone: the divergence rule stays quiet)
    got = rows(report)
    codes = {"activation.norm_growth"}
    check_row(got["lr_x0.1"], plain(QK_STEPS, start=start, qk_norm_model=True, lr_scale=0.1), codes, start, QK_STEPS)
    clip = got["grad_clip"]["threshold"]
    check_row(got["grad_clip"], plain(QK_STEPS, start=start, qk_norm_model=True, clip=clip), codes, start, QK_STEPS)
    assert got["warmup"]["outcome"] == "not_applicable"  # 60 warmup steps leave 20 at the peak: too few to judge
    assert "qk_norm" not in got and "z_loss" not in got  # no attention growth, no log Z divergence
    verified = [a for a in f.advice if a.startswith("Verified by replay")]
    assert verified == [f"Verified by replay ({r['remedy']}): {r['change']}" for r in report.remedies
                        if r["outcome"] == "fixed"]
    assert any(a.startswith("Verified by replay (lr_x0.1): optimizer.args.learning_rate: 0.01") for a in f.advice)


def test_attention_decoder_remedies_match_plain_loops(attn_run: Report) -> None:
    """Attention-logit growth and FC2's output RMS growth, no divergence: lr_x0.1, clipping and qk-layernorm from
    the earliest warning's start, a 60-step warmup from step 0, each judged as a plain loop with that change."""
    report = attn_run
    found = warned(report)
    assert {"attention.logit_growth", "activation.norm_growth"} <= set(found) and report.first_fault is None
    assert "loss.divergence" not in found
    codes = set(found) & set(THRESHOLD)
    start = min(found[c].location.step for c in codes)
    assert report.details["remedies"]["control"]["reproduced"] is True
    unchanged = plain(ATTN_STEPS)
    for c in codes:
        assert growths(unchanged[2], c)[found[c].location.layer] >= THRESHOLD[c][1]
    got = rows(report)
    check_row(got["lr_x0.1"], plain(ATTN_STEPS, start=start, lr_scale=0.1), codes, start, ATTN_STEPS)
    check_row(got["grad_clip"], plain(ATTN_STEPS, start=start, clip=got["grad_clip"]["threshold"]), codes, start,
              ATTN_STEPS)
    check_row(got["qk_norm"], plain(ATTN_STEPS, start=start, qk_norm=True), codes, start, ATTN_STEPS)
    warm = plain(ATTN_STEPS, warmup=2 * WARMUP)
    check_row(got["warmup"], warm, codes, 0, ATTN_STEPS)
    assert got["qk_norm"]["qk_norm"]["layers"] == ["blocks.0.attn", "blocks.1.attn"]
    assert any(r["outcome"] == "fixed" for r in report.remedies)
    for c in codes:  # each warning the control raised again lists the replays' verdicts, YAML for a spec
        assert any(a.startswith("Verified by replay (lr_x0.1): optimizer.args.learning_rate") for a in found[c].advice)


def test_head_without_final_layernorm_remedies_match_plain_loops(head_run: Report) -> None:
    """The head's log Z diverges (and an FC1 output RMS grows), the loss does not diverge: lr_x0.1 and z-loss
    from the log Z's start, each judged as a plain loop with that change."""
    report = head_run
    found = warned(report)
    assert "output.logit_divergence" in found and report.first_fault is None and "loss.divergence" not in found
    assert found["output.logit_divergence"].location.layer == "head"
    codes = set(found) & set(THRESHOLD)
    start = min(found[c].location.step for c in codes)
    assert report.details["remedies"]["control"]["reproduced"] is True
    unchanged = plain(ATTN_STEPS, peak=HEAD_PEAK, final_ln=False)
    assert growths(unchanged[2], "output.logit_divergence")["head"] >= 1.0  # (the rule fires on the plain loop)
    got = rows(report)
    check_row(got["lr_x0.1"], plain(ATTN_STEPS, start=start, peak=HEAD_PEAK, final_ln=False, lr_scale=0.1), codes,
              start, ATTN_STEPS)
    check_row(got["z_loss"], plain(ATTN_STEPS, start=start, peak=HEAD_PEAK, final_ln=False, z_loss=True), codes,
              start, ATTN_STEPS)
    assert got["z_loss"]["z_loss"] == {"layer": "head", "coef": 1e-4}


def test_the_lower_lr_twin_gets_no_replays(tmp_path: Path) -> None:
    """At a 10x lower peak the plain loop's quantities stay under every threshold: no warning, so no replay
    (the other decoders' twins: tests/test_precursors.test_the_lower_lr_twins_stay_quiet)."""
    peak, model = HEAD_PEAK / 10, {"final_ln": False}
    losses, fault, record = plain(ATTN_STEPS, peak=peak, final_ln=False)
    assert truth_fixed((losses, fault, record), set(THRESHOLD), ATTN_STEPS)
    report = probe(tmp_path, peak=peak, steps=ATTN_STEPS, **model)
    assert report.verdict.value == "healthy" and all(f.severity.value == "info" for f in report.findings)
    assert report.remedies == [] and "remedies" not in report.details


def spiked(losses: np.ndarray, start: int) -> bool:
    """A step from `start` on at least 3x the median of the (up to 50) steps before it, or a non-finite one."""
    x = np.asarray(losses, dtype=np.float64)
    return not np.isfinite(x).all() or any(x[i] >= 3 * np.median(x[max(0, i - 50):i])
                                           for i in range(max(start, 32), len(x)))


def test_a_lone_spike_is_replayed_and_judged_as_plain_loops_say(tmp_path: Path) -> None:
    """A data spike the run recovers from: the replays start 4 steps before it; a lower rate there does not
    remove a spike made by the batch's own values, as the plain loop with the rate cut there shows."""
    report = trend_probe(tmp_path, SPIKE_LR, warmup=0, n=SPIKE_STEPS, spike_at=SPIKE_AT, try_fixes=True)
    [spike] = [f for f in report["findings"] if f["code"] == "loss.spike"]
    assert spike["location"]["step"] == SPIKE_AT
    info = report["details"]["remedies"]
    assert info["of"] == "loss.spike" and info["growth_step"] == SPIKE_AT - 4
    assert info["control"]["reproduced"] is True
    assert spiked(plain_losses(SPIKE_LR, warmup=0, n=SPIKE_STEPS, spike_at=SPIKE_AT), SPIKE_AT - 4)
    got = {r["remedy"]: r for r in report["remedies"]}
    truth = plain_losses(SPIKE_LR, warmup=0, n=SPIKE_STEPS, spike_at=SPIKE_AT, lr_x=(SPIKE_AT - 4, 0.1))
    row = got["lr_x0.1"]
    assert row["start_step"] == SPIKE_AT - 4
    assert row["loss_after"] == pytest.approx(float(np.mean(truth[-3:])), rel=1e-3)
    assert row["outcome"] == ("not_fixed" if spiked(truth, SPIKE_AT - 4) else "fixed"), row["note"]
    clip = got["grad_clip"]
    truth = plain_losses(SPIKE_LR, warmup=0, n=SPIKE_STEPS, spike_at=SPIKE_AT, clip=(SPIKE_AT - 4, clip["threshold"]))
    assert clip["outcome"] == ("not_fixed" if spiked(truth, SPIKE_AT - 4) else "fixed"), clip["note"]
