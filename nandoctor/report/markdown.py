"""The Markdown report: GitHub-flavoured, for bug tickets, readable by someone who has never run nandoctor.

Sections, in the order a maintainer reads them: verdict and summary, the first fault, the findings,
what to do, the timeline, data fields (scan), plots, environment, how to reproduce. Pure text in, text
out; the output is byte-stable for a given Report (golden tests rely on it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from nandoctor.findings import Finding, Report
from nandoctor.report.common import (
    VERDICT_TEXT,
    as_float,
    downsample,
    fault_step,
    field_table,
    fmt_number,
    fmt_value,
    ordered_stats,
    summary_parts,
)

TIMELINE_ROWS = 30


def render(report: Report) -> str:
    """The whole report as Markdown, ending in a newline."""
    out: list[str] = [f"# nandoctor {report.command}: {VERDICT_TEXT[report.verdict]}", ""]
    if report.partial:
        out += ["> **Partial report.** The run was interrupted before it finished; everything below covers "
                "only what was seen until then.", ""]
    out += [f"**Verdict:** `{report.verdict.value}` · " + " · ".join(summary_parts(report))
            + f" · exit status {report.exit_code}", ""]
    out += _first_fault(report)
    out += _findings(report)
    out += _advice(report)
    out += _timeline(report)
    out += _fields(report)
    out += _plots(report)
    out += _environment(report)
    out += _reproduce(report)
    while out and out[-1] == "":
        out.pop()
    return "\n".join(out) + "\n"


def cell(value: Any, code: bool = False) -> str:
    """A table cell: `|` escaped, newlines folded, empty shown as an em dash, optionally as code."""
    if value is None or (isinstance(value, (str, list, tuple)) and len(value) == 0):
        return "—"
    text = fmt_value(value) if not isinstance(value, str) else value
    text = text.replace("\r", "").replace("\n", "<br>").replace("|", "\\|")
    if code and "`" not in text:
        return f"`{text}`"
    return text


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A GitHub table from already-escaped cells."""
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines + [""]


def _first_fault(report: Report) -> list[str]:
    ff = report.first_fault
    if ff is None:
        return []
    samples = ", ".join(str(i) for i in ff.sample_indices) if ff.sample_indices else None
    out = ["## First fault", ""]
    out += table(("step", "phase", "layer", "op", "parameter", "batch", "samples"),
                 [(cell(ff.step), cell(ff.phase.value), cell(ff.layer, code=True), cell(ff.op, code=True),
                   cell(ff.parameter, code=True), cell(ff.batch_index), cell(samples))])
    source = report.details.get("source")
    if source:
        out += [f"The offending op was created at `{source}` (the user's code).", ""]
    stats = report.details.get("offending_tensor")
    if isinstance(stats, dict) and stats:
        out += ["Offending tensor:", ""]
        out += table(("statistic", "value"), [(cell(k), cell(fmt_value(v))) for k, v in ordered_stats(stats)])
    return out


def _findings(report: Report) -> list[str]:
    findings = report.sorted_findings()
    if not findings:
        return ["## Findings", "", "No findings: nothing non-finite, nothing at risk.", ""]
    rows = [(str(i), f.severity.value, cell(_code(f), code=True), cell(f.location.describe()),
             cell(f.message)) for i, f in enumerate(findings, 1)]
    return ["## Findings", ""] + table(("#", "severity", "code", "where", "message"), rows)


def _code(f: Finding) -> str:
    return getattr(f.code, "value", str(f.code))


def _advice(report: Report) -> list[str]:
    findings = report.sorted_findings()
    if not any(f.advice or f.evidence for f in findings):
        return []
    out = ["## What to do", ""]
    for i, f in enumerate(findings, 1):
        if not (f.advice or f.evidence):
            continue
        out += [f"### {i}. `{_code(f)}` ({f.severity.value}): {f.location.describe()}", ""]
        out += [f"- {line}" for line in f.advice]
        if f.evidence:
            evidence = "; ".join(f"{k}: {fmt_value(v)}" for k, v in f.evidence.items())
            out += ([""] if f.advice else []) + [f"Evidence: {evidence}"]
        out.append("")
    return out


def _timeline(report: Report) -> list[str]:
    points = report.timeline
    if not points:
        return []
    fault = fault_step(report)
    shown = downsample(points, fault, TIMELINE_ROWS)
    with_scale = any(as_float(p.loss_scale) is not None for p in points)
    with_skipped = any(p.skipped for p in points)
    header = ["step", "loss", "grad norm"] + (["loss scale"] if with_scale else []) + (
        ["skipped"] if with_skipped else [])
    rows = []
    for p in shown:
        row = [f"**{p.step}** (fault)" if p.step == fault else str(p.step), fmt_number(p.loss),
               fmt_number(p.grad_norm)]
        if with_scale:
            row.append(fmt_number(p.loss_scale))
        if with_skipped:
            row.append("yes" if p.skipped else "")
        rows.append(row)
    out = ["## Timeline", ""]
    if len(shown) < len(points):
        out += [f"{len(shown)} of {len(points)} steps shown (always the first, the last and the fault step).",
                ""]
    return out + table(header, rows)


def _fields(report: Report) -> list[str]:
    found = field_table(report.details.get("fields"))
    if found is None:
        return []
    headers, rows = found
    return ["## Data fields", ""] + table(headers, [[cell(row[0], code=True)] + [cell(x) for x in row[1:]]
                                                    for row in rows])


def _plots(report: Report) -> list[str]:
    plots = report.details.get("plots")
    if not isinstance(plots, dict) or not plots:
        return []
    out = ["## Plots", ""]
    for title, path in plots.items():
        alt = str(title).replace("[", "\\[").replace("]", "\\]")
        out += [f"![{alt}]({str(path).replace(' ', '%20')})", ""]
    return out


def _environment(report: Report) -> list[str]:
    if not report.environment:
        return []
    rows = [(cell(k), cell(fmt_value(v, limit=400))) for k, v in report.environment.items()]
    return ["## Environment", ""] + table(("item", "value"), rows)


def _reproduce(report: Report) -> list[str]:
    command = report.run.get("command_line")
    if not command and report.run.get("config"):
        command = f"nandoctor {report.command} {report.run['config']}"
    out = ["## How to reproduce", ""]
    if command:
        out += ["```shell", str(command), "```", ""]
    else:
        out += ["The command line was not recorded.", ""]
    extra = {k: v for k, v in report.run.items() if k != "command_line" and v is not None}
    if extra:
        out += ["Run settings: " + ", ".join(f"{k} `{fmt_value(v)}`" for k, v in extra.items()), ""]
    return out
