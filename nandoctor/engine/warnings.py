"""Warnings that come before a fault: exploding gradient norms, float16 headroom, vanishing gradients.

Each rule must stay silent on a healthy run, so each asks for a large, sustained signal: a gradient
norm orders of magnitude above its early level, an activation beyond float16's 65504 (only when the
spec asks for float16 AMP; an info without it), gradients below float16's smallest subnormal (only with AMP).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

import numpy as np

from nandoctor.advice import advice_for
from nandoctor.findings import Code, Finding, Location, Phase, Severity

FP16_MAX = 65504.0
FP16_TINY = 6.0e-8  # float16's smallest subnormal is 5.96e-8: anything below flushes to zero
_EARLY_STEPS = 5  # the "early level" of the gradient norm: the median of the first steps
_EXPLODE_RATIO = 100.0  # a norm this many times its early level is an explosion in progress
_ALERT_RATIO = 10.0  # from here on, collect per-layer stats every step


# Steps of norms and learning rates kept besides the early ones: a growth is walked back at most this far
_KEPT_STEPS = 4096


class WarningTracker:
    """Fed one StepRecord per healthy step; `findings()` gives the warnings once the run is over."""

    def __init__(self, layer_names: list[str], param_names: list[str], *, fp16: bool, amp: bool,
                 learning_rate: float | None) -> None:
        self.layer_names = layer_names
        self.param_names = param_names
        self.fp16 = fp16
        self.amp = amp
        self.learning_rate = learning_rate
        self.norms: list[tuple[int, float]] = []
        self._early: float | None = None
        self.explosion: Finding | None = None
        self.fp16_hits: dict[int, tuple[int, float]] = {}  # layer index -> (first step, max value)
        self.vanishing: dict[int, tuple[int, float]] = {}  # param index -> (first step, norm)
        self.lrs: dict[int, float | None] = {}
        # the gradient norm's alert as the last conclusive norm left it: a step without one (unread gradients, or
        # read only because timing allowed it) keeps it, so the alert follows the conclusive norms alone
        self._norm_alert = False

    def early_level(self) -> float | None:
        """The median norm of the first steps; fixed once those steps are in, so computed once then."""
        if len(self.norms) < 3:
            return None
        if self._early is not None:
            return self._early
        level = statistics.median(n for _, n in self.norms[:_EARLY_STEPS])
        if len(self.norms) >= _EARLY_STEPS:
            self._early = level
        return level

    def note_lrs(self, records: list[Any]) -> None:
        """Records with a loss alone (the unread steps, read together): all `update` takes of them."""
        self.lrs.update((r.step, r.lr) for r in records)
        self._trim()

    def update(self, record: Any) -> bool:
        """Take one step's numbers; True while something looks like trouble (stats on every step)."""
        self.lrs[record.step] = record.lr  # the watcher records the scheduler's value
        # only norms every read stride reads (StepRecord.conclusive): an alert or an explosion found on a step
        # read because the machine was fast would make the report follow the machine's load
        norm = record.grad_norm if getattr(record, "conclusive", True) else None
        if norm is not None and math.isfinite(norm):
            self.norms.append((record.step, norm))
        self._trim()
        if norm is not None and math.isfinite(norm):
            early = self.early_level()
            if early is not None and early > 0:
                ratio = norm / early
                self._norm_alert = ratio >= _ALERT_RATIO
                if ratio >= _EXPLODE_RATIO and self.explosion is None:
                    self.explosion = self._explosion(record.step, early)
        alert = self._norm_alert
        # per-layer values only from the stats steps every run takes (StepRecord.stats_fixed), as for the norms
        fixed = getattr(record, "stats_fixed", True)
        if record.act_max is not None and fixed:  # the float16 what-if: a warning with float16 AMP, else info
            over = np.where(np.isfinite(record.act_max) & (record.act_max > FP16_MAX))[0]
            for i in over.tolist():
                first, top = self.fp16_hits.get(i, (record.step, 0.0))
                self.fp16_hits[i] = (first, max(top, float(record.act_max[i])))
            if self.fp16:
                alert = alert or bool(np.any(np.isfinite(record.act_max) & (record.act_max > FP16_MAX / 4)))
        if self.amp and record.grad_sq is not None and record.step > 0 and fixed:
            norms = np.sqrt(record.grad_sq)
            tiny = np.where(np.isfinite(norms) & (norms > 0) & (norms < FP16_TINY))[0]
            for i in tiny.tolist():
                self.vanishing.setdefault(i, (record.step, float(norms[i])))
        return alert

    def _trim(self) -> None:
        """A long run: the early steps and the recent ones are what is read."""
        if len(self.lrs) > 2 * _KEPT_STEPS:
            self.lrs = dict(list(self.lrs.items())[-_KEPT_STEPS:])
            del self.norms[_EARLY_STEPS:max(_EARLY_STEPS, len(self.norms) - _KEPT_STEPS)]

    def _explosion(self, step: int, early: float) -> Finding:
        """Reported where the growth began: the norm is walked back while it kept rising (the same rule as
        the lookback after a fault, `_rise_to`). Every figure in the finding is measured against one level,
        the median of the norms before that start (the start's own norm when the growth began at the first
        step): a steady x10-per-step growth from step 0 puts the first steps' median inside the growth, so
        "early" and "typical" would disagree, and the start would be placed where the norm passed it."""
        xs = [(s, v) for s, v in self.norms if v > 0]
        rise = _rise_to(xs, len(xs) - 1, 1.0) if len(xs) >= 2 else None
        if rise is None:  # not rising into this step (a spike that fell back): the step itself, over the early level
            start_step, start_norm, level = step, self.norms[-1][1], early
        else:
            start_step, start_norm, level = rise.start_step, rise.start, rise.level
        now = self.norms[-1][1]
        clip = level * CLIP_FACTOR
        lr = self.lrs.get(start_step)
        lr = lr if lr is not None else self.learning_rate
        since = (f"from {start_norm:.3g} at step {start_step}, where the growth began" if start_step < step else
                 f"in one step, from a level of about {level:.3g}")
        before = (f" (about {level:.3g} before it)" if start_step < step and xs and xs[0][0] < start_step else "")
        return Finding(
            Code.GRAD_EXPLOSION, Severity.WARNING,
            f"The global gradient norm grew {now / start_norm if start_step < step else now / level:.3g}x {since}"
            f"{before}, to {now:.3g} at step {step}. Training is heading for overflow: clip gradients or lower the "
            "learning rate.",
            Location(step=start_step, phase=Phase.BACKWARD),
            {"early_norm": level, "norm_at_start": start_norm, "norm_now": now, "step_now": step,
             "growth": now / start_norm if start_step < step else now / level, "learning_rate": lr,
             "typical_grad_norm": level, "clip_threshold": clip},
            advice_for(Code.GRAD_EXPLOSION.value, clip_norm=clip, learning_rate=lr, lr_step=start_step,
                       typical_norm=level))

    def _fp16_finding(self) -> Finding:
        """One finding a run, at the layer with the largest output: every layer past float16's range is
        listed in its evidence (a diverging run crosses it in layer after layer, and ten findings with the
        same advice buried the error)."""
        # ties (a container and the sublayer whose output it returns) go to the later, inner layer
        hits = sorted(self.fp16_hits.items(), key=lambda kv: (-kv[1][1], -kv[0]))
        i, (step, top) = hits[0]
        name = self.layer_names[i]
        if self.fp16:
            sev, tail = Severity.WARNING, "but with AMP in float16 (as the spec asks) this layer would output inf"
        else:
            sev, tail = Severity.INFO, "the spec has no float16 AMP, but with it this layer would output inf"
        others = [self.layer_names[j] for j, _ in hits[1:]]
        also = ""
        if others:
            shown = ", ".join(others[:5]) + ("…" if len(others) > 5 else "")
            first = min(hits, key=lambda kv: (kv[1][0], kv[0]))
            also = (f" {len(others)} other layer(s) also exceed it ({shown}); {self.layer_names[first[0]]} was the "
                    f"first to, at step {first[1][0]}.")
        layers = [{"layer": self.layer_names[j], "max_abs": v, "first_step": st} for j, (st, v) in hits[:50]]
        return Finding(
            Code.PRECISION_FP16_OVERFLOW, sev,
            f"Layer {name} outputs values up to {top:.3g} (first at step {step}), {top / FP16_MAX:.3g}x "
            f"float16's maximum of 65504: finite in float32; {tail} and the run would go NaN.{also}",
            Location(step=step, phase=Phase.FORWARD, layer=name),
            {"max_abs": top, "fp16_max": FP16_MAX, "margin": top / FP16_MAX, "amp_float16": self.fp16,
             "layers": layers, "n_layers": len(hits)},
            advice_for(Code.PRECISION_FP16_OVERFLOW.value))

    def findings(self) -> list[Finding]:
        out: list[Finding] = []
        if self.explosion is not None:
            out.append(self.explosion)
        if self.fp16_hits:
            out.append(self._fp16_finding())
        if self.vanishing:
            items = sorted(self.vanishing.items())
            names = [self.param_names[i] for i, _ in items]
            step, norm = items[0][1]
            out.append(Finding(
                Code.GRAD_VANISHING, Severity.INFO,
                f"{len(names)} parameter(s) get gradients whose whole norm is below float16's smallest value "
                f"(~6e-8), e.g. {names[0]} ({norm:.2g} at step {step}): in float16 they would flush to zero.",
                Location(step=step, phase=Phase.BACKWARD, parameter=names[0]),
                {"parameters": names[:20]}, advice_for(Code.GRAD_VANISHING.value)))
        return out


# The lookback after a fault: growth this large, ending right before the fault, is its cause.
_RISE_RATIO = 3.0  # over at least _RISE_STEPS rising steps
_RISE_STEPS = 2
_JUMP_RATIO = 100.0  # or in a single step, right before the fault
_MIN_STEP = 1.2  # the growth begins at the first step that rises by this much
_ABOVE_LEVEL = 2.0  # and ending this far above the level before it (a recovery from a dip is no growth)
_PEAK_WINDOW = 3  # a peak this close before the fault, followed by a dip, counts only when it towers:
_PEAK_ABOVE_LEVEL = 10.0
CLIP_FACTOR = 1.5  # the suggested clip threshold: the typical pre-growth norm times this


@dataclass
class Rise:
    start_step: int
    start: float
    end_step: int
    end: float
    level: float  # the median of the values before the rise (the start value when there are none)

    @property
    def growth(self) -> float:
        return self.end / self.start


def find_rise(series: list[tuple[int, float]]) -> Rise | None:
    """The rise that ends the series (strictly increasing up to its last value), when it is a real growth:
    >= 3x over >= 2 steps, or >= 100x in one step, and >= 2x above the level before it (a recovery from
    a dip is no growth). Failing that, a rise to a peak in the last _PEAK_WINDOW values that towers >= 10x
    over the level before it (the norm spiked, fell back for a step, then the run went NaN)."""
    xs = [(s, v) for s, v in series if math.isfinite(v) and v > 0]
    if len(xs) < 2 or xs[-1][0] != series[-1][0]:
        return None
    found = _rise_to(xs, len(xs) - 1, _ABOVE_LEVEL)
    if found is None:
        tail = range(max(1, len(xs) - _PEAK_WINDOW), len(xs) - 1)
        peak = max(tail, key=lambda j: xs[j][1], default=None)
        if peak is not None:
            found = _rise_to(xs, peak, _PEAK_ABOVE_LEVEL)
    return found


def _rise_to(xs: list[tuple[int, float]], end: int, above: float) -> Rise | None:
    i = end
    while i > 0 and xs[i - 1][1] < xs[i][1]:
        i -= 1
    while i < end and xs[i + 1][1] < _MIN_STEP * xs[i][1]:  # a flat start is no growth yet
        i += 1
    rising = end - i
    if rising == 0:
        return None
    before = [v for _, v in xs[:i]][-10:]
    level = statistics.median(before) if before else xs[i][1]
    rise = Rise(xs[i][0], xs[i][1], xs[end][0], xs[end][1], level)
    jump = xs[end][1] / xs[end - 1][1]
    big = (rise.growth >= _RISE_RATIO and rising >= _RISE_STEPS) or jump >= _JUMP_RATIO
    if not big or rise.end < above * level:
        return None
    # only the last jump is big: it began there. What rose before the jump by less than a growth (_RISE_RATIO)
    # is the level's own noise, e.g. two reads of different batches before a jump when reads are spaced out
    if rising >= _RISE_STEPS and jump >= _JUMP_RATIO and xs[end - 1][1] < _RISE_RATIO * xs[i][1]:
        rise.start_step, rise.start = xs[end - 1]
    return rise


def growth_before_fault(records: list[Any], fault_step: int, fallback_lr: float | None,
                        samples_alone: list[int] | None = None) -> Finding | None:
    """grad.explosion when the gradient norm (or else the loss) rose before the fault at `fault_step`,
    reported at the step where the growth began, with the learning rate there and a clip threshold.

    `samples_alone`: the fault reproduces with these samples of its batch alone (a strict subset). Then a
    modest rise (below the single-step jump ratio) is not what made the fault, only a note beside it:
    early training's norms often triple while the fault is a log(0) on one bad sample."""
    norms, losses = _series_to_fault(records, fault_step)
    rise, what = find_rise(norms), "gradient norm"
    if rise is None:
        rise, what = find_rise(losses), "loss"
    if rise is None:
        return None
    lr = _lr_at(records, rise.start_step, fallback_lr)
    typical = _typical_norm(norms, rise.start_step)
    clip = typical * CLIP_FACTOR if typical else None
    severity, message = _growth_message(what, rise, fault_step, lr, samples_alone)
    return Finding(
        Code.GRAD_EXPLOSION, severity, message,
        Location(step=rise.start_step, phase=Phase.BACKWARD),
        {"signal": what, "step_start": rise.start_step, "value_at_start": rise.start, "step_now": rise.end_step,
         "value_now": rise.end, "growth": rise.growth, "level_before": rise.level, "fault_step": fault_step,
         "learning_rate": lr, "typical_grad_norm": typical, "clip_threshold": clip,
         "history": [[s, v] for s, v in (norms if what == "gradient norm" else losses)[-20:]]},
        advice_for(Code.GRAD_EXPLOSION.value, clip_norm=clip, learning_rate=lr, lr_step=rise.start_step,
                   typical_norm=typical))


def _series_to_fault(records: list[Any], fault_step: int) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """The gradient norms and the losses, by step, up to the fault: the faulting step's own values count when
    finite (an update fault: its gradient was finite), and the records before it come first."""
    before = [r for r in records if r.step < fault_step]
    at_fault = [r for r in records if r.step == fault_step]
    # the norms every read stride reads (StepRecord.conclusive), and the faulting step's own
    norms = [(r.step, float(r.grad_norm)) for r in before + at_fault
             if r.grad_norm is not None and (getattr(r, "conclusive", True) or r.step == fault_step)]
    if norms and not math.isfinite(norms[-1][1]):
        norms = norms[:-1]
    losses = [(r.step, float(r.loss)) for r in before + at_fault if r.loss is not None]
    if losses and not math.isfinite(losses[-1][1]):
        losses = losses[:-1]
    return norms, losses


def _lr_at(records: list[Any], step: int, fallback_lr: float | None) -> float | None:
    """The learning rate the record of `step` holds (the growth's first step), else the run's."""
    by_step = {r.step: r for r in records}
    lr = getattr(by_step.get(step), "lr", None)
    return lr if lr is not None else fallback_lr


def _typical_norm(norms: list[tuple[int, float]], start_step: int) -> float | None:
    """The gradient norm before the growth (the median of the last ten before `start_step`, else its own):
    what a clip threshold is a multiple of."""
    pre = [v for s, v in norms if s < start_step][-10:] or [v for s, v in norms if s == start_step]
    return statistics.median(pre) if pre else None


def _growth_message(what: str, rise: Rise, fault_step: int, lr: float | None,
                    samples_alone: list[int] | None) -> tuple[Severity, str]:
    """The finding's severity and message: a warning that the growth made the fault, or (a modest growth, and
    the fault reproduces with some samples of its batch alone) an info that those samples made it."""
    lr_text = f" The learning rate at step {rise.start_step} was {lr:g}." if lr is not None else ""
    grew = (f"The {what} grew {rise.growth:.3g}x from {rise.start:.3g} at step {rise.start_step} to {rise.end:.3g} "
            f"at step {rise.end_step}, right before the fault at step {fault_step}")
    if samples_alone and rise.growth < _JUMP_RATIO:
        shown = ", ".join(str(i) for i in samples_alone[:10])
        return Severity.INFO, (f"{grew}; but the fault reproduces with sample(s) {shown} of its batch alone, so "
                               f"those samples, not the growth, made it.{lr_text} If the growth goes on once they "
                               "are fixed, lower the learning rate or clip the gradients.")
    return Severity.WARNING, (f"{grew}: the fault is where that growth overflowed, and the growth began at step "
                              f"{rise.start_step}.{lr_text} Lower the learning rate or clip the gradients.")
