"""The terminal view of a report (rich): verdict, summary, first fault, findings with advice, timeline.

One of the three places allowed to write to the terminal (with cli.py and run.py). Every piece of user
text (layer names, messages, advice) goes in as `rich.text.Text`, never as markup, so a `[` in a
parameter name cannot break or restyle the output. And the report itself first goes through
`common.shown_report`, since rich passes escape sequences through: a teammate's report cannot clear the
screen, retitle the window, hide a hyperlink or the cursor, and no string prints more than
`common.TEXT_LIMIT` characters.
"""

from __future__ import annotations

import io
from typing import Any

from rich import box
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from nandoctor.findings import Finding, Report, Severity, Verdict
from nandoctor.report.common import (
    VERDICT_TEXT,
    as_float,
    change_parts,
    code_text,
    field_table,
    finding_advice,
    fmt_value,
    ordered_stats,
    overflowed_norm,
    range_text,
    replay_calls_text,
    shown_report,
    shown_value,
    source_text,
    sparkline,
    summary_parts,
    verdict_line,
)

VERDICT_STYLE = {
    Verdict.HEALTHY: "bold green",
    Verdict.AT_RISK: "bold yellow",
    Verdict.NAN_FOUND: "bold red",
    Verdict.CRASHED: "bold red",
    Verdict.INTERRUPTED: "bold yellow",
    Verdict.ERROR_FOUND: "bold red",
}
SEVERITY_STYLE = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.INFO: "cyan"}
SPARK_WIDTH = 60


def render(report: Report, console: Console) -> None:
    """The full report, top to bottom in the order a tired reader needs it."""
    report = shown_report(report)
    console.print(_headline(report))
    if report.partial:
        console.print(Text("Partial report: the run was interrupted; only what was seen before it stopped "
                           "is below.", style="yellow"))
    console.print(_summary(report))
    if report.first_fault is not None:
        console.print(_first_fault_panel(report))
    if report.remedies or _remedies_notice(report):
        console.print(_remedies(report))
    for i, finding in enumerate(report.sorted_findings(), 1):
        console.print(_finding(i, finding, report.remedies))
    fields = _fields_table(report, console)
    if fields is not None:
        console.print()
        console.print(fields)
    if report.timeline:
        console.print(_timeline(report, console.width))
    console.print(_next_steps(report))


def render_verdict_line(report: Report, console: Console) -> None:
    """One line for --quiet: verdict, counts, and where the first fault is (common.verdict_line)."""
    verdict, rest = verdict_line(report)
    line = Text()
    line.append(verdict.value, style=VERDICT_STYLE[verdict])
    line.append(rest)
    console.print(line, soft_wrap=True)


def render_environment(env: dict[str, Any], console: Console) -> None:
    """`nandoctor env`: a two-column table to paste into a bug ticket."""
    table = Table(title="nandoctor environment", show_header=True, header_style="bold", title_justify="left")
    table.add_column("item", style="bold", no_wrap=True)
    table.add_column("value", overflow="fold")
    for key, value in shown_value(env).items():
        table.add_row(Text(str(key)), Text(fmt_value(value, limit=400)))
    console.print(table)


def _headline(report: Report) -> Text:
    text = Text()
    text.append(f"{report.title}: ", style="bold")
    text.append(VERDICT_TEXT[report.verdict], style=VERDICT_STYLE[report.verdict])
    text.append(f"  ({report.verdict.value})", style="dim")
    return text


def _summary(report: Report) -> Table:
    counts = report.counts()
    table = Table(show_header=True, header_style="bold", box=None, padding=(0, 2))
    parts = summary_parts(report)[3:]  # the counts get their own coloured columns
    for sev in Severity:
        table.add_column(sev.value + ("s" if sev != Severity.INFO else ""), justify="right")
    for part in parts:
        label = part.partition(" ")[2]
        table.add_column(label, justify="right")
    cells = [Text(str(counts[s.value]), style=SEVERITY_STYLE[s] if counts[s.value] else "dim")
             for s in Severity]
    cells += [Text(part.partition(" ")[0]) for part in parts]
    table.add_row(*cells)
    return table


def _first_fault_panel(report: Report) -> Panel:
    ff = report.first_fault
    assert ff is not None
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(overflow="fold")
    samples = ", ".join(str(i) for i in ff.sample_indices) if ff.sample_indices else None
    layer = ff.layer
    if layer is None and ff.phase.value == "forward" and not report.crashed:  # the root's own forward code
        layer = "the model's forward (outside every sublayer)"
    for label, value in (("step", ff.step), ("phase", ff.phase.value), ("layer", layer), ("op", ff.op),
                         ("parameter", ff.parameter), ("batch", ff.batch_index), ("samples", samples),
                         ("source", report.details.get("source")),
                         ("library line", report.details.get("library_source"))):
        if value is not None:  # a data fault has no step, layer or op: rows of dashes would only be noise
            grid.add_row(label, Text(fmt_value(value)))
            line = source_text(report) if label == "source" else None
            if line:
                grid.add_row("", Text(line, style="cyan"))
    replays = replay_calls_text(report)
    if replays:
        grid.add_row("replays", Text(replays))
    parts: list[Any] = [grid]
    stats = report.details.get("offending_tensor")
    if isinstance(stats, dict) and stats:
        shown = ", ".join(f"{k}={fmt_value(v)}" for k, v in ordered_stats(stats))
        parts.append(Text("offending tensor: " + shown))
    return Panel(Group(*parts), title="first fault", title_align="left", border_style="red", expand=False)


def _finding(index: int, finding: Finding, remedies: list[dict[str, Any]]) -> Group:
    head = Text(f"{index}. ")
    head.append(finding.severity.value.upper(), style=SEVERITY_STYLE[finding.severity])
    head.append(" ")
    head.append(code_text(finding), style="bold")
    head.append("  " + finding.location.describe(), style="dim")
    lines: list[Any] = [Text(""), head, Text("   " + finding.message)]
    for advice in finding_advice(finding.advice, remedies):
        bullet = Text("   • ", style="green")
        bullet.append(advice)
        lines.append(bullet)
    return Group(*lines)


def _remedies_notice(report: Report) -> str | None:
    from nandoctor.report.remedies_text import notice

    return notice(report)


def _remedies(report: Report) -> Group:
    """Each candidate fix, replayed: a list (a table at 80 columns broke identifiers mid-word), each entry
    with its outcome, then the change to make as code on its own line, so it can be copied whole."""
    from nandoctor.report import remedies_text as rt

    parts: list[Any] = [Text(""), Text("remedies (replayed from a saved state)", style="bold")]
    summary = rt.summary_line(report)
    if summary:
        parts.append(Text(summary, style="dim"))
    style = {"fixed": "bold green", "not_fixed": "red", "not_applicable": "dim"}
    mark = {"fixed": "✓", "not_fixed": "✗", "not_applicable": "·"}
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column()
    for row in report.remedies:
        outcome = str(row.get("outcome"))
        head = Text()
        head.append(str(row.get("remedy")), style="bold")
        head.append(": ")
        head.append(rt.outcome_label(row), style=style.get(outcome, ""))
        loss = rt.loss_text(row)
        run = rt.run_text(row)
        if loss != "-":
            head.append(f", loss {loss}")
        if run:
            head.append(f"; {run}" if outcome != "not_applicable" else f": {run}", style="dim")
        grid.add_row(Text(mark.get(outcome, "-"), style=style.get(outcome, "")), head)
        if outcome != "not_applicable":
            grid.add_row(Text(""), _change_text(row.get("change")))
        skip = rt.skip_list_text(row)
        if skip:
            grid.add_row(Text(""), Text(f"Skip list to resume with: {skip}"))
    if report.remedies:
        parts.append(grid)
    return Group(*parts)


def _change_text(change: Any) -> Text:
    """A remedy's change with its code in colour (a note in parentheses dim), wrapped only at spaces."""
    text = Text()
    for piece, is_code in change_parts(change):
        text.append(piece, style="cyan" if is_code else "dim")
    return text


def _fields_table(report: Report, console: Console) -> Table | Group | None:
    """The scan's per-field statistics. Names and dtypes are never cut (an 'attention…' names nothing): a
    table without vertical rules when every column fits whole, else one entry per field."""
    found = field_table(report.details.get("fields"))
    if found is None:
        return None
    headers, rows = found
    table = Table(title="data fields", title_justify="left", header_style="bold", box=box.SIMPLE_HEAD,
                  show_edge=False, padding=(0, 1), collapse_padding=True)
    for header in headers:
        table.add_column(header, justify="left" if header in ("field", "role", "dtype", "shape") else "right",
                         style="bold" if header == "field" else "", no_wrap=True)
    for row in rows:
        table.add_row(*[Text(x) for x in row])
    natural = console.measure(table, options=console.options.update_width(10_000)).maximum
    return table if natural <= console.width else _fields_list(headers, rows)


def _fields_list(headers: list[str], rows: list[list[str]]) -> Group:
    """The fields table as a list, for names or shapes too long for the terminal's width."""
    lines: list[Any] = [Text("data fields", style="bold")]
    for row in rows:
        cells = dict(zip(headers, row))
        line = Text("  ")
        line.append(cells.pop("field"), style="bold")
        kind = [cells.pop(k) for k in ("role", "dtype", "shape") if k in cells]
        line.append("  " + ", ".join(kind))
        lines.append(line)
        lines.append(Text("    " + ", ".join(f"{k} {v}" for k, v in cells.items())))
    return Group(*lines)


def _timeline(report: Report, width: int) -> Group:
    """Sparklines of loss and gradient norm (log scale); a red ✗ marks each non-finite step, a ▲ a norm
    above float32's range at a step whose gradients were finite (not a fault)."""
    spark_width = min(SPARK_WIDTH, max(16, width - 60))
    first, last = report.timeline[0].step, report.timeline[-1].step
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column(no_wrap=True)
    grid.add_column(style="dim", overflow="fold")
    over = [overflowed_norm(report, p.step, p.grad_norm, p.skipped) for p in report.timeline]
    series = [("loss", [p.loss for p in report.timeline], False, None),
              ("grad norm", [p.grad_norm for p in report.timeline], True, over if any(over) else None),
              ("loss scale", [p.loss_scale for p in report.timeline], True, None)]
    for label, values, log, overflowed in series:
        if label != "loss" and not any(as_float(v) is not None for v in values):
            continue
        spark = Text()
        for char, finite in sparkline(values, log=log, width=spark_width, overflowed=overflowed):
            spark.append(char, style="" if finite else "bold red")
        grid.add_row(label, spark, range_text(values, log=log, overflowed=overflowed))
    return Group(Text(""), Text(f"timeline (steps {first}–{last})", style="bold"), grid)


def _next_steps(report: Report) -> Text:
    """What to do next; an exit status and the --markdown flag only where a command ran (not in a user's
    loop or a callback, whose process nandoctor does not end, and whose report folder holds report.md)."""
    text = Text("\n")
    mode = report.mode
    command = mode is None or mode.is_command
    if report.partial:
        text.append("Stopped by a signal: exit status 130 (Ctrl-C) or 143 (SIGTERM). " if command else
                    "Stopped by a signal. ", style="bold")
    elif not command:
        text.append("The report holds an error. " if report.exit_code else "No errors. ", style="bold")
    elif report.exit_code:
        text.append("Exit status 1: the report holds an error. ", style="bold")
    else:
        text.append("Exit status 0: no errors. ", style="bold")
    if report.verdict in (Verdict.NAN_FOUND, Verdict.CRASHED):
        text.append("Apply the advice for the first finding above, then run again to confirm. ")
    elif report.exit_code:
        text.append("Fix the errors above (each names where and what to change), then run again. ")
    elif report.verdict == Verdict.AT_RISK:
        text.append("Nothing broke yet, but the warnings above tend to come before a NaN. ")
    if command and not report.run.get("markdown_written"):
        text.append("Re-run with --markdown report.md to attach to a bug ticket.")
    elif not command:
        text.append("report.md in the report folder is the one to attach to a bug ticket.")
    return text


def render_text(report: Report) -> str:
    """The console report as plain text, for `logging`."""
    buf = io.StringIO()
    render(report, Console(file=buf, width=110, force_terminal=False, color_system=None))
    return buf.getvalue()
