"""A remedy's change as the user makes it: spec keys and values for a spec, Python for a script.

A remedy that changes the run's settings (clipping, the learning rate, a warmup) carries its change as a
mapping, `spec_change`: dotted spec key -> the value to set; `change_text` spells it in the mode the user ran.
"""

from __future__ import annotations

from typing import Any

from nandoctor.advice import LR_KEY, finite_rows_expr, flow_yaml, lr_edit, num3, setting_text, spec_mode
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
