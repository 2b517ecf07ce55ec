"""Warnings that come before a fault: exploding gradient norms, float16 headroom, vanishing gradients.

Each rule must stay silent on a healthy run, so each asks for a large, sustained signal: a gradient
norm orders of magnitude above its early level, an activation beyond float16's 65504 (only when the
spec asks for float16 AMP), gradients below float16's smallest subnormal (only with AMP).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import numpy as np

from nandoctor.advice import advice_for
from nandoctor.findings import Code, Finding, Location, Phase, Severity

FP16_MAX = 65504.0
FP16_TINY = 6.0e-8  # float16's smallest subnormal is 5.96e-8: anything below flushes to zero
_EARLY_STEPS = 5  # the "early level" of the gradient norm: the median of the first steps
_EXPLODE_RATIO = 100.0  # a norm this many times its early level is an explosion in progress
_ALERT_RATIO = 10.0  # from here on, collect per-layer stats every step


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

    def update(self, record: Any) -> bool:
        """Take one step's numbers; True while something looks like trouble (stats on every step)."""
        alert = False
        if record.grad_norm is not None and math.isfinite(record.grad_norm):
            self.norms.append((record.step, record.grad_norm))
            early = self.early_level()
            if early is not None and early > 0:
                ratio = record.grad_norm / early
                alert = ratio >= _ALERT_RATIO
                if ratio >= _EXPLODE_RATIO and self.explosion is None:
                    self.explosion = self._explosion(record.step, early)
        if record.act_max is not None and self.fp16:
            over = np.where(np.isfinite(record.act_max) & (record.act_max > FP16_MAX))[0]
            for i in over.tolist():
                first, top = self.fp16_hits.get(i, (record.step, 0.0))
                self.fp16_hits[i] = (first, max(top, float(record.act_max[i])))
            alert = alert or bool(np.any(np.isfinite(record.act_max) & (record.act_max > FP16_MAX / 4)))
        if self.amp and record.grad_sq is not None and record.step > 0:
            norms = np.sqrt(record.grad_sq)
            tiny = np.where(np.isfinite(norms) & (norms > 0) & (norms < FP16_TINY))[0]
            for i in tiny.tolist():
                self.vanishing.setdefault(i, (record.step, float(norms[i])))
        return alert

    def _explosion(self, step: int, early: float) -> Finding:
        """Reported where the growth began: walk back while the norm kept rising and was above early."""
        start_i = len(self.norms) - 1
        while start_i > 0:
            prev = self.norms[start_i - 1][1]
            if prev < self.norms[start_i][1] and prev > 2 * early:
                start_i -= 1
            else:
                break
        start_step, start_norm = self.norms[start_i]
        now = self.norms[-1][1]
        before = [n for s, n in self.norms if s < start_step] or [early]
        clip = float(np.median(before[-10:]))
        lr = self.learning_rate
        return Finding(
            Code.GRAD_EXPLOSION, Severity.WARNING,
            f"The global gradient norm grew from about {early:.3g} (early steps) to {now:.3g} at step {step} "
            f"({now / early:.3g}x); the growth began at step {start_step} (norm {start_norm:.3g}). Training is "
            "heading for overflow: clip gradients or lower the learning rate.",
            Location(step=start_step, phase=Phase.BACKWARD),
            {"early_norm": early, "norm_at_start": start_norm, "norm_now": now, "step_now": step,
             "growth": now / early, "learning_rate": lr},
            advice_for(Code.GRAD_EXPLOSION.value, clip_norm=clip, learning_rate=lr))

    def findings(self) -> list[Finding]:
        out: list[Finding] = []
        if self.explosion is not None:
            out.append(self.explosion)
        for i, (step, top) in sorted(self.fp16_hits.items(), key=lambda kv: -kv[1][1])[:10]:
            name = self.layer_names[i]
            out.append(Finding(
                Code.PRECISION_FP16_OVERFLOW, Severity.WARNING,
                f"Layer {name} outputs values up to {top:.3g} (first at step {step}), {top / FP16_MAX:.3g}x "
                "float16's maximum of 65504: finite in float32, but with AMP in float16 this layer would output "
                "inf and the run would go NaN.",
                Location(step=step, phase=Phase.FORWARD, layer=name),
                {"max_abs": top, "fp16_max": FP16_MAX, "margin": top / FP16_MAX},
                advice_for(Code.PRECISION_FP16_OVERFLOW.value)))
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
