"""Remedies for a run whose loss diverged without a NaN (issue 35): the step-size changes (the learning rate
x0.1, gradient clipping, a longer warmup) replayed from before the growth began to the probe's last step.

Each replay is judged by loss_trend's own divergence rule (one rule) on the run's losses with the replayed ones in
place of the run's from where the replay began: `fixed` when the rule no longer finds a divergence, `not_fixed`
when it still does (or the replay went NaN/Inf, or its loss left the healthy steps' range). A replay without any
change must find the divergence again, else no replay is evidence either way. The replays share trial.py's
bounds: replayed steps, not seconds, decide what is tried.

A run whose only signs are transformer precursors (attention.logit_growth, activation.norm_growth,
output.logit_divergence) or a loss spike, with no divergence, gets the same replays from before the earliest
warning began, plus qk-layernorm where the attention logits grew and z-loss where the head's log Z diverged. Each
replay samples the precursors on the run's very steps (a monitor resumed from the probe's) and is judged by the
rules that raised the warnings: `fixed` when none fires again on the replayed steps, no spike rises, and the loss
stays in the healthy range (no divergence, no blow-up); the replay without any change must raise them again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from nandoctor.engine.replay import Change, Replay, replay
from nandoctor.engine.snapshots import Snapshot, SnapshotRing, restore
from nandoctor.findings import Code, Finding, Report
from nandoctor.progress import ProgressFn, no_progress
from nandoctor.remedies import changes as rt
from nandoctor.remedies import trial as bounds  # trial's bounds, read when a probe runs (where tests patch them)
from nandoctor.remedies.candidates import (
    GROWTHS,
    Candidate,
    clip_from_norms,
    conclusive_norms,
    model_change_candidates,
)
from nandoctor.remedies.judging import (
    NOT_APPLICABLE,
    baseline_loss,
    divergence_of,
    healthy_span,
    judge_divergence,
    judge_precursors,
    still_warned,
)
from nandoctor.remedies.trial import (  # (one row, one count)
    Trial,
    remedy_row,
    safety_note,
    time_budget,
    verdict_lines,
    verified_first,
)

MIN_PEAK_STEPS = 30  # a longer warmup is judged only with this many replayed steps at the peak after it
PRECURSORS = (Code.ATTENTION_LOGIT_GROWTH, Code.ACTIVATION_NORM_GROWTH, Code.OUTPUT_LOGIT_DIVERGENCE)
# A change that begins at a spike's first step cannot change that step's loss (its forward ran before the change's
# first update): a lone spike's replays change the run from this many steps before it (one precursor sample apart)
SPIKE_LEAD = 4


@dataclass
class _Aim:
    """What the replays answer: the loss's divergence, or (with none) the precursor warnings and loss spikes, and
    the probe's precursor monitor whose series the replays' samples continue."""

    divergence: Finding | None
    warnings: list[Finding] = field(default_factory=list)
    monitor: Any = None
    reproduced: list[Finding] = field(default_factory=list)  # the warnings the control raised again

    @property
    def findings(self) -> list[Finding]:
        return [self.divergence] if self.divergence is not None else self.warnings


def diverged(report: Report) -> Finding | None:
    """The loss.divergence warning of a run without an error (what these remedies answer), else None."""
    if any(f.severity.value == "error" for f in report.findings):
        return None
    return next((f for f in report.findings if f.code == Code.LOSS_DIVERGENCE), None)


def warned(report: Report) -> list[Finding]:
    """The precursor warnings and loss spikes of a run without an error or a loss divergence (what the precursor
    replays answer); [] otherwise."""
    if diverged(report) is not None or any(f.severity.value == "error" for f in report.findings):
        return []
    return [f for f in report.findings if f.code in (*PRECURSORS, Code.LOSS_SPIKE) and f.location.step is not None]


def _warnings_start(warnings: list[Finding]) -> int:
    """Where the replays' changes begin: the earliest precursor's start, or SPIKE_LEAD steps before a spike."""
    return max(0, min(f.location.step - (SPIKE_LEAD if f.code == Code.LOSS_SPIKE else 0) for f in warnings))


def growth_step(report: Report, divergence: Finding) -> int:
    """Where the growth began: the loss's rise, or an earlier precursor's start (attention logits, a linear
    layer's output RMS, log Z) when one came before it."""
    last = divergence.location.step or 0
    steps = [f.location.step for f in report.findings if f.code in GROWTHS and f.location.step is not None
             and f.location.step <= last]
    return min(steps, default=last)


def try_divergence_remedies(report: Report, res: Any, workload: Any, optimizer: Any, ring: SnapshotRing, *,
                            probe_seconds: float = 0.0, amp: bool = False, device: str = "cpu",
                            progress: ProgressFn = no_progress, precursors: Any = None) -> None:
    """Fill `report.remedies` for a run whose loss diverged without a fault, or (with none) whose only signs are
    precursor warnings or a loss spike: the step-size remedies (and qk-norm, z-loss for their precursors)
    replayed from before the growth began to the probe's last step and judged by the rule that raised the
    warning; the model, optimizer and RNG are put back as the probe left them. `precursors`: the probe's
    precursor monitor (engine/precursors.py), whose steps and layers the replays sample."""
    aim = _aim(report, precursors)
    records = list(getattr(res, "records", None) or [])
    if aim is None or not records or ring.first is None:
        return
    if amp and device != "cpu":
        report.details["remedies"] = {"note": "remedies are not replayed under AMP on a GPU yet (the replays do "
                                      "not drive the GradScaler); run with amp.enabled: false to have them tried"}
        return
    last = records[-1]
    end_step = last.step + 1
    entry = ring.take(end_step, last.epoch or 0, (last.batch_index or 0) + 1)  # to put back afterwards
    start = growth_step(report, aim.divergence) if aim.divergence is not None else _warnings_start(aim.warnings)
    sampler = None if aim.monitor is None else (lambda: type(aim.monitor).resumed(aim.monitor))
    trial = Trial(report, None, workload, optimizer, ring, end_step, time.perf_counter(),
                  time_budget(probe_seconds), span=healthy_span(report, start),
                  steps_left=bounds.REPLAY_STEPS_FACTOR * end_step, sampler=sampler)
    before = [(r.step, float(r.loss)) for r in records if r.step < end_step and r.loss is not None]
    cands = _candidates(report, workload, ring, start, end_step, conclusive_norms(records))
    cands += model_change_candidates(report, workload, ring, start, end_step)  # (none without their precursors)
    try:
        control = _control(trial, cands, progress, aim)
        reproduced = _reproduced(control, before, end_step, aim)
        rows = [_try_one(trial, c, before, k, progress, aim) for k, c in enumerate(cands)]
    finally:  # the weights, optimizer state and RNG as the probe left them, whatever stopped the replays
        restore(entry, workload.model, optimizer)
        entry.rng.restore()
    if reproduced is not True:
        for row in rows:
            if row["outcome"] != NOT_APPLICABLE:
                row["outcome"], row["note"] = NOT_APPLICABLE, _unverified(control, reproduced, end_step, aim)
    _record(trial, rows, control, reproduced, start, probe_seconds, aim)


def _aim(report: Report, monitor: Any) -> _Aim | None:
    """The divergence to answer, else the precursor warnings (those of a monitor the replays can resume) and
    loss spikes; None: nothing to replay for."""
    divergence = diverged(report)
    if divergence is not None:
        return _Aim(divergence)
    warnings = [f for f in warned(report) if f.code == Code.LOSS_SPIKE or monitor is not None]
    return _Aim(None, warnings, monitor) if warnings else None


def _candidates(report: Report, workload: Any, ring: SnapshotRing, start: int, end_step: int,
                norms: list[tuple[int, float]]) -> list[Candidate]:
    """The learning rate x0.1 and clipping from the growth's step, and a longer warmup from the first step: a
    few, as each replays the probe's steps again."""
    snap = ring.latest(start)
    spec_opt = workload.spec.optimizer
    lr_edit, lr_note = rt.lr_change(spec_opt, _lr(report, start), 0.1)
    out = [Candidate("lr_x0.1", rt.change_text(lr_edit, lr_note) if lr_edit else lr_note,
                     Change(lr_scale=0.1, from_step=start), snap, extra={"spec_change": lr_edit} if lr_edit else {})]
    clip = clip_from_norms(norms, start)
    if clip is None:
        out.append(Candidate("grad_clip", "optimizer.grad_clip: {global_norm: ...}", Change(), None,
                             why_not="no gradient norm read before the growth began to set a threshold from"))
    else:
        edit = rt.clip_change(clip)
        clip = edit[rt.CLIP_KEY]["global_norm"]  # the replay verifies the very threshold the text states
        out.append(Candidate("grad_clip", rt.change_text(edit), Change(clip_norm=clip, from_step=start), snap,
                             extra={"threshold": clip, "spec_change": edit}))
    out.append(_warmup(spec_opt, ring, start, end_step))
    return out


def _warmup(spec_opt: Any, ring: SnapshotRing, start: int, end_step: int) -> Candidate:
    """Twice the run's own warmup (else a warmup over twice the steps before the growth) to the same peak, from
    the first step; only where the replay then runs MIN_PEAK_STEPS at the peak, and the peak is the spec's
    base rate (a warmup alone, or none: another scheduler's rates after it are its own)."""
    sched = spec_opt.lr_scheduler
    own = sched.warmup.steps if sched is not None and sched.warmup is not None else 0
    steps = 2 * max(own, start, 1)
    edit = rt.warmup_change(steps)
    text = rt.change_text(edit, f"a linear warmup from 0 to the same peak over the first {steps} steps"
                          + (f", in place of {own}" if own else ""))
    peak = (spec_opt.args or {}).get("learning_rate")
    why = None
    if sched is not None and (sched.name or sched.entry):
        why = "the run's warmup leads into a scheduler of its own: the replay cannot lengthen the warmup alone"
    elif not isinstance(peak, (int, float)):
        why = "the spec names no base learning rate to warm up to"
    elif end_step - steps < MIN_PEAK_STEPS:
        why = (f"a warmup of {steps} steps leaves fewer than {MIN_PEAK_STEPS} of the probe's {end_step} steps at the "
               "peak rate to judge it by: probe more steps (--steps) to have it tried")
    change = Change(warmup_steps=steps, warmup_peak=float(peak) if why is None else None)
    return Candidate("warmup", text, change, ring.first, why_not=why, extra={"spec_change": edit})


def _lr(report: Report, step: int) -> float | None:
    """The learning rate at `step` (the growth's), from the timeline."""
    return next((p.lr for p in report.timeline if p.step == step and p.lr is not None), None)


def _control(trial: Trial, cands: list[Candidate], progress: ProgressFn, aim: _Aim) -> Replay | None:
    """The replay without any change from the earliest state a candidate restarts from to the probe's last
    step: does the loss diverge again (are the warnings raised again)?"""
    starts = [c.start for c in cands if c.start is not None and c.why_not is None]
    snap: Snapshot | None = min(starts, key=lambda s: s.step, default=None)
    if snap is None:
        return None
    again = "does the loss diverge again?" if aim.divergence is not None else "are the warnings raised again?"
    progress(0, None, f"replaying without any change ({again})")
    trial.charge(snap, trial.end_step)  # (the control always runs: without it no replay is evidence)
    r = replay(trial.workload, trial.optimizer, trial.ring, snap, trial.end_step, Change(), trial.deadline,
               sample=trial.sampler() if trial.sampler is not None else None)
    trial.time_limit_hit = trial.time_limit_hit or r.cut
    return r


def _try_one(trial: Trial, c: Candidate, before: list[tuple[int, float]], k: int,
             progress: ProgressFn, aim: _Aim) -> dict[str, Any]:
    """A candidate's row: its replay judged by the divergence rule (or the warnings' own rules), or why it was
    not tried."""
    if c.why_not is None and trial.past_deadline():
        c.why_not = safety_note(trial.budget)
    if c.why_not is not None or c.start is None:
        return remedy_row(c, NOT_APPLICABLE, None, note=c.why_not or "no state to restart from")
    against = "the divergence" if aim.divergence is not None else "the warnings"
    progress(k + 1, None, f"trying remedy {k + 1}: {c.remedy} (against {against})")
    r = trial.run_from(c.start, c.change)
    if aim.divergence is not None:
        outcome, note = judge_divergence(r, c, before, trial.end_step, trial.span)
    else:  # (judged against the warnings the control raised again; none: every row is made not applicable)
        outcome, note = judge_precursors(r, c, before, trial.end_step, trial.span, aim.reproduced or aim.warnings,
                                         aim.monitor.series if aim.monitor is not None else {})
    return remedy_row(c, outcome, r, note=note, before=baseline_loss(trial.report, r.start_step))


def _reproduced(control: Replay | None, before: list[tuple[int, float]], end_step: int, aim: _Aim) -> bool | None:
    """Whether the replay without any change diverged again (raised the warnings again: `aim.reproduced`), by
    the same rules; None: unknown (no control, or the safety net stopped it)."""
    if control is None or control.cut:
        return None
    if not control.finite or control.start_step + control.steps_run < end_step:
        return False
    if aim.divergence is not None:
        return divergence_of(control, before) is not None
    series = aim.monitor.series if aim.monitor is not None else {}
    aim.reproduced = [f for f in aim.warnings if still_warned(f, control, before, series, anywhere=False)]
    return bool(aim.reproduced)


def _unverified(control: Replay | None, reproduced: bool | None, end_step: int, aim: _Aim) -> str:
    tail = ", so no replay is evidence for or against a remedy"
    if control is None:
        return "no replay without any change could start (no state before the growth to restart from)" + tail
    if reproduced is None:
        return "the replay without any change was stopped by nandoctor's safety time limit" + tail
    if not control.finite:
        return f"the replay without any change went NaN/Inf at step {control.failed_at}" + tail
    if control.start_step + control.steps_run < end_step:
        return f"the replay without any change ran out of data before step {end_step - 1}" + tail
    if aim.divergence is None:
        said = "; ".join(_named(f) for f in aim.warnings)
        return (f"the replay without any change did not raise the warnings again on the same batches ({said}; a "
                "nondeterministic run)" + tail)
    return ("the replay without any change did not diverge again on the same batches (a nondeterministic run)"
            + tail)


def _named(f: Finding) -> str:
    """'attention.logit_growth at blocks.1.attn from step 12'."""
    at = f" at {f.location.layer}" if f.location.layer else ""
    return f"{f.code.value}{at} from step {f.location.step}"


def _record(trial: Trial, rows: list[dict[str, Any]], control: Replay | None, reproduced: bool | None,
            start: int, probe_seconds: float, aim: _Aim) -> None:
    """The rows in the report, verified first; what the replays were in its details; the advice of the findings
    they answer marked (the warnings the control raised again)."""
    report = trial.report
    report.remedies = verified_first(rows)
    report.details["remedies"] = {"of": aim.findings[0].code.value, "growth_step": start,
                                  **trial.details(control, reproduced, probe_seconds)}
    if aim.divergence is None:
        report.details["remedies"]["warnings"] = [
            {"code": f.code.value, "layer": f.location.layer, "start_step": f.location.step,
             "reproduced": f in aim.reproduced} for f in aim.warnings]
    report.details["snapshots"] = trial.ring.summary()
    lines = verdict_lines(rows)
    if not lines:
        return
    for finding in aim.findings if aim.divergence is not None else aim.reproduced:
        kept = [a for a in finding.advice if not a.startswith(("Verified by", "Tried by"))]
        finding.advice = kept + lines
