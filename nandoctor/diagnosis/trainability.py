"""Losses and models that cannot train, as findings that say what to write instead.

Paddle accepts all three silently or fails far from the cause: `backward()` on a non-scalar loss
backpropagates its sum, a loss cut off from the parameters leaves every gradient empty and the
optimizer stepping nothing, and an optimizer over no parameter trains nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nandoctor.findings import Code, Finding, Location, Phase, Severity

if TYPE_CHECKING:  # (annotations only: a watched process does not load the spec's parser)
    from nandoctor.spec import Spec


def loss_source(spec: Spec, uses_step: bool) -> str:
    if uses_step and spec.step is not None:
        return f"step.entry {spec.step.entry}"
    if spec.loss is not None and spec.loss.entry is not None:
        return f"loss.entry {spec.loss.entry}"
    if spec.loss is not None and spec.loss.builtin is not None:
        return f"loss.builtin {spec.loss.builtin}"
    return "the loss"


def loss_finding(fault: Any, where: str) -> Finding:
    """A `loss.not_tensor`, `loss.not_scalar` or `loss.no_grad` error for the step the loss was seen at;
    `where` names the loss's code as the user wrote it (`loss_source`)."""
    loc = Location(step=fault.step, phase=fault.phase or Phase.LOSS, batch_index=fault.batch_index)
    ev = dict(fault.evidence)
    ev["source"] = where
    if fault.code == Code.LOSS_NOT_TENSOR:
        return Finding(
            Code.LOSS_NOT_TENSOR, Severity.ERROR,
            f"The loss from {where} is a {ev.get('type')}, not a paddle.Tensor, so nothing can be backpropagated "
            f"and the probe stopped at step {fault.step}. Return the loss tensor itself, e.g. `return "
            "F.cross_entropy(out, label)`, without .item(), float() or .numpy() (log those separately).",
            loc, ev,
            ["Return the loss tensor; turn it into a number only for logging, after the step."])
    if fault.code == Code.LOSS_NOT_SCALAR:
        shape = ev.get("shape")
        return Finding(
            Code.LOSS_NOT_SCALAR, Severity.ERROR,
            f"The loss from {where} has shape {shape}, not a single number: Paddle's backward() would silently "
            f"train on the sum of its {_numel(shape)} values, so the probe stopped at step {fault.step}. Reduce "
            "it to a scalar at the end of your loss, e.g. `return loss.mean()` (or `reduction='mean'`).",
            loc, ev,
            ["Return `loss.mean()` (or `.sum()` if you mean the sum) from the loss or step function.",
             "With `reduction='none'`, reduce the per-sample losses yourself before returning them."])
    reason = ev.get("reason")
    why = ("it does not require a gradient (stop_gradient is True): it was computed under paddle.no_grad(), "
           "from .detach()ed or .numpy() values, or only from the data" if reason == "stop_gradient" else
           "after backward() no trainable parameter has a gradient: the loss does not depend on any of them")
    return Finding(
        Code.LOSS_NO_GRAD, Severity.ERROR,
        f"The loss from {where} cannot train the model: {why} (step {fault.step}). Compute the loss from the "
        "model's output in the same graph: `out = model(x); loss = F.cross_entropy(out, label)`, with no "
        "paddle.no_grad(), .detach() or .numpy() between them.",
        loc, ev,
        ["Return a loss built from `model(...)`'s output without detaching it.",
         "Check that the parameters the loss uses have `stop_gradient=False` (not frozen)."])


def no_trainable_finding(spec: Spec, model: Any) -> Finding:
    """`model.no_trainable`: every parameter is frozen (or there is none), checked before training."""
    n = len(list(model.parameters()))
    what = ("has no parameter at all" if n == 0 else
            f"has {n} parameter(s), all frozen (stop_gradient=True)")
    return Finding(
        Code.MODEL_NO_TRAINABLE, Severity.ERROR,
        f"The model from model.entry {spec.model.entry} {what}, so an optimizer has nothing to train and the "
        "probe did not start. Unfreeze the layers to train (`for p in layer.parameters(): p.stop_gradient = "
        "False`, or `trainable=True` in their ParamAttr), or return the model that holds them.",
        Location(phase=Phase.PARAMS), {"parameters": n, "trainable": 0},
        ["Set `stop_gradient = False` on the parameters you want to train.",
         "If you freeze a backbone, leave at least the head trainable."])


def _numel(shape: Any) -> int:
    n = 1
    for d in shape or []:
        n *= int(d)
    return n
