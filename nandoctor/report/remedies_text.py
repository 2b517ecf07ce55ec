"""Shared wording for the remedies section (console and Markdown): one place for labels and numbers, and
the remedies' `change` texts.

A remedy that changes the run's settings (clipping, the learning rate, a warmup) carries its change as a
mapping, `spec_change`: dotted spec key -> the value to set there (replacing what is there), e.g.
`{"optimizer.grad_clip": {"global_norm": 126.0}}`. Only keys the spec validator accepts are named: with
an `optimizer.lr_scheduler`, the base rate is still `optimizer.args.learning_rate`. Its `change` text is
rendered from the mapping: for a spec, YAML that loads back to the same mapping (`yaml.safe_load`),
with a `# comment` saying what it was; for a user's own script, the Python or TrainingArguments field.
"""

from __future__ import annotations

from typing import Any

from nandoctor.advice import LR_KEY, finite_rows_expr, flow_yaml, lr_edit, num3, setting_text, spec_mode
from nandoctor.findings import Mode
from nandoctor.report.common import fmt_value

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


OUTCOME_LABEL = {"fixed": "verified fix", "not_fixed": "did not help", "not_applicable": "not applicable"}


def outcome_label(row: dict[str, Any]) -> str:
    return OUTCOME_LABEL.get(str(row.get("outcome")), str(row.get("outcome")))


def loss_text(row: dict[str, Any]) -> str:
    before, after = row.get("loss_before"), row.get("loss_after")
    if before is None and after is None:
        return "-"
    return f"{fmt_value(before) if before is not None else '-'} → {fmt_value(after) if after is not None else '-'}"


def run_text(row: dict[str, Any]) -> str:
    """'20 steps from step 6 (0.02 s)', or the reason it was not run."""
    if row.get("outcome") == "not_applicable":
        return str(row.get("note") or "")
    start = row.get("start_step")
    since = f" from step {start}" if start is not None else ""
    out = f"{row.get('steps_run', 0)} steps{since} ({fmt_value(row.get('seconds', 0))} s)"
    return out + (f"; {row['note']}" if row.get("note") else "")


def notice(report: Any) -> str | None:
    """Why there is no remedies table: nandoctor's own replay failed, or replays do not apply here."""
    info = report.details.get("remedies")
    if not isinstance(info, dict):
        return None
    text = info.get("error") or info.get("note")
    return str(text) if text else None


def summary_line(report: Any) -> str | None:
    """'Each remedy was replayed from a saved state to step 36; the fault reproduced in a replay without any
    change.' The replays' timings, budget and snapshot ring are nandoctor's own figures: JSON only."""
    info = report.details.get("remedies")
    if not isinstance(info, dict):
        return None
    if notice(report):
        return notice(report)
    control = info.get("control") or {}
    if not control:
        repro = "no replay without a change was possible"
    elif control.get("reproduced") is None:
        repro = "the replay without any change ran out of time, so reproduction is unchecked"
    elif control.get("reproduced"):
        repro = "the fault reproduced in a replay without any change"
    else:
        repro = "the fault did NOT reproduce in a replay without any change, so outcomes are not evidence"
    end = info.get("end_step")
    to = f" to step {end}" if end is not None else ""
    ring = report.details.get("snapshots") or {}
    where = ("on the failing step alone (no room in memory or on disk for a snapshot of an earlier state)"
             if ring.get("enabled") is False else "from a saved state")
    return f"Each remedy was replayed {where}{to}; {repro}."


def skip_list_text(row: dict[str, Any]) -> str | None:
    import json

    sl = row.get("skip_list")
    return None if not sl else json.dumps(sl)
