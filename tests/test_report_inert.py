"""A report from someone else is inert: `nandoctor report` shows a teammate's JSON without obeying it.

No escape sequence, control or bidi-override character reaches the terminal or the Markdown, no string
prints more than `TEXT_LIMIT` characters, an image outside the report's folder is never referenced, and a
file nested 100,000 levels deep is a malformed report (exit 2), not a crash of nandoctor (exit 3).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from markdown_it import MarkdownIt
from report_samples import probe_nan_report
from rich.console import Console
from typer.testing import CliRunner

from nandoctor.cli import app
from nandoctor.findings import Report
from nandoctor.report import console as console_report
from nandoctor.report import json as json_report
from nandoctor.report import markdown as markdown_report
from nandoctor.report.common import MAX_NESTING, TEXT_LIMIT, inert, shown_value

# Each one measured in a report before the fix, reaching the terminal whole.
CLEAR_SCREEN = "\x1b[2J"
WINDOW_TITLE = "\x1b]0;pwned\x07"
HYPERLINK = "\x1b]8;;https://evil.example/x\x1b\\click here\x1b]8;;\x1b\\"
HIDE_CURSOR = "\x1b[?25l"
BIDI = "\u202eevil\u202c \u2066iso\u2069"
C1_CSI = "\x9b31mred"
HOSTILE = CLEAR_SCREEN + WINDOW_TITLE + HYPERLINK + HIDE_CURSOR + BIDI + C1_CSI + "\x07\x08\x00\x7f\x1bc end"
# Anything a terminal could act on: C0 but tab and newline, DEL, C1, bidi overrides and isolates.
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _cli(*args: str):
    return CliRunner(env={"COLUMNS": "100", "NO_COLOR": "1"}).invoke(app, list(args))


def _report_data() -> dict[str, Any]:
    return json.loads(json_report.render(probe_nan_report()))


def _write(folder: Path, data: dict[str, Any] | str, name: str = "report.json") -> Path:
    path = folder / name
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return path


def _hostile_data() -> dict[str, Any]:
    """The hostile text in every part of a report a renderer shows."""
    data = _report_data()
    finding = data["findings"][1]
    finding["message"] += HOSTILE
    finding["advice"].append(HOSTILE)
    finding["evidence"][HOSTILE] = HOSTILE
    finding["location"]["layer"] = "head" + HOSTILE
    data["first_fault"]["layer"] = "head" + HOSTILE
    data["first_fault"]["op"] = "sqrt" + HOSTILE
    data["details"]["source"] = "model.py:3" + HOSTILE
    data["details"]["fields"] = {"x" + HOSTILE: {"dtype": HOSTILE, "min": 0.0}}
    data["environment"]["paddle" + HOSTILE] = HOSTILE
    data["run"]["command_line"] = "nandoctor probe c.yaml" + HOSTILE
    data["remedies"][0]["change"] = HOSTILE
    return data


# --- 1. escape sequences, control and bidi characters ------------------------------------------------

def test_inert_strips_each_kind_of_sequence_and_keeps_the_words():
    assert inert(CLEAR_SCREEN + "a" + HIDE_CURSOR) == "a"
    assert inert(WINDOW_TITLE + "a") == "a"  # the title goes with its sequence
    assert inert(HYPERLINK) == "click here"  # the hidden URL goes, the visible words stay
    assert inert(BIDI) == "evil iso"
    assert inert(C1_CSI) == "red"
    assert inert("\x1b]0;no end\nnext line") == "0;no end\nnext line"  # unterminated: nothing hidden
    assert inert("line 1\r\nline 2\tx\rline 3\x00\x0b\x0c") == "line 1\nline 2\tx\nline 3"
    assert CONTROL.search(inert(HOSTILE)) is None


def test_report_command_prints_no_control_character(tmp_path: Path):
    result = _cli("report", str(_write(tmp_path, _hostile_data())))
    assert result.exit_code == 1, result.output
    assert CONTROL.findall(result.stdout) == []
    for words in ("click here", "evil iso", "sqrtclick here"):
        assert words in result.stdout, words


def test_report_markdown_holds_no_control_character(tmp_path: Path):
    out = tmp_path / "ticket.md"
    result = _cli("report", str(_write(tmp_path, _hostile_data())), "--markdown", str(out))
    assert result.exit_code == 1, result.output
    markdown = out.read_text(encoding="utf-8")
    assert CONTROL.findall(markdown) == []
    assert "click here" in markdown and "evil iso" in markdown
    assert "evil.example" not in markdown  # the hidden hyperlink's target is gone with its sequence


def test_every_renderer_makes_user_text_inert():
    """Not only `nandoctor report`: the terminal view, the --quiet line and the Markdown of any report."""
    report = Report.from_dict(_hostile_data())
    console = Console(width=100, record=True, force_terminal=True, color_system="truecolor", highlight=False)
    console_report.render(report, console)
    console_report.render_verdict_line(report, console)
    console_report.render_environment(report.environment, console)
    # rich's own colours are SGR sequences (ESC [ ... m); nothing else may be there.
    printed = re.sub("\x1b\\[[0-9;]*m", "", console.export_text(styles=True))
    assert CONTROL.findall(printed) == []
    assert CONTROL.findall(markdown_report.render(report)) == []


# --- 2. a string of a megabyte -------------------------------------------------------------------------

def test_a_megabyte_string_is_cut_in_the_terminal_and_the_markdown(tmp_path: Path):
    data = _report_data()
    data["findings"][1]["message"] = "x" * 1_000_000
    data["findings"][1]["advice"].append("y" * 1_000_000)
    path = _write(tmp_path, data)
    cut = f"… ({1_000_000 - TEXT_LIMIT} characters cut)"
    result = _cli("report", str(path))
    assert result.exit_code == 1, result.output
    assert len(result.stdout) < 50_000  # was 2.1 MB
    flat = "".join(result.stdout.split())  # rich wraps the long line; its words are what count
    for char in "xy":
        assert char * TEXT_LIMIT + "".join(cut.split()) in flat and char * (TEXT_LIMIT + 1) not in flat
    out = tmp_path / "ticket.md"
    assert _cli("report", str(path), "--markdown", str(out)).exit_code == 1
    markdown = out.read_text(encoding="utf-8")
    assert len(markdown) < 50_000
    assert "x" * TEXT_LIMIT + cut in markdown and "y" * TEXT_LIMIT + cut in markdown
    # The JSON keeps what it has.
    assert json.loads(json_report.render(Report.from_dict(data)))["findings"][1]["message"] == "x" * 1_000_000


# --- 3. images only from inside the report's folder -----------------------------------------------------

def _images(markdown: str) -> list[str]:
    tokens = MarkdownIt("commonmark").parse(markdown)
    return [c.attrs["src"] for t in tokens for c in (t.children or []) if c.type == "image"]


def test_report_markdown_references_only_images_inside_the_report_folder(tmp_path: Path):
    folder = tmp_path / "bundle"
    (folder / "plots").mkdir(parents=True)
    (folder / "plots" / "loss.png").write_bytes(b"\x89PNG")
    outside = tmp_path / "secret.png"
    outside.write_bytes(b"\x89PNG")
    (folder / "link.png").symlink_to(outside)
    data = _report_data()
    data["details"]["plots"] = {"good": "plots/loss.png", "up": "../../../../etc/passwd", "absolute": "/etc/passwd",
                                "symlink out": "link.png", "folder": "plots", "inner up": "plots/../../secret.png",
                                "url": "https://evil.example/x.png", "home": "~/.ssh/id_rsa"}
    tickets = tmp_path / "tickets"
    tickets.mkdir()
    out = tickets / "ticket.md"
    result = _cli("report", str(_write(folder, data)), "--markdown", str(out))
    assert result.exit_code == 1, result.output
    markdown = out.read_text(encoding="utf-8")
    # One image, linked from where the Markdown is, and it is the file inside the report's folder.
    assert _images(markdown) == ["../bundle/plots/loss.png"]
    assert (tickets / "../bundle/plots/loss.png").resolve() == (folder / "plots" / "loss.png").resolve()
    plots = markdown.split("## Plots", 1)[1].split("## ", 1)[0]
    assert plots.count("left out") == 7
    assert "`../../../../etc/passwd` is not an image file inside the report's folder" in plots


def test_report_markdown_beside_the_report_keeps_its_relative_image(tmp_path: Path):
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / "loss.png").write_bytes(b"\x89PNG")
    data = _report_data()
    data["details"]["plots"] = {"Loss": "plots/loss.png"}
    out = tmp_path / "report.md"
    assert _cli("report", str(_write(tmp_path, data)), "--markdown", str(out)).exit_code == 1
    assert _images(out.read_text(encoding="utf-8")) == ["plots/loss.png"]


def test_markdown_of_a_report_in_memory_drops_paths_that_leave_its_folder():
    report = probe_nan_report()
    report.details["plots"] = {"ok": "plots/a.png", "up": "../x.png", "abs": "/etc/passwd.png"}
    assert _images(markdown_report.render(report)) == ["plots/a.png"]


# --- 4. nesting -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("depth", [100_000, 900, MAX_NESTING + 1])
def test_a_deeply_nested_report_is_malformed_exit_2(tmp_path: Path, depth: int):
    """100,000 levels break the JSON parser itself (was exit 3, 'a bug in nandoctor'); 900 parse but are
    more than any renderer should walk; just over the limit is refused the same way."""
    data = _report_data()
    data["findings"][1]["evidence"] = {"rows": "@NESTED@"}
    text = json.dumps(data).replace('"@NESTED@"', "[" * depth + "]" * depth)
    path = _write(tmp_path, text)
    result = _cli("report", str(path))
    assert result.exit_code == 2, result.output
    message = " ".join(result.output.split())
    assert str(path) in message and "malformed report" in message and "too deeply nested" in message
    assert "bug in nandoctor" not in message and "Traceback" not in message
    assert not list(tmp_path.glob("nandoctor-internal-error-*"))


def test_a_report_nested_within_the_limit_still_renders(tmp_path: Path):
    data = _report_data()
    data["findings"][1]["evidence"] = {"rows": json.loads("[" * 10 + "1" + "]" * 10)}
    assert _cli("report", str(_write(tmp_path, data))).exit_code == 1


def test_renderers_cut_nesting_they_are_given():
    deep: Any = "bottom"
    for _ in range(200):
        deep = [deep]
    shown = shown_value({"rows": deep})
    for _ in range(MAX_NESTING - 1):
        shown = shown[0] if isinstance(shown, list) else shown["rows"]
    assert shown == [f"… (nested more than {MAX_NESTING} levels deep, not shown)"]


def test_a_verdict_that_is_a_list_is_a_bad_report_not_a_crash(tmp_path: Path):
    data = _report_data()
    data["verdict"] = []
    result = _cli("report", str(_write(tmp_path, data)))
    assert result.exit_code == 2, result.output
    assert "'verdict' is []" in result.output
