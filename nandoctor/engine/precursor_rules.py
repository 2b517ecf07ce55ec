"""The precursors' rules (issue 35): when a sampled series is a growth, where it began, and its finding.

`engine/precursors.py` measures; this judges the series it kept, after the run, so every threshold and every
figure of a finding lives here. The thresholds separate the healthy runs measured for issue 35 from the ones
that blew up (docs/how-it-works.md, "Precursors: warnings before the NaN").
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from nandoctor.advice import precursor_advice
from nandoctor.findings import Code, Finding, Location, Phase, Severity

ATTN_MAX, ATTN_ENT, LOG_Z, RMS = "attention_logit_max", "attention_entropy", "log_z", "output_rms"
EARLY_STEPS = 8  # the early level: the median of the samples in the first steps (a warmup's growth starts soon)
START_BAND = 2.0  # a growth begins after the last sample within this factor of the early level
# Thresholds (issue 35's measurements: healthy twins at a 10x lower LR reach 6.5x their early attention
# logits, 3.2x an output RMS, 3x |log Z|; the runs that blew up ~640x, ~40x and log Z from ~8 to 40-75)
ATTENTION_RATIO = 50.0
RMS_RATIO = 20.0
LOGZ_RATIO = 5.0  # |log Z| this many times its early level,
LOGZ_FLOOR = 20.0  # and at least this (e^20: a confident classifier seldom needs more),
LOGZ_DOUBLING_STEPS = 16  # and doubled within this many steps (a healthy head drifts slowly, then settles)


@dataclass
class Growth:
    """One quantity's growth in one layer, as the samples show it."""

    layer: str
    quantity: str
    early: float
    start_step: int  # the last sampled step still within START_BAND of the early level
    alarm_step: int  # the first sampled step past the threshold
    level: float  # at the last sample (the report's time)
    level_step: int
    peak: float
    peak_step: int
    history: list[tuple[int, float]]

    @property
    def ratio(self) -> float:
        return self.peak / self.early if self.early > 0 else math.inf


def judge(series: dict[tuple[str, str], list[tuple[int, float]]], fault_step: int | None,
          lrs: dict[int, float | None], every: int) -> list[Finding]:
    """One warning for each quantity that grew past its threshold in some layer, up to `fault_step`."""
    out: list[Finding] = []
    for code, (quantity, alarm) in _RULE.items():
        growths = [g for (q, layer), xs in series.items() if q == quantity
                   for g in [_growth(layer, quantity, _upto(xs, fault_step), alarm)] if g is not None]
        if growths:
            out.append(_finding(code, growths, fault_step, lrs, every, series))
    return out


def growth_of(code: Code, layer: str, series: dict[tuple[str, str], list[tuple[int, float]]]) -> Growth | None:
    """The growth `code`'s own rule finds in `layer`'s series (None: it does not fire there): what a remedy's
    replay is judged by, with the same thresholds as the warning."""
    quantity, alarm = _RULE[code]
    return _growth(layer, quantity, series.get((quantity, layer), []), alarm)


def _finding(code: Code, growths: list[Growth], fault_step: int | None, lrs: dict[int, float | None],
             every: int, series: dict[tuple[str, str], list[tuple[int, float]]]) -> Finding:
    """One finding a code, at the layer whose growth passed its threshold first (the largest on a tie);
    the other layers listed in its evidence."""
    growths.sort(key=lambda g: (g.alarm_step, -g.ratio, g.layer))
    g = growths[0]
    lead = fault_step - g.alarm_step if fault_step is not None else None
    # the highest rate up to the alarm: the peak of a warmup, where the growth was driven
    rates = [r for s, r in lrs.items() if r is not None and s <= g.alarm_step]
    lr = max(rates) if rates else None
    entropy = _entropy(g, series) if code == Code.ATTENTION_LOGIT_GROWTH else None
    message = _message(code, g, entropy, lead, fault_step, len(growths) - 1)
    evidence: dict[str, Any] = {
        "quantity": g.quantity, "layer": g.layer, "start_step": g.start_step, "early_level": g.early,
        "level": g.level, "level_step": g.level_step, "alarm_step": g.alarm_step, "peak": g.peak,
        "peak_step": g.peak_step, "growth": g.ratio, "lead_steps": lead, "fault_step": fault_step,
        "sample_every": every, "threshold": _THRESHOLD[code], "learning_rate": lr,
        "history": [[s, v] for s, v in g.history[-40:]],
        "layers": [{"layer": o.layer, "start_step": o.start_step, "alarm_step": o.alarm_step,
                    "early_level": o.early, "peak": o.peak} for o in growths[:20]],
    }
    if entropy is not None:
        evidence["entropy_early"], evidence["entropy"] = entropy
    return Finding(code, Severity.WARNING, message, Location(step=g.start_step, phase=Phase.FORWARD, layer=g.layer),
                   evidence, precursor_advice(code.value, lr, at=f"at step {g.alarm_step}", layer=g.layer))


def _entropy(g: Growth, series: dict[tuple[str, str], list[tuple[int, float]]]) -> tuple[float, float] | None:
    xs = series.get((ATTN_ENT, g.layer))
    if not xs:
        return None
    early = [v for s, v in xs if s < xs[0][0] + EARLY_STEPS]
    at = [v for s, v in xs if s <= g.level_step]
    return (statistics.median(early), at[-1]) if early and at else None


_THRESHOLD = {Code.ATTENTION_LOGIT_GROWTH: ATTENTION_RATIO, Code.ACTIVATION_NORM_GROWTH: RMS_RATIO,
              Code.OUTPUT_LOGIT_DIVERGENCE: LOGZ_RATIO}
_WHAT = {ATTN_MAX: "largest attention logit", LOG_Z: "largest |log Z| (logsumexp of the logits)",
         RMS: "output RMS"}


def _message(code: Code, g: Growth, entropy: tuple[float, float] | None, lead: int | None,
             fault_step: int | None, others: int) -> str:
    what = _WHAT[g.quantity]
    text = (f"The {what} of layer {g.layer} grew {g.ratio:.3g}x: from an early level of {g.early:.3g}, it began "
            f"to grow after step {g.start_step}, passed {_THRESHOLD[code]:g}x at step {g.alarm_step} and was "
            f"{g.level:.3g} at step {g.level_step}")
    if g.peak_step != g.level_step:
        text += f" (peak {g.peak:.3g} at step {g.peak_step})"
    text += "."
    if entropy is not None:
        text += f" Its attention entropy fell from {entropy[0]:.3g} to {entropy[1]:.3g} nats."
    if others:
        text += f" {others} other layer(s) grew past it too (evidence.layers)."
    if lead is not None:
        text += (f" This came {lead} step(s) before the fault at step {fault_step}, and the growth "
                 f"{fault_step - g.start_step} steps before it: the run was heading there.")
    else:
        text += " No NaN yet, but runs like this diverge or overflow."
    return text


def _attention_alarm(series: list[tuple[int, float]], early: float) -> int | None:
    return next((i for i, (_, v) in enumerate(series) if v >= ATTENTION_RATIO * early), None)


def _rms_alarm(series: list[tuple[int, float]], early: float) -> int | None:
    return next((i for i, (_, v) in enumerate(series) if v >= RMS_RATIO * early), None)


def _logz_alarm(series: list[tuple[int, float]], early: float) -> int | None:
    """Past LOGZ_RATIO x early and LOGZ_FLOOR, and doubled within LOGZ_DOUBLING_STEPS: a head that blows
    up, not one that drifts to a confident level and settles."""
    for i, (s, v) in enumerate(series):
        if v < max(LOGZ_RATIO * early, LOGZ_FLOOR):
            continue
        before = [u for t, u in series[:i] if t >= s - LOGZ_DOUBLING_STEPS]
        if before and v >= 2.0 * min(before):
            return i
    return None


_RULE = {Code.ATTENTION_LOGIT_GROWTH: (ATTN_MAX, _attention_alarm), Code.OUTPUT_LOGIT_DIVERGENCE: (LOG_Z, _logz_alarm),
         Code.ACTIVATION_NORM_GROWTH: (RMS, _rms_alarm)}


def _growth(layer: str, quantity: str, series: list[tuple[int, float]], judge: Any) -> Growth | None:
    xs = [(s, v) for s, v in series if math.isfinite(v)]
    if len(xs) < 3:
        return None
    early_vals = [v for s, v in xs if s < xs[0][0] + EARLY_STEPS]
    early = statistics.median(early_vals)
    if not early > 0:
        return None
    alarm = judge(xs, early)
    if alarm is None:
        return None
    start = alarm
    while start > 0 and xs[start][1] > START_BAND * early:
        start -= 1
    peak = max(range(len(xs)), key=lambda i: xs[i][1])
    return Growth(layer, quantity, early, xs[start][0], xs[alarm][0], xs[-1][1], xs[-1][0], xs[peak][1],
                  xs[peak][0], xs)


def _upto(series: list[tuple[int, float]], fault_step: int | None) -> list[tuple[int, float]]:
    """The samples up to the fault's step (its own forward ran before the fault; later ones are not the run's)."""
    return series if fault_step is None else [(s, v) for s, v in series if s <= fault_step]
