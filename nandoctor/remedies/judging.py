"""Judging a remedy's replay: `fixed` when it stays finite past the fault step without its loss blowing up,
else `not_fixed` or `not_applicable`, with a note that says why or what the evidence does not cover; and
whether the replay without any change met the fault at all (else no replay is evidence either way).
"""

from __future__ import annotations

import math
from typing import Any

from nandoctor.engine.replay import Replay
from nandoctor.engine.snapshots import SnapshotRing
from nandoctor.engine.watcher import FaultKind
from nandoctor.findings import Report
from nandoctor.remedies.candidates import Candidate
from nandoctor.remedies.guard import never_fired

STUCK = 1e10  # a finite loss still this large is not a recovered run (an exp clamped at its limit)
BLOW_UP = 10.0  # a finite run whose loss ends this many times above where it started is not a fix

FIXED, NOT_FIXED, NOT_APPLICABLE = "fixed", "not_fixed", "not_applicable"

def judge(r: Replay, fault_step: int, end_step: int, c: Candidate, before: float | None,
          span: tuple[float, float] | None = None) -> tuple[str, str | None]:
    """One candidate's replay judged: no evidence (not applicable), or the fault still there, the replay short
    of the fault step, or a loss that did not recover or left the healthy steps' range (not fixed), else
    fixed, with a note on what the replay does not cover. `before`: the probe's loss where the replay
    started; `span`: the lowest and highest finite loss of the probe's steps before the fault (healthy_span)."""
    unjudged = _no_evidence(r, c)
    if unjudged is not None:
        return unjudged
    if not r.finite:
        return NOT_FIXED, _still_nonfinite(r, fault_step)
    last = r.start_step + r.steps_run - 1
    kept_only = r.data_note is not None and last == fault_step  # the faulty batch was the last one it could have
    short = _short_of_fault(r, last, fault_step, kept_only)
    if short is not None:
        return NOT_FIXED, short
    unrecovered = _loss_not_recovered(r, before) or _loss_out_of_range(r, fault_step, span)
    if unrecovered is not None:
        return NOT_FIXED, unrecovered
    dodged = _dodged_nan_weight(r, c)
    if dodged is not None:
        return NOT_FIXED, dodged
    return FIXED, _fixed_note(r, fault_step, end_step, last, kept_only)


def _no_evidence(r: Replay, c: Candidate) -> tuple[str, str | None] | None:
    """A replay that could not run, raised, or whose guard was never applied says nothing about the fix."""
    if r.not_applicable is not None:
        return NOT_APPLICABLE, r.not_applicable
    if r.error is not None:
        return NOT_FIXED, f"the replay raised {r.error}"
    if r.cut:  # the safety net, not the run, stopped it: the machine's load is no verdict either way
        return NOT_APPLICABLE, (f"not judged: nandoctor's safety time limit stopped this replay after {r.steps_run} "
                                "step(s) (the machine ran far slower than during the probe); run the probe again on "
                                "a quieter machine for a verdict")
    if r.other_data_at is not None:
        return NOT_APPLICABLE, (f"this replay read another batch at step {r.other_data_at} than the training did "
                                f"(the loader gave other data when re-read: {_why_other(r)}), so it says nothing "
                                "about the fix")
    clamp = c.change.clamp_output
    if clamp is not None and not r.clamp_hits:
        return NOT_APPLICABLE, (f"the clamp never changed a value of layer {clamp[0]}'s output during the replay, so "
                                "this replay says nothing about the fix")
    if c.change.qk_norm and not r.qk_hits:
        return NOT_APPLICABLE, ("the query and key projections never ran during the replay, so this replay says "
                                "nothing about qk-layernorm")
    unused = never_fired(r, c.change)  # before the outcome: a guard never applied says nothing about the fix
    if unused is not None:
        return NOT_APPLICABLE, unused
    return None


def _why_other(r: Replay) -> str:
    return r.data_note or "a stream, an unseeded shuffle or augmentation"


def _still_nonfinite(r: Replay, fault_step: int) -> str:
    """Where the replay still went NaN/Inf, and, past the fault step, the NaN weight a later batch read."""
    held = _held(r)
    if held and r.failed_at is not None and r.failed_at > fault_step:
        return (f"still NaN/Inf at step {r.failed_at}: {held} and a later batch reads it "
                "again (leaving samples out cannot repair a NaN weight; re-initialise it)")
    return f"still NaN/Inf at step {r.failed_at}"


def _short_of_fault(r: Replay, last: int, fault_step: int, kept_only: bool) -> str | None:
    """A finite replay that stopped before it passed the fault step (but on the faulty batch, the last one the
    probe kept) shows nothing."""
    if last < fault_step or (last == fault_step and not kept_only):
        why = "the data ran out" if r.ended else "the time budget ran out"
        return f"{why} before the replay passed the fault step"
    return None


def _loss_not_recovered(r: Replay, before: float | None) -> str | None:
    """A finite replay whose loss grew far above where it started, or stays huge, is no fix."""
    before = before if before is not None else first_loss(r)
    after = loss_after(r)
    if before is not None and after is not None and after > BLOW_UP * max(abs(before), 1e-3):
        return f"finite, but the loss grew from {before:.3g} to {after:.3g}"
    if after is not None and abs(after) > STUCK:
        return f"finite, but the loss stays at {after:.3g}: training does not recover"
    return None


def _loss_out_of_range(r: Replay, fault_step: int, span: tuple[float, float] | None,
                       what: str = "the fault") -> str | None:
    """A finite replay whose loss, after the fault step, left the range the run's healthy steps had by far
    (BLOW_UP times that range's scale beyond either end) is no fix: a guard that clamps `exp` inside a
    hand-written log-sum-exp leaves the target's logit unbounded, and the loss reads -3e6, finite and
    meaningless. The fault step itself may read high: its batch is the one that overflowed, now clamped."""
    if span is None:
        return None
    lo, hi = span
    reach = BLOW_UP * max(hi - lo, abs(lo), abs(hi), 1e-3)
    out = [(i, v) for i, v in enumerate(r.losses) if r.start_step + i > fault_step and math.isfinite(v)
           and not lo - reach <= v <= hi + reach]
    if not out:
        return None
    i, v = max(out, key=lambda iv: abs(iv[1]))
    return (f"finite, but the loss reached {v:.3g} at step {r.start_step + i}, far outside the {lo:.3g} to "
            f"{hi:.3g} of the steps before {what}: the change broke the loss rather than fixing the run")


def healthy_span(report: Report, fault_step: int) -> tuple[float, float] | None:
    """The lowest and highest finite loss of the probe's own steps before the fault (None: none recorded)."""
    vals = [p.loss for p in report.timeline if p.step < fault_step and p.loss is not None and math.isfinite(p.loss)]
    return (min(vals), max(vals)) if vals else None


def _dodged_nan_weight(r: Replay, c: Candidate) -> str | None:
    """Samples left out around a weight the report found NaN (param.nonfinite) that still holds NaN/Inf:
    finite only because no batch the replay read reached it again (now that a record is left out in every
    epoch), so the samples were never the cause; the weight is."""
    if c.remedy != "drop_samples" or not set(r.still_nonfinite) & c.nan_weights:
        return None
    held = _held(r)
    last = r.start_step + r.steps_run - 1
    return (f"finite through step {last} only because no later batch read the weight again: {held}; leaving "
            "samples out cannot repair a NaN weight, and any later batch that reads it goes NaN (re-initialise it)")


def _fixed_note(r: Replay, fault_step: int, end_step: int, last: int, kept_only: bool) -> str | None:
    """What a fixed replay's evidence does not cover: the steps it did not reach, and NaN weights no batch
    read again."""
    note = None
    if kept_only:
        note = (f"finite on the faulty batch (step {fault_step}), the last the probe kept: {r.data_note}, so no "
                "step after it was replayed")
    elif last < end_step - 1 and r.data_note:
        note = f"finite through step {last}, the last batch the probe kept: {r.data_note}"
    elif last < end_step - 1:
        note = f"finite through step {last} (stopped early: {'data' if r.ended else 'time'} ran out)"
    held = _held(r)
    if held:  # e.g. samples dropped around a NaN embedding row: finite only while no batch reads it
        note = (f"{note or f'finite through step {last}'}, but {held}: this holds only while no "
                "later batch reads it (re-initialise it to be safe)")
    return note


def _held(r: Replay) -> str:
    """'model.embed_tokens.weight still holds 64 NaN/Inf value(s)': the weights a replay left non-finite."""
    return ", ".join(f"{name} still holds {n} NaN/Inf value(s)" for name, n in list(r.still_nonfinite.items())[:3])


def first_loss(r: Replay) -> float | None:
    return r.losses[0] if r.losses else None


def baseline_loss(report: Report, step: int) -> float | None:
    """The probe's own loss level where a replay starts: the median of its last 3 finite losses up to `step`."""
    vals = [p.loss for p in report.timeline if p.step <= step and p.loss is not None and math.isfinite(p.loss)][-3:]
    return sorted(vals)[len(vals) // 2] if vals else None


def loss_after(r: Replay) -> float | None:
    tail = r.losses[-3:]
    return sum(tail) / len(tail) if tail else None


def fault_reproduced(control: Replay | None, fault: Any) -> bool | None:
    """Whether the replay without any change met the fault where the probe did: an update fault shows in the
    next step's loss, any other fault at its own step. None: unknown (no control, or it ran out of time)."""
    if control is None or control.cut:
        return None
    late = 1 if fault.kind == FaultKind.UPDATE else 0
    return not control.finite and control.failed_at is not None and control.other_data_at is None and \
        fault.step <= control.failed_at <= fault.step + late


def unverified_note(control: Replay | None, reproduced: bool | None, ring: SnapshotRing, fault_step: int) -> str:
    """Why no remedy can be called verified: the replay without any change did not meet the fault at its step
    on the training's batch."""
    tail = ", so no replay is evidence for or against a remedy"
    if control is None:
        return "no replay without any change could start (no state before the fault to restart from)" + tail
    if control.not_applicable:
        return control.not_applicable
    if control.cut:
        return f"the replay without any change ran out of time before the fault step ({fault_step})" + tail
    said = f"the replay without any change did not reproduce the fault at step {fault_step}"
    if control.other_data_at is not None:
        return (f"{said}: it read another batch at step {control.other_data_at} than the training did (the loader "
                f"gave other data when re-read: {_why_other(control)})" + tail)
    data = control.data_note or getattr(ring.batches, "stream", None)
    last = control.start_step + control.steps_run - 1
    if control.failed_at is not None:
        seen = f"it stopped at step {control.failed_at}"
    elif control.ended:
        seen = f"its data ended after step {last}"
    else:
        seen = "it stayed finite"
    if data:
        return f"{said} ({seen}): {data}" + tail
    return f"{said} on the same batches ({seen}; a nondeterministic run)" + tail


def _with_replay(r: Replay, before: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """(step, loss) of the run up to where the replay began, then the replay's: what each loss rule reads again."""
    return [(s, v) for s, v in before if s < r.start_step] + [(r.start_step + i, v) for i, v in enumerate(r.losses)]


def divergence_of(r: Replay, before: list[tuple[int, float]]) -> Any:
    """loss_trend's divergence (the one rule) on the run's losses with the replay's in place of the run's from
    where it began (diagnosis/loss_trend.Divergence), or None: the loss no longer diverges."""
    from nandoctor.diagnosis.loss_trend import find_divergence

    series = _with_replay(r, before)
    return find_divergence([s for s, _ in series], [v for _, v in series])


def judge_divergence(r: Replay, c: Candidate, before: list[tuple[int, float]], end_step: int,
                     span: tuple[float, float] | None) -> tuple[str, str | None]:
    """A replay against a divergence without a fault: fixed when it reached the probe's last step (`end_step` - 1)
    finite, within the healthy steps' range (`span`), and the divergence rule no longer fires on the run's losses
    with the replay's from its start; else not fixed, saying what the loss did."""
    unjudged = _no_evidence(r, c)
    if unjudged is not None:
        return unjudged
    if not r.finite:
        return NOT_FIXED, f"NaN/Inf at step {r.failed_at}"
    last = r.start_step + r.steps_run - 1
    if last < end_step - 1:
        return NOT_APPLICABLE, f"the data ran out at step {last}, before the probe's last step ({end_step - 1})"
    d = divergence_of(r, before)
    if d is not None:
        return NOT_FIXED, (f"the loss still diverged: from {d.min_loss:.3g} at step {d.min_step} it rose from step "
                           f"{d.start_step} to {d.level:.3g} over the last {d.stretch} steps ({d.ratio:.3g}x)")
    broke = _loss_out_of_range(r, r.start_step - 1, span, "the growth began")
    if broke is not None:
        return NOT_FIXED, broke
    from nandoctor.diagnosis.loss_trend import DIVERGE_RATIO, final_rise

    rise = final_rise([v for _, v in _with_replay(r, before)])
    if rise is None or rise[1] <= 0:
        return FIXED, f"no divergence through step {last}"
    level, lowest = rise
    said = (f"the median of its last steps' losses is {level:.3g}, {level / lowest:.3g}x the run's smoothed minimum "
            f"({lowest:.3g})")
    if level >= DIVERGE_RATIO * lowest:  # noisy, but several-fold up at the end: not back in the healthy range
        return NOT_FIXED, f"the loss still ended several-fold above its minimum: {said}"
    return FIXED, f"no divergence through step {last}: {said}"


# ---- a run whose only signs are precursors or a loss spike (issue 35): each warning's own rule, replayed ----

Series = dict[tuple[str, str], list[tuple[int, float]]]


def replayed_series(run: Series, r: Replay) -> Series:
    """The run's precursor series with the replay's samples in place from where the replay began (its change's
    first step): the early level stays the run's, the growth is the replay's."""
    keys = set(run) | set(r.precursors)
    return {k: [(s, v) for s, v in run.get(k, []) if s < r.start_step]
            + [(s, v) for s, v in r.precursors.get(k, []) if s >= r.start_step] for k in keys}


def replayed_spikes(r: Replay, before: list[tuple[int, float]]) -> list[Any]:
    """loss_trend's spikes (the one rule) on the run's losses with the replay's in place from its start, those
    whose elevated steps reach into the replayed stretch."""
    from types import SimpleNamespace

    from nandoctor.diagnosis.loss_trend import find_spikes

    spikes = find_spikes([SimpleNamespace(step=s, loss=v) for s, v in _with_replay(r, before)])
    return [s for s in spikes if s.end_step >= r.start_step]


def still_warned(f: Any, r: Replay, before: list[tuple[int, float]], run: Series, anywhere: bool) -> str | None:
    """What the warning `f`'s own rule finds on the replayed steps: a sentence, or None when it does not fire.
    A precursor's rule is read at `f`'s layer, or (`anywhere`) at every layer of its quantity, as the report would
    read it again; a spike's on the replayed losses."""
    from nandoctor.engine.precursor_rules import growth_of
    from nandoctor.findings import Code

    if f.code == Code.LOSS_SPIKE:
        spikes = replayed_spikes(r, before)
        return None if not spikes else (f"the loss still spiked from step {spikes[0].start_step}, up to "
                                        f"{spikes[0].peak:.3g} ({spikes[0].peak / spikes[0].baseline:.3g}x the median "
                                        "before it)")
    series = replayed_series(run, r)
    quantity = f.evidence.get("quantity")
    layers = sorted({layer for q, layer in series if q == quantity}) if anywhere else [f.location.layer]
    for layer in layers:
        g = growth_of(f.code, layer, series)
        if g is not None:
            return (f"{f.code.value} still fired at layer {layer}: it grew {g.ratio:.3g}x from step {g.start_step}, "
                    f"past the threshold at step {g.alarm_step}")
    return None


def judge_precursors(r: Replay, c: Candidate, before: list[tuple[int, float]], end_step: int,
                     span: tuple[float, float] | None, warnings: list[Any], run: Series) -> tuple[str, str | None]:
    """A replay against precursor warnings or a loss spike without a fault or a divergence: fixed when no spike
    rises in the replayed stretch, the loss stays in the healthy range (judge_divergence: finite to the last step,
    no divergence, no blow-up), and no warning's own rule fires again on the replayed steps (at any layer)."""
    reached = r.finite and r.start_step + r.steps_run >= end_step and _no_evidence(r, c) is None
    spikes = replayed_spikes(r, before) if reached else []
    if spikes:  # (said first: a spike's top is out of the healthy range too, and the spike is what happened)
        s = spikes[0]
        when = f"at step {s.start_step}" if s.start_step == s.end_step else f"from step {s.start_step} to {s.end_step}"
        return NOT_FIXED, (f"the loss still spiked {when}, up to {s.peak:.3g} at step {s.peak_step} "
                           f"({s.peak / s.baseline:.3g}x the median before it)")
    outcome, note = judge_divergence(r, c, before, end_step, span)
    if outcome != FIXED:
        return outcome, note
    said = {id(f): still_warned(f, r, before, run, anywhere=True) for f in warnings}
    fired = [s for s in said.values() if s]
    quiet = ", ".join(f"{f.code.value}" + (f" at {f.location.layer}" if f.location.layer else "") for f in warnings
                      if not said[id(f)])
    if fired:
        return NOT_FIXED, "; ".join(fired) + (f" (no longer warned: {quiet})" if quiet else "")
    return FIXED, f"no longer warned ({quiet}) through step {end_step - 1}; {note}" if note else \
        f"no longer warned ({quiet}) through step {end_step - 1}"
