"""What a report shows at 80 columns, in Markdown and in plots (issue 21, "What is shown").

Reports come from a real probe run on a sample config (lr_divergence: a verified learning-rate, clipping
and warmup remedy each) and from the fixtures in report_samples.py; plots are checked on matplotlib's
objects, never on pixels.
"""

from __future__ import annotations

import json
import linecache
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from inloop_helpers import ROOT
from report_samples import probe_nan_report, scan_report
from rich.console import Console

from nandoctor.findings import Mode, Report
from nandoctor.report import console as console_report
from nandoctor.report import markdown as markdown_report

LIMIT = 240


def test_paddles_ccache_warning_never_reaches_the_terminal(tmp_path: Path) -> None:
    """`nandoctor run` watches a script that imports Paddle: its "No ccache found" notice is filtered (that
    message only), as the CLI's own import of Paddle is."""
    script = tmp_path / "imports.py"
    script.write_text("import warnings\nimport paddle\nwarnings.warn('the script warns too')\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "80"}
    proc = subprocess.run([sys.executable, "-m", "nandoctor", "run", "--", sys.executable, str(script)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=LIMIT, env=env)
    assert "the script warns too" in proc.stderr  # the script's own warnings still show
    assert "No ccache found" not in proc.stderr + proc.stdout


# --- a real report: lr_divergence probed by the CLI ------------------------------------------------------

SAMPLES = ROOT / "sample_configs"


@pytest.fixture(scope="module")
def lr_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Report, str, str]:
    """The probe's own report of lr_divergence (SGD at 0.03 on unstandardised features), read back, with
    what the command printed at 80 columns and the Markdown it wrote."""
    folder = tmp_path_factory.mktemp("lr")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "80"}
    proc = subprocess.run([sys.executable, "-m", "nandoctor", "probe", str(SAMPLES / "lr_divergence" / "config.yaml"),
                           "--json", "report.json", "--markdown", "report.md"], cwd=folder, capture_output=True,
                          text=True, timeout=LIMIT, env=env)
    assert proc.returncode == 1, proc.stderr
    report = Report.from_dict(json.loads((folder / "report.json").read_text()))
    assert [r["outcome"] for r in report.remedies[:3]] == ["fixed"] * 3  # lr_x0.1, grad_clip, warmup
    return report, proc.stdout, (folder / "report.md").read_text()


@pytest.fixture(scope="module")
def lr_divergence(lr_run: tuple[Report, str, str]) -> Report:
    return lr_run[0]


def _console(report: Report, width: int = 80) -> str:
    console = Console(width=width, record=True, color_system=None, force_terminal=False)
    console_report.render(report, console)
    return console.export_text()


def test_replay_internals_stay_out_of_the_console(lr_divergence: Report) -> None:
    """The snapshot ring, the replays' budget and timings are nandoctor's figures: JSON only."""
    text = _console(lr_divergence)
    assert "snapshots kept" not in text and " MB" not in text and "budget" not in text
    assert "the fault reproduced in a replay without any change" in " ".join(text.split())  # this stays
    assert lr_divergence.details["snapshots"]["kept_steps"]  # and the JSON still holds the figures


def test_remedies_are_a_list_with_each_change_whole_and_printed_once(lr_divergence: Report) -> None:
    """At 80 columns a table broke `optimizer.lr_s│cheduler` mid-identifier; each change's identifiers now
    stand whole on a line, and each change is printed once (the findings name the verified remedies)."""
    text = _console(lr_divergence)
    lines = text.splitlines()
    for row in lr_divergence.remedies:
        if row["outcome"] != "fixed":
            continue
        code = row["change"].rsplit(" (", 1)[0]
        for token in re.findall(r"[A-Za-z_][\w.]*", code):
            assert any(re.search(rf"(?<![\w.]){re.escape(token)}(?![\w.])", line) for line in lines), token
        assert " ".join(text.split()).count(" ".join(row["change"].split())) == 1, row["change"]
    assert "│" not in text.split("remedies", 1)[1].split("1. ERROR")[0]  # no table rules between the lines
    assert "Verified by replay: lr_x0.1, grad_clip, warmup" in " ".join(text.split())


def test_first_fault_shows_the_text_of_the_source_line(lr_run: tuple[Report, str, str]) -> None:
    report, stdout, _ = lr_run
    path, line = report.details["source"].split(" in ")[0].split(":")
    expected = linecache.getline(str(SAMPLES / "lr_divergence" / path), int(line)).strip()
    assert expected.startswith("return self.out(")
    panel = stdout.split("first fault", 1)[1].split("╰")[0]
    assert expected in panel


def test_field_names_and_dtypes_are_never_cut() -> None:
    """A scan report's fields at 80 columns: every name and dtype whole (a table cut 'attention…')."""
    report = scan_report()
    stats = dict(next(iter(report.details["fields"].values())))
    report.details["fields"]["attention_mask_of_the_decoder"] = dict(stats, dtype="bfloat16")
    report.details["fields"]["position_ids"] = dict(stats, dtype="int64", shape=[[8, 512], [8, 384], [4, 128]])
    for width in (80, 100):
        text = _console(report, width)
        assert "…" not in text.split("data fields", 1)[1]
        for name, field in report.details["fields"].items():
            assert re.search(rf"\b{re.escape(name)}\b", text) and field["dtype"] in text


@pytest.mark.parametrize("mode", [Mode.WATCH, Mode.HAPI, Mode.TRAINER])
def test_in_loop_reports_name_no_exit_status_and_no_flag(mode: Mode) -> None:
    """A watch or callback run ends as the user's own process does: no 'exit status 1', no --markdown."""
    report = probe_nan_report()
    report.run["mode"] = mode.value
    text = " ".join(_console(report).split()).lower()
    assert "exit status" not in text and "--markdown" not in text
    assert "exit status" not in markdown_report.render(report).lower()


def test_no_markdown_footer_when_markdown_was_written(lr_run: tuple[Report, str, str]) -> None:
    _, stdout, _ = lr_run
    assert "--markdown" not in stdout and "Exit status 1" in " ".join(stdout.split())
