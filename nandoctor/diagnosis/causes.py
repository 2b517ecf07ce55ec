"""Causes, not only symptoms: what the probe checks before training and reads back after a fault.

Before training: parameters that already hold NaN/Inf (nan_params.py decides whether the probe can train
on) and weights initialised far from their fan-in's scale (diagnosis/params.py's check, as warnings, so a
forward overflow at step 0 carries its cause). After the run: the step that first read a bad parameter,
and the growth of the gradient norm or loss that led to the fault (grad.explosion, where it began), with
the scale of the faulting batch's fields (targets three orders of magnitude off unit scale make a
divergence). `explain` is the part every way in shares (probe, run, watch, callbacks); its advice is
written for the report's mode (YAML for a spec, Python for the user's script).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nandoctor.advice import advice_for, fit_mode
from nandoctor.diagnosis import nan_params
from nandoctor.diagnosis.params import init_scale_findings
from nandoctor.engine.monitors import param_nonfinite
from nandoctor.engine.warnings import growth_before_fault
from nandoctor.engine.watcher import FaultKind
from nandoctor.findings import Code, Finding, Report, Severity
from nandoctor.tensors.convert import to_numpy


@dataclass
class Causes:
    """What the starting parameters say, read once before training (`check_start`), for `assemble`."""

    bad: list[nan_params.BadParam] = field(default_factory=list)
    stop: bool = False
    nonfinite: list[str] = field(default_factory=list)  # parameters and buffers holding NaN/Inf at the start
    init_findings: list[Finding] = field(default_factory=list)  # weights far from their fan-in's scale
    reported: bool = False  # these findings are in the report already (the probe's `before_training`)


def check_start(model: Any, optimizer: Any) -> Causes:
    """The starting parameters' causes: weights initialised far from their fan-in's scale (one host sync for
    every weight, grouped.py) and parameters holding NaN/Inf (one reduction on the device)."""
    out = Causes(init_findings=init_scale_findings(model))
    names = out.nonfinite = param_nonfinite(model)
    if names:
        out.bad = nan_params.inspect(model, optimizer, names)
    return out


def before_training(report: Report, model: Any, optimizer: Any) -> Causes:
    """The probe's: the starting parameters' findings in the report before it trains; `.stop` when it must
    not train at all (every step would be NaN)."""
    out = check_start(model, optimizer)
    report.findings += out.init_findings
    if out.nonfinite:
        out.stop = nan_params.before_training(report, out.bad)
    out.reported = True
    return out


def explain(report: Report, fault: Any, records: list[Any] | None, lr: float | None, *,
            label: str | None = None, optimizer: Any = None) -> None:
    """The fault's causes (the growth before it, a loss jump, a NaN parameter read, the initial scale) and
    advice that fits the cause, the data's shape and the report's mode; every way in calls it once its
    findings are made. `label`: the target field's name, when known; `optimizer`: a spec's optimizer block
    (its settings' keys), None outside a spec."""
    if fault is not None and fault.kind == FaultKind.DATA:
        _data_advice(report, fault)
    if fault is not None and fault.kind in (FaultKind.NONFINITE, FaultKind.UPDATE):
        found = growth_before_fault(records or [], fault.step, lr, _samples_alone(report, fault))
        if found is not None:  # it sees the whole rise up to the fault: it replaces the tracker's warning
            report.findings = [f for f in report.findings if f.code != Code.GRAD_EXPLOSION]
            report.findings.append(found)
        _name_causes(report, fault.step, records, lr, scales=field_scales(fault, label), optimizer=optimizer)
    fit_mode(report, optimizer)


def field_scales(fault: Any, label: str | None) -> list[dict[str, Any]]:
    """The faulting batch's floating fields, measured on the host in float64: mean, standard deviation and
    root mean square, with the role the field plays (target when it is the label)."""
    out: list[dict[str, Any]] = []
    for name, value in (getattr(fault, "fields", None) or {}).items():
        try:
            arr = to_numpy(value)  # (None for an object of the user's, even one with a numpy() of its own)
            if arr is None:
                continue
        except Exception:  # noqa: BLE001 - a field that is no array (text, a nested structure): nothing to measure
            continue
        if arr.dtype.kind != "f" or arr.size == 0:
            continue
        n, s1, s2 = _moments(arr)
        if n == 0:
            continue
        mean = s1 / n
        out.append({"field": name, "role": "target" if name == label else ("input" if label else "field"),
                    "batch": fault.batch_index, "mean": mean, "std": math.sqrt(max(s2 / n - mean * mean, 0.0)),
                    "rms": math.sqrt(s2 / n)})
    return out


_CHUNK = 1 << 20  # values converted to float64 at a time: an image batch is not copied whole


def _moments(arr: np.ndarray) -> tuple[int, float, float]:
    """Count, sum and sum of squares of the finite values, accumulated in float64."""
    flat = arr.reshape(-1)
    n, s1, s2 = 0, 0.0, 0.0
    for i in range(0, flat.size, _CHUNK):
        c = flat[i:i + _CHUNK].astype(np.float64)
        c = c[np.isfinite(c)]
        n, s1, s2 = n + c.size, s1 + float(c.sum()), s2 + float(np.dot(c, c))
    return n, s1, s2


def _data_advice(report: Report, fault: Any) -> None:
    """A NaN in the data gets data advice, its filter written for each bad field's shape."""
    shapes: dict[str, list[int]] = {}
    for name in fault.bad_fields:
        value = (fault.fields or {}).get(name)
        shape = getattr(value, "shape", None)
        if shape is not None:
            shapes[name] = [int(d) for d in shape]
    finding = next((f for f in report.findings if f.code == Code.DATA_NONFINITE and f.location.step == fault.step),
                   None)
    if finding is not None and shapes:
        kept = [a for a in finding.advice if a.startswith(("Verified by", "Tried by"))]
        finding.advice = kept + advice_for(Code.DATA_NONFINITE.value, shapes=shapes)


def _samples_alone(report: Report, fault: Any) -> list[int] | None:
    """The first fault's samples when they are a strict subset of the batch (the bisection found them alone)."""
    from nandoctor.tensors.sizes import batch_size

    ff = report.first_fault
    samples = ff.sample_indices if ff is not None else None
    size = batch_size(fault.fields) if fault.fields is not None else None
    return samples if samples and size is not None and len(samples) < size else None


_SYMPTOMS = (Code.ACTIVATION_NONFINITE, Code.LOSS_NONFINITE, Code.GRAD_NONFINITE, Code.UPDATE_NONFINITE)
_INIT_STEPS = 3  # a forward overflow this early still follows from the initial scale


_Cause = tuple[str, str]  # (code, text): what led to the fault, as the symptom's message says it


def _name_causes(report: Report, fault_step: int, records: list[Any] | None = None, lr: float | None = None,
                 scales: list[dict[str, Any]] | None = None, optimizer: Any = None) -> None:
    """The fault's own finding says what led to it, so the first thing read is cause and symptom together;
    its advice then starts with what fixes that cause, not with what the op does wrong in general."""
    symptom = next((f for f in report.findings if f.code in _SYMPTOMS and f.location.step == fault_step), None)
    if symptom is None:
        return
    causes: list[_Cause] = []
    facts: dict[str, Any] = {"learning_rate": lr, "mode": report.mode, "scales": scales, "optimizer": optimizer}
    read = _params_read(report, fault_step, symptom)
    if read:
        facts["parameter"] = read[0].location.parameter
        causes.append((Code.PARAM_NONFINITE.value, f"{facts['parameter']} held NaN/Inf before training and this "
                       "op read it (param.nonfinite)"))
    causes += _growth_causes(report, fault_step, facts)
    if not any(code == Code.GRAD_EXPLOSION.value for code, _ in causes) and not read \
            and not _samples_named(report):
        jump = _loss_jump_cause(records, fault_step, lr)
        if jump is not None:
            causes.append(jump)
    init = _init_scale_cause(report, fault_step, symptom)
    if init is not None:
        causes.append(init)
    if causes:
        _tell_causes(symptom, causes, facts)


def _params_read(report: Report, fault_step: int, symptom: Finding) -> list[Finding]:
    """The param.nonfinite findings whose parameter the symptom's op read at its step (nan_params.py)."""
    return [f for f in report.findings if f.code == Code.PARAM_NONFINITE
            and f.evidence.get("first_read_step") == fault_step and f.location.parameter == symptom.location.parameter]


def _growth_causes(report: Report, fault_step: int, facts: dict[str, Any]) -> list[_Cause]:
    """Each gradient-norm (or loss) growth warned of up to the fault; the learning rate and clip threshold
    it saw go into `facts`, so the advice is written for the values the run had."""
    causes: list[_Cause] = []
    for f in report.findings:
        if f.code == Code.GRAD_EXPLOSION and f.severity != Severity.INFO and (f.location.step or 0) <= fault_step:
            ev = f.evidence
            grew = f"{ev['growth']:.3g}x" if "growth" in ev else "sharply"
            causes.append((f.code.value, f"the {ev.get('signal', 'gradient norm')} grew {grew} from step "
                           f"{f.location.step} (grad.explosion: lower the learning rate or clip)"))
            if ev.get("learning_rate") is not None:
                facts["learning_rate"], facts["lr_step"] = ev["learning_rate"], f.location.step
            if ev.get("clip_threshold"):
                facts["clip_norm"] = ev["clip_threshold"]
    return causes


def _loss_jump_cause(records: list[Any] | None, fault_step: int, lr: float | None) -> _Cause | None:
    """One update that multiplied the loss (`_loss_jump`), said with the learning rate that made it."""
    jump = _loss_jump(records or [], fault_step)
    if jump is None:
        return None
    (s0, v0), (s1, v1) = jump
    at_lr = f" at learning rate {lr:g}" if lr is not None else ""
    return ("loss.jump", f"the loss jumped {v1 / v0:.3g}x in one update{at_lr} ({v0:.3g} at step "
            f"{s0}, {v1:.3g} at step {s1}): the step size threw the weights out of range")


def _init_scale_cause(report: Report, fault_step: int, symptom: Finding) -> _Cause | None:
    """Weights initialised far above their fan-in's scale, for a forward or loss fault within the first
    `_INIT_STEPS` steps (an overflow this early still follows from the initial scale)."""
    inits = [f for f in report.findings if f.code == Code.PARAM_INIT_SCALE and f.evidence.get("ratio", 1) > 1]
    if inits and fault_step < _INIT_STEPS and symptom.location.phase is not None \
            and symptom.location.phase.value in ("forward", "loss"):
        names = ", ".join(f"{f.location.parameter} ({f.evidence['ratio']:.3g}x)" for f in inits[:3])
        return (Code.PARAM_INIT_SCALE.value,
                f"weights initialised far above their fan-in's scale: {names} (param.init_scale)")
    return None


def _tell_causes(symptom: Finding, causes: list[_Cause], facts: dict[str, Any]) -> None:
    """Write the causes into the symptom's message and evidence; its advice starts from the first cause."""
    said = [text for code, text in causes  # the NaN parameter's read is said already (nan_params.py)
            if not (code == Code.PARAM_NONFINITE.value and "NaN before training" in symptom.message)]
    if said:
        symptom.message += " Likely cause: " + "; ".join(said) + "."
    symptom.evidence["causes"] = [code for code, _ in causes]
    op = symptom.location.op
    symptom.advice = list(dict.fromkeys(advice_for(symptom.code.value, op=op, cause=causes[0][0], **facts)))


_LOSS_JUMP = 5.0  # a finite loss this many times the one before, right before the fault


def _samples_named(report: Report) -> bool:
    ff = report.first_fault
    return bool(ff is not None and ff.sample_indices)


def _loss_jump(records: list[Any], fault_step: int) -> tuple[tuple[int, float], tuple[int, float]] | None:
    """The last two finite losses up to the fault when the later is `_LOSS_JUMP` times the earlier: one
    update threw the weights out of range (too few steps of history for grad.explosion to see a trend)."""
    losses = [(r.step, float(r.loss)) for r in records if r.step <= fault_step and r.loss is not None
              and math.isfinite(float(r.loss))]
    if len(losses) < 2:
        return None
    (s0, v0), (s1, v1) = losses[-2], losses[-1]
    if s1 != s0 + 1 or s1 < fault_step - 1 or v0 <= 0 or v1 < _LOSS_JUMP * v0:
        return None
    return (s0, v0), (s1, v1)
