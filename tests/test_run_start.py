"""`nandoctor run`'s parent process only supervises the script: what it imports is its fixed start, paid
whole by a short run (issue 36). Checked with Python's own import log of that process (`-X importtime`,
which the script's process does not inherit): a process, because its imports are what is checked."""

from __future__ import annotations

import subprocess
import sys

# Imported by the watched script's process (Paddle itself imports numpy), never by the parent
NOT_IN_PARENT = ("numpy", "paddle", "yaml", "nandoctor.report.bundle", "nandoctor.spec", "nandoctor.inloop")


def _imported(stderr: str) -> set[str]:
    """The modules an `-X importtime` log names."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def test_the_parent_imports_neither_paddle_nor_numpy_nor_the_report_stack() -> None:
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "nandoctor", "run", "--", sys.executable, "-c",
                           "pass"], capture_output=True, text=True, timeout=120, check=False)
    imported = _imported(done.stderr)
    assert "nandoctor.zero_change.runner" in imported, done.stderr[-2000:]  # the log is the parent's, and whole
    assert "nothing was watched" in done.stderr
    assert sorted(m for m in NOT_IN_PARENT if m in imported) == []
