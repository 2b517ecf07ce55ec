"""A remedy is a fix only if the replayed loss stays finite and in the range of the run's healthy steps
(issue 35, item 3): a hand-written log-sum-exp whose `exp` overflows once log Z drifts (a decoder without a
final LayerNorm, a too-high peak learning rate) is "fixed" by clamping exp's input only in name: log Z is then
bounded while the target's logit is not, and the loss reads -1e6, finite and meaningless.

Ground truth: plain AdamW loops over the same decoder and data (tests/precursor_models.py), seeded as the
probe seeds: one as written (its losses before the overflow are the healthy range), one with exp's input
clamped at the guard's bound (its loss leaves that range by orders of magnitude), one with the learning rate
cut 10x from where log Z began to grow (finite, in range: the remedy the report verifies), one with PaLM's
z-loss added to the loss from there (it still overflows: the report's z_loss row must not say fixed).
"""

from __future__ import annotations

import math

import numpy as np
import paddle
import precursor_models as pm
import pytest
from run_truth import changed_from, precursor_record
from test_precursors import WARMUP, probe

from nandoctor.engine.op_guards import limit_of
from nandoctor.engine.replay import Change, Replay
from nandoctor.remedies.candidates import Candidate
from nandoctor.remedies.judging import healthy_span, judge

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


def _lowered_from(step: int, steps: int) -> list[float]:
    """The plain loop as written, its learning rate x0.1 from `step` on (the lr_x0.1 remedy): its losses."""
    paddle.seed(0)
    np.random.seed(0)
    model = pm.gpt(final_ln=False)
    opt = paddle.optimizer.AdamW(learning_rate=0.0, parameters=model.parameters())
    losses = []
    for t, (x, y) in enumerate(pm.tokens(steps)):
        opt.set_lr(PEAK * min(1.0, t / WARMUP) * (0.1 if t >= step else 1.0))
        loss = pm.naive_cross_entropy(model(paddle.to_tensor(x)), paddle.to_tensor(y))
        losses.append(float(loss))
        loss.backward()
        opt.step()
        opt.clear_grad()
    return losses


def test_the_lower_rate_is_replayed_from_where_log_z_began_to_grow(report) -> None:
    """The precursor's start, not the overflow's step, is where the step-size remedies restart: from there a
    10x lower rate keeps the run finite and in its healthy range, as the plain loop shows; the exp guard,
    which only hides the growth, is not offered."""
    losses, fault = _plain(pm.naive_cross_entropy, STEPS)
    growth = next(f for f in report.findings if f.code.value == "output.logit_divergence")
    start = growth.location.step
    assert start < fault
    row = next(r for r in report.remedies if r["remedy"] == "lr_x0.1")
    assert row["outcome"] == "fixed" and row["start_step"] == start, row
    truth = _lowered_from(start, fault + 20)
    hi = max(losses[:fault])
    assert all(math.isfinite(v) and v <= hi for v in truth)
    assert abs(row["loss_after"] - sum(truth[-3:]) / 3) < 0.1 * hi
    assert "op_guard" not in {r["remedy"] for r in report.remedies}


def test_a_guard_that_breaks_the_loss_is_not_a_fix(report) -> None:
    """The judging rule on the plain loop's own losses: exp clamped at the guard's bound keeps the run finite,
    and its loss leaves the healthy range by orders of magnitude, which is no fix."""
    losses, fault = _plain(pm.naive_cross_entropy, STEPS)
    lo, hi = min(losses[:fault]), max(losses[:fault])
    bound = limit_of("exp")
    clamped, clamped_fault = _plain(_clamped_cross_entropy(bound), fault + 20)
    assert clamped_fault is None and min(clamped) < lo - 10 * max(hi - lo, abs(lo), abs(hi))
    replay = Replay(start_step=0, steps_run=len(clamped), losses=clamped)
    cand = Candidate("op_guard", "", Change(), None)
    outcome, note = judge(replay, fault, fault + 20, cand, losses[0], healthy_span(report, fault))
    assert outcome == "not_fixed" and "far outside the" in note and f"{lo:.3g} to {hi:.3g}" in note, note
    assert judge(replay, fault, fault + 20, cand, losses[0], None)[0] == "fixed"  # what it was judged before


def test_the_z_loss_is_replayed_from_where_log_z_began_to_grow_and_agrees_with_a_plain_loop(report) -> None:
    """The z-loss on the head the warning names, added to the loss from where log Z began to grow: the plain
    loop with the same term added from that step still overflows here (the learning rate drives the growth,
    not the head alone), and so does nandoctor's replay, at the same step; the row says what to write in the
    spec (a loss entry wrapping the user's loss)."""
    growth = next(f for f in report.findings if f.code.value == "output.logit_divergence")
    start, head = growth.location.step, growth.location.layer
    row = next(r for r in report.remedies if r["remedy"] == "z_loss")
    assert row["start_step"] == start and row["z_loss"] == {"layer": head, "coef": 1e-4}, row
    losses, fault = _plain(pm.naive_cross_entropy, STEPS)
    paddle.seed(0)
    np.random.seed(0)
    truth, truth_fault = changed_from(pm.gpt(final_ln=False), pm.tokens(fault + 20), pm.naive_cross_entropy,
                                      peak_lr=PEAK, warmup=WARMUP, start=start,
                                      changed_loss=pm.with_z_loss(pm.naive_cross_entropy))
    assert truth_fault is not None  # the plain loop with the z-loss is not fine: no fix to verify
    assert row["outcome"] == "not_fixed" and abs(row["failed_at"] - truth_fault) <= 2, (row, truth_fault)
    assert row["spec_change"] == {"loss": {"entry": "z_loss.py:loss_with_z_loss"}}
    change = row["change"]
    assert change.startswith("loss: {entry: ") and "from precursor_models import naive_cross_entropy" in change
    assert "return naive_cross_entropy(logits, label) + 1e-4 * paddle.logsumexp(logits, axis=-1)" in change


def test_the_z_loss_file_the_row_asks_for_computes_the_loss_plus_the_term() -> None:
    """The file a z_loss row asks to write, for a spec with the builtin cross-entropy, run as written: it gives
    the token cross-entropy plus 1e-4 * mean(logsumexp^2), both computed here in float64; a step entry gets
    the line to add there, a script the line after its loss."""
    from types import SimpleNamespace

    from nandoctor.findings import Mode
    from nandoctor.remedies.changes import z_loss_change
    from nandoctor.spec import EntrySpec, LossSpec

    text, edit = z_loss_change(SimpleNamespace(loss=LossSpec(builtin="cross_entropy"), step=None), "head", 1e-4)
    assert edit == {"loss": {"entry": "z_loss.py:loss_with_z_loss"}}
    source = "\n".join(line[2:] for line in text.splitlines()[2:])  # the file's lines, after the YAML and header
    scope: dict = {}
    exec(source, scope)  # noqa: S102 - the text under test
    rng = np.random.default_rng(0)
    logits, label = rng.normal(0, 3, (2, 5, pm.VOCAB)), rng.integers(0, pm.VOCAB, (2, 5))
    got = float(scope["loss_with_z_loss"](paddle.to_tensor(logits, "float32"), paddle.to_tensor(label)))
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[..., 0]
    ce = (lse - np.take_along_axis(logits, label[..., None], -1)[..., 0]).mean()
    assert got == pytest.approx(ce + 1e-4 * (lse ** 2).mean(), rel=1e-5)
    step_text, step_edit = z_loss_change(SimpleNamespace(loss=None, step=EntrySpec("train.py:step")), "head", 1e-4)
    assert step_edit is None and step_text.startswith("in your step function (train.py:step), right after the loss")
    py_text, _ = z_loss_change(None, "head", 1e-4, mode=Mode.WATCH)
    assert py_text == ("right after your loss: loss = loss + 1e-4 * paddle.logsumexp(logits, axis=-1).square().mean()"
                       "  # logits: the output of layer head")
