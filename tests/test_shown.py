"""What a report shows at 80 columns, in Markdown and in plots (issue 21, "What is shown").

Reports come from a real probe run on a sample config (lr_divergence: a verified learning-rate, clipping
and warmup remedy each) and from the fixtures in report_samples.py; plots are checked on matplotlib's
objects, never on pixels.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from inloop_helpers import ROOT

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

import json  # noqa: E402

import pytest  # noqa: E402
from rich.console import Console  # noqa: E402

from nandoctor.findings import Report  # noqa: E402
from nandoctor.report import console as console_report  # noqa: E402

SAMPLES = ROOT / "sample_configs"


@pytest.fixture(scope="module")
def lr_divergence(tmp_path_factory: pytest.TempPathFactory) -> Report:
    """The probe's own report of lr_divergence (SGD at 0.03 on unstandardised features), read back."""
    out = tmp_path_factory.mktemp("lr") / "report.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "80"}
    proc = subprocess.run([sys.executable, "-m", "nandoctor", "probe", str(SAMPLES / "lr_divergence" / "config.yaml"),
                           "--json", str(out)], capture_output=True, text=True, timeout=LIMIT, env=env)
    assert proc.returncode == 1, proc.stderr
    report = Report.from_dict(json.loads(out.read_text()))
    assert [r["outcome"] for r in report.remedies[:3]] == ["fixed"] * 3  # lr_x0.1, grad_clip, warmup
    return report


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
