"""A remedy is a fix only if the replayed loss stays finite and in the range of the run's healthy steps
(issue 35, item 3): a hand-written log-sum-exp whose `exp` overflows once log Z drifts (a decoder without a
final LayerNorm, a too-high peak learning rate) is "fixed" by clamping exp's input only in name: log Z is then
bounded while the target's logit is not, and the loss reads -1e6, finite and meaningless.

Ground truth: plain AdamW loops over the same decoder and data (tests/precursor_models.py), seeded as the
probe seeds: one as written (its losses before the overflow are the healthy range), one with exp's input
clamped at the bound the report's op_guard row tried (its loss leaves that range by orders of magnitude).
"""

from __future__ import annotations

import math

import numpy as np
import paddle
import precursor_models as pm
import pytest
from run_truth import precursor_record
from test_precursors import probe

PEAK, STEPS = 0.2, 40


def _clamped_cross_entropy(bound: float):
    """naive_cross_entropy with exp's input clamped at `bound`, as the op guard clamps it."""
    def loss(logits, label):
        flat = logits.reshape([-1, pm.VOCAB])
        log_z = paddle.log(paddle.exp(paddle.clip(flat, max=bound)).sum(axis=-1))
        target = paddle.take_along_axis(flat, label.reshape([-1, 1]), axis=-1).squeeze(-1)
        return (log_z - target).mean()
    return loss


def _plain(loss, steps: int) -> tuple[list[float], int | None]:
    paddle.seed(0)
    np.random.seed(0)
    _, losses, fault = precursor_record(pm.gpt(final_ln=False), pm.tokens(steps), loss, peak_lr=PEAK, warmup=30)
    return losses, fault


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory):
    return probe(tmp_path_factory.mktemp("logz"), peak=PEAK, steps=STEPS, loss="naive_cross_entropy",
                 final_ln=False)


def test_a_guard_that_breaks_the_loss_is_not_a_fix(report) -> None:
    losses, fault = _plain(pm.naive_cross_entropy, STEPS)
    assert fault is not None and report.first_fault.step == fault and report.first_fault.op == "exp"
    lo, hi = min(losses[:fault]), max(losses[:fault])
    guard = next(r for r in report.remedies if r["remedy"] == "op_guard")
    # the truth: with exp clamped at the row's bound the run stays finite, and its loss leaves the range
    clamped, clamped_fault = _plain(_clamped_cross_entropy(guard["threshold"]), fault + 20)
    assert clamped_fault is None and all(math.isfinite(v) for v in clamped)
    assert min(clamped) < lo - 10 * max(hi - lo, abs(lo), abs(hi))
    assert guard["outcome"] == "not_fixed", guard
    assert "far outside the" in guard["note"] and f"{lo:.3g} to {hi:.3g}" in guard["note"], guard["note"]
    assert all(r["outcome"] != "fixed" or lo / 10 <= r["loss_after"] <= 10 * hi for r in report.remedies)
