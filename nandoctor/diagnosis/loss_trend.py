"""The loss's own course, read after any run: a divergence (several-fold above its minimum, and staying there)
and spikes that recovered. Warnings, from the loss of every step, which every way in records (unread steps'
losses are read together later, watcher.py), so the conclusion never depends on which steps were read.

Both rules are robust by construction, so noisy-but-healthy losses (small-batch SGD) stay quiet:
- divergence: the median of the last stretch (8-20 steps, a tenth of the run) is >= 3x the lowest running
  median over a stretch, and every running median of 5 steps in it stayed >= 2x above that (one bad batch is
  no trend), and the lower quartile of the last stretch is >= 2x the upper quartile of the stretch around the
  minimum (a shift of the whole distribution, not of its noise); the rise must also be a real share (>= 20%) of
  the way back to the early loss (a loss that fell 1000x and then tripled at the noise floor is not diverging);
- spike: against the median and the 95th percentile of the 50 steps before it (at least 32), a step must reach
  3x the median and the median plus 4x the window's spread (p95 - median), hold there for 2 steps (or tower 4x
  over that threshold for one), and the loss must come back below half-way before the run ends.
Losses at or below zero have no "several-fold": the rules are not applied to them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from nandoctor.advice import lower_lr_advice
from nandoctor.findings import Code, Finding, Location, Phase, Report, Severity

MIN_STEPS = 30  # fewer losses than this say nothing about a trend
SMOOTH = 5  # the running median's width (centred)
DIVERGE_RATIO = 3.0  # the last stretch's median over the smoothed minimum
STAY_RATIO = 2.0  # ... and every smoothed step of that stretch at least this far above it
RISE_SHARE = 0.2  # ... and the rise at least this share of the fall from the early loss to the minimum
EARLY_STEPS = 5
SPIKE_WINDOW = 50
SPIKE_MIN_WINDOW = 32
SPIKE_RATIO = 3.0  # a spike's step over the window's median
SPIKE_SPREAD = 4.0  # ... and over the median plus this many times the window's spread (p95 - median)
SPIKE_TOWER = 4.0  # a single step must reach this many times the threshold
MAX_SPIKES = 3  # findings; the rest are counted in the last one's evidence
TOP_BATCHES = 3


@dataclass
class Divergence:
    min_step: int
    min_loss: float
    start_step: int
    last_step: int
    level: float  # the median of the last `stretch` raw losses
    last_loss: float
    stretch: int
    early: float

    @property
    def ratio(self) -> float:
        return self.level / self.min_loss


@dataclass
class Spike:
    start_step: int
    end_step: int  # the last elevated step
    peak_step: int
    peak: float
    baseline: float  # the window's median before it
    threshold: float
    recovered_step: int  # the first step back below half-way
    top: list[tuple[int, float, int | None, int | None]]  # (step, loss, batch_index, epoch), highest first


def loss_series(records: list[Any], fault_step: int | None) -> list[Any]:
    """The records with a finite loss before the fault (a fault's own loss is the fault, not its precursor)."""
    out = [r for r in records if r.loss is not None and math.isfinite(r.loss)]
    return [r for r in out if fault_step is None or r.step < fault_step]


def _median(values: np.ndarray, axis: int | None = None) -> Any:
    """np.median of finite values, as it computes it, without its NaN check, which imports numpy.ma on first
    use (~15 ms at the end of every run; the losses here are finite, `loss_series`)."""
    s, axis = _sorted(values, axis)
    n = s.shape[axis]
    mid = np.take(s, n // 2, axis=axis)
    return mid if n % 2 else (np.take(s, n // 2 - 1, axis=axis) + mid) / 2.0


def _percentile(values: np.ndarray, q: float, axis: int | None = None) -> Any:
    """np.percentile's default ("linear") of finite values, as it computes it, without numpy.ma (`_median`)."""
    s, axis = _sorted(values, axis)
    at = (s.shape[axis] - 1) * (q / 100.0)
    lo = math.floor(at)
    t = at - lo
    a = np.take(s, lo, axis=axis)
    if t == 0.0:
        return a
    b = np.take(s, lo + 1, axis=axis)
    diff = b - a
    return a + diff * t if t < 0.5 else b - diff * (1.0 - t)


def _sorted(values: np.ndarray, axis: int | None) -> tuple[np.ndarray, int]:
    return (np.sort(values.ravel()), 0) if axis is None else (np.sort(values, axis=axis), axis)


def running_median(values: np.ndarray, width: int = SMOOTH) -> np.ndarray:
    """A centred running median (shorter at the ends): one outlying batch moves it by nothing. Vectorised: a
    run's 4096 kept records are read in ~1 ms."""
    n, half = len(values), width // 2
    out = np.empty(n)
    if n >= width:
        out[half:n - half] = _median(np.lib.stride_tricks.sliding_window_view(values, width), axis=1)
    for i in [*range(min(half, n)), *range(max(half, n - half), n)]:
        out[i] = _median(values[max(0, i - half):i + half + 1])
    return out


def _windows_before(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each index, the median and the 95th percentile of the (up to) SPIKE_WINDOW values before it (NaN
    where fewer than SPIKE_MIN_WINDOW precede it)."""
    n = len(x)
    med, p95 = np.full(n, np.nan), np.full(n, np.nan)
    for i in range(SPIKE_MIN_WINDOW, min(SPIKE_WINDOW, n)):
        med[i], p95[i] = _median(x[:i]), _percentile(x[:i], 95)
    if n > SPIKE_WINDOW:
        win = np.lib.stride_tricks.sliding_window_view(x[:-1], SPIKE_WINDOW)  # win[j] = x[j:j + W], before j + W
        med[SPIKE_WINDOW:] = _median(win, axis=1)
        p95[SPIKE_WINDOW:] = _percentile(win, 95, axis=1)
    return med, p95


def find_divergence(steps: list[int], losses: list[float]) -> Divergence | None:
    """The run's divergence, when its loss ended several-fold above its minimum and stayed there."""
    n = len(losses)
    if n < MIN_STEPS:
        return None
    x = np.asarray(losses, dtype=np.float64)
    smooth = running_median(x)
    stretch, i_min, m = _smoothed_minimum(x)
    if m <= 0 or not _stayed_up(x, smooth, m, i_min, stretch):
        return None
    level = float(_median(x[n - stretch:]))
    cross = i_min + int(np.argmax(smooth[i_min:] >= DIVERGE_RATIO * m))
    low = m + 0.1 * (level - m)
    start = max((i for i in range(i_min, cross) if smooth[i] <= low), default=i_min)
    lowest = int(np.argmin(x[:start + 1]))  # the lowest loss before the rise began
    return Divergence(steps[lowest], float(x[lowest]), steps[start], steps[-1], level, float(x[-1]), stretch,
                      float(_median(x[:EARLY_STEPS])))


def _stretch(n: int) -> int:
    """The last stretch's length: a tenth of the run, 8-20 steps."""
    return max(8, min(20, n // 10))


def _smoothed_minimum(x: np.ndarray) -> tuple[int, int, float]:
    """(the last stretch's length, the index and value of the run's minimum before it). The minimum of a wider
    running median: the lowest of hundreds of noisy 5-step medians is an extreme of the noise (small-batch
    regression losses are chi-square-like), not a level the run reached."""
    stretch = _stretch(len(x))
    head = running_median(x, stretch | 1)[:len(x) - stretch]
    i_min = int(np.argmin(head))
    return stretch, i_min, float(head[i_min])


def final_rise(losses: list[float]) -> tuple[float, float] | None:
    """(the last stretch's median, the run's smoothed minimum): the first measure of the divergence rule, without
    its tests that the rise stayed apart from the noise. A remedy's replay is held to it (a fix ends below
    DIVERGE_RATIO times the minimum), where a warning needs the whole rule; None: too few steps."""
    if len(losses) < MIN_STEPS:
        return None
    x = np.asarray(losses, dtype=np.float64)
    stretch, _, m = _smoothed_minimum(x)
    return float(_median(x[len(x) - stretch:])), m


def _stayed_up(x: np.ndarray, smooth: np.ndarray, m: float, i_min: int, stretch: int) -> bool:
    """The last stretch is several-fold above the minimum `m` (at `i_min`), apart from the noise, and the rise is
    a real share of the way back to the early loss."""
    n = len(x)
    last = x[n - stretch:]
    level = float(_median(last))
    if level < DIVERGE_RATIO * m or float(smooth[n - stretch:].min()) < STAY_RATIO * m:
        return False
    # apart from the noise: the last stretch's lower quartile above the upper quartile of the stretch at the minimum
    around = x[max(0, i_min - stretch):i_min + stretch + 1]
    if _percentile(last, 25) < STAY_RATIO * _percentile(around, 75):
        return False
    early = float(_median(x[:EARLY_STEPS]))
    return not (early > m and level - m < RISE_SHARE * (early - m) and level < early)


def find_spikes(records: list[Any]) -> list[Spike]:
    """Rises of the loss that recovered before the run ended, against a robust window before each."""
    x = np.asarray([r.loss for r in records], dtype=np.float64)
    meds, p95s = _windows_before(x)
    out: list[Spike] = []
    i = SPIKE_MIN_WINDOW
    while i < len(x):
        med = float(meds[i])
        if not med > 0:
            i += 1
            continue
        threshold = max(SPIKE_RATIO * med, med + SPIKE_SPREAD * (float(p95s[i]) - med))
        if x[i] < threshold:
            i += 1
            continue
        spike = _spike_from(records, x, i, med, threshold)
        if spike is None:  # not held, or never recovered: the divergence rule reads what stays up
            i += 1
            continue
        out.append(spike)
        i = _index_of(records, spike.recovered_step) + SPIKE_MIN_WINDOW  # the next window holds no spike
    return out


def _index_of(records: list[Any], step: int) -> int:
    return next(j for j, r in enumerate(records) if r.step == step)


def _spike_from(records: list[Any], x: np.ndarray, i: int, med: float, threshold: float) -> Spike | None:
    """The spike that begins at index `i`: its elevated steps (above half-way from the median to the threshold),
    held >= 2 steps at the threshold or towering over it; None unless the loss came back down before the end."""
    half = med + 0.5 * (threshold - med)
    j = i
    while j < len(x) and x[j] >= half:
        j += 1
    if j >= len(x):
        return None  # still up when the run ended
    held = int((x[i:j] >= threshold).sum())
    peak = i + int(np.argmax(x[i:j]))
    if held < 2 and x[peak] < SPIKE_TOWER * threshold:
        return None
    order = sorted(range(i, j), key=lambda k: -x[k])[:TOP_BATCHES]
    top = [(records[k].step, float(x[k]), getattr(records[k], "batch_index", None), getattr(records[k], "epoch", None))
           for k in order]
    return Spike(records[i].step, records[j - 1].step, records[peak].step, float(x[peak]), med, threshold,
                 records[j].step, top)


def _lr_at(records: list[Any], step: int) -> float | None:
    return next((r.lr for r in records if r.step == step and getattr(r, "lr", None) is not None), None)


def divergence_finding(d: Divergence, lr: float | None, fault_step: int | None, report: Report) -> Finding:
    """loss.divergence: where the rise began, the minimum and its step, the level at the report (or the fault)."""
    until = (f"until the fault at step {fault_step}" if fault_step is not None else "at the end of the run")
    lead = fault_step - d.start_step if fault_step is not None else None
    then = (f" {lead} step(s) later the run hit the fault at step {fault_step}." if lead is not None else
            " No value went non-finite, but the run is no longer learning.")
    message = (f"The loss diverged: it fell to its minimum of {d.min_loss:.3g} at step {d.min_step}, began to rise "
               f"at step {d.start_step} and stayed several-fold above it {until}: {d.level:.3g} (the median of the "
               f"last {d.stretch} steps, {d.ratio:.3g}x the minimum; {d.last_loss:.3g} at step {d.last_step}).{then}"
               " The step size is too large from there on: lower the learning rate, or warm up to it longer.")
    advice = [lower_lr_advice(lr, f"at step {d.start_step}", report.mode)]
    return Finding(
        Code.LOSS_DIVERGENCE, Severity.WARNING, message, Location(step=d.start_step, phase=Phase.OPTIMIZER),
        {"quantity": "loss", "layer": None, "start_step": d.start_step, "early_level": d.min_loss,
         "min_step": d.min_step, "min_loss": d.min_loss, "level": d.level, "level_step": d.last_step,
         "last_loss": d.last_loss, "ratio": d.ratio, "stretch": d.stretch, "initial_loss": d.early,
         "lead_steps": lead, "fault_step": fault_step, "learning_rate": lr},
        advice)


def spike_finding(s: Spike, lr: float | None, report: Report, others: int) -> Finding:
    """loss.spike: its steps, its peak over the level before it, the batches at its top."""
    tops = ", ".join(_batch_text(step, b, e) for step, _, b, e in s.top)
    span = (f"at step {s.start_step}" if s.start_step == s.end_step else
            f"from step {s.start_step} to {s.end_step}")
    more = f" {others} more spike(s) like it are not listed." if others else ""
    message = (f"The loss spiked {span}: up to {s.peak:.3g} at step {s.peak_step}, {s.peak / s.baseline:.3g}x the "
               f"median of the steps before it ({s.baseline:.3g}), and recovered by step {s.recovered_step}. "
               f"Its highest losses were on {tops}: check those batches (outliers, bad labels), and if they are "
               f"sound the step size is marginal.{more}")
    advice = [f"Look at the batch(es) at the spike's top ({tops}) for outliers or corrupt records.",
              "If they are sound: " + lower_lr_advice(lr, f"at step {s.start_step}", report.mode)]
    return Finding(
        Code.LOSS_SPIKE, Severity.WARNING, message, Location(step=s.start_step, phase=Phase.LOSS,
                                                             batch_index=s.top[0][2]),
        {"quantity": "loss", "layer": None, "start_step": s.start_step, "end_step": s.end_step,
         "peak_step": s.peak_step, "early_level": s.baseline, "level": s.peak, "ratio": s.peak / s.baseline,
         "threshold": s.threshold, "recovered_step": s.recovered_step,
         "top": [{"step": st, "loss": v, "batch_index": b, "epoch": e} for st, v, b, e in s.top],
         "learning_rate": lr, "more_spikes": others},
        advice)


def _batch_text(step: int, batch_index: int | None, epoch: int | None) -> str:
    if batch_index is None:
        return f"step {step}'s batch"
    where = f" of epoch {epoch}" if epoch else ""
    return f"batch {batch_index}{where} (step {step})"


def loss_findings(report: Report, records: list[Any], fault_step: int | None) -> list[Finding]:
    """The loss's warnings for a finished run (up to its fault, when there was one): the divergence first."""
    series = loss_series(records, fault_step)
    out: list[Finding] = []
    div = find_divergence([r.step for r in series], [r.loss for r in series])
    if div is not None:
        out.append(divergence_finding(div, _lr_at(series, div.start_step), fault_step, report))
    spikes = find_spikes(series)
    if div is not None:  # a spike on the way up is part of the divergence
        spikes = [s for s in spikes if s.end_step < div.start_step]
    shown = sorted(sorted(spikes, key=lambda s: -s.peak / s.baseline)[:MAX_SPIKES], key=lambda s: s.start_step)
    for k, s in enumerate(shown):
        others = len(spikes) - len(shown) if k == len(shown) - 1 else 0
        out.append(spike_finding(s, _lr_at(series, s.start_step), report, others))
    return out


def loss_warned(records: list[Any]) -> bool:
    """Whether a run without a fault gets a loss warning (an in-loop run then writes its report, as for the
    watcher's own warnings)."""
    series = loss_series(records, None)
    return (find_divergence([r.step for r in series], [r.loss for r in series]) is not None
            or bool(find_spikes(series)))

