"""Shared wording for the remedies section (console and Markdown): one place for labels and numbers.

The `change` texts themselves are made where the remedies are (remedies/changes.py).
"""

from __future__ import annotations

from typing import Any

from nandoctor.report.common import fmt_value

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
    what = _answered(info)
    if not control:
        repro = "no replay without a change was possible"
    elif control.get("reproduced") is None:
        repro = "the replay without any change ran out of time, so reproduction is unchecked"
    elif control.get("reproduced"):
        repro = f"{what} reproduced in a replay without any change"
    else:
        repro = f"{what} did NOT reproduce in a replay without any change, so outcomes are not evidence"
    end = info.get("end_step")
    to = f" to step {end}" if end is not None else ""
    ring = report.details.get("snapshots") or {}
    where = ("on the failing step alone (no room in memory or on disk for a snapshot of an earlier state)"
             if ring.get("enabled") is False else "from a saved state")
    return f"Each remedy was replayed {where}{to}; {repro}."


def _answered(info: dict[str, Any]) -> str:
    """What the replays answered: the fault, the loss's divergence, or a run's precursor warnings and spikes."""
    if info.get("of") == "loss.divergence":
        return "the loss's divergence"
    warnings = info.get("warnings")
    if isinstance(warnings, list) and warnings:
        return "the warning(s) " + ", ".join(sorted({str(w.get("code")) for w in warnings}))
    return "the fault"


def skip_list_text(row: dict[str, Any]) -> str | None:
    import json

    sl = row.get("skip_list")
    return None if not sl else json.dumps(sl)
