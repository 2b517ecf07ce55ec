"""The Markdown report: GitHub-flavoured, for bug tickets, readable by someone who has never run nandoctor.

Sections, in the order a maintainer reads them: verdict and summary, the first fault, the findings,
what to do, the timeline, data fields (scan), plots, environment, how to reproduce. Pure text in, text
out; the output is byte-stable for a given Report (golden tests rely on it).

Everything that comes from the user (exception messages, layer, parameter and field names, source
lines, paths) goes through `text`, `code` or `cell`, so no message can open or close a code fence,
inject HTML, start a heading or swallow a section. Before that, every string of the report is made inert
and cut at `common.TEXT_LIMIT` characters (`common.shown_report`): no escape sequence or control character
reaches a ticket. Paths are shown relative to the project or with ~. An image is referenced only when its
path stays inside the report's folder (see `_image_path`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import quote

from nandoctor.findings import Report
from nandoctor.report.common import (
    OVERFLOW_NOTE,
    VERDICT_TEXT,
    as_float,
    change_parts,
    code_text,
    downsample,
    fault_step,
    field_table,
    finding_advice,
    fmt_number,
    fmt_value,
    ordered_stats,
    overflowed_norm,
    replay_calls_text,
    shown_report,
    summary_parts,
)

TIMELINE_ROWS = 30


def render(report: Report, *, report_dir: Path | None = None, markdown_dir: Path | None = None) -> str:
    """The whole report as Markdown, ending in a newline.

    `report_dir` is the folder of a saved report being re-rendered (`nandoctor report`): its images are
    then checked against that folder and referenced from `markdown_dir` (where the Markdown goes; the
    report's folder by default). Without it the report is nandoctor's own, whose plots sit beside it.
    """
    report = shown_report(report, public=True)
    out: list[str] = [f"# {report.title}: {VERDICT_TEXT[report.verdict]}", ""]
    if report.partial:
        out += ["> **Partial report.** The run was interrupted before it finished; everything below covers "
                "only what was seen until then.", ""]
    mode = report.mode
    status = f" · exit status {report.exit_code}" if mode is None or mode.is_command else ""
    out += [f"**Verdict:** `{report.verdict.value}` · " + " · ".join(summary_parts(report)) + status, ""]
    out += _first_fault(report)
    out += _findings(report)
    out += _remedies(report)
    out += _advice(report)
    out += _timeline(report)
    out += _fields(report)
    out += _plots(report, report_dir, markdown_dir)
    out += _environment(report)
    out += _reproduce(report)
    while out and out[-1] == "":
        out.pop()
    return "\n".join(out) + "\n"


_SPECIAL = re.compile(r"([\\`*<>#|~]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9]))")  # intraword _ is inert in GFM
_LINK = re.compile(r"\](?=[(\[])")  # "](" or "][" would end a link text; brackets alone make no link


def text(value: Any) -> str:
    """User text as inert inline Markdown: punctuation that could format escaped, `&` as an entity, one line."""
    raw = value if isinstance(value, str) else fmt_value(value)
    raw = " ".join(raw.replace("\r", "\n").split("\n"))
    return _LINK.sub(r"\\]", _SPECIAL.sub(r"\\\1", raw.replace("&", "&amp;")))


def prose(value: Any, in_table: bool = False) -> str:
    """Text that may quote code in single backticks (advice, messages): each `span` stays code, safely fenced,
    and everything between is escaped as `text`; unbalanced backticks make it all plain text."""
    raw = value if isinstance(value, str) else fmt_value(value)
    raw = " ".join(raw.replace("\r", "\n").split("\n"))
    parts = raw.split("`")
    if len(parts) % 2 == 0 or "``" in raw:
        return text(raw)
    return "".join(code(part, in_table) if i % 2 else text(part) for i, part in enumerate(parts))


def code(value: Any, in_table: bool = False) -> str:
    """User text as one inline code span, fenced with more backticks than it holds, so it cannot close early."""
    raw = value if isinstance(value, str) else fmt_value(value)
    raw = " ".join(raw.replace("\r", "\n").split("\n"))
    if in_table:
        raw = raw.replace("|", "\\|")  # GFM splits cells before reading code spans
    longest = max((len(run) for run in re.findall("`+", raw)), default=0)
    fence = "`" * (longest + 1)
    pad = " " if raw.startswith("`") or raw.endswith("`") or not raw.strip() else ""
    return f"{fence}{pad}{raw}{pad}{fence}"


def fenced(value: str, info: str = "") -> list[str]:
    """A fenced code block whose fence is longer than any backtick run inside, so nothing can close it."""
    longest = max((len(run) for run in re.findall("`+", value)), default=0)
    fence = "`" * max(3, longest + 1)
    return [fence + info, value.replace("\r", ""), fence]


def cell(value: Any, code_span: bool = False) -> str:
    """A table cell from any value: escaped (or one code span), newlines folded, empty shown as an em dash."""
    if value is None or (isinstance(value, (str, list, tuple)) and len(value) == 0):
        return "—"
    raw = fmt_value(value) if not isinstance(value, str) else value
    if code_span:
        return code(raw, in_table=True)
    return "<br>".join(prose(line, in_table=True) for line in raw.replace("\r", "").split("\n"))


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
                 [(cell(ff.step), cell(ff.phase.value), _layer_cell(ff),
                   cell(ff.op, code_span=True), cell(ff.parameter, code_span=True), cell(ff.batch_index),
                   cell(samples))])
    source = report.details.get("source")
    library = report.details.get("library_source")
    if source and library:
        out += [f"The offending op was created at {code(library)} (library code), called from {code(source)} "
                "(the user's code).", ""]
    elif source:
        out += [f"The offending op was created at {code(source)} (the user's code).", ""]
    elif library:
        out += [f"The offending op was created at {code(library)} (library code).", ""]
    replays = replay_calls_text(report)
    if replays:
        out += [prose(f"nandoctor's replays {replays}."), ""]
    stats = report.details.get("offending_tensor")
    if isinstance(stats, dict) and stats:
        out += ["Offending tensor:", ""]
        out += table(("statistic", "value"), [(cell(k), cell(fmt_value(v))) for k, v in ordered_stats(stats)])
    return out


def _layer_cell(ff: Any) -> str:
    """The layer, or words for a fault in the root model's own forward (no sublayer: layer null)."""
    if ff.layer is None and ff.phase.value == "forward":
        return "the model's forward"
    return cell(ff.layer, code_span=True)


def _findings(report: Report) -> list[str]:
    findings = report.sorted_findings()
    if not findings:
        return ["## Findings", "", "No findings: nothing non-finite, nothing at risk.", ""]
    rows = [(str(i), f.severity.value, cell(code_text(f), code_span=True), cell(f.location.describe()),
             cell(f.message)) for i, f in enumerate(findings, 1)]
    return ["## Findings", ""] + table(("#", "severity", "code", "where", "message"), rows)


def _advice(report: Report) -> list[str]:
    findings = report.sorted_findings()
    if not any(f.advice or f.evidence for f in findings):
        return []
    out = ["## What to do", ""]
    for i, f in enumerate(findings, 1):
        if not (f.advice or f.evidence):
            continue
        out += [f"### {i}. {code(code_text(f))} ({f.severity.value}): {text(f.location.describe())}", ""]
        out += [f"- {prose(line)}" for line in finding_advice(f.advice, report.remedies)]
        if f.evidence:
            evidence = "; ".join(f"{text(k)}: {text(fmt_value(v))}" for k, v in f.evidence.items())
            out += ([""] if f.advice else []) + [f"Evidence: {evidence}"]
        out.append("")
    return out


def _remedies(report: Report) -> list[str]:
    """The candidate fixes the probe replayed, verified first, each with the change to make."""
    from nandoctor.report import remedies_text as rt

    if not report.remedies and not rt.notice(report):
        return []
    rows = [[cell(rt.outcome_label(r)), cell(r.get("remedy"), code_span=True), _change_cell(r.get("change")),
             cell(rt.loss_text(r)), cell(rt.run_text(r))] for r in report.remedies]
    out = ["## Remedies", ""]
    summary = rt.summary_line(report)
    if summary:
        out += [prose(summary), ""]
    if rows:
        out += table(("outcome", "remedy", "change to make", "loss (before → after)", "replay"), rows)
    for r in report.remedies:
        skip = rt.skip_list_text(r)
        if skip:
            out += ["Skip list to resume with:", ""] + fenced(skip, "json") + [""]
    return out


def _change_cell(change: Any) -> str:
    """A remedy's change with its code in code spans (one per line of YAML), its notes as text."""
    pieces = change_parts(change)
    if not pieces:
        return "—"
    return "".join("<br>" if piece == "\n" else code(piece.strip(), in_table=True) if is_code
                   else text(piece) for piece, is_code in pieces)


def _timeline(report: Report) -> list[str]:
    points = report.timeline
    if not points:
        return []
    fault = fault_step(report)
    shown = downsample(points, fault, TIMELINE_ROWS)
    with_scale = any(as_float(p.loss_scale) is not None for p in points)
    with_skipped = any(p.skipped for p in points)
    with_lr = any(as_float(p.lr) is not None for p in points)
    header = ["step", "loss", "grad norm"] + (["learning rate"] if with_lr else []) + (
        ["loss scale"] if with_scale else []) + (["skipped"] if with_skipped else [])
    rows = []
    for p in shown:
        norm = (OVERFLOW_NOTE if overflowed_norm(report, p.step, p.grad_norm, p.skipped)
                else fmt_number(p.grad_norm))
        row = [f"**{p.step}** (fault)" if p.step == fault else str(p.step), fmt_number(p.loss), norm]
        if with_lr:
            row.append(fmt_number(p.lr))
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
    return ["## Data fields", ""] + table(headers, [[cell(row[0], code_span=True)] + [cell(x) for x in row[1:]]
                                                    for row in rows])


def _plots(report: Report, report_dir: Path | None, markdown_dir: Path | None) -> list[str]:
    plots = report.details.get("plots")
    if not isinstance(plots, dict) or not plots:
        return []
    out = ["## Plots", ""]
    for title, path in plots.items():
        link = _image_path(path, report_dir, markdown_dir)
        if link is None:
            out += [f"Plot {text(title)} left out: {code(path)} is not an image file inside the report's "
                    "folder.", ""]
        else:
            out += [f"![{text(title)}]({quote(link)})", ""]
    return out


def _image_path(path: Any, report_dir: Path | None, markdown_dir: Path | None) -> str | None:
    """The link to put in the Markdown for a plot path of the report, or None when it may not be shown.

    A teammate's report could name `../../../../etc/passwd` or `/home/x/.ssh/id_rsa.png`: only a relative
    path with no `..`, no backslash and no scheme is taken; with `report_dir`, it must also stay inside that
    folder once symlinks are resolved, and name a file there if anything exists at it. A plot that is
    missing is kept, as nandoctor's own reports keep it: the link then shows nothing and reveals nothing.
    """
    raw = path if isinstance(path, str) else ""
    parts = PurePosixPath(raw).parts
    if (not raw.strip() or raw.startswith(("/", "~")) or "\\" in raw or ":" in raw or ".." in parts
            or not parts):
        return None
    if report_dir is None:
        return raw
    root = report_dir.resolve()
    target = (root / raw).resolve()
    if not target.is_relative_to(root) or (target.exists() and not target.is_file()):
        return None
    base = (markdown_dir or report_dir).resolve()
    return Path(os.path.relpath(target, base)).as_posix()


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
        out += fenced(str(command), "shell") + [""]
    else:
        out += ["The command line was not recorded.", ""]
    extra = {k: v for k, v in report.run.items() if k != "command_line" and v is not None}
    if extra:
        out += ["Run settings: " + ", ".join(f"{text(k)} {code(fmt_value(v))}" for k, v in extra.items()), ""]
    return out
