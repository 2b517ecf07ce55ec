"""The renderers: exact Markdown and JSON output (golden files), strict JSON, and the terminal view."""

from __future__ import annotations

import json
import math
import re

import pytest
from report_samples import healthy_report, probe_nan_report, scan_report
from rich.console import Console

from nandoctor.findings import Code, Finding, Location, Report, Severity, TimelinePoint
from nandoctor.report import console as console_report
from nandoctor.report import json as json_report
from nandoctor.report import markdown as markdown_report
from nandoctor.report.common import BLOCKS, NONFINITE_MARK, downsample, sparkline


def _strict_loads(text: str):
    """json.loads that refuses NaN/Infinity literals, as most other JSON parsers do."""
    def refuse(name: str):
        raise ValueError(f"non-standard JSON literal {name}")
    return json.loads(text, parse_constant=refuse)


def _console(width: int = 100, **kwargs) -> Console:
    kwargs.setdefault("force_terminal", False)
    return Console(width=width, record=True, highlight=False, **kwargs)


def _console_text(report: Report, **kwargs) -> str:
    con = _console(**kwargs)
    console_report.render(report, con)
    return con.export_text()


# --- golden files -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, build", [("probe_nan", probe_nan_report), ("scan", scan_report),
                                         ("healthy", healthy_report)])
def test_markdown_golden(golden, name, build):
    golden(f"{name}.md", markdown_report.render(build()))


@pytest.mark.parametrize("name, build", [("probe_nan", probe_nan_report), ("scan", scan_report)])
def test_json_golden(golden, name, build):
    golden(f"{name}.json", json_report.render(build()))


# --- JSON ---------------------------------------------------------------------------------------------

def test_json_is_strict_and_has_no_nan_literals():
    text = json_report.render(probe_nan_report())
    assert text.endswith("}\n")
    data = _strict_loads(text)  # raises on NaN / Infinity
    assert ": NaN" not in text and ": Infinity" not in text and ": -Infinity" not in text  # no bare literal
    assert data["schema"] == "nandoctor.report/1"
    assert data["verdict"] == "nan_found"
    assert data["first_fault"]["batch_index"] == 4  # was a numpy int64
    assert data["timeline"][36] == {"step": 36, "loss": "NaN", "grad_norm": "Infinity"}
    assert data["findings"][1]["evidence"]["max"] == "Infinity"


def test_json_keeps_contract_keys():
    data = _strict_loads(json_report.render(probe_nan_report()))
    assert set(data) >= {"schema", "command", "verdict", "first_fault", "findings", "timeline", "environment"}
    assert set(data["first_fault"]) == {"step", "phase", "layer", "op", "parameter", "batch_index",
                                        "sample_indices", "rank"}  # rank: null outside multi-process runs
    finding = data["findings"][1]
    assert set(finding) >= {"code", "severity", "message", "location", "evidence", "advice"}
    assert finding["location"]["layer"] == "head.distance" and finding["location"]["op"] == "sqrt_grad"


def test_json_numpy_values_in_location_and_details():
    np = pytest.importorskip("numpy")
    report = Report(command="scan", findings=[Finding(
        Code.DATA_RANGE, Severity.WARNING, "big",
        Location(batch_index=np.int64(3), sample_indices=[np.int32(1)]),
        evidence={"max": np.float32(np.inf), "values": np.array([1.0, np.nan])})],
        details={"fields": {"x": {"std": np.float64("nan")}}})
    data = _strict_loads(json_report.render(report))
    assert data["findings"][0]["location"]["batch_index"] == 3
    assert data["findings"][0]["location"]["sample_indices"] == [1]
    assert data["findings"][0]["evidence"] == {"max": "Infinity", "values": [1.0, "NaN"]}
    assert data["details"]["fields"]["x"]["std"] == "NaN"


def test_json_round_trip_renders_the_same_markdown():
    """A report read back from its JSON (NaN as strings, numpy gone) renders exactly as the original."""
    for build in (probe_nan_report, scan_report, healthy_report):
        original = build()
        back = Report.from_dict(_strict_loads(json_report.render(original)))
        assert back.verdict == original.verdict
        assert json_report.render(back) == json_report.render(original)
        assert back.details == _strict_loads(json.dumps(original.to_dict()["details"]))  # timings back in place
        assert markdown_report.render(back) == markdown_report.render(original)


# --- Markdown -----------------------------------------------------------------------------------------

def test_markdown_sections_and_escaping():
    text = markdown_report.render(probe_nan_report())
    assert text.startswith("# nandoctor probe: NaN/Inf found\n")
    assert "| 36 | backward | `head.distance` | `sqrt_grad` | — | 4 | 3, 7 |" in text
    assert "(\\|x\\| = 0 in 2 rows)" in text  # a | inside a table cell is escaped
    assert "| max | Inf |" in text  # offending tensor statistics
    assert "- The gradient of sqrt at 0 is infinite" in text
    assert "![Loss and gradient norm](plots/loss_and_grad_norm.png)" in text
    assert "```shell\nnandoctor probe examples/siamese/config.yaml --steps 40\n```" in text
    assert "| paddle | 3.3.1 |" in text
    assert "Partial report" not in text
    findings = text.split("## Findings")[1].split("## ")[0]
    rows = [line for line in findings.splitlines() if line.startswith("| ")]
    assert len(rows) == 5  # header, rule, three findings
    for line in rows:  # five columns each: a stray | in a message would add a cell
        assert line.replace("\\|", "").count("|") == 6, line


def test_markdown_partial_report_says_so_at_the_top():
    report = probe_nan_report()
    report.partial = True
    head = markdown_report.render(report).split("## ")[0]
    assert "Partial report" in head


def test_markdown_timeline_downsampled_keeps_first_last_and_fault():
    report = probe_nan_report()
    report.timeline = [TimelinePoint(step=i, loss=1.0, grad_norm=1.0) for i in range(500)]
    report.timeline[317] = TimelinePoint(step=317, loss=math.nan, grad_norm=math.nan)
    report.first_fault.step = 317
    text = markdown_report.render(report)
    section = text.split("## Timeline")[1].split("## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| step")
            and not line.startswith("| ---")]
    assert 20 <= len(rows) <= 31
    assert rows[0].startswith("| 0 |") and rows[-1].startswith("| 499 |")
    assert any(r.startswith("| **317** (fault) | NaN |") for r in rows)
    assert "of 500 steps shown" in section


def test_markdown_loss_scale_column_only_when_present():
    report = healthy_report()
    assert "loss scale" not in markdown_report.render(report)
    report.timeline[2].loss_scale = 32768.0
    text = markdown_report.render(report)
    assert "| step | loss | grad norm | loss scale |" in text and "| 3.277e+04 |" in text


def test_markdown_without_findings_or_command_line():
    text = markdown_report.render(Report(command="scan"))
    assert "No findings" in text and "command line was not recorded" in text
    assert "## First fault" not in text and "## Timeline" not in text


def test_downsample_and_sparkline_units():
    points = [TimelinePoint(step=i, loss=float(i)) for i in range(100)]
    kept = downsample(points, keep_step=57, max_rows=10)
    steps = [p.step for p in kept]
    assert steps[0] == 0 and steps[-1] == 99 and 57 in steps and len(steps) <= 10
    assert downsample(points[:5], keep_step=None) == points[:5]
    cells = sparkline([1.0, 10.0, 100.0, 1000.0, float("nan")], log=True)
    chars = "".join(c for c, _ in cells)
    assert chars == BLOCKS[0] + BLOCKS[2] + BLOCKS[5] + BLOCKS[7] + NONFINITE_MARK
    assert cells[-1] == (NONFINITE_MARK, False)
    # Bucketing a long series never hides a single non-finite point.
    long = [1.0] * 999 + ["inf"]
    assert NONFINITE_MARK in "".join(c for c, _ in sparkline(long, width=60))
    assert len(sparkline(long, width=60)) == 60


# --- terminal -----------------------------------------------------------------------------------------

def test_console_probe_report_shows_fault_advice_and_sparklines():
    text = _console_text(probe_nan_report())
    assert "nandoctor probe: NaN/Inf found" in text and "nan_found" in text
    assert "head.distance" in text and "sqrt_grad" in text
    assert "first fault" in text and re.search(r"│ samples +3, 7 ", text)
    assert not re.search(r"│ parameter ", text)  # a field with no value is left out of the panel
    assert "num_inf=2" in text  # offending tensor statistics
    assert "grad.nonfinite" in text and "ERROR" in text and "WARNING" in text
    assert "• The gradient of sqrt at 0 is infinite" in text
    loss_line = next(line for line in text.splitlines() if line.startswith("loss "))
    norm_line = next(line for line in text.splitlines() if line.startswith("grad norm"))
    assert NONFINITE_MARK * 4 in loss_line and NONFINITE_MARK * 4 in norm_line
    assert BLOCKS[0] in norm_line and BLOCKS[-1] in norm_line and "log scale" in norm_line
    assert "--markdown report.md" in text and "Exit status 1" in text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_console_nonfinite_mark_is_red_and_verdict_coloured():
    con = _console(force_terminal=True, color_system="standard")
    console_report.render(probe_nan_report(), con)
    ansi = con.export_text(styles=True)
    assert "\x1b[1;31m" + NONFINITE_MARK in ansi
    con = _console(force_terminal=True, color_system="standard")
    console_report.render(healthy_report(), con)
    assert "\x1b[1;32mhealthy" in con.export_text(styles=True)


def test_console_scan_report_shows_field_table():
    text = _console_text(scan_report())
    assert "data fields" in text
    x_row = next(line for line in text.splitlines() if line.split()[:1] == ["x"])
    assert "float32" in x_row and "NaN" in x_row and "-3.2" in x_row and "32×16" in x_row
    assert "12" in text and "batches scanned" in text
    assert "field 'x'" in text


def test_console_user_text_is_not_markup():
    report = Report(command="probe", findings=[Finding(
        Code.USER_CODE_ERROR, Severity.ERROR, "IndexError: [bold]list index[/bold] out of range",
        Location(step=0, layer="blocks[0]"), advice=["Look at [red]x[/red]."])], crashed=True)
    text = _console_text(report)
    assert "[bold]list index[/bold]" in text and "[red]x[/red]" in text and "layer blocks[0]" in text
    assert "crashed" in text


def test_console_healthy_and_partial():
    text = _console_text(healthy_report())
    assert "healthy" in text and "Exit status 0" in text and NONFINITE_MARK not in text
    report = probe_nan_report()
    report.partial = True
    assert "Partial report" in _console_text(report)


def test_verdict_line_is_one_line_with_first_fault():
    con = _console()
    console_report.render_verdict_line(probe_nan_report(), con)
    text = con.export_text()
    assert text.count("\n") == 1
    assert text.startswith("nan_found: 1 error, 1 warning, 1 info, 40 steps run; "
                           "first fault: grad.nonfinite at step 36")
    assert "layer head.distance, op sqrt_grad" in text


def test_render_environment_table():
    con = _console()
    console_report.render_environment({"paddle": "3.3.1", "gpus": ["A100", "A100"], "flags": {"F": "1"}}, con)
    text = con.export_text()
    assert "paddle" in text and "3.3.1" in text and "[A100, A100]" in text and "F=1" in text


def test_report_from_a_newer_nandoctor_still_renders():
    """A finding code this version does not know is kept as text and shown, not refused."""
    data = _strict_loads(json_report.render(scan_report()))
    data["findings"][0]["code"] = "data.future_check"
    back = Report.from_dict(data)
    assert "`data.future_check`" in markdown_report.render(back)
    assert "data.future_check" in _console_text(back)
    assert "data.future_check" in json_report.render(back)


def test_next_step_line_matches_the_verdict():
    report = scan_report()
    report.findings = [f for f in report.findings if f.code.value == "data.label_range"]  # an error, no NaN
    text = _console_text(report)
    assert "error_found" in text and "Exit status 1" in text and "Fix the errors above" in text
    assert "Nothing broke yet" not in text
    report.findings[0].severity = Severity.WARNING
    assert "Nothing broke yet" in _console_text(report)
