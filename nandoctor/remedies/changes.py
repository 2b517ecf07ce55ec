"""A remedy's change as the user makes it: spec keys and values for a spec, Python for a script.

A remedy that changes the run's settings (clipping, the learning rate, a warmup) carries its change as a
mapping, `spec_change`: dotted spec key -> the value to set; `change_text` spells it in the mode the user ran.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from nandoctor.advice import (
    LR_KEY,
    Z_LOSS_ENTRY,
    coef_text,
    finite_rows_expr,
    flow_yaml,
    lr_edit,
    num3,
    setting_text,
    spec_mode,
    z_loss_line,
    z_loss_term,
)
from nandoctor.findings import Mode

CLIP_KEY = "optimizer.grad_clip"


WARMUP_KEY = "optimizer.lr_scheduler.warmup"


def change_text(edit: dict[str, Any], note: str | None = None, mode: Mode | str | None = None) -> str:
    """A `spec_change` as the user writes it: `key: value` lines for a spec (with `note` as a YAML comment),
    else the Python (or TrainingArguments) for their script."""
    if spec_mode(mode):
        lines = [f"{key}: {flow_yaml(value)}" for key, value in edit.items()]
        if note:
            lines[-1] += f"  # {note}"
        return "\n".join(lines)
    parts = []
    for key, value in edit.items():
        if key == CLIP_KEY:
            parts.append(setting_text("clip", next(iter(value.values())), mode))
        elif key == LR_KEY:
            parts.append(setting_text("lr", value, mode))
        elif key == WARMUP_KEY:
            parts.append(setting_text("warmup", value["steps"], mode))
        else:
            parts.append(f"{key} = {value!r}")
    # the renderers put a change in a code span already
    return "; ".join(parts).replace("`", "") + (f" ({note})" if note else "")


def clip_change(norm: float) -> dict[str, Any]:
    return {CLIP_KEY: {"global_norm": num3(norm)}}


def warmup_change(steps: int) -> dict[str, Any]:
    """A linear warmup from 0 over `steps`: valid with or without a scheduler (it wraps the one there)."""
    return {WARMUP_KEY: {"steps": int(steps), "start_lr": 0.0}}


def lr_change(optimizer_spec: Any, lr: float | None, scale: float) -> tuple[dict[str, Any] | None, str]:
    """The learning rate times `scale` as a spec edit and a note (advice.lr_edit: only keys the validator
    accepts; None for a scheduler of the user's own `entry`)."""
    return lr_edit(optimizer_spec, scale, lr)


def drop_nonfinite_text(fault: Any, rows: list[int]) -> str:
    """Filter the samples holding NaN/Inf out in the loader, with a mask that fits each bad field's shape
    (`fault.bad_fields` names them, `fault.fields` holds the batch)."""
    shapes = {n: getattr((fault.fields or {}).get(n), "shape", None) for n in fault.bad_fields}
    masks = " & ".join(finite_rows_expr(n, len(s)) for n, s in shapes.items() if s is not None)
    keep = f"keep the samples where {masks}" if masks else "keep the samples with no NaN/Inf in any field"
    return (f"filter samples holding NaN/Inf out in the loader ({keep}), first found: sample(s) {rows} of batch "
            f"{fault.batch_index}")


def fingerprints_text(fault: Any, rows: list[int], prints: list[str]) -> str:
    """Leave out records a loader without a batch sampler cannot name by index: named by their values'
    fingerprint (tensors/fingerprint.py), with how to compute it in the user's data code."""
    return (f"leave out the record(s) of sample(s) {rows} of batch {fault.batch_index} (epoch {fault.epoch}) wherever "
            f"they come again: no batch sampler names them by index, so they go by their values' fingerprint {prints} "
            "(hashlib.blake2b(digest_size=6), updated for each field in name order with f'{name}:{row.dtype.str}:' "
            "and the row's bytes); fix or filter those records in your data code")


Z_LOSS_FILE = Z_LOSS_ENTRY.partition(":")[0]
# the spec's builtin losses as Python on (logits, label), as workload.builtin_loss computes them
_BUILTIN = {
    "cross_entropy": 'F.cross_entropy(logits, label.astype("int64").reshape([*logits.shape[:-1], 1]))',
    "bce_with_logits": "F.binary_cross_entropy_with_logits(logits, label.astype(logits.dtype).reshape(logits.shape))",
    "mse": "F.mse_loss(logits, label.astype(logits.dtype).reshape(logits.shape))",
    "l1": "F.l1_loss(logits, label.astype(logits.dtype).reshape(logits.shape))",
}


def z_loss_change(spec: Any, head: str, coef: float,
                  mode: Mode | str | None = None) -> tuple[str, dict[str, Any] | None]:
    """The z-loss on layer `head`'s output as the user adds it: for a spec whose `loss` block names the loss, a
    loss entry wrapping theirs (the YAML line, and the file to write beside the spec as YAML comments); for a
    `step` entry or a model that computes its own loss, the line to add there; in a script, the line to add
    right after their loss. The `spec_change` is None where no spec key makes the change."""
    line = z_loss_line(head, coef)
    if not spec_mode(mode):
        return f"right after your loss: {line}", None
    loss = getattr(spec, "loss", None)
    if loss is None or not (loss.builtin or loss.entry):
        where = f"your step function ({spec.step.entry})" if getattr(spec, "step", None) else "your model's forward"
        return f"in {where}, right after the loss: {line}", None
    edit = {"loss": {"entry": Z_LOSS_ENTRY}}
    call, imports = _loss_call(loss)
    body = [f"# {Z_LOSS_FILE}, beside this YAML file: your loss ({loss.builtin or loss.entry}) plus the z-loss on "
            f"the output of layer {head}, which the loss gets as logits:",
            *[f"# {i}" for i in imports],
            "# def loss_with_z_loss(logits, label):",
            f"#     return {call} + {z_loss_term(coef)}"]
    return "\n".join([change_text(edit, f"your loss plus a z-loss of {coef_text(coef)}"), *body]), edit


def _loss_call(loss: Any) -> tuple[str, list[str]]:
    """The spec's own loss as a call on (logits, label), and the imports it needs (a file entry imported by its
    path from the spec's folder, which is importable while the user's code runs; by its name alone when it
    lies elsewhere)."""
    if loss.builtin:
        return _BUILTIN[loss.builtin], ["import paddle", "import paddle.nn.functional as F"]
    source, _, name = loss.entry.partition(":")
    if source.endswith(".py"):
        path = PurePosixPath(source.replace("\\", "/"))
        inside = not path.is_absolute() and ".." not in path.parts
        source = ".".join(path.with_suffix("").parts) if inside else path.stem
    return f"{name}(logits, label)", ["import paddle", f"from {source} import {name}"]
