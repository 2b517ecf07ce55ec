"""The command line: help text everywhere, `nandoctor env`, exit codes, `nandoctor report`, `python -m`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from report_samples import healthy_report, probe_nan_report, scan_report
from typer.testing import CliRunner

from nandoctor.cli import app
from nandoctor.findings import Report
from nandoctor.report import json as json_report
from nandoctor.report import markdown as markdown_report

COMMANDS = ("scan", "probe", "run", "report", "env")


def _cli(*args: str):
    return CliRunner(env={"COLUMNS": "100", "NO_COLOR": "1"}).invoke(app, list(args))


def _click_commands():
    return typer.main.get_command(app).commands


# --- help ---------------------------------------------------------------------------------------------

def test_every_registered_command_has_a_docstring():
    assert {c.callback.__name__ for c in app.registered_commands} == set(COMMANDS)
    for command in app.registered_commands:
        doc = command.help or command.callback.__doc__
        assert doc and len(doc.strip()) > 20, f"command {command.callback.__name__} has no help text"


def test_every_option_and_argument_has_help():
    for name, command in _click_commands().items():
        for param in command.params:
            assert getattr(param, "help", None), f"`nandoctor {name}`: {param.name} has no help text"


@pytest.mark.parametrize("command", COMMANDS)
def test_help_of_each_command(command: str):
    result = _cli(command, "--help")
    assert result.exit_code == 0, result.output
    first_line = _click_commands()[command].help.split(".")[0].split("(")[0].strip()
    squashed = " ".join(result.output.split())
    assert " ".join(first_line.split()) in squashed


def test_top_level_help_lists_commands():
    result = _cli("--help")
    assert result.exit_code == 0
    for command in COMMANDS:
        assert command in result.output
    assert "NaN" in result.output


def test_unknown_command_exits_2():
    result = _cli("frobnicate")
    assert result.exit_code == 2 and "No such command" in result.output


def test_python_dash_m_help():
    done = subprocess.run([sys.executable, "-m", "nandoctor", "--help"], capture_output=True, text=True,
                          timeout=120, env={"COLUMNS": "100", "NO_COLOR": "1", "PATH": ""})
    assert done.returncode == 0, done.stderr
    assert "Usage: nandoctor" in done.stdout
    for command in COMMANDS:
        assert command in done.stdout


# --- env ----------------------------------------------------------------------------------------------

def test_env_prints_paddle_version():
    import paddle

    result = _cli("env")
    assert result.exit_code == 0, result.output
    assert "paddle" in result.stdout and paddle.__version__ in result.stdout
    assert "python" in result.stdout and "nandoctor" in result.stdout
    assert "Traceback" not in result.output


# --- nandoctor report ---------------------------------------------------------------------------------

def _write(tmp_path: Path, report: Report, name: str = "report.json") -> Path:
    path = tmp_path / name
    path.write_text(json_report.render(report), encoding="utf-8")
    return path


@pytest.mark.parametrize("build, code", [(probe_nan_report, 1), (scan_report, 1), (healthy_report, 0)])
def test_report_rerenders_saved_json_with_the_same_exit_code(tmp_path: Path, build, code: int):
    path = _write(tmp_path, build())
    result = _cli("report", str(path))
    assert result.exit_code == code, result.output
    if build is probe_nan_report:
        assert "head.distance" in result.stdout and "sqrt_grad" in result.stdout and "✗" in result.stdout


def test_report_markdown_round_trip(tmp_path: Path):
    original = probe_nan_report()
    path = _write(tmp_path, original)
    out = tmp_path / "ticket.md"
    result = _cli("report", str(path), "--markdown", str(out))
    assert result.exit_code == 1, result.output
    assert out.read_text(encoding="utf-8") == markdown_report.render(original)
    assert str(out) in result.stdout


def test_report_accepts_a_bundle_folder(tmp_path: Path):
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    _write(bundle, healthy_report())
    result = _cli("report", str(bundle))
    assert result.exit_code == 0, result.output
    assert "healthy" in result.stdout


@pytest.mark.parametrize("content, words", [
    ('{"hello": "world"}', "not a nandoctor report"),
    ("[1, 2, 3]", "not a nandoctor report (a JSON list"),
    ("{not json", "not a readable JSON report"),
    ('{"schema": "nandoctor.report/1", "command": "probe", "verdict": "nan_found", "findings": [{"code": "x"}]}',
     "the key 'severity' is missing"),
    # a schema line alone used to render as "healthy" (exit 0): the required keys are checked
    ('{"schema": "nandoctor.report/1"}', "it has no 'command', 'verdict', 'findings'"),
    ('{"schema": "nandoctor.report/1", "command": "probe", "findings": []}', "it has no 'verdict'"),
    ('{"schema": "nandoctor.report/1", "command": "probe", "verdict": "fine", "findings": []}', "'verdict' is 'fine'"),
    ('{"schema": "nandoctor.report/1", "command": "probe", "verdict": "healthy", "findings": {}}',
     "'findings' is a dict"),
])
def test_report_rejects_non_reports_with_exit_2(tmp_path: Path, content: str, words: str):
    path = tmp_path / "report.json"
    path.write_text(content, encoding="utf-8")
    result = _cli("report", str(path))
    assert result.exit_code == 2, result.output
    assert words in result.output and "Traceback" not in result.output


def test_report_missing_file_exits_2(tmp_path: Path):
    result = _cli("report", str(tmp_path / "nope.json"))
    assert result.exit_code == 2 and "no such file" in result.output


def test_report_markdown_into_missing_folder_exits_2(tmp_path: Path):
    path = _write(tmp_path, healthy_report())
    result = _cli("report", str(path), "--markdown", str(tmp_path / "missing" / "r.md"))
    assert result.exit_code == 2 and "does not exist" in result.output


def test_json_written_by_renderer_reads_back_equal(tmp_path: Path):
    original = scan_report()
    data = json.loads(_write(tmp_path, original).read_text(encoding="utf-8"))
    back = Report.from_dict(data)
    assert back.to_dict() == data
    assert back.exit_code == original.exit_code and back.verdict == original.verdict


# --- scan end to end: what reaches the terminal and the files -------------------------------------------

NAN_PROJECT = {
    "models.py": "def build_model():\n    import paddle\n\n    return paddle.nn.Linear(3, 2)\n",
    "data.py": ("import numpy as np\n\n\ndef build_loader():\n    x = np.ones((4, 3), 'float32')\n"
                "    x[2, 1] = np.nan\n    return [(np.ones((4, 3), 'float32'), np.zeros(4, 'int64')),\n"
                "            (x, np.zeros(4, 'int64'))]\n"),
    "config.yaml": ('version: 1\nmodel: {entry: "models.py:build_model"}\n'
                    'data: {entry: "data.py:build_loader", fields: [x, y], label: y}\n'
                    "loss: {builtin: cross_entropy}\n"),
}


@pytest.fixture
def nan_project(tmp_path: Path) -> Path:
    for name, text in NAN_PROJECT.items():
        (tmp_path / name).write_text(text)
    return tmp_path


def test_scan_quiet_json_and_markdown(nan_project: Path):
    config, out_json, out_md = nan_project / "config.yaml", nan_project / "r.json", nan_project / "r.md"
    result = _cli("scan", str(config), "--quiet", "--json", str(out_json), "--markdown", str(out_md))
    assert result.exit_code == 1, result.output
    assert result.stdout.count("\n") == 1  # --quiet: one line
    assert result.stdout.startswith("nan_found: 1 error") and "batch 1, sample 2, field 'x'" in result.stdout
    text = out_json.read_text(encoding="utf-8")
    data = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} literal in JSON"))
    assert data["verdict"] == "nan_found" and data["first_fault"]["batch_index"] == 1
    assert data["first_fault"]["sample_indices"] == [2]
    markdown = out_md.read_text(encoding="utf-8")
    assert markdown.startswith("# nandoctor scan: NaN/Inf found")
    assert "## How to reproduce\n\n```shell\nnandoctor " in markdown  # argv under CliRunner is pytest's
    assert markdown == markdown_report.render(Report.from_dict(data))
