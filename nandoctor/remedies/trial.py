"""Verified remedies: after a fault, replay the training with each candidate fix and keep the evidence.

The candidates follow from what the probe found: an epsilon/clamp for the faulting op, dropping the
offending samples, re-drawing the NaN rows of a weight named by param.nonfinite, re-initialising weights
named by param.init_scale, gradient clipping at a threshold from the norms before the fault, learning
rate x0.1 and a linear warmup. Each restarts from a snapshot (snapshots.py): the failing step itself for
op, sample and NaN-row remedies, the state before the growth began for divergence remedies, the first
step for warmup and re-initialisation. A run that stays finite to
`end_step` without its loss blowing up is `fixed`. A replay without any change (the control) checks
that the fault reproduces at all. A run whose loss diverged without a fault gets the step-size remedies
replayed to its last step (divergence.py). The replays are bounded in steps (REPLAY_STEPS_FACTOR times the
steps they replay to, in all), so what is tried and concluded is the same on every run; a seconds limit
(`safety_seconds`) is only a safety net against a machine far slower than when the probe ran, and a replay it
stops is said to be stopped by it, never judged. The candidates are made in candidates.py, each replay is
judged in judging.py.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any

from nandoctor.engine.op_guards import limit_of
from nandoctor.engine.replay import Change, Replay, replay
from nandoctor.engine.snapshots import Snapshot, SnapshotRing, restore
from nandoctor.engine.watcher import FaultKind
from nandoctor.findings import Code, Report
from nandoctor.progress import ProgressFn, no_progress
from nandoctor.remedies.candidates import (
    SYMPTOMS,
    Candidate,
    candidates_for,
    conclusive_norms,
    fault_fields,
    skip_list_of,
)
from nandoctor.remedies.guard import (
    elsewhere_note,
    guard_info,
    guard_text,
    replay_guard,
    scope_note,
    source_clamp_text,
)
from nandoctor.remedies.judging import (
    FIXED,
    NOT_APPLICABLE,
    NOT_FIXED,
    baseline_loss,
    fault_reproduced,
    first_loss,
    healthy_span,
    loss_after,
    unverified_note,
)
from nandoctor.remedies.judging import judge as _judge  # the name tests/test_remedies.py imports from here

FIX_STEPS = 20  # replays run to the fault step + this many steps
# The replays' bound: in all, this many times the steps they replay to (the fault step + FIX_STEPS, or a diverged
# run's last step), counted as planned before each replay runs: what is tried never follows the machine's load
REPLAY_STEPS_FACTOR = 8
# The time the remedies are expected to take: a few times the probe's own run (at least MIN_BUDGET_SECONDS). It
# decides nothing: the safety net is SAFETY_FACTOR times it (at least SAFETY_MIN_SECONDS), reached only on a
# machine far slower than when the probe ran; a replay it stops is reported as stopped by it, with no verdict
MIN_BUDGET_SECONDS = 20.0
BUDGET_FACTOR = 4.0
SAFETY_MIN_SECONDS = 900.0
SAFETY_FACTOR = 10.0
# Tests only: the time budget forced, in seconds (a loaded machine's small one, a quiet one's large one)
BUDGET_ENV = "NANDOCTOR_REMEDY_SECONDS"


def time_budget(probe_seconds: float) -> float:
    """The remedies' expected time in seconds (BUDGET_ENV when a test forces it)."""
    raw = os.environ.get(BUDGET_ENV, "").strip()
    try:
        return max(0.0, float(raw))
    except ValueError:
        return max(MIN_BUDGET_SECONDS, BUDGET_FACTOR * probe_seconds)


def safety_seconds(budget: float) -> float:
    """The seconds after which the replays stop whatever they found: a safety net, far above the budget."""
    return max(SAFETY_MIN_SECONDS, SAFETY_FACTOR * budget)


def try_remedies(report: Report, res: Any, workload: Any, optimizer: Any, ring: SnapshotRing, *,
                 fix_steps: int = FIX_STEPS, probe_seconds: float = 0.0, amp: bool = False,
                 device: str = "cpu", progress: ProgressFn = no_progress) -> None:
    """Fill `report.remedies` (verified first) and `report.details['remedies']`; the model and RNG are put
    back as they were. Only faults with a training state to restart from are tried."""
    fault = res.fault
    if fault is None or fault.kind not in ("nonfinite", "update", "data"):
        return
    if amp and device != "cpu":  # the replays do not drive a GradScaler yet: they would not be the user's run
        report.details["remedies"] = {"note": "remedies are not replayed under AMP on a GPU yet (the replays do "
                                      "not drive the GradScaler); run with amp.enabled: false to have them tried"}
        return
    t0 = time.perf_counter()
    entry = ring.take(fault.step, fault.epoch, fault.batch_index or 0)  # to put back afterwards
    here = _fault_snapshot(fault, ring, entry)
    end_step = fault.step + max(1, fix_steps)
    trial = Trial(report, fault, workload, optimizer, ring, end_step, t0, time_budget(probe_seconds),
                  _fault_batch(fault, workload, ring), span=healthy_span(report, fault.step),
                  steps_left=REPLAY_STEPS_FACTOR * end_step)
    records = getattr(res, "records", None)
    cands = candidates_for(report, fault, workload, ring, here, amp,
                           norms=conclusive_norms(records) if records else None)
    # The fault's batch has served (localisation, findings, the candidates' texts; a bundle took its own
    # copy): the replays read the batch again, so holding this one too keeps a second copy of a batch alive
    # through every replay (the loop's watcher and step engine must let it go as well for it to be freed).
    fault.fields = None
    try:
        control = _control(trial, cands, progress)
        rows = _try_all(trial, cands, control, progress)
    finally:  # the weights, optimizer state and RNG as the probe left them, whatever stopped the replays
        restore(entry, workload.model, optimizer)
        entry.rng.restore()
    reproduced = fault_reproduced(control, fault)
    why = None if reproduced else unverified_note(control, reproduced, ring, fault.step)
    if why is not None:  # a replay that never met the fault says nothing about a remedy, either way
        _unverify(rows, why)
    _record(trial, rows, control, reproduced, probe_seconds, fix_steps)
    if why is not None and control is not None:
        report.details["remedies"]["control"]["note"] = why


@dataclass
class Trial:
    """What every replay of one fault shares: the probe's report and fault, the run to replay, the step a
    replay must reach, and the time all of them may take from `t0`."""

    report: Report
    fault: Any
    workload: Any
    optimizer: Any
    ring: SnapshotRing
    end_step: int
    t0: float
    budget: float  # the remedies' expected seconds (time_budget): only the safety net follows from it
    expect: tuple[int, str] | None = None  # the fault's step and its batch's fingerprint (replay.Replay.expect)
    elsewhere: bool = False  # the control saw the guarded op overflow at another call as well
    span: tuple[float, float] | None = None  # the loss range of the probe's steps before the fault (healthy_span)
    steps_left: int = 0  # replayed steps the replays may still take (REPLAY_STEPS_FACTOR)
    steps_budget: int = 0  # ... of this many in all
    time_limit_hit: bool = False  # the safety net stopped a replay, or kept one from starting
    # makes a fresh precursor monitor for each replay (engine/precursors.py), when the replays are judged by the
    # precursors' own rules (divergence.py); None: no sampling
    sampler: Any = None

    def __post_init__(self) -> None:
        self.steps_budget = self.steps_budget or self.steps_left

    @property
    def deadline(self) -> float:
        return self.t0 + safety_seconds(self.budget)

    def past_deadline(self) -> bool:
        """Whether the safety net has been reached (and so said in the report)."""
        if time.perf_counter() > self.deadline:
            self.time_limit_hit = True
        return self.time_limit_hit

    def details(self, control: Replay | None, reproduced: bool | None, probe_seconds: float) -> dict[str, Any]:
        """What the replays were, for the report's details: time and step budgets spent, and the control."""
        return {"seconds": round(time.perf_counter() - self.t0, 3), "budget_seconds": round(self.budget, 1),
                "safety_seconds": round(safety_seconds(self.budget), 1), "time_limit_hit": self.time_limit_hit,
                "replayed_steps": self.steps_budget - self.steps_left, "step_budget": self.steps_budget,
                "probe_seconds": round(probe_seconds, 3), "end_step": self.end_step,
                "control": None if control is None else {"start_step": control.start_step, "reproduced": reproduced,
                                                         "failed_at": control.failed_at}}

    def charge(self, start: Snapshot, end_step: int) -> str | None:
        """Take a replay from `start` to `end_step` out of the step budget; why not when it does not fit."""
        planned = max(0, end_step - start.step)
        if planned > self.steps_left:
            return (f"not tried: the remedies' step budget ({self.steps_budget} replayed steps, "
                    f"{REPLAY_STEPS_FACTOR}x the {self.end_step} steps replayed to) was spent")
        self.steps_left -= planned
        return None

    def run_from(self, start: Snapshot, change: Change) -> Replay:
        """A replay with `change` from `start` to `end_step`, when the step budget has room for it (else a replay
        that did not run, saying so); the safety net may stop it (`Replay.cut`)."""
        spent = self.charge(start, self.end_step)
        if spent is not None:
            return Replay(start.step, finite=False, not_applicable=spent)
        if self.fault is not None:  # (a divergence's replays have no fault)
            change = _at_the_fault(change, start, self.fault.step)
        r = replay(self.workload, self.optimizer, self.ring, start, self.end_step, change, self.deadline,
                   expect=self.expect, sample=self.sampler() if self.sampler is not None else None)
        self.time_limit_hit = self.time_limit_hit or r.cut
        return r


def _at_the_fault(change: Change, start: Snapshot, fault_step: int) -> Change:
    """A guard or clamp replayed from a snapshot before the fault (an update fault, or live weights already
    unsound) applies from the fault's step on: which snapshot the ring held there follows the snapshots'
    measured spacing, and the row's start and verdict must not (the same report on every run)."""
    if change.from_step is not None or start.step >= fault_step or (change.guard is None
                                                                     and change.clamp_output is None):
        return change
    return dataclasses.replace(change, from_step=fault_step)


def _control(trial: Trial, cands: list[Candidate], progress: ProgressFn) -> Replay | None:
    """The replay without any change, from the earliest state a candidate restarts from to just past the
    fault: does the fault come back? None: no candidate has a state to restart from."""
    fault = trial.fault
    control_start = min((c.start for c in cands if c.start is not None), key=lambda s: s.step, default=None)
    if control_start is None:
        return None
    progress(0, None, "replaying without any change (does the fault come back?)")
    trial.charge(control_start, fault.step + 2)  # (the control always runs: without it no replay is evidence)
    r = replay(trial.workload, trial.optimizer, trial.ring, control_start, fault.step + 2, Change(),
               trial.deadline, watch=_watch(cands, fault.step), expect=trial.expect)
    trial.time_limit_hit = trial.time_limit_hit or r.cut
    return r


def _fault_batch(fault: Any, workload: Any, ring: SnapshotRing) -> tuple[int, str] | None:
    """The fault's step and the fingerprint of the batch the training read there (the one the probe kept, else
    the fault's own fields), for every replay to check it reads that batch too; None: no batch to check by."""
    from nandoctor.tensors.fingerprint import batch_fingerprint

    if fault.batch_index is None:  # (where the batch came in its epoch is unknown: nothing to check against)
        return None
    found = batch_fingerprint(fault_fields(fault, workload, ring))
    return None if found is None else (fault.step, found)


def _try_all(trial: Trial, cands: list[Candidate], control: Replay | None,
             progress: ProgressFn) -> list[dict[str, Any]]:
    """One row per candidate, in the candidates' order, each replayed in turn while the budget lasts; after a
    clamp that did not help, the clamp where the value is made."""
    healthy = _healthy_max(control, trial.fault.step)
    # the value overflows the op at another call too: a tighter clamp at this one cannot help, so none is searched
    trial.elsewhere = bool(control is not None and control.overflows)
    rows: list[dict[str, Any]] = []
    tried = [c for c in cands if c.why_not is None and c.start is not None]
    for c in cands:
        if c in tried:  # the display says what runs, not the probe's last step
            k = tried.index(c) + 1
            progress(k, len(tried), f"trying remedy {k}/{len(tried)}: {c.remedy}")
        rows.append(_try_one(trial, c, healthy))
        if c.remedy == "op_guard" and rows[-1]["outcome"] == NOT_FIXED and control is not None:
            rows += _at_the_source(trial, c, rows[-1], control)
    return rows


def _try_one(trial: Trial, c: Candidate, healthy: float | None) -> dict[str, Any]:
    """A candidate's row: not applicable without a replay (no state to restart from, the step budget spent, or
    the safety net reached), else its replay judged, the note saying what a guard's search did."""
    if c.why_not is None and trial.past_deadline():
        c.why_not = safety_note(trial.budget)
    if c.why_not is not None or c.start is None:
        return remedy_row(c, NOT_APPLICABLE, None, note=c.why_not or "no state to restart from")
    r, searched = _replay_candidate(trial, c, c.start, healthy)
    before = baseline_loss(trial.report, r.start_step)
    outcome, note = _judge(r, trial.fault.step, trial.end_step, c, before, trial.span)
    widened = scope_note(c.change, r)
    # widened scope; then the threshold search; then the verdict's own note
    note = "; ".join(n for n in (widened, searched, note) if n) or None
    return remedy_row(c, outcome, r, note=note, before=before)


def _replay_candidate(trial: Trial, c: Candidate, start: Snapshot,
                      healthy: float | None) -> tuple[Replay, str | None]:
    """The candidate's replay, and what a threshold search tried. A guard's scope is widened past the
    reported line while it never fired, its clamp tightened while it does not verify: the candidate's change
    and text become what ran."""

    def run(change: Change) -> Replay:
        return trial.run_from(start, change)

    if c.change.guard is None:
        return run(c.change), None
    r, c.change, searched = _search_guard(run, c, trial.report, trial.fault.step, trial.end_step, healthy,
                                          trial.elsewhere)
    c.change_text = guard_text(c.change, r)
    c.extra["guard"] = guard_info(c.change, r)
    return r, searched


def _at_the_source(trial: Trial, c: Candidate, row: dict[str, Any], control: Replay) -> list[dict[str, Any]]:
    """A clamp at the reported line that did not help, because the value also overflows the op at another
    call: the row says so, and the layer output that feeds them is clamped where it is made, its bound
    searched as the guard's (a `source_clamp` row), when the watch found that layer."""
    guard = c.change.guard
    top = limit_of(guard.op) if guard is not None else None
    if guard is None or top is None or c.start is None:
        return []
    said = elsewhere_note(guard.op, control.overflows, control.source_layer)
    if said:
        row["note"] = "; ".join(n for n in (said, row["note"]) if n)
    layer = control.source_layer
    if layer is None or trial.past_deadline():
        return []
    before = baseline_loss(trial.report, c.start.step)
    cand = Candidate("source_clamp", "", Change(), c.start, accumulate=c.accumulate)
    tried: list[str] = []
    for limit in _limits(top, None):
        cand.change = Change(clamp_output=(layer, limit))
        r = trial.run_from(c.start, cand.change)
        outcome, note = _judge(r, trial.fault.step, trial.end_step, cand, before, trial.span)
        cand.extra["threshold"] = limit
        if outcome != NOT_FIXED or r.error is not None or trial.past_deadline():
            break
        tried.append(f"clipped at {limit:g}: {note}")
    cand.change_text = source_clamp_text(guard.op, layer, limit, c.change.source, control.overflows)
    note = "; ".join(n for n in ("; ".join(tried), note) if n) or None
    row = remedy_row(cand, outcome, r, note=note, before=before)
    row["clamp"] = {"layer": layer, "max": limit}  # what reproduce.py --with-remedy source_clamp applies
    return [row]


def _unverify(rows: list[dict[str, Any]], why: str) -> None:
    """Every replayed row made not applicable, saying `why` (and with no skip list: nothing was shown)."""
    for row in rows:
        if row["outcome"] != NOT_APPLICABLE:
            row["outcome"], row["note"] = NOT_APPLICABLE, why
            row.pop("skip_list", None)
            row.pop("failed_at", None)  # (where a replay of unverified data failed is no evidence either)


def _record(trial: Trial, rows: list[dict[str, Any]], control: Replay | None, reproduced: bool | None,
            probe_seconds: float, fix_steps: int) -> None:
    """The rows in the report, verified first; what the replays were in its details; the advice marked."""
    report, ring = trial.report, trial.ring
    report.remedies = verified_first(rows)
    report.details["remedies"] = {**trial.details(control, reproduced, probe_seconds), "fix_steps": fix_steps,
                                  "data": _data_note(ring)}
    report.details["snapshots"] = ring.summary()  # now with the fault-time snapshot's epoch kept
    _mark_advice(report, rows, trial.fault.step)


def verified_first(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows sorted in place, verified first (stable: the practitioner's order within each outcome)."""
    order = {FIXED: 0, NOT_FIXED: 1, NOT_APPLICABLE: 2}
    rows.sort(key=lambda r: order[r["outcome"]])
    return rows


def verdict_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The advice lines a finding gets from the replays of its remedies: which fixed it, which did not help."""
    lines = [f"Verified by replay ({r['remedy']}): {r['change']}" for r in rows if r["outcome"] == FIXED]
    return lines + [f"Tried by replay, did not help ({r['remedy']}): {r['change']}" for r in rows
                    if r["outcome"] == NOT_FIXED]


def safety_note(budget: float) -> str:
    """Why a replay has no verdict: the safety net stopped it (a machine far slower than when the probe ran)."""
    return (f"not judged: nandoctor's safety time limit ({safety_seconds(budget):.0f} s) stopped the replays (the "
            "machine ran far slower than during the probe); run the probe again on a quieter machine for a verdict")


_MAX_LIMITS = 6  # clamps a threshold search tries: the rule's bound, then halved


def _watch(cands: list[Candidate], fault_step: int) -> tuple[Any, str | None, int] | None:
    """The op of a clamp whose bound may be searched (exp), for the control replay to record its inputs (and,
    from the fault's step, its other calls that overflow)."""
    c = next((c for c in cands if c.change.guard is not None and c.why_not is None and c.start is not None), None)
    if c is None or limit_of(c.change.guard.op) is None:
        return None
    return c.change.guard, c.change.source, fault_step


def _healthy_max(control: Replay | None, fault_step: int) -> float | None:
    """The largest input the watched op got on the steps before the fault (what a clamp must leave alone)."""
    import math

    vals = [v for s, v in (control.observed if control is not None else []) if s < fault_step and math.isfinite(v)]
    return max(vals) if vals else None


def _limits(top: float, healthy: float | None) -> list[float]:
    """The rule's bound, then halved while it stays above what the healthy steps used (and above 1)."""
    out = [top]
    floor = max(healthy if healthy is not None else 0.0, 1.0)
    while len(out) < _MAX_LIMITS and out[-1] / 2 > floor:
        out.append(out[-1] / 2)
    return out


def _search_guard(run: Any, c: Candidate, report: Report, fault_step: int, end_step: int,
                  healthy: float | None, elsewhere: bool = False) -> tuple[Replay, Change, str | None]:
    """The guard's replay; for a clamp with an upper bound (exp's 60), tighter bounds while it does not
    verify: a value clamped at 60 can still overflow where it is squared downstream (a VAE's std); not when
    the value overflows the op at another call too (`elsewhere`: no bound at this call can help). Returns
    the last replay, its change, and what the search tried (for the row's note)."""
    import dataclasses

    top = limit_of(c.change.guard.op) if c.change.guard is not None else None
    if top is None:
        r, change = replay_guard(run, c.change)
        return r, change, None
    tried: list[tuple[float, str]] = []
    for limit in _limits(top, healthy)[:1 if elsewhere else None]:
        r, change = replay_guard(run, dataclasses.replace(c.change, guard_limit=limit))
        outcome, note = _judge(r, fault_step, end_step, dataclasses.replace(c, change=change),
                               baseline_loss(report, r.start_step), healthy_span(report, fault_step))
        c.extra["threshold"] = limit
        tried.append((limit, outcome if outcome == FIXED else (note or outcome)))
        if outcome != NOT_FIXED or not r.guard_calls or r.error is not None:
            break
    if len(tried) == 1:
        return r, change, None
    op = change.guard.op if change.guard is not None else "op"
    seen = f" (the healthy steps' largest {op} input: {healthy:.3g})" if healthy is not None else ""
    failed = "; ".join(f"clamped at {lim:g}: {why}" for lim, why in tried[:-1])
    last = "verified at" if tried[-1][1] == FIXED or tried[-1][1] is None else "last tried"
    return r, change, f"threshold searched from {top:g} down{seen}: {failed}; {last} {tried[-1][0]:g}"


def _data_note(ring: SnapshotRing) -> str:
    """What the replays read: the batches the probe kept, or the user's loader again (and why)."""
    tape = ring.batches
    if tape is None:
        return ("the batches were not kept (a resumed run): each replay re-read the user's loader from its "
                "snapshot's position")
    said = ("the replays ran on the batches the probe read (kept in memory, not read again); past them the "
            "loader was read once more, checked against the kept batches, and kept for the next replay")
    if tape.evicted:
        said += (f"; {tape.evicted} batch(es) beyond the {(tape.cap or 0) / 2**20:.3g} MB kept were let go: a "
                 "replay before them re-read the loader there")
    if tape.stream:
        said += f"; {tape.stream}, so the replays ended with the kept batches"
    return said


def _fault_snapshot(fault: Any, ring: SnapshotRing, entry: Snapshot) -> Snapshot | None:
    """The state right before the failing step: the live weights for a loss/gradient/data fault (the
    optimizer never stepped on it), with the step's RNG; for an update fault, the ring's last snapshot
    before the update (the live weights already hold the NaN)."""
    if fault.kind == FaultKind.UPDATE:
        first = fault.update_range[0] if fault.update_range else fault.step
        return ring.latest(first)
    if not ring.sound(entry):
        return ring.latest(fault.step)
    if fault.rng is None:
        return entry
    from nandoctor.engine.snapshots import RngState

    return dataclasses.replace(entry, rng=RngState(fault.rng, entry.rng.numpy, entry.rng.python))


def remedy_row(c: Candidate, outcome: str, r: Replay | None, note: str | None,
               before: float | None = None) -> dict[str, Any]:
    """One contract row; `loss_before` is the probe's own loss where the replay started (else the replay's
    first), `loss_after` the replay's mean over its last 3 steps."""
    if r is not None and before is None:
        before = first_loss(r)
    row: dict[str, Any] = {"remedy": c.remedy, "change": c.change_text, "outcome": outcome,
                           "steps_run": r.steps_run if r else 0,
                           "loss_before": before, "loss_after": loss_after(r) if r else None,
                           "seconds": round(r.seconds, 3) if r else 0.0,
                           "start_step": r.start_step if r else None, "note": note}
    if r is not None and not r.finite:
        row["failed_at"] = r.failed_at
    for key in ("guard", "z_loss", "qk_norm"):  # what the replay applied, whatever its outcome
        if key in c.extra:
            row[key] = c.extra[key]
    if "spec_change" in c.extra:  # what `change` says, as spec key -> value (report/remedies_text.py)
        row["spec_change"] = c.extra["spec_change"]
    if outcome == FIXED:
        row.update(c.extra)
        if r is not None and r.dropped:
            row["skip_list"] = skip_list_of(r.dropped, c.accumulate)
            named = next((k for k in ("records", "fingerprints") if k in c.extra), None)
            if named is not None:  # the records themselves: what to filter out, whatever epoch reads them
                for entry, ids in zip(row["skip_list"]["batches"], r.dropped_records):
                    entry[named] = ids
                row["skip_list"] = {named: c.extra[named], **row["skip_list"]}
    elif "threshold" in c.extra:
        row["threshold"] = c.extra["threshold"]
    return row


_CAUSE_OF = {"grad_clip": Code.GRAD_EXPLOSION, "lr_x0.1": Code.GRAD_EXPLOSION, "warmup": Code.GRAD_EXPLOSION,
             "reinit": Code.PARAM_INIT_SCALE, "reinit_rows": Code.PARAM_NONFINITE,
             "z_loss": Code.OUTPUT_LOGIT_DIVERGENCE, "qk_norm": Code.ATTENTION_LOGIT_GROWTH}


def _mark_advice(report: Report, rows: list[dict[str, Any]], fault_step: int) -> None:
    """The advice lists say which change was verified by replay and which did not help: the fault's own
    finding lists every replayed remedy first, a cause's finding (grad.explosion, param.init_scale) its
    own after its advice."""
    symptom = next((f for f in report.findings if f.location.step == fault_step and f.code in SYMPTOMS), None)
    for finding in report.findings:
        if finding is symptom:
            mine = rows
        else:
            mine = [r for r in rows if _CAUSE_OF.get(r["remedy"]) == finding.code]
        lines = verdict_lines(mine)
        if not lines:
            continue
        kept = [a for a in finding.advice if not a.startswith(("Verified by", "Tried by"))]
        # the fault's own finding leads with the evidence; a cause's finding keeps its advice first
        finding.advice = lines + kept if finding is symptom else kept + lines
