"""A detected fault -> the report's findings and first_fault (data, params, forward/loss/backward, update).

Kept apart from the loop so the wording of every message (what, where, what to do) is in one place;
advice text itself comes from `nandoctor.advice`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from nandoctor.advice import advice_for
from nandoctor.diagnosis.crash import first_line
from nandoctor.engine.watcher import Fault
from nandoctor.findings import Code, Finding, FirstFault, Location, Phase, Report, Severity

if TYPE_CHECKING:  # localize.py and its tracing modules load only when a fault needs them (5 ms at start)
    from nandoctor.diagnosis.localize import Localization

# Paddle optimizer class -> the in-place update op the tensor checker names (checked on 3.3.1: Adam's
# update is `adam_`; the others follow the same `<name>_` pattern).
_UPDATE_OPS = {"Adam": "adam_", "AdamW": "adamw_", "SGD": "sgd_", "Momentum": "momentum_", "Adagrad": "adagrad_",
               "Adadelta": "adadelta_", "Adamax": "adamax_", "RMSProp": "rmsprop_", "Lamb": "lamb_",
               "NAdam": "nadam_", "RAdam": "radam_", "ASGD": "asgd_", "Rprop": "rprop_"}


def update_op(optimizer: Any) -> str:
    name = type(optimizer).__name__
    return _UPDATE_OPS.get(name, f"{name.lower()}_")


def set_first(report: Report, loc: Location) -> None:
    report.first_fault = FirstFault(step=loc.step, phase=loc.phase or Phase.FORWARD, layer=loc.layer, op=loc.op,
                                    parameter=loc.parameter, batch_index=loc.batch_index,
                                    sample_indices=loc.sample_indices)


def params_before_training(report: Report, names: list[str], facts: dict[str, Any] | None = None) -> None:
    """A trained parameter wholly NaN/Inf: every step reads it, so the probe does not train at all."""
    loc = Location(step=None, phase=Phase.PARAMS, parameter=names[0])
    shown = ", ".join(names[:8]) + ("…" if len(names) > 8 else "")
    report.findings.append(Finding(
        Code.PARAM_NONFINITE, Severity.ERROR,
        f"Parameter {names[0]} is NaN/Inf in every value before any training step ({len(names)} tensor(s) "
        f"affected: {shown}). The probe did not train: every step that uses it is non-finite from the start (if "
        "nothing uses it, set stop_gradient on it or remove it, and the probe trains on).",
        loc, {"parameters": names, **({"tensors": facts} if facts else {})},
        advice_for(Code.PARAM_NONFINITE.value)))
    set_first(report, loc)


def data_fault(report: Report, fault: Fault) -> None:
    for i, (name, rows) in enumerate(fault.bad_fields.items()):
        loc = Location(step=fault.step, phase=Phase.DATA, batch_index=fault.batch_index,
                       sample_indices=rows or None, field=name)
        shown = ", ".join(str(r) for r in rows[:10]) + ("…" if len(rows) > 10 else "")
        report.findings.append(Finding(
            Code.DATA_NONFINITE, Severity.ERROR,
            f"Field '{name}' of batch {fault.batch_index} (step {fault.step}, epoch {fault.epoch}) holds NaN/Inf "
            f"in sample(s) {shown}. {_data_consequence(fault)}",
            loc, {"epoch": fault.epoch, "rows": rows[:100]}, advice_for(Code.DATA_NONFINITE.value)))
        if i == 0:
            set_first(report, loc)


def _data_consequence(fault: Fault) -> str:
    """What the batch's NaN/Inf did: the probe judges a batch by that (a mask's -inf does not count)."""
    if fault.exc is not None:
        return (f"The model's code then raised {type(fault.exc).__name__}: {first_line(str(fault.exc))}. "
                "Clean the data first; the error may go with it.")
    # (a loop that only computes its loss has no update: "before any update" holds for every way in)
    return "It made the step's loss or gradients NaN/Inf; nandoctor stopped there, before any update from it."


def update_fault(report: Report, fault: Fault, optimizer: Any) -> None:
    op = update_op(optimizer)
    loc = Location(step=fault.step, phase=Phase.OPTIMIZER, op=op, parameter=fault.bad_params[0],
                   batch_index=fault.batch_index)
    shown = ", ".join(fault.bad_params[:8]) + ("…" if len(fault.bad_params) > 8 else "")
    norm = f" (gradient norm {fault.grad_norm:.3g}, finite)" if fault.grad_norm is not None else ""
    if fault.unread:  # the rollback could not replay them (its note is in details.rollback)
        unread = ", ".join(str(s) for s in fault.unread[:8])
        why = (f"; the gradients of step(s) {unread} were not read (a deep model's are read one step in four at most) "
               "and could not be replayed, so a NaN gradient there may have done it: run `nandoctor probe "
               "--no-try-fixes` to check every step's gradients")
    else:
        why = "; the gradients were finite, so the optimizer's own arithmetic did it"
    report.findings.append(Finding(
        Code.UPDATE_NONFINITE, Severity.ERROR,
        f"The {type(optimizer).__name__} update at step {fault.step}{norm} wrote NaN/Inf into {fault.bad_params[0]}"
        f" ({len(fault.bad_params)} parameter(s): {shown}){why}.",
        loc, {"parameters": fault.bad_params, "grad_norm": fault.grad_norm, "epoch": fault.epoch,
              "update_steps": list(fault.update_range) if fault.update_range else None,
              "unread_gradient_steps": fault.unread or None},
        advice_for(Code.UPDATE_NONFINITE.value, op=op)))
    set_first(report, loc)


def nonfinite_fault(report: Report, fault: Fault, loc_: Localization, samples: list[int] | None,
                    sample_notes: list[str], scope: str | None = None, reason: str | None = None) -> None:
    """A replayed forward, loss or backward fault (`localize`, samples.py) -> its finding and first_fault."""
    phase = loc_.phase
    code = {Phase.FORWARD: Code.ACTIVATION_NONFINITE, Phase.LOSS: Code.LOSS_NONFINITE,
            Phase.BACKWARD: Code.GRAD_NONFINITE}[phase]
    loc = Location(step=fault.step, phase=phase, layer=loc_.layer, op=loc_.op, parameter=loc_.parameter,
                   batch_index=fault.batch_index, sample_indices=samples)
    what = _nonfinite_what(fault, loc_, _samples_said(fault.batch_index, samples, reason))
    evidence = _nonfinite_evidence(fault, loc_, sample_notes, scope, reason)
    if loc_.source:
        report.details["source"] = loc_.source  # the first-fault panel shows it beside layer and op
    if loc_.library_source:
        report.details["library_source"] = loc_.library_source
    advice = advice_for(code.value, op=loc_.op, hidden_op=loc_.hidden_forward_op)
    report.findings.append(Finding(code, Severity.ERROR, what, loc, evidence, advice))
    if loc_.offending:
        report.details["offending_tensor"] = loc_.offending
    set_first(report, loc)


def _samples_said(b: int | None, samples: list[int] | None, reason: str | None) -> str:
    """Which samples of batch `b` made the fault, or why none alone did (samples.py's reasons)."""
    from nandoctor.diagnosis.samples import EVERY_SAMPLE, REST_FAULTS, WHOLE_BATCH

    if samples:
        return f"Caused by sample(s) {', '.join(str(s) for s in samples[:10])} of batch {b}."
    if reason == EVERY_SAMPLE:
        return f"Not sample-specific: every sample of batch {b} faults on its own."
    if reason == WHOLE_BATCH:
        return f"Not sample-specific: only batch {b} together faults (no subset of its samples faults alone)."
    if reason == REST_FAULTS:
        return (f"Not sample-specific: parts of batch {b} fault on their own, and so does the rest of the batch "
                "without them.")
    return f"Caused by batch {b} (its samples could not be tried apart)."


# What hides a forward NaN from the loss, most often (paddle-notes.md: measured on Paddle 3.3.1)
_HIDING = "Paddle's relu turns NaN into 0; a where that drops it does the same"


def _nonfinite_what(fault: Fault, loc_: Localization, who: str) -> str:
    """The finding's message: what went non-finite in which phase, where and by which op, then `who` (the
    samples) and the user's line that created the op."""
    st = fault.stats
    phase = loc_.phase
    if loc_.layer:
        where = f"in layer {loc_.layer}"
    elif loc_.model_forward:
        where = "in the model's own forward (outside every sublayer)"
    else:
        where = "outside every model layer (the loss or step code)"
    op = f" (op {loc_.op})" if loc_.op else ""
    if loc_.op and loc_.nan_op:  # the harmful Inf came first; the op that made NaN of it follows
        op = f" (op {loc_.op}, whose Inf op {loc_.nan_op} then turned into NaN)"
    if phase == Phase.BACKWARD:
        par = f"; first non-finite parameter gradient: {loc_.parameter}" if loc_.parameter else ""
        what = f"A gradient became NaN/Inf in the backward pass at step {fault.step}, {where}{op}{par}"
        hidden = loc_.hidden_forward_op
        if hidden:  # seen in the forward replay: the same op made NaN there, and something hid it
            inside = f" inside layer {loc_.layer}" if loc_.layer else ""
            what += (f". The loss was finite ({st.loss:.4g}) but the forward pass was not: the same op, {hidden}, "
                     f"made NaN{inside}, and a later op hid it from the loss ({_HIDING}). {who}")
        else:
            what += f", while the loss was finite ({st.loss:.4g}). {who}"
    elif phase == Phase.FORWARD:
        owner = f"Layer {loc_.layer}'s forward output" if loc_.layer else \
            "A value computed in the model's own forward (outside every sublayer)"
        what = f"{owner} became NaN/Inf at step {fault.step}{op}."
        if loc_.hidden_by == "loss":  # the model's output held them: the loss code left them out
            what += (f" The loss stayed finite ({st.loss:.4g}): the model's output held them too, and the loss left "
                     "them out (rows whose label is ignored or masked, say), so they showed only in the gradients.")
        elif loc_.hidden_by == "model":
            what += (f" The loss stayed finite ({st.loss:.4g}): a later op in the model hid them ({_HIDING}), so "
                     "they showed only in the gradients.")
        what += f" {who}"
    else:
        what = (f"The loss became NaN/Inf at step {fault.step} {where}{op} while the model's outputs were finite. "
                f"{who}")
    return what + created_at(loc_.source, loc_.library_source)


def created_at(source: str | None, library: str | None) -> str:
    """Where the op was made: the user's line, and the library line inside it when their line only called
    into a library's code."""
    if source and library:
        return f" The op was created at {library}, in library code your line {source} called."
    if source:
        return f" The op was created at {source}."
    if library:
        return f" The op was created at {library}, in library code."
    return ""


def _nonfinite_evidence(fault: Fault, loc_: Localization, sample_notes: list[str], scope: str | None,
                        reason: str | None) -> dict[str, Any]:
    """The finding's evidence: the step's numbers, and whatever the localization and the bisection found."""
    st = fault.stats
    evidence: dict[str, Any] = {"epoch": fault.epoch, "loss": st.loss, "grad_norm": st.grad_norm}
    if loc_.nan_op:
        evidence["nan_op"] = loc_.nan_op
    if loc_.hidden_forward_op:
        evidence["hidden_forward_op"] = loc_.hidden_forward_op
    if loc_.source:
        evidence["source"] = loc_.source
    if loc_.library_source:
        evidence["library_source"] = loc_.library_source
    if scope is not None:
        evidence["samples_scope"] = scope
    if reason is not None:
        evidence["samples_reason"] = reason
    if loc_.bad_parameters:
        evidence["nonfinite_grad_parameters"] = loc_.bad_parameters[:50]
    if loc_.offending:
        evidence["offending_tensor"] = loc_.offending
    notes = loc_.notes + sample_notes
    if notes:
        evidence["notes"] = notes
    return evidence


def interrupted(report: Report, steps_run: int) -> None:
    report.partial = True
    report.findings.append(Finding(
        Code.RUN_INTERRUPTED, Severity.INFO,
        f"The probe was interrupted (Ctrl-C) after {steps_run} step(s); the findings cover only those.",
        Location(step=steps_run), {"steps_run": steps_run}, advice_for(Code.RUN_INTERRUPTED.value)))


def amp_inactive(report: Report, dtype: str) -> None:
    report.findings.append(Finding(
        Code.AMP_INACTIVE, Severity.INFO,
        f"amp is enabled ({dtype}) but the probe runs on CPU, where Paddle has no {dtype} kernels: the run was "
        "float32 and float16 risk is judged from float32 magnitudes (65504 is float16's maximum).",
        Location(), {"dtype": dtype}, advice_for(Code.AMP_INACTIVE.value)))


# How each way in gets the replay that names layer, op, line and samples, when it had none
_REPLAY_HOW = {
    "watch": "Pass step_fn=(model, batch) -> loss to nandoctor.watch to have the step replayed for the layer, op, "
             "source line and samples.",
    "hapi": "Construct NanDoctorCallback(replay=True) (the default) to have the step replayed for the layer, op, "
            "source line and samples.",
    "run": "nandoctor run could not replay this step (the loss is neither a paddle.nn.Layer nor computed from a "
           "tensor output of the model); write a spec for the model, data and loss and run `nandoctor probe` on "
           "it for the layer, op, source line and samples.",
    "trainer": "The Trainer's compute_loss could not be replayed; run `nandoctor probe` on a spec of the same "
               "model and data for the layer, op, source line and samples.",
}


# How each way in gets the layer, op, line and samples when its replay was tried and failed (`failed`: why)
_REPLAY_FAILED_HOW = {
    "watch": "Make step_fn(model, batch) compute the loss from the batch given to check() exactly as your loop "
             "does, and the step is replayed for them.",
    "run": "To have them, watch the loop with nandoctor.watch(model, optimizer, step_fn=...) in your script, with "
           "a step_fn that makes the model's inputs from the batch as your loop does before its model call, or "
           "run `nandoctor probe` on a spec of the same model, data and loss.",
    "hapi": "Run `nandoctor probe` on a spec of the same network, data and loss for them.",
    "trainer": "Run `nandoctor probe` on a spec of the same model and data for them.",
}


def _no_replay_said(mode: str, failed: str | None) -> str:
    """Why no layer, op, line or samples are named, and how this way in gets them."""
    if failed is None:
        return _REPLAY_HOW.get(mode, _REPLAY_HOW["watch"])
    who = "nandoctor run" if mode == "run" else "nandoctor"
    how = _REPLAY_FAILED_HOW.get(mode)
    return (f"{who} could not replay this step, so no layer, op, source line or samples are named: "
            f"{failed.rstrip('.')}." + (f" {how}" if how else ""))


def detection_only(report: Report, fault: Fault, model: Any, mode: str, failed: str | None = None) -> None:
    """No replay (none given, or `failed`: why it could not run): what the step's numbers say (loss or
    gradient, the first parameter whose gradient is non-finite), and how this way in gets the rest."""
    import paddle

    from nandoctor.tensors.convert import float_dtypes

    st = fault.stats
    loss_ok = st is not None and math.isfinite(st.loss)
    bad = [n for n, p in model.named_parameters()
           if p.grad is not None and p.grad.dtype in float_dtypes() and not bool(paddle.isfinite(p.grad).all())]
    phase = Phase.BACKWARD if loss_ok else Phase.LOSS
    code = Code.GRAD_NONFINITE if loss_ok else Code.LOSS_NONFINITE
    loc = Location(step=fault.step, phase=phase, parameter=bad[0] if bad and loss_ok else None,
                   batch_index=fault.batch_index)
    what = (f"A gradient became NaN/Inf at step {fault.step} while the loss was finite ({st.loss:.4g})"
            + (f"; first non-finite parameter gradient: {bad[0]}" if bad else "") if loss_ok else
            f"The loss became NaN/Inf at step {fault.step}")
    what += ". " + _no_replay_said(mode, failed)
    report.findings.append(Finding(code, Severity.ERROR, what, loc,
                                   {"loss": st.loss if st else None, "grad_norm": st.grad_norm if st else None,
                                    "nonfinite_grad_parameters": bad[:50], "localised": False},
                                   advice_for(code.value)))
    set_first(report, loc)


def loss_code_fault(report: Report, fault: Fault, outside: Any, mode: str) -> None:
    """A fault that began in the user's loss code, outside the model (`diagnose.LossCodeFault`): its phase,
    its samples where the checked pass bisected the batch through the loss function (else why none is
    named, with the rows of the gradient at the model's output as evidence), and its op where a pass saw it."""
    phase = outside.phase
    code = Code.LOSS_NONFINITE if phase == Phase.LOSS else Code.GRAD_NONFINITE
    bis = outside.samples or {}
    checked = bis.get("scope") is not None  # the bisection tried the samples apart
    samples = list(bis.get("samples") or []) if checked else None
    loc = Location(step=fault.step, phase=phase, layer=None, op=outside.op, batch_index=fault.batch_index,
                   sample_indices=samples)
    if checked:
        who = " " + _samples_said(fault.batch_index, samples, bis.get("reason")) + _bisected_with(bis)
    else:
        who = _not_named(outside, fault.batch_index, mode)
    what = _loss_code_what(fault, outside) + who + _loss_code_source_said(outside, mode)
    evidence = _loss_code_evidence(fault, outside, bis if checked else None)
    if outside.source:
        report.details["source"] = outside.source
    report.findings.append(Finding(code, Severity.ERROR, what, loc, evidence, advice_for(code.value, op=outside.op)))
    set_first(report, loc)


def _bisected_with(bis: dict[str, Any]) -> str:
    """How the samples were tried apart: the checked pass's replays through the model and the loss function."""
    fn = bis.get("function")
    return (f" Each part of the batch was replayed through the model and your loss function ({fn}) in the checked "
            "second pass." if fn else "")


_NOT_NAMED = {
    "inline": "your loss code is not a function that takes the model's output, which nandoctor could call again "
              "on part of the batch (it is written inline in the loop, or given a tensor derived from the output)",
    "no_batch": "the model's inputs have no common batch dimension to split",
    "not_reproduced": "no function of yours that took the model's output ({function}), replayed on the whole "
                      "batch through the model, faulted again: none of them is the loss, or all of it",
    "failed": "nandoctor's own replay of your loss function failed (a nandoctor bug, please report it)",
}


def _not_named(outside: Any, batch_index: int | None, mode: str) -> str:
    """Why no sample is named, and the rows of the gradient at the model's output that are NaN/Inf (evidence:
    a loss that mixes its rows spreads one sample's NaN to others, so they are not named as causes)."""
    bis = outside.samples or {}
    if bis.get("why") in _NOT_NAMED:
        why = _NOT_NAMED[bis["why"]].format(function=bis.get("function") or "?")
    elif outside.no_pass:
        why = f"this is {outside.no_pass}, where nandoctor run does not re-run the command to replay your loss code"
    elif mode == "run":
        why = "the checked second pass did not replay your loss code"
    else:
        why = "your loss code was not replayed on part of the batch"
    rows = outside.rows
    seen = ""
    if rows and outside.batch_size is not None and len(rows) >= outside.batch_size:
        seen = (f" The gradient that came back to the model's output is NaN/Inf in every row of batch {batch_index}, "
                "so it does not tell the samples apart.")
    elif rows:
        shown = ", ".join(str(r) for r in rows[:10]) + ("…" if len(rows) > 10 else "")
        seen = (f" The gradient that came back to the model's output is NaN/Inf in the rows of sample(s) {shown} of "
                f"batch {batch_index}: look at those first.")
    return f" No sample is named as a cause: {why}.{seen}"


def _loss_code_what(fault: Fault, outside: Any) -> str:
    """What went non-finite in the loss code: a value the loss's reduction left out, the loss, or a gradient."""
    st = fault.stats
    op = f" (op {outside.op})" if outside.op else ""
    loss_ok = st is not None and math.isfinite(st.loss)
    if outside.phase == Phase.LOSS and loss_ok:  # the forward made a NaN/Inf the loss's reduction left out
        return (f"A value in the loss code became NaN/Inf at step {fault.step}, outside the model{op}: the model's "
                f"outputs were finite, and the loss itself stayed finite ({st.loss:.4g}) but not its gradient.")
    if outside.phase == Phase.LOSS:
        return (f"The loss became NaN/Inf at step {fault.step} in the loss code, outside the model{op}: the model's "
                "outputs were finite.")
    return (f"A gradient became NaN/Inf at step {fault.step} in the backward pass of the loss code, outside the "
            f"model{op}, while the loss was finite ({st.loss:.4g}) and the model's outputs were finite.")


def _loss_code_source_said(outside: Any, mode: str) -> str:
    """The user's line that created the op, or why nandoctor run cannot name one."""
    if outside.source:
        return f" The op was created at {outside.source}."
    if mode == "run":
        return (" nandoctor run sees the model's outputs and the gradient that comes back to them, not your loss "
                "code's ops, so no op is named here.")
    return ""


def _loss_code_evidence(fault: Fault, outside: Any, bis: dict[str, Any] | None) -> dict[str, Any]:
    """The finding's evidence: the step's numbers, the output gradient's bad rows, the bisection's scope (or
    that there was none) and the pass's notes."""
    st = fault.stats
    rows = outside.rows
    evidence: dict[str, Any] = {"epoch": fault.epoch, "loss": st.loss if st else None,
                                "grad_norm": st.grad_norm if st else None, "localised": "outside_model"}
    if outside.source:
        evidence["source"] = outside.source
    if rows:
        evidence["nonfinite_output_grad_rows"] = list(rows[:100])
    notes = list(outside.notes)
    if bis is not None:
        evidence["samples_scope"] = bis["scope"]
        if bis.get("reason"):
            evidence["samples_reason"] = bis["reason"]
        notes += list(bis.get("notes") or [])
    else:
        evidence["samples_reason"] = "loss_code_not_replayed"
    if notes:
        evidence["notes"] = notes
    return evidence
