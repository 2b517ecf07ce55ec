"""Facts the data checks read from the model: its position tables, the width and the scale of its output.

The scale is for a regression target far from unit scale (`data.target_scale`): targets in the thousands
under an MSE loss give first losses in the millions and gradients to match, a common first cause of an
exploding loss. The target's RMS is compared with the RMS of the model's initial output on the same rows.

Kept apart from data.py because these are the only places the data scan touches the model, and they
must leave it exactly as they found it (eval mode restored, no gradients recorded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from nandoctor.advice import advice_for
from nandoctor.findings import Code, Finding, Location, Phase, Severity


def position_tables(model: Any) -> list[tuple[str, int]]:
    """(dotted name, num_embeddings) of every nn.Embedding whose name says it holds positions."""
    import paddle

    out = []
    for name, layer in model.named_sublayers():
        if isinstance(layer, paddle.nn.Embedding) and "pos" in name.lower():
            out.append((name, int(layer.weight.shape[0])))
    return out


# The model's first forward in a scan runs on at most this many samples of the first batch: its output
# width and scale need a few rows, and the whole batch would cost the model's activations for every row
# (a 100 MB batch of 8 features through a Linear(8, 16) was 400 MB of activations: issue 34, item 9).
FORWARD_ROWS = 64


def first_rows(fields: dict[str, Any], n: int | None) -> dict[str, Any]:
    """The batch cut to its first FORWARD_ROWS samples (fields without that leading dimension kept whole)."""
    from nandoctor.tensors.sizes import subset

    if n is None or n <= FORWARD_ROWS:
        return fields
    return subset(fields, list(range(FORWARD_ROWS)))


def eval_outputs(model: Any, call: Callable[..., Any]) -> Any:
    """The model's output in eval mode without gradients; the mode is restored however the call ends.
    `call` runs the model as the user's code (exceptions become UserCodeError)."""
    import paddle

    was_training = model.training
    model.eval()
    try:
        with paddle.no_grad():
            return call(model)
    finally:
        if was_training:
            model.train()


def first_output(outputs: Any) -> Any:
    """The tensor the loss would get: the first of a tuple or list."""
    if isinstance(outputs, (tuple, list)) and outputs:
        return outputs[0]
    return outputs


def num_classes_from(outputs: Any, label: Any) -> tuple[int | None, str]:
    """The number of classes from the model's output width, or None and why not.

    Only when the label is an integer array and the output is a 2-D+ tensor whose leading dims match
    the label's (logits [B, C] for labels [B] or [B, 1]; [B, L, V] for [B, L]) and whose last dim is
    > 1: anything else (regression, NCHW segmentation logits) would give a wrong count, so no guess.
    """
    from nandoctor.tensors.convert import to_numpy

    label_arr = to_numpy(label)
    if label_arr is None or label_arr.dtype.kind not in "iu":
        return None, "the label is not an integer array"
    outputs = first_output(outputs)
    shape = getattr(outputs, "shape", None)
    if shape is None or len(shape) < 2 or int(shape[-1]) <= 1:
        shown = None if shape is None else list(shape)
        return None, f"the model's output has shape {shown}, not [..., classes]"
    out_lead = [int(s) for s in shape[:-1]]
    lab_shape = list(label_arr.shape)
    if len(lab_shape) == len(out_lead) + 1 and lab_shape[-1] == 1:
        lab_shape = lab_shape[:-1]
    if lab_shape != out_lead:
        return None, (f"the model's output shape {list(shape)} does not line up with the label shape "
                      f"{list(np.shape(label_arr))}")
    return int(shape[-1]), f"the width of the model's output ({int(shape[-1])}) on the first batch"


@dataclass
class Scales:
    """RMS and max |value| of a float array, computed in float64."""

    rms: float
    max_abs: float
    values: int


def scales(value: Any) -> Scales | None:
    """The RMS and max |value| of a float tensor or array (float64 on the host); None for anything else,
    or when a value is not finite (the NaN checks report that, not a scale)."""
    from nandoctor.tensors.convert import to_numpy

    arr = to_numpy(value)
    if arr is None or arr.dtype.kind != "f" or arr.size == 0:
        return None
    x = arr.astype(np.float64)
    if not np.isfinite(x).all():
        return None
    return Scales(float(np.sqrt(np.mean(x * x))), float(np.abs(x).max()), int(x.size))


# A target this many times the model's initial output RMS (and a decade beyond unit scale) is flagged
TARGET_SCALE_RATIO = 100.0
TARGET_SCALE_FLOOR = 10.0


@dataclass
class TargetCheck:
    """A float label's scale against the model's initial output on the same rows of one batch."""

    field: str
    batch_index: int
    rows: int  # samples of that batch the forward ran on
    target: Scales
    output: Scales
    loader: str = "data.entry"  # the spec's data.entry, where the advice says to standardise

    @property
    def ratio(self) -> float:
        return self.target.rms / self.output.rms if self.output.rms > 0 else math.inf

    def far(self) -> bool:
        """Whether the target is far above the output: >= TARGET_SCALE_RATIO x its RMS and >= 10 in RMS
        (a tiny initial output against targets near 1 is not a target far from unit scale)."""
        return (self.output.rms > 0 and self.ratio >= TARGET_SCALE_RATIO
                and self.target.rms >= TARGET_SCALE_FLOOR)


def target_check(field: str, batch_index: int, label: Any, outputs: Any, loader: str) -> TargetCheck | None:
    """The measurement, or None when the label or the output is not a finite float tensor."""
    target, output = scales(label), scales(first_output(outputs))
    if target is None or output is None:
        return None
    rows = getattr(label, "shape", [0])
    return TargetCheck(field, batch_index, int(rows[0]) if len(rows) else 1, target, output, loader)


def target_scale_finding(check: TargetCheck, mean: float | None, std: float | None,
                         batches: int) -> Finding | None:
    """`data.target_scale` when the target is far from the output's scale; `mean`/`std` are the target's over
    the `batches` scanned (the values to standardise with)."""
    if not check.far():
        return None
    t, o, name = check.target, check.output, check.field
    how = (f"({name} - {mean:.6g}) / {std:.6g} (its mean and std over the {batches} batch(es) scanned)"
           if mean is not None and std else f"({name} - mean) / std (over the training set)")
    return Finding(
        Code.DATA_TARGET_SCALE, Severity.WARNING,
        f"Target '{name}' has RMS {t.rms:.4g} (max |value| {t.max_abs:.4g}) on the first {check.rows} sample(s) "
        f"of batch {check.batch_index}, {check.ratio:.3g}x the RMS of the model's initial output on the same "
        f"samples ({o.rms:.3g}, max |value| {o.max_abs:.3g}). A regression target this far from the output's "
        "scale makes the first losses and gradients huge (under MSE, the square of the gap): a common first "
        f"cause of an exploding loss. Standardise '{name}' in the dataset or loader.",
        Location(phase=Phase.DATA, batch_index=check.batch_index, field=name),
        {"target_rms": t.rms, "target_max_abs": t.max_abs, "output_rms": o.rms, "output_max_abs": o.max_abs,
         "ratio": check.ratio, "rows": check.rows, "threshold": TARGET_SCALE_RATIO, "target_mean": mean,
         "target_std": std},
        [f"In `{check.loader}` (the spec's data.entry), yield '{name}' as {how}; keep the two numbers to turn "
         "predictions back into the original units.", *advice_for(Code.DATA_TARGET_SCALE.value)])
