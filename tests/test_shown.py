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
