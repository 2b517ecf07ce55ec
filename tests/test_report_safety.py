"""Reports go into public tickets: user text cannot reshape the Markdown, and no absolute home path leaks.

The Markdown is parsed back with markdown-it (CommonMark + GFM tables, installed with rich), so the
checks are on the document's structure, not on strings: the headings, code blocks, HTML and table
cells are exactly the ones nandoctor made, whatever the exception message says.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from markdown_it import MarkdownIt
from report_samples import probe_nan_report

from nandoctor.findings import Code, Finding, FirstFault, Location, Phase, Report, Severity
from nandoctor.report import json as json_report
from nandoctor.report import markdown as markdown_report
from nandoctor.report.common import public_paths

HOSTILE = ("boom\n```\n# Injected heading\n<script>alert(1)</script>\n| a | b |\n\n## Findings\n"
           "~~~\n[click](https://evil.example) `unclosed")


def _hostile_report() -> Report:
    fault = FirstFault(step=3, phase=Phase.FORWARD, layer="enc`oder|x\n# L", op="```",
                       parameter="<img src=x onerror=alert(1)>", batch_index=3, sample_indices=[1])
    report = Report(command="probe", first_fault=fault)
    report.findings.append(Finding(Code.USER_CODE_ERROR, Severity.ERROR, HOSTILE, fault.as_location(),
                                   evidence={"field|`": HOSTILE},
                                   advice=["Use `x` then `a|b`", "two `` ticks ` odd", HOSTILE]))
    report.details["source"] = "model.py:3 in f```\n# Pwned <b>"
    report.details["fields"] = {"x`|\n# f": {"dtype": "float32", "min": HOSTILE}}
    report.environment = {"path|": "</table><script>x</script>"}
    report.run = {"config": "c.yaml", "command_line": "nandoctor probe 'a\n```\n# x\n````'.yaml",
                  "device": "cpu`|\n# d"}
    return report


def _tokens(markdown: str):
    return MarkdownIt("commonmark").enable("table").parse(markdown)


def test_hostile_user_text_cannot_reshape_the_markdown():
    markdown = markdown_report.render(_hostile_report())
    tokens = _tokens(markdown)
    headings = [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "heading_open"]
    assert headings[0].startswith("nandoctor probe")
    assert [h for h in headings[1:] if not h.startswith("1. ")] == [
        "First fault", "Findings", "What to do", "Data fields", "Environment", "How to reproduce"]
    assert not any("Injected" in h or "Pwned" in h for h in headings)
    fences = [t for t in tokens if t.type in ("fence", "code_block")]
    assert len(fences) == 1 and fences[0].info == "shell"
    assert fences[0].content == "nandoctor probe 'a\n```\n# x\n````'.yaml\n"  # the whole command, verbatim
    html = [c.content for t in tokens for c in (t.children or []) if c.type == "html_inline"]
    html += [t.content for t in tokens if t.type == "html_block"]
    assert set(html) <= {"<br>"}
    links = [c for t in tokens for c in (t.children or []) if c.type == "link_open"]
    assert links == []
    # Every table row has as many cells as its header.
    cells, header = 0, None
    for t in tokens:
        if t.type == "tr_open":
            cells = 0
        elif t.type in ("th_open", "td_open"):
            cells += 1
        elif t.type == "tr_close":
            header = cells if header is None else header
            assert cells == header
        elif t.type == "table_close":
            header = None


def test_hostile_text_is_still_shown_in_full():
    """Escaping keeps the text readable: the rendered words are all there."""
    markdown = markdown_report.render(_hostile_report())
    html = MarkdownIt("commonmark").enable("table").render(markdown)
    for words in ("Injected heading", "alert(1)", "Use <code>x</code> then", "evil.example",
                  "enc`oder|x # L", "model.py:3 in f``` # Pwned &lt;b&gt;"):
        assert words in html, words
    assert "<script>" not in html and "<img" not in html


def test_code_spans_survive_backticks_and_pipes():
    code = markdown_report.code
    assert code("a`b") == "``a`b``"
    assert code("`x`") == "`` `x` ``"
    assert markdown_report.cell("a|b", code_span=True) == "`a\\|b`"
    assert markdown_report.fenced("x\n```\ny", "shell") == ["````shell", "x\n```\ny", "````"]


def test_golden_reports_keep_their_look():
    """Intraword underscores and balanced `code` in advice stay as they were (no escaping noise)."""
    markdown = markdown_report.render(probe_nan_report())
    assert "op sqrt_grad" in markdown and "`optimizer.grad_clip: {global_norm: 1.5}`" in markdown


# --- paths: relative to the project, ~ for home ---------------------------------------------------------


def test_public_paths_rewrites_project_and_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    home = tmp_path / "home" / "ana"
    project = home / "proj"
    monkeypatch.setenv("HOME", str(home))
    value = {"source": f"{project}/model.py:12 in forward", "cmd": f"nandoctor probe {project}/config.yaml",
             "other": f"{home}/data/x.npy and {home}", "not_home": f"{home}2/x",
             "project": str(project), "list": [f"{home}/.venv/bin/python"]}
    assert public_paths(value, project) == {
        "source": "model.py:12 in forward", "cmd": "nandoctor probe config.yaml",
        "other": "~/data/x.npy and ~", "not_home": f"{home}2/x", "project": ".",
        "list": ["~/.venv/bin/python"]}


def test_reports_and_bundle_never_show_the_home_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    from typer.testing import CliRunner

    from nandoctor.cli import app

    sample = Path(__file__).resolve().parent.parent / "sample_configs" / "nan_in_data"
    home = tmp_path / "home" / "ana"
    project = home / "work" / "proj"
    project.mkdir(parents=True)
    for name in ("config.yaml", "model.py", "data.py"):
        (project / name).write_bytes((sample / name).read_bytes())
    monkeypatch.setenv("HOME", str(home))
    out = home / "tickets"
    out.mkdir()
    result = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"}).invoke(app, [
        "scan", str(project / "config.yaml"), "--json", str(out / "r.json"), "--markdown", str(out / "r.md"),
        "--bundle", str(out / "b"), "--quiet"])
    assert result.exit_code == 1, result.output
    written = [out / "r.json", out / "r.md"] + [p for p in (out / "b").rglob("*") if p.suffix in
                                                (".json", ".md", ".txt")]
    assert len(written) >= 7
    for file in written:
        assert str(home) not in file.read_text(), file
    data = json.loads((out / "r.json").read_text())
    assert data["run"]["config"] == "config.yaml"
    assert data["run"]["command_line"].startswith("nandoctor scan config.yaml")
    assert (out / "b" / "command.txt").read_text().startswith("nandoctor scan config.yaml")


def test_json_report_keeps_paths_outside_home_and_project(tmp_path: Path):
    report = Report(command="scan", run={"config": str(tmp_path / "p" / "c.yaml")})
    report.findings.append(Finding(Code.DATA_NONFINITE, Severity.ERROR, "bad at /opt/data/x.npy",
                                   Location(batch_index=0)))
    data = json.loads(json_report.render(report))
    assert data["run"]["config"] == "c.yaml"
    assert data["findings"][0]["message"] == "bad at /opt/data/x.npy"


def test_environment_shows_the_interpreter_under_home_with_a_tilde(monkeypatch: pytest.MonkeyPatch):
    from nandoctor import env

    monkeypatch.setenv("HOME", "/home/ana")
    assert env.home_relative("/home/ana/proj/.venv/bin/python") == "~/proj/.venv/bin/python"
    assert env.home_relative("/home/anna/python") == "/home/anna/python"
    monkeypatch.setattr(env.sys, "executable", "/home/ana/.venv/bin/python")
    assert env.collect()["executable"] == "~/.venv/bin/python"
