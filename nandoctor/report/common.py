"""What the terminal and Markdown renderers share: verdict words, the summary, number text, timelines.

Kept in one place so the two views of a report never disagree on a count or on how a NaN is spelled.

A timeline value may be a float, None, or (after a JSON round trip) the strings "nan"/"inf"/"-inf" that
`findings._jsonable` writes because JSON has no NaN; every renderer reads them through `as_float`.

A report may be a teammate's file, so every renderer first takes `shown_report(report)`: each string made
inert (`inert`: no terminal escape sequence, control or bidi-override character) and cut at `TEXT_LIMIT`
characters, nesting cut at `MAX_NESTING` levels, and for public output paths made relative (`public_paths`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nandoctor.findings import Finding, Report, TimelinePoint, Verdict

BLOCKS = "▁▂▃▄▅▆▇█"
NONFINITE_MARK = "✗"
OVERFLOW_MARK = "▲"  # a gradient norm above float32's range (its square overflowed): finite gradients
_OVERFLOWED: Any = object()  # stands for such a norm inside `sparkline`
MISSING_MARK = " "

_TEXT_FLOATS = {"nan": math.nan, "inf": math.inf, "+inf": math.inf, "-inf": -math.inf,
                "infinity": math.inf, "-infinity": -math.inf}


def as_float(value: Any) -> float | None:
    """A timeline or statistic value as a float (NaN/Inf included); None when there is no number."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TEXT_FLOATS:
            return _TEXT_FLOATS[text]
        try:
            return float(text)
        except ValueError:
            return None
    try:
        return float(value)  # numpy scalars
    except (TypeError, ValueError):
        return None


VERDICT_TEXT = {
    Verdict.HEALTHY: "healthy",
    Verdict.AT_RISK: "at risk",
    Verdict.NAN_FOUND: "NaN/Inf found",
    Verdict.CRASHED: "crashed",
    Verdict.INTERRUPTED: "interrupted (partial report)",
    Verdict.ERROR_FOUND: "errors found",
}


def verdict_line(report: Report) -> tuple[Verdict, str]:
    """The --quiet line (and a healthy `nandoctor run`'s): its verdict, then the counts and where the first
    fault is, as `: 0 errors, ...; first fault: <code> at <where>` (the renderers style the verdict)."""
    report = shown_report(report)
    rest = ": " + ", ".join(summary_parts(report))
    lead = _lead_finding(report)
    if report.first_fault is not None:
        where = lead.location if lead is not None else report.first_fault.as_location()
        code = f"{code_text(lead)} " if lead is not None else ""
        rest += f"; first fault: {code}at {where.describe()}"
    elif report.findings:
        first = report.sorted_findings()[0]
        rest += f"; first: {code_text(first)} at {first.location.describe()}"
    if report.partial:
        rest += " (partial: interrupted)"
    return report.verdict, rest


def plain_text_stream(stream: Any) -> bool:
    """Whether rich would print to `stream` without any style (not a terminal, and no FORCE_COLOR or
    TTY_COMPATIBLE set, which make rich style its output anyway): a line for it can then be written as
    plain text, without importing rich (~30 ms of a `nandoctor run` parent's CPU)."""
    try:
        terminal = stream.isatty()
    except (AttributeError, ValueError):
        return False
    return not terminal and "FORCE_COLOR" not in os.environ and "TTY_COMPATIBLE" not in os.environ


def _lead_finding(report: Report) -> Finding | None:
    """The finding that is the first fault (same step, phase and batch), which also knows the field."""
    ff = report.first_fault
    if ff is None:
        return None
    for finding in report.sorted_findings():
        loc = finding.location
        if (loc.step, loc.phase, loc.batch_index) == (ff.step, ff.phase, ff.batch_index):
            return finding
    return None


def code_text(finding: Finding) -> str:
    """The finding's code as written in every report ('nan.forward'; a plain string code as it is)."""
    return getattr(finding.code, "value", str(finding.code))


def summary_parts(report: Report) -> list[str]:
    """'2 errors', '1 warning', '0 info', '40 steps run' ...: the one-line summary both renderers print."""
    counts = report.counts()
    parts = [_plural(counts["error"], "error"), _plural(counts["warning"], "warning"),
             f"{counts['info']} info"]
    steps = _first_int(report.details, "steps_run") if report.command == "probe" else None
    if steps is None and report.command == "probe" and report.timeline:
        steps = len(report.timeline)
    if steps is not None:
        parts.append(_plural(steps, "step") + " run")
    batches = _first_int(report.details, "batches_scanned", "batches", "num_batches")
    if batches is not None:
        parts.append(_plural(batches, "batch", "batches") + " scanned")
    samples = _first_int(report.details, "samples_scanned", "samples", "num_samples")
    if samples is not None:
        parts.append(_plural(samples, "sample"))
    return parts


def _plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word if n == 1 else (many or word + 's')}"


def _first_int(d: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = d.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def fmt_value(value: Any, limit: int = 200) -> str:
    """Any JSON-ish value as short text: numbers via `fmt_number`, lists as [a, b], dicts as k=v."""
    if isinstance(value, (bool, int, float)):
        text = fmt_number(value)
    elif isinstance(value, str) and value.strip().lower() in _TEXT_FLOATS:
        text = fmt_number(value)  # a NaN/Inf that went through JSON
    elif isinstance(value, dict):
        text = ", ".join(f"{k}={fmt_value(v, limit)}" for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        text = "[" + ", ".join(fmt_value(v, limit) for v in value) + "]"
    elif value is None:
        text = "—"
    else:
        text = str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


# Data-field columns: (header, keys the scan may use for it), in reading order; missing keys show "—".
FIELD_COLUMNS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("role", ("role",)), ("dtype", ("dtype",)), ("shape", ("shape", "shapes")), ("min", ("min",)),
    ("max", ("max",)), ("mean", ("mean",)), ("std", ("std",)), ("NaN", ("num_nan", "nan")),
    ("Inf", ("num_inf", "inf")),
)
# Statistics of the offending tensor, in the order people look for them.
TENSOR_STAT_ORDER = ("shape", "dtype", "numel", "num_nan", "num_inf", "min", "max", "mean", "std", "abs_max")


def field_table(fields: Any) -> tuple[list[str], list[list[str]]] | None:
    """`report.details["fields"]` as (headers, rows of text); None when there is nothing to show.

    Tolerant on purpose: a column appears only when some field has it, and a field without it shows "—".
    """
    if not isinstance(fields, dict) or not fields:
        return None
    stats = [s if isinstance(s, dict) else {} for s in fields.values()]
    columns = [(h, keys) for h, keys in FIELD_COLUMNS if any(k in s for s in stats for k in keys)]
    rows = []
    for name, s in zip(fields, stats):
        row = [str(name)]
        for header, keys in columns:
            key = next((k for k in keys if k in s), None)
            value = s[key] if key is not None else None
            row.append(fmt_shape(value) if header == "shape" else fmt_value(value))
        rows.append(row)
    return ["field"] + [h for h, _ in columns], rows


def fmt_shape(value: Any) -> str:
    """[16, 16] -> '16×16'; [[16, 16], [8, 16]] (shapes seen) -> '16×16, 8×16'; at most four shapes."""
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (list, tuple)) for v in value):
        shown = ", ".join(fmt_shape(v) for v in value[:4])
        return shown + (f" (+{len(value) - 4} more)" if len(value) > 4 else "")
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return "×".join(str(v) for v in value) if value else "scalar"
    return fmt_value(value)


def ordered_stats(stats: dict[str, Any]) -> list[tuple[str, Any]]:
    first = [(k, stats[k]) for k in TENSOR_STAT_ORDER if k in stats]
    return first + [(k, v) for k, v in stats.items() if k not in TENSOR_STAT_ORDER]


def fmt_number(value: Any) -> str:
    """Compact, stable text for a number: 4 significant digits, NaN/Inf spelled out, '—' for nothing."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return str(value)
    number = as_float(value)
    if number is None:
        return "—" if value is None else str(value)
    if math.isnan(number):
        return "NaN"
    if math.isinf(number):
        return "Inf" if number > 0 else "-Inf"
    if number == 0:
        return "0"
    return f"{number:.4g}"


def fault_step(report: Report) -> int | None:
    return report.first_fault.step if report.first_fault is not None else None


def downsample(points: Sequence[TimelinePoint], keep_step: int | None = None,
               max_rows: int = 30) -> list[TimelinePoint]:
    """At most about `max_rows` evenly spaced points, always keeping the first, the last and `keep_step`.

    Also keeps the first non-finite point, so a table never hides where the loss or norm broke.
    """
    if len(points) <= max_rows:
        return list(points)
    n = len(points)
    keep = {0, n - 1}
    for i, p in enumerate(points):
        if p.step == keep_step:
            keep.add(i)
    first_bad = next((i for i, p in enumerate(points) if not is_finite_point(p)), None)
    if first_bad is not None:
        keep.add(first_bad)
    room = max(max_rows - len(keep), 0)
    if room:
        stride = (n - 1) / (room + 1)
        keep.update(round(stride * k) for k in range(1, room + 1))
    return [points[i] for i in sorted(keep)]


def is_finite_point(point: TimelinePoint) -> bool:
    for value in (point.loss, point.grad_norm):
        number = as_float(value)
        if number is not None and not math.isfinite(number):
            return False
    return True


def sparkline(values: Sequence[Any], *, log: bool = False, width: int = 60,
              overflowed: Sequence[bool] | None = None) -> list[tuple[str, bool]]:
    """Unicode-block sparkline cells as (char, finite) pairs; non-finite values become ✗, missing a blank.

    With `log`, values are drawn on log10 (non-positive finite values sit at the bottom), which is how
    gradient norms spanning orders of magnitude stay readable. Longer series are bucketed into `width`
    cells; a bucket that holds any non-finite value is drawn as non-finite, so the fault never vanishes.
    """
    numbers = [as_float(v) for v in values]
    if overflowed is not None:  # a norm float32 could not hold: above every finite value, not a fault
        numbers = [_OVERFLOWED if over else x for x, over in zip(numbers, overflowed)]
    buckets = _buckets(numbers, width)
    lo, hi = _scaled_range(buckets, log)
    return [_spark_cell(bucket, log, lo, hi) for bucket in buckets]


def _scaled_range(buckets: list[list[Any]], log: bool) -> tuple[float, float]:
    """The lowest and highest finite value on the drawing scale, (0, 0) when there is none: the blocks span it."""
    finite_all = [x for b in buckets for x in b if isinstance(x, float) and math.isfinite(x)]
    scaled_all = [_scale(x, log) for x in finite_all]
    scaled_all = [s for s in scaled_all if s is not None]
    return (min(scaled_all), max(scaled_all)) if scaled_all else (0.0, 0.0)


def _spark_cell(bucket: list[Any], log: bool, lo: float, hi: float) -> tuple[str, bool]:
    """One bucket's cell: blank when it holds no value, ✗ when any is non-finite, ▲ when a norm overflowed,
    else the block for its largest value between `lo` and `hi`."""
    present = [x for x in bucket if x is not None]
    if not present:
        return (MISSING_MARK, True)
    if any(not math.isfinite(x) for x in present if x is not _OVERFLOWED):
        return (NONFINITE_MARK, False)
    if any(x is _OVERFLOWED for x in present):
        return (OVERFLOW_MARK, True)
    scaled = [s for s in (_scale(x, log) for x in present) if s is not None]
    level = max(scaled) if scaled else lo
    index = 0 if hi <= lo else round((level - lo) / (hi - lo) * (len(BLOCKS) - 1))
    return (BLOCKS[index], True)


def _scale(x: float, log: bool) -> float | None:
    if not log:
        return x
    return math.log10(x) if x > 0 else None


def _buckets(numbers: list[float | None], width: int) -> list[list[float | None]]:
    if len(numbers) <= width:
        return [[x] for x in numbers]
    size = len(numbers) / width
    return [numbers[int(k * size):max(int((k + 1) * size), int(k * size) + 1)] for k in range(width)]


def range_text(values: Sequence[Any], *, log: bool = False, overflowed: Sequence[bool] | None = None) -> str:
    """'2.31 → 0.4 (min 0.39, max 2.31)' style caption for a sparkline: first, last, min and max finite;
    norms float32 could not hold (`overflowed`) are counted apart from the non-finite ones."""
    over = sum(bool(o) for o in overflowed) if overflowed is not None else 0
    numbers = [None if overflowed is not None and o else as_float(v) for v, o in
               zip(values, overflowed if overflowed is not None else [False] * len(values))]
    present = [x for x in numbers if x is not None]
    finite = [x for x in present if math.isfinite(x)]
    if not present:
        return "no values"
    text = f"{fmt_number(present[0])} → {fmt_number(present[-1])}"
    if finite:
        scale = ", log scale" if log else ""
        text += f" (min {fmt_number(min(finite))}, max {fmt_number(max(finite))}{scale})"
    bad = len(present) - len(finite)
    if bad:
        text += f", {bad} non-finite"
    if over:
        text += f", {over} {OVERFLOW_NOTE} (gradients finite)"
    return text


# --- remedies: a change's code, and advice that repeats a remedy ----------------------------------------

_CODE_HEAD = re.compile(r"^[A-Za-z_][\w.\[\]'\"-]*\s*[:=(]")  # a key path or a call: `a.b: 1`, `f(...)`


def change_parts(change: Any) -> list[tuple[str, bool]]:
    """A remedy's change as (text, is_code) pieces, so renderers can show the code as code.

    Backtick spans are code and the rest prose. Without backticks, each line is read as code then words:
    'optimizer.args.learning_rate: 0.003  # was 0.03' (YAML and its comment), 'grad_clip=paddle.nn.
    ClipGradByGlobalNorm(126) passed to your optimizer (was none)' (code up to the first word outside
    brackets, then prose); a sentence ('leave out the offending samples') is prose. Lines are joined by
    a newline piece.
    """
    raw = "" if change is None else str(change)
    if raw.count("`") >= 2 and raw.count("`") % 2 == 0:
        return [(part, i % 2 == 1) for i, part in enumerate(raw.split("`")) if part]
    out: list[tuple[str, bool]] = []
    for n, line in enumerate(raw.split("\n")):
        if n:
            out.append(("\n", False))
        for k, part in enumerate(_split_top(line, "; ")):
            if k:
                out.append(("; ", False))
            out += _code_then_words(part)
    return out


def _code_then_words(text: str) -> list[tuple[str, bool]]:
    code, sep, comment = text.partition("  # ")
    if sep:  # a YAML line with its comment: all of it is valid YAML, the comment shown as a note
        return [(code, True), ("  # " + comment, False)]
    if not _CODE_HEAD.match(text):
        return [(text, False)] if text else []
    depth = 0
    for i, char in enumerate(text):
        depth += {"(": 1, "[": 1, "{": 1, "<": 1, ")": -1, "]": -1, "}": -1, ">": -1}.get(char, 0)
        if char == " " and depth <= 0 and i and text[i - 1] not in ":,=":
            return [(text[:i], True), (text[i:], False)]
    return [(text, True)]


def _split_top(text: str, sep: str) -> list[str]:
    """`text` split at `sep` outside brackets."""
    parts, depth, last = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(char, 0)
        if depth == 0 and text.startswith(sep, i):
            parts.append(text[last:i])
            last = i + len(sep)
    return parts + [text[last:]]


_VERIFIED = re.compile(r"^Verified by replay \(([^)]*)\)")
_NOT_HELPED = re.compile(r"^Tried by replay, did not help \(([^)]*)\)")


def finding_advice(advice: Sequence[str], remedies: Sequence[dict[str, Any]]) -> list[str]:
    """A finding's advice without the lines that repeat a replayed remedy's change (the remedies section
    above shows each change once): they become one line naming the verified remedies, and one naming
    those that did not help."""
    listed = {str(r.get("remedy")) for r in remedies}
    out: list[Any] = []  # advice lines, and a (key,) placeholder where a summary line goes
    named: dict[str, list[str]] = {"verified": [], "not": []}
    for line in advice:
        for key, pattern in (("verified", _VERIFIED), ("not", _NOT_HELPED)):
            match = pattern.match(line)
            if match and match.group(1) in listed:
                if not named[key]:
                    out.append((key,))  # the summary line's place: where the first repeated line stood
                named[key].append(match.group(1))
                break
        else:
            out.append(line)
    summaries = {"verified": "Verified by replay: {} (each change is listed under remedies above).",
                 "not": "Tried by replay, did not help: {}."}
    return [summaries[line[0]].format(", ".join(named[line[0]])) if isinstance(line, tuple) else line
            for line in out]


def replay_calls_text(report: Report) -> str | None:
    """What nandoctor's replays did to the user's code: how many more times they called it than their training
    did (`details.replay_calls`), for the first-fault section; None when no replay ran it."""
    calls = report.details.get("replay_calls")
    if not isinstance(calls, dict):
        return None
    count, code = calls.get("count"), calls.get("code")
    if not isinstance(count, int) or isinstance(count, bool) or count <= 0 or not isinstance(code, str):
        return None
    return f"called {code} {count} more time{'s' if count != 1 else ''} than your training did"


# --- the faulting source line ---------------------------------------------------------------------------

_SOURCE = re.compile(r"^(?P<path>.+?\.py):(?P<line>\d+)(?: in \S+)?$")


def source_text(report: Report) -> str | None:
    """The text of the user's line the report names ('model.py:16 in forward'), for the terminal.

    Taken from `details["source_line"]` when the report carries it; else read from the file, relative to
    the spec's folder (as the command was given, so relative to the working folder) or to the working
    folder, right after the run that found it. Only a `.py` file is read, so a foreign report cannot have a
    renderer print a line of some other file.
    """
    carried = report.details.get("source_line")
    if isinstance(carried, str) and carried.strip():
        return carried.strip()
    match = _SOURCE.match(str(report.details.get("source") or "").strip())
    if match is None:
        return None
    path, number = Path(match["path"]).expanduser(), int(match["line"])
    config = report.run.get("config")
    bases = ([Path(str(config)).expanduser().parent] if config else []) + _script_folders(report) + [Path.cwd()]
    for base in bases:
        candidate = path if path.is_absolute() else base / path
        try:
            if not candidate.is_file():
                continue
            with candidate.open(encoding="utf-8", errors="replace") as handle:
                for i, line in enumerate(handle, 1):
                    if i == number:
                        return inert(line.strip(), 200) or None
        except OSError:
            continue
        return None
    return None


def _script_folders(report: Report) -> list[Path]:
    """The folders of the .py files in `nandoctor run`'s command line: the user's code sits beside them."""
    import shlex

    try:
        words = shlex.split(str(report.run.get("command_line") or ""))
    except ValueError:
        return []
    return [Path(w).expanduser().parent for w in words if w.endswith(".py")]


# --- gradient norms: a float32 overflow is not a fault -------------------------------------------------

def overflowed_norm(report: Report, step: int | None, value: Any, skipped: bool | None = None) -> bool:
    """A non-finite gradient norm recorded at a step whose gradients were finite: float32's sum of squares
    overflowed (norms above ~1.8e19), the gradients did not. The watcher stops at the first step with a
    non-finite gradient, so every step before the first fault had finite ones; a step the loss scaler
    skipped did have non-finite gradients (that is why it was skipped)."""
    number = as_float(value)
    if number is None or math.isfinite(number) or skipped or step is None:
        return False
    fault = fault_step(report)
    if fault is None:
        return report.first_fault is None and report.verdict in (Verdict.HEALTHY, Verdict.AT_RISK)
    return step < fault


OVERFLOW_NOTE = "overflowed in float32"


def project_dir(report: Report) -> Path | None:
    """The folder of the spec the report came from, when the report names it by an absolute path.

    A relative config path (as the user typed it, or as a public report holds it) gives None: guessing
    from today's working folder would rewrite paths of a report re-rendered elsewhere.
    """
    config = report.run.get("config")
    if not config:
        return None
    path = Path(str(config)).expanduser()
    return path.parent if path.is_absolute() else None


# --- what a renderer may show of a (maybe foreign) report ----------------------------------------------

TEXT_LIMIT = 2000  # characters of one string that a renderer shows; the JSON file keeps every character
MAX_NESTING = 32  # levels of lists and dicts a renderer walks into; nandoctor's own reports use under ten

# Whole escape sequences first, so their parameters (a window title, a hyperlink's URL) go with them:
# CSI (colours, cursor moves, clear screen, hide cursor), then OSC/DCS/SOS/PM/APC up to their terminator
# (BEL or ST: window titles, OSC 8 hyperlinks), then any other ESC + final byte. Both 7-bit (ESC [) and
# 8-bit (C1) introducers.
_ESCAPE_SEQUENCE = re.compile(
    r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"
    r"|(?:\x1b[]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c\n]*(?:\x07|\x1b\\|\x9c)"
    r"|\x1b[ -/]*[0-~]")
# What is left of C0 (tab and newline kept: messages and source lines span lines), DEL, C1, and the
# bidi overrides and isolates that make text read differently from what it is (Trojan Source).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def inert(text: str, limit: int | None = TEXT_LIMIT) -> str:
    """`text` safe to show in a terminal or a ticket: escape sequences, control characters (but newline and
    tab) and bidi overrides removed, a carriage return read as a newline, then cut at `limit` characters
    with a '… (N characters cut)' tail."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return _cut(_CONTROL.sub("", _ESCAPE_SEQUENCE.sub("", text)), limit)


def _cut(text: str, limit: int | None) -> str:
    if limit is not None and len(text) > limit:
        return f"{text[:limit]}… ({len(text) - limit} characters cut)"
    return text


def shown_report(report: Report, *, public: bool = False, limit: int | None = TEXT_LIMIT) -> Report:
    """A copy of `report` that a renderer can show whatever its file held: every string (keys included)
    through `inert`, values nested deeper than `MAX_NESTING` replaced by a note, and with `public` (tickets)
    the project's and home folder's absolute paths rewritten as `public_paths` does."""
    project = project_dir(report) if public else None
    rules = _path_rules(project) if public else []
    # The timeline (up to tens of thousands of points) goes around the round trip: its numbers need no
    # cleaning, and only a point holding a string (a foreign file's) is cleaned. 0.9 s -> 0.1 s at 20k steps.
    shown = Report.from_dict(_shown(dataclasses.replace(report, timeline=[]).to_dict(), rules, limit, 0))
    shown.timeline = [p if all(not isinstance(v, str) for v in vars(p).values())
                      else TimelinePoint(**_shown(vars(p), rules, limit, 0)) for p in report.timeline]
    return shown


def shown_value(value: Any, *, limit: int | None = TEXT_LIMIT) -> Any:
    """`shown_report` for any other JSON-ish value (the environment table of `nandoctor env`)."""
    return _shown(value, [], limit, 0)


def _shown(value: Any, rules: list[tuple[re.Pattern[str], str]], limit: int | None, depth: int) -> Any:
    # Made inert before the path rules (an escape inside a path would hide it from them), cut after.
    if isinstance(value, str):
        return _cut(_apply(inert(value, None), rules), limit)
    if isinstance(value, (dict, list, tuple)) and depth >= MAX_NESTING:
        return f"… (nested more than {MAX_NESTING} levels deep, not shown)"
    if isinstance(value, dict):
        # A key is a name, one line: its newlines and tabs become spaces.
        return {(" ".join(_shown(k, rules, limit, depth).split()) if isinstance(k, str) else k):
                _shown(v, rules, limit, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_shown(v, rules, limit, depth + 1) for v in value)
    return value


def nesting_exceeds(value: Any, limit: int = MAX_NESTING) -> bool:
    """Whether lists and dicts in `value` nest more than `limit` levels (checked without recursion, so a
    hostile file nested 100,000 levels deep is measured, not overflowed)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list, tuple)):
            if depth >= limit:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return False


def public_paths(value: Any, project: Path | None = None) -> Any:
    """`value` (text, or a JSON-ish tree) with the project's absolute path made relative and the home folder as ~.

    Reports go into public tickets: `/home/ana/proj/model.py:12` becomes `model.py:12`, any other path
    under the home folder `~/...`. Applied to every string, so messages, command lines and source lines
    are covered wherever they sit.
    """
    rules = _path_rules(project)
    if not rules:
        return value
    return _apply(value, rules)


def _path_rules(project: Path | None) -> list[tuple[re.Pattern[str], str]]:
    rules: list[tuple[re.Pattern[str], str]] = []
    roots: list[tuple[str, str, str]] = []  # (absolute root, replacement before "/", replacement alone)
    if project is not None:
        for form in {str(project.absolute()), str(_resolved(project))}:
            roots.append((form, "", "."))
    home = os.environ.get("HOME") or str(Path.home())
    for form in {home.rstrip("/"), str(_resolved(Path(home)))}:
        roots.append((form, "~/", "~"))
    for root, before_slash, alone in roots:
        if len(root) <= 1:  # "/" or "": replacing it would mangle every path
            continue
        escaped = re.escape(root)
        rules.append((re.compile(escaped + "/"), before_slash))
        rules.append((re.compile(escaped + r"(?![\w.\-/])"), alone))
    return rules


def _resolved(path: Path) -> Path:
    try:
        return path.resolve()
    except OSError:
        return path


def _apply(value: Any, rules: list[tuple[re.Pattern[str], str]]) -> Any:
    if isinstance(value, str):
        for pattern, replacement in rules:
            value = pattern.sub(replacement, value)
        return value
    if isinstance(value, dict):
        return {_apply(k, rules) if isinstance(k, str) else k: _apply(v, rules) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_apply(v, rules) for v in value)
    return value
