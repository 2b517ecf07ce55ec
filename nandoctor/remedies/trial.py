"""Verified remedies: after a fault, replay the training with each candidate fix and keep the evidence.

The candidates follow from what the probe found: an epsilon/clamp for the faulting op, dropping the
offending samples, re-drawing the NaN rows of a weight named by param.nonfinite, re-initialising weights
named by param.init_scale, gradient clipping at a threshold from the norms before the fault, learning
rate x0.1 and a linear warmup. Each restarts from a snapshot (snapshots.py): the failing step itself for
op, sample and NaN-row remedies, the state before the growth began for divergence remedies, the first
step for warmup and re-initialisation. A run that stays finite to
`end_step` without its loss blowing up is `fixed`. A replay without any change (the control) checks
that the fault reproduces at all. Time is bounded by a budget of a few times the probe's own run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from nandoctor.engine.op_guards import guard_for, limit_of
from nandoctor.engine.replay import Change, Replay, replay
from nandoctor.engine.snapshots import Snapshot, SnapshotRing, restore
from nandoctor.engine.warnings import CLIP_FACTOR
from nandoctor.engine.watcher import FaultKind
from nandoctor.findings import Code, Report
from nandoctor.progress import ProgressFn, no_progress
from nandoctor.remedies import changes as rt
from nandoctor.remedies.guard import guard_info, guard_text, never_fired, replay_guard, scope_note
from nandoctor.remedies.weights import init_stds, nan_rows, rows_text

FIX_STEPS = 20  # replays run to the fault step + this many steps
MIN_BUDGET_SECONDS = 20.0
BUDGET_FACTOR = 4.0  # remedies may take this many times the probe's own run (at least MIN_BUDGET_SECONDS)
STUCK = 1e10  # a finite loss still this large is not a recovered run (an exp clamped at its limit)
BLOW_UP = 10.0  # a finite run whose loss ends this many times above where it started is not a fix
_RECURRENT = ("RNN", "SimpleRNN", "LSTM", "GRU", "RNNCellBase", "RNNBase")

FIXED, NOT_FIXED, NOT_APPLICABLE = "fixed", "not_fixed", "not_applicable"


@dataclass
class Candidate:
    remedy: str
    change_text: str
    change: Change
    start: Snapshot | None
    why_not: str | None = None  # not applicable: why
    extra: dict[str, Any] = field(default_factory=dict)
    accumulate: int = 1


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
    budget = max(MIN_BUDGET_SECONDS, BUDGET_FACTOR * probe_seconds)
    entry = ring.take(fault.step, fault.epoch, fault.batch_index or 0)  # to put back afterwards
    here = _fault_snapshot(fault, ring, entry)
    end_step = fault.step + max(1, fix_steps)
    cands = _candidates(report, fault, workload, ring, here, amp)
    # The fault's batch has served (localisation, findings, the candidates' texts; a bundle took its own
    # copy): the replays read the batch again, so holding this one too keeps a second copy of a batch alive
    # through every replay (the loop's watcher and step engine must let it go as well for it to be freed).
    fault.fields = None
    control_start = min((c.start for c in cands if c.start is not None), key=lambda s: s.step, default=None)
    control = None
    rows: list[dict[str, Any]] = []
    try:
        if control_start is not None:
            progress(0, None, "replaying without any change (does the fault come back?)")
            control = replay(workload, optimizer, ring, control_start, fault.step + 2, Change(), t0 + budget,
                             watch=_watch(cands))
        healthy = _healthy_max(control, fault.step)
        tried = [c for c in cands if c.why_not is None and c.start is not None]
        for c in cands:
            if c in tried:  # the display says what runs, not the probe's last step
                k = tried.index(c) + 1
                progress(k, len(tried), f"trying remedy {k}/{len(tried)}: {c.remedy}")
            if c.why_not is None and time.perf_counter() - t0 > budget:
                c.why_not = f"not tried: the remedies' time budget ({budget:.0f} s) was spent"
            if c.why_not is not None or c.start is None:
                rows.append(_row(c, NOT_APPLICABLE, None, note=c.why_not or "no state to restart from"))
                continue
            start = c.start

            def run(change: Change, start: Snapshot = start) -> Any:
                return replay(workload, optimizer, ring, start, end_step, change, t0 + budget)

            searched = None
            if c.change.guard is not None:  # widened past the reported line while it never fired
                r, c.change, searched = _search_guard(run, c, report, fault.step, end_step, healthy)
                c.change_text = guard_text(c.change, r)
                c.extra["guard"] = guard_info(c.change, r)
            else:
                r = run(c.change)
            before = _baseline_loss(report, r.start_step)
            outcome, note = _judge(r, fault.step, end_step, c, before)
            if searched:
                note = "; ".join(n for n in (searched, note) if n)
            widened = scope_note(c.change, r)
            note = "; ".join(n for n in (widened, note) if n) or None
            rows.append(_row(c, outcome, r, note=note, before=before))
    finally:  # the weights, optimizer state and RNG as the probe left them, whatever stopped the replays
        restore(entry, workload.model, optimizer)
        entry.rng.restore()
    # an update fault shows in the next step's loss; any other fault at its own step
    late = 1 if fault.kind == FaultKind.UPDATE else 0
    reproduced: bool | None = None  # unknown: no control, or it ran out of time
    if control is not None and not control.cut:
        reproduced = not control.finite and control.failed_at is not None and \
            fault.step <= control.failed_at <= fault.step + late
    if not reproduced:  # a replay that never met the fault says nothing about a remedy, either way
        why = _unverified(control, reproduced, ring)
        for row in rows:
            if row["outcome"] != NOT_APPLICABLE:
                row["outcome"], row["note"] = NOT_APPLICABLE, why
                row.pop("skip_list", None)
    order = {FIXED: 0, NOT_FIXED: 1, NOT_APPLICABLE: 2}
    rows.sort(key=lambda r: order[r["outcome"]])  # stable: the practitioner's order within each outcome
    report.remedies = rows
    seconds = time.perf_counter() - t0
    report.details["remedies"] = {
        "seconds": round(seconds, 3), "budget_seconds": round(budget, 1), "probe_seconds": round(probe_seconds, 3),
        "fix_steps": fix_steps, "end_step": end_step, "data": _data_note(ring),
        "control": None if control is None else {"start_step": control.start_step, "reproduced": reproduced,
                                                 "failed_at": control.failed_at}}
    report.details["snapshots"] = ring.summary()  # now with the fault-time snapshot's epoch kept
    _mark_advice(report, rows, fault.step)


_MAX_LIMITS = 6  # clamps a threshold search tries: the rule's bound, then halved


def _watch(cands: list[Candidate]) -> tuple[Any, str | None] | None:
    """The op of a clamp whose bound may be searched (exp), for the control replay to record its inputs."""
    c = next((c for c in cands if c.change.guard is not None and c.why_not is None and c.start is not None), None)
    if c is None or limit_of(c.change.guard.op) is None:
        return None
    return c.change.guard, c.change.source


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
                  healthy: float | None) -> tuple[Replay, Change, str | None]:
    """The guard's replay; for a clamp with an upper bound (exp's 60), tighter bounds while it does not
    verify: a value clamped at 60 can still overflow where it is squared downstream (a VAE's std). Returns
    the last replay, its change, and what the search tried (for the row's note)."""
    import dataclasses

    top = limit_of(c.change.guard.op) if c.change.guard is not None else None
    if top is None:
        r, change = replay_guard(run, c.change)
        return r, change, None
    tried: list[tuple[float, str]] = []
    for limit in _limits(top, healthy):
        r, change = replay_guard(run, dataclasses.replace(c.change, guard_limit=limit))
        outcome, note = _judge(r, fault_step, end_step, dataclasses.replace(c, change=change),
                               _baseline_loss(report, r.start_step))
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


def _unverified(control: Replay | None, reproduced: bool | None, ring: SnapshotRing) -> str:
    """Why no remedy can be called verified: the replay without any change did not meet the fault."""
    tail = ", so no replay is evidence for or against a remedy"
    if control is None:
        return "no replay without any change could start (no state before the fault to restart from)" + tail
    if control.not_applicable:
        return control.not_applicable
    if control.cut:
        return "the replay without any change ran out of time before the fault step" + tail
    data = control.data_note or getattr(ring.batches, "stream", None)
    seen = f"it stopped at step {control.failed_at}" if control.failed_at is not None else "it stayed finite"
    if data:
        return f"the replay without any change did not reproduce the fault ({seen}): {data}" + tail
    return (f"the replay without any change did not reproduce the fault on the same batches ({seen}; a "
            "nondeterministic run)" + tail)


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
    import dataclasses

    from nandoctor.engine.snapshots import RngState

    return dataclasses.replace(entry, rng=RngState(fault.rng, entry.rng.numpy, entry.rng.python))


def _candidates(report: Report, fault: Any, workload: Any, ring: SnapshotRing, here: Snapshot | None,
                amp: bool) -> list[Candidate]:
    first = ring.first
    growth = next((f for f in report.findings if f.code == Code.GRAD_EXPLOSION
                   and (f.location.step or 0) <= fault.step), None)
    growth_step = growth.location.step if growth is not None else None
    before_growth = ring.latest(growth_step) if growth_step is not None else None
    diverge_start = before_growth or here
    out: list[Candidate] = []
    symptom = next((f for f in report.findings if f.location.step == fault.step and f.code in _SYMPTOMS), None)
    op = symptom.location.op if symptom is not None else None
    source = symptom.evidence.get("source") if symptom is not None else None
    guard = guard_for(op)
    if guard is not None:
        where = f" at {source}" if source else ""
        out.append(Candidate("op_guard", f"{guard.change}{where}", Change(guard=guard, source=source), here))
    else:
        out.append(Candidate("op_guard", "an epsilon or clamp for the faulting op", Change(), None,
                             why_not=f"no guard for op {op}" if op else "no single op was named"))
    for name, bad in nan_rows(report, workload.model, here).items():
        out.append(Candidate("reinit_rows", rows_text(name, bad, report), Change(reinit_rows={name: bad}), here))
    rows = _offending_rows(fault, symptom)
    if fault.kind == FaultKind.DATA:
        text = rt.drop_nonfinite_text(fault, rows)  # the mask fits each field's shape (an NCHW image too)
        out.append(Candidate("drop_samples", text, Change(drop_nonfinite=True), here))
    elif rows and _sample_specific(report, symptom):
        records = _records(ring, fault, rows)
        if records is not None:  # the dataset's own indices: left out wherever the sampler yields them
            out.append(Candidate("drop_samples", _records_text(fault, rows, records), Change(
                drop_records=frozenset(records)), here, extra={"records": records}))
        else:
            drop = (fault.epoch, fault.batch_index or 0, rows)
            out.append(Candidate("drop_samples", _skip_text(fault, rows, workload), Change(drop=drop), here,
                                 extra={"skip_list": _skip_list(fault, rows, workload)}))
    else:
        out.append(Candidate("drop_samples", "leave out the offending samples", Change(), None,
                             why_not="no subset of the batch was found to cause the fault (not sample-specific: the "
                             "batch as a whole or the weights are at fault)"))
    stds = init_stds(report, workload.model, first)
    if stds:
        names = ", ".join(list(stds)[:4]) + ("…" if len(stds) > 4 else "")
        text = (f"re-initialise {names} with a fan-in aware initializer (std ~{min(stds.values()):.3g}): "
                "weight_attr=paddle.ParamAttr(initializer=paddle.nn.initializer.XavierNormal()), or drop the "
                "custom init (Paddle's default is fan-in scaled)")
        out.append(Candidate("reinit", text, Change(reinit=stds), first,
                             why_not=None if first is not None else "no snapshot of the initial state"))
    clip = _clip_threshold(report, growth, fault.step)
    if clip is not None:  # the change texts and their spec_change mappings: report/remedies_text.py
        edit = rt.clip_change(clip)
        clip = edit[rt.CLIP_KEY]["global_norm"]  # the replay verifies the very threshold the text states
        out.append(Candidate("grad_clip", rt.change_text(edit), Change(clip_norm=clip), diverge_start,
                             extra={"threshold": clip, "spec_change": edit}))
    else:
        out.append(Candidate("grad_clip", "optimizer.grad_clip: {global_norm: ...}", Change(), None,
                             why_not="no finite gradient norm before the fault to set a threshold from"))
    lr_edit, lr_note = rt.lr_change(workload.spec.optimizer, _lr(report, fault.step), 0.1)
    out.append(Candidate("lr_x0.1", rt.change_text(lr_edit, lr_note) if lr_edit else lr_note, Change(lr_scale=0.1),
                         diverge_start, extra={"spec_change": lr_edit} if lr_edit else {}))
    warm = max(1, growth_step or fault.step)
    warm_edit = rt.warmup_change(warm)
    out.append(Candidate("warmup", rt.change_text(warm_edit, f"a linear warmup from 0 over the first {warm} steps"),
                         Change(warmup_steps=warm), first, extra={"spec_change": warm_edit},
                         why_not="the fault is at the first steps: no steps before it to warm up over"
                         if fault.step < 2 else (None if first is not None else "no snapshot of the first step")))
    if amp:  # (on a GPU, try_remedies has returned with a note before getting here)
        why = "the probe ran on CPU, where AMP is inactive: float16 remedies need a GPU"
        out.append(Candidate("fp32_layer", "run the faulting layer in float32 (paddle.amp.auto_cast(enable=False) "
                             "around it)", Change(), None, why_not=why))
        out.append(Candidate("loss_scale", "amp.init_loss_scaling: a lower start (YAML)", Change(), None, why_not=why))
    for c in out:
        c.accumulate = _accumulate(workload)
    out = [c for c in out if c.remedy in _by_cause(fault, symptom, growth)]
    return _ordered(out, report, fault, symptom, growth, workload.model)


_DATA_REMEDIES = {"drop_samples", "reinit_rows"}
_DIVERGENCE = ("loss.jump", Code.GRAD_EXPLOSION.value)


def _by_cause(fault: Any, symptom: Any, growth: Any) -> set[str]:
    """The remedies worth a replay for the cause found: a NaN in the data is the data's (a learning rate,
    clipping or warmup cannot remove it); an overflow at the end of a divergence is the step size's (an epsilon
    on the op that overflowed last only hides it)."""
    every = {"op_guard", "drop_samples", "reinit_rows", "reinit", "grad_clip", "lr_x0.1", "warmup", "fp32_layer",
             "loss_scale"}
    if fault.kind == FaultKind.DATA:
        return _DATA_REMEDIES
    causes = set(symptom.evidence.get("causes", [])) if symptom is not None else set()
    if growth is not None or causes & set(_DIVERGENCE):
        return every - {"op_guard"}
    return every


def _ordered(cands: list[Candidate], report: Report, fault: Any, symptom: Any, growth: Any,
             model: Any) -> list[Candidate]:
    """The order a practitioner would try them in, given the cause the probe found."""
    causes = set(symptom.evidence.get("causes", [])) if symptom is not None else set()
    if Code.PARAM_INIT_SCALE.value in causes:
        pref = ["reinit", "op_guard", "grad_clip", "lr_x0.1", "warmup", "drop_samples"]
    elif growth is not None or fault.kind == FaultKind.UPDATE:
        recurrent = any(type(m).__name__ in _RECURRENT for _, m in model.named_sublayers())
        pref = (["grad_clip", "lr_x0.1"] if recurrent else ["lr_x0.1", "grad_clip"]) + \
            ["warmup", "reinit", "op_guard", "drop_samples"]
    else:
        pref = ["op_guard", "drop_samples", "reinit", "grad_clip", "lr_x0.1", "warmup"]
    rank = {name: i for i, name in enumerate(["reinit_rows", *pref])}  # a NaN weight is repaired first
    return sorted(cands, key=lambda c: rank.get(c.remedy, len(pref)))


def _judge(r: Replay, fault_step: int, end_step: int, c: Candidate,
           before: float | None) -> tuple[str, str | None]:
    if r.not_applicable is not None:
        return NOT_APPLICABLE, r.not_applicable
    if r.error is not None:
        return NOT_FIXED, f"the replay raised {r.error}"
    unused = never_fired(r, c.change)  # before the outcome: a guard never applied says nothing about the fix
    if unused is not None:
        return NOT_APPLICABLE, unused
    held = _held(r)
    if not r.finite:
        if held and r.failed_at is not None and r.failed_at > fault_step:
            return NOT_FIXED, (f"still NaN/Inf at step {r.failed_at}: {held} and a later batch reads it "
                               "again (leaving samples out cannot repair a NaN weight; re-initialise it)")
        return NOT_FIXED, f"still NaN/Inf at step {r.failed_at}"
    last = r.start_step + r.steps_run - 1
    kept_only = r.data_note is not None and last == fault_step  # the faulty batch was the last one it could have
    if last < fault_step or (last == fault_step and not kept_only):
        why = "the data ran out" if r.ended else "the time budget ran out"
        return NOT_FIXED, f"{why} before the replay passed the fault step"
    before = before if before is not None else _first_loss(r)
    after = _loss_after(r)
    if before is not None and after is not None and after > BLOW_UP * max(abs(before), 1e-3):
        return NOT_FIXED, f"finite, but the loss grew from {before:.3g} to {after:.3g}"
    if after is not None and abs(after) > STUCK:
        return NOT_FIXED, f"finite, but the loss stays at {after:.3g}: training does not recover"
    note = None
    if kept_only:
        note = (f"finite on the faulty batch (step {fault_step}), the last the probe kept: {r.data_note}, so no "
                "step after it was replayed")
    elif last < end_step - 1 and r.data_note:
        note = f"finite through step {last}, the last batch the probe kept: {r.data_note}"
    elif last < end_step - 1:
        note = f"finite through step {last} (stopped early: {'data' if r.ended else 'time'} ran out)"
    if held:  # e.g. samples dropped around a NaN embedding row: finite only while no batch reads it
        note = (f"{note or f'finite through step {last}'}, but {held}: this holds only while no "
                "later batch reads it (re-initialise it to be safe)")
    return FIXED, note


def _held(r: Replay) -> str:
    """'model.embed_tokens.weight still holds 64 NaN/Inf value(s)': the weights a replay left non-finite."""
    return ", ".join(f"{name} still holds {n} NaN/Inf value(s)" for name, n in list(r.still_nonfinite.items())[:3])


def _first_loss(r: Replay) -> float | None:
    return r.losses[0] if r.losses else None


def _baseline_loss(report: Report, step: int) -> float | None:
    """The probe's own loss level where a replay starts: the median of its last 3 finite losses up to `step`."""
    import math

    vals = [p.loss for p in report.timeline if p.step <= step and p.loss is not None and math.isfinite(p.loss)][-3:]
    return sorted(vals)[len(vals) // 2] if vals else None


def _loss_after(r: Replay) -> float | None:
    tail = r.losses[-3:]
    return sum(tail) / len(tail) if tail else None


def _row(c: Candidate, outcome: str, r: Replay | None, note: str | None,
         before: float | None = None) -> dict[str, Any]:
    """One contract row; `loss_before` is the probe's own loss where the replay started (else the replay's
    first), `loss_after` the replay's mean over its last 3 steps."""
    if r is not None and before is None:
        before = _first_loss(r)
    row: dict[str, Any] = {"remedy": c.remedy, "change": c.change_text, "outcome": outcome,
                           "steps_run": r.steps_run if r else 0,
                           "loss_before": before, "loss_after": _loss_after(r) if r else None,
                           "seconds": round(r.seconds, 3) if r else 0.0,
                           "start_step": r.start_step if r else None, "note": note}
    if r is not None and not r.finite:
        row["failed_at"] = r.failed_at
    if "guard" in c.extra:
        row["guard"] = c.extra["guard"]
    if "spec_change" in c.extra:  # what `change` says, as spec key -> value (report/remedies_text.py)
        row["spec_change"] = c.extra["spec_change"]
    if outcome == FIXED:
        row.update(c.extra)
        if r is not None and r.dropped:
            row["skip_list"] = _skip_list_of(r.dropped, c.accumulate)
            if "records" in c.extra:  # the records themselves: what to filter out, whatever epoch reads them
                for entry, ids in zip(row["skip_list"]["batches"], r.dropped_records):
                    entry["records"] = ids
                row["skip_list"] = {"records": c.extra["records"], **row["skip_list"]}
    elif "threshold" in c.extra:
        row["threshold"] = c.extra["threshold"]
    return row


_SYMPTOMS = (Code.ACTIVATION_NONFINITE, Code.LOSS_NONFINITE, Code.GRAD_NONFINITE, Code.UPDATE_NONFINITE,
             Code.DATA_NONFINITE)


def _offending_rows(fault: Any, symptom: Any) -> list[int]:
    if fault.kind == FaultKind.DATA:
        return sorted({r for rows in fault.bad_fields.values() for r in rows})
    return list(symptom.location.sample_indices or []) if symptom is not None else []


def _skip_list(fault: Any, rows: list[int], workload: Any) -> dict[str, Any]:
    """What to resume with: the batch and sample ids, and PaddleFormers' `skip_data_intervals` (1-based
    optimizer steps, inclusive) for skipping that whole step."""
    return _skip_list_of([(fault.epoch, fault.batch_index, fault.step, rows)], _accumulate(workload))


def _skip_list_of(dropped: list[tuple[int, int | None, int, list[int]]], accumulate: int) -> dict[str, Any]:
    steps = sorted({step // accumulate + 1 for _, _, step, _ in dropped})
    return {"batches": [{"epoch": e, "batch_index": b, "step": s, "samples": rows} for e, b, s, rows in dropped],
            "skip_data_intervals": [[g, g] for g in steps]}


def _accumulate(workload: Any) -> int:
    return workload.spec.optimizer.accumulate_steps


def _skip_text(fault: Any, rows: list[int], workload: Any) -> str:
    sl = _skip_list(fault, rows, workload)
    return (f"leave out sample(s) {rows} of batch {fault.batch_index} (epoch {fault.epoch}), or skip that step: "
            f"skip_data_intervals: {sl['skip_data_intervals']} (the loader has no batch sampler to name the records "
            "by, so this leaves out that position of that batch only: if the loader yields the same records again, "
            "in another epoch, they are not left out there)")


def _sample_specific(report: Report, symptom: Any) -> bool:
    """Whether the localisation named samples as the cause (a whole-batch fault names none)."""
    ff = report.first_fault
    if ff is not None and not ff.sample_indices:
        return False
    return symptom is None or symptom.evidence.get("samples_scope") != "not_sample_specific"


def _records(ring: SnapshotRing, fault: Any, rows: list[int]) -> list[int] | None:
    """The dataset indices of the faulty batch's rows, from its batch sampler (None: no sampler, or the batch
    was not kept)."""
    tape = ring.batches
    ids = tape.records.get((fault.epoch, fault.batch_index or 0)) if tape is not None else None
    if ids is None or any(r >= len(ids) for r in rows):
        return None
    return sorted({ids[r] for r in rows})


def _records_text(fault: Any, rows: list[int], records: list[int]) -> str:
    return (f"leave out record(s) {records} of the dataset (dataset index, from the batch sampler; sample(s) {rows} "
            f"of batch {fault.batch_index}, epoch {fault.epoch}) in every epoch: filter them out of the dataset, or "
            "give the DataLoader a sampler without them")


def _clip_threshold(report: Report, growth: Any, fault_step: int) -> float | None:
    if growth is not None and growth.evidence.get("clip_threshold"):
        return float(growth.evidence["clip_threshold"])
    norms = sorted(p.grad_norm for p in report.timeline if p.step < fault_step and p.grad_norm is not None
                   and p.grad_norm == p.grad_norm and p.grad_norm != float("inf"))
    if not norms:
        return None
    return float(norms[len(norms) // 2]) * CLIP_FACTOR


def _lr(report: Report, step: int) -> float | None:
    lrs = [p.lr for p in report.timeline if p.lr is not None and p.step <= step]
    return lrs[0] if lrs else None


_CAUSE_OF = {"grad_clip": Code.GRAD_EXPLOSION, "lr_x0.1": Code.GRAD_EXPLOSION, "warmup": Code.GRAD_EXPLOSION,
             "reinit": Code.PARAM_INIT_SCALE, "reinit_rows": Code.PARAM_NONFINITE}


def _mark_advice(report: Report, rows: list[dict[str, Any]], fault_step: int) -> None:
    """The advice lists say which change was verified by replay and which did not help: the fault's own
    finding lists every replayed remedy first, a cause's finding (grad.explosion, param.init_scale) its
    own after its advice."""
    symptom = next((f for f in report.findings if f.location.step == fault_step and f.code in _SYMPTOMS), None)
    for finding in report.findings:
        if finding is symptom:
            mine = rows
        else:
            mine = [r for r in rows if _CAUSE_OF.get(r["remedy"]) == finding.code]
        lines = [f"Verified by replay ({r['remedy']}): {r['change']}" for r in mine if r["outcome"] == FIXED]
        lines += [f"Tried by replay, did not help ({r['remedy']}): {r['change']}" for r in mine
                  if r["outcome"] == NOT_FIXED]
        if not lines:
            continue
        kept = [a for a in finding.advice if not a.startswith(("Verified by", "Tried by"))]
        # the fault's own finding leads with the evidence; a cause's finding keeps its advice first
        finding.advice = lines + kept if finding is symptom else kept + lines
