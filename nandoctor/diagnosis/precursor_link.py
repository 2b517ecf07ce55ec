"""A fault that a precursor's growth or the loss's divergence came before (issue 35): the fault's finding says so.

The replay names the op, the layer and the samples of the faulting batch, and the samples are where the
values overflowed first; but when attention logits, log Z or a layer's output had been growing for tens
of steps before it, those samples are not the cause alone. The fault's finding (and a note that would blame
the samples instead of a modest gradient growth) then names the precursor, its start and its lead.
"""

from __future__ import annotations

from typing import Any

from nandoctor.findings import Code, Finding, Report, Severity

PRECURSOR_CODES = (Code.ATTENTION_LOGIT_GROWTH, Code.OUTPUT_LOGIT_DIVERGENCE, Code.ACTIVATION_NORM_GROWTH)


def link_precursors(report: Report, fault_step: int | None) -> None:
    """Point the fault's findings at the precursors whose growth began before `fault_step`; a note that
    blamed the batch's samples instead of the gradient's growth names them, or the loss's divergence, too
    (the fault's own finding names a divergence already: _note_divergence)."""
    if fault_step is None:
        return
    _note_divergence(report, next((f for f in report.findings if f.code == Code.LOSS_DIVERGENCE), None), fault_step)
    growths = sorted((f for f in report.findings if f.code in (*PRECURSOR_CODES, Code.LOSS_DIVERGENCE)
                      and f.location.step is not None and f.location.step < fault_step),
                     key=lambda f: f.location.step)
    before = [f for f in growths if f.code in PRECURSOR_CODES]
    for f in report.findings:
        if f.severity == Severity.ERROR and f.location.step == fault_step and before:
            f.message += (f" It did not come from nowhere: {_text(before, fault_step)}. The samples named are "
                          "where that growth overflowed first, not its cause alone: fix the growth (see the "
                          "warning's advice).")
            f.evidence["precursors"] = _refs(before)
        elif f.code == Code.GRAD_EXPLOSION and f.severity == Severity.INFO and "not the growth" in f.message \
                and growths:
            f.message = _unblame(f, _text(growths, fault_step))
            f.evidence["precursors"] = _refs(growths)


def _text(growths: list[Finding], fault_step: int) -> str:
    return "; ".join(_summary(f, fault_step) for f in growths)


def _refs(growths: list[Finding]) -> list[dict[str, Any]]:
    return [{"code": f.code.value, "layer": f.evidence.get("layer"), "start_step": f.location.step,
             "lead_steps": f.evidence.get("lead_steps")} for f in growths]


def _summary(f: Finding, fault_step: int) -> str:
    ev: dict[str, Any] = f.evidence
    what = {Code.ATTENTION_LOGIT_GROWTH: "the largest attention logit", Code.OUTPUT_LOGIT_DIVERGENCE: "|log Z|",
            Code.ACTIVATION_NORM_GROWTH: "the output RMS", Code.LOSS_DIVERGENCE: "the loss"}[f.code]
    of = f" of {ev.get('layer')}" if ev.get("layer") else ""
    return (f"{what}{of} grew from {ev.get('early_level', 0):.3g} to {ev.get('level', 0):.3g} from "
            f"step {f.location.step}, {fault_step - f.location.step} steps before it ({f.code.value})")


def _unblame(f: Finding, text: str) -> str:
    """A note that said the batch's samples, not the gradient's modest growth, made the fault: with a precursor
    before it, both grew out of the same instability."""
    head = f.message.split("; but the fault reproduces", 1)[0]
    return (f"{head}. The fault also reproduces with a few samples of its batch alone, but {text}: the samples "
            "are where the growth overflowed first, not its cause alone.")


def _note_divergence(report: Report, divergence: Finding | None, fault_step: int) -> None:
    """The fault's own finding says that the loss had been diverging: it was not only the last batch's doing."""
    if divergence is None:
        return
    ev = divergence.evidence
    fault = next((f for f in report.findings if f.severity == Severity.ERROR and f.location.step == fault_step),
                 None)
    if fault is None:
        return
    fault.message += (f" It came {ev['lead_steps']} step(s) after the loss began to diverge (step "
                      f"{ev['start_step']}: from its minimum {ev['min_loss']:.3g} at step {ev['min_step']} to "
                      f"{ev['level']:.3g}; see loss.divergence): the run was diverging before this batch, so look "
                      "at the step size as well as at the batch.")
    fault.evidence["precursor"] = {"code": Code.LOSS_DIVERGENCE.value, "start_step": ev["start_step"],
                                   "lead_steps": ev["lead_steps"]}
