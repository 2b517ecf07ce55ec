"""The same report on every run (issue 35 item 4): how often the probe reads the device follows measured
timings, so a test forces the read stride (NANDOCTOR_READ_EVERY, tests only) to two values and asks for the same
findings (codes, severities, steps, layers, ops), verdict and remedy verdicts. The runs: a plain SGD warmup to a
too-high rate whose loss diverges and overflows at step ~150 (past the steps read in full), and an Adam one
that diverges without a NaN."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_loss_trend import FAULTY as FAULTY_RUN
from test_loss_trend import probe

from nandoctor.engine.watcher import READ_EVERY_ENV

FAULTY = {"peak": 1.0, **FAULTY_RUN}
DIVERGING = {"peak": 1.0, "n": 200}


def conclusions(report: dict[str, Any]) -> dict[str, Any]:
    """What a report concludes, timings and measured figures aside."""
    return {
        "verdict": report["verdict"],
        "first_fault": report["first_fault"],
        "findings": [(f["code"], f["severity"], f["location"]["step"], f["location"]["layer"], f["location"]["op"],
                      f["location"]["batch_index"]) for f in report["findings"]],
        "remedies": [(r["remedy"], r["outcome"], r.get("start_step")) for r in report.get("remedies") or []],
    }


@pytest.mark.parametrize("case", ["faulty", "diverging"])
def test_forced_read_strides_give_the_same_findings(case: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    kw = FAULTY if case == "faulty" else DIVERGING
    seen = []
    for stride in ("1", "48"):
        monkeypatch.setenv(READ_EVERY_ENV, stride)
        report = probe(tmp_path, try_fixes=case == "faulty", **kw)
        seen.append(conclusions(report))
    assert seen[0] == seen[1]
    codes = {f[0] for f in seen[0]["findings"]}
    assert "loss.divergence" in codes
    if case == "faulty":
        assert seen[0]["verdict"] == "nan_found" and seen[0]["first_fault"]["step"] > 64
