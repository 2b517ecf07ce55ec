"""What the model returned -> the tensor the loss gets, per `model.output`; mistakes become spec messages.

Real models return tuples, dicts and output objects (`out.logits`, `out.loss`). A builtin loss handed
one of those would fail deep inside Paddle or nandoctor with an AttributeError that reads like a bug
in the user's code; here it is a SpecError that says what the output holds and which key to write.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nandoctor.errors import SpecError
from nandoctor.spec import OUTPUT_LOSS

_HOW = ("set `model.output` to the key, attribute or position of the logits (e.g. `model.output: logits` or "
        "`model.output: 0`), `model.output: loss` if the model computes its own loss, or write a `loss.entry` "
        "or `step.entry` function that takes the output as it is")


def _is_tensor(value: Any) -> bool:
    import paddle

    return isinstance(value, paddle.Tensor)


def describe(outputs: Any) -> str:
    """A one-line account of an output: its kind and the keys, attributes or positions it offers."""
    if _is_tensor(outputs):
        return f"a Tensor of shape {list(outputs.shape)}"
    if isinstance(outputs, Mapping):
        return f"a {type(outputs).__name__} with keys {_names(list(outputs))}"
    if isinstance(outputs, (tuple, list)):
        parts = [f"[{i}] {_kind(v)}" for i, v in enumerate(outputs[:8])]
        more = ", ..." if len(outputs) > 8 else ""
        return f"a {type(outputs).__name__} of {len(outputs)} ({', '.join(parts)}{more})"
    attrs = attributes(outputs)
    if attrs:
        return f"a {type(outputs).__name__} object with attributes {_names(attrs)}"
    return f"a {type(outputs).__name__}"


def attributes(obj: Any) -> list[str]:
    """The public data attributes of an output object (what `model.output` may name)."""
    try:
        names = list(vars(obj))
    except TypeError:
        names = [n for n in dir(obj) if not callable(getattr(obj, n, None))]
    return [n for n in names if not n.startswith("_")]


def _kind(value: Any) -> str:
    if _is_tensor(value):
        return f"Tensor{list(value.shape)}"
    return "None" if value is None else type(value).__name__


def _names(names: list[Any]) -> str:
    shown = ", ".join(repr(n) for n in names[:12])
    return f"[{shown}{', ...' if len(names) > 12 else ''}]"


def pick(outputs: Any, selector: str | int, spec_path: Path) -> Any:
    """outputs[selector] / outputs.selector for `model.output`; a selector that does not fit is a SpecError."""
    where = f"{spec_path}: `model.output` is {selector!r}"
    if isinstance(selector, int):
        if not isinstance(outputs, (tuple, list)):
            raise SpecError(f"{where}, a position, but the model returned {describe(outputs)}. Write the key or "
                            "attribute name instead, or remove `model.output` if the output is the logits.")
        if not -len(outputs) <= selector < len(outputs):
            raise SpecError(f"{where}, but the model returned {describe(outputs)}; pick a position from 0 to "
                            f"{len(outputs) - 1}.")
        return outputs[selector]
    if isinstance(outputs, Mapping):
        if selector not in outputs:
            raise SpecError(f"{where}, but the model returned {describe(outputs)}; write one of those keys.")
        return outputs[selector]
    if isinstance(outputs, (tuple, list)) or _is_tensor(outputs) or not hasattr(outputs, selector):
        hint = " (a tuple is picked by position: write e.g. `model.output: 0`)" if isinstance(
            outputs, (tuple, list)) else ""
        raise SpecError(f"{where}, but the model returned {describe(outputs)}, which has no {selector!r}{hint}.")
    return getattr(outputs, selector)


def own_loss(outputs: Any, spec_path: Path) -> Any:
    """The loss a model computed itself (`model.output: loss`): the tensor, `["loss"]`, `.loss` or `[0]`."""
    if _is_tensor(outputs):
        return outputs
    if isinstance(outputs, Mapping):
        loss = outputs.get("loss")
    elif isinstance(outputs, (tuple, list)):
        loss = outputs[0] if outputs else None
    else:
        loss = getattr(outputs, "loss", None)
    if not _is_tensor(loss):
        found = "no loss" if loss is None else f"a {type(loss).__name__} as its loss"
        raise SpecError(f"{spec_path}: `model.output` is `loss`, but the model returned {describe(outputs)}, "
                        f"with {found}. Most models compute the loss only when given the labels: map them in "
                        "`data.inputs`, e.g. `inputs: {input_ids: input_ids, labels: labels}`; or set "
                        "`model.output` to the logits and add a `loss` block.")
    return loss


def for_builtin(outputs: Any, loss_name: str, spec_path: Path) -> Any:
    """A builtin loss needs one tensor; anything else is a spec-level message saying what to write."""
    if _is_tensor(outputs):
        return outputs
    raise SpecError(f"{spec_path}: `loss.builtin: {loss_name}` needs the model's output to be one Tensor, but "
                    f"the model returned {describe(outputs)}. To fix it, {_HOW}.")


def select(outputs: Any, selector: str | int | None, spec_path: Path) -> Any:
    """Apply `model.output` (None: the output as it is; `loss`: the model's own loss)."""
    if selector is None:
        return outputs
    if selector == OUTPUT_LOSS:
        return own_loss(outputs, spec_path)
    return pick(outputs, selector, spec_path)
