"""Write a spec for tests/probe_models.py into a temp folder and run the probe on it (test helper)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from nandoctor.findings import Report
from nandoctor.probe import ProbeOptions, run_probe
from nandoctor.spec import load_spec

MODELS = Path(__file__).resolve().parent / "probe_models.py"


def probe(tmp_path: Path, *, model: str = "classifier", model_args: dict | None = None, data: str = "loader",
          data_args: dict | None = None, loss: str | None = "cross_entropy", step: str | None = None,
          optimizer: dict | None = None, steps: int = 6, extra: dict | None = None, progress: Any = None) -> Report:
    raw: dict[str, Any] = {
        "version": 1,
        "model": {"entry": f"{MODELS}:{model}", "args": model_args or {}},
        "data": {"entry": f"{MODELS}:{data}", "args": data_args or {}, "fields": ["x", "label"], "label": "label"},
        "optimizer": optimizer or {"name": "Adam", "args": {"learning_rate": 0.01}},
    }
    if step is not None:
        raw["step"] = {"entry": f"{MODELS}:{step}"}
    else:
        raw["loss"] = {"builtin": loss}
    raw.update(extra or {})
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    spec = load_spec(path)
    options = ProbeOptions(steps=steps, seed=0, device="cpu")
    return run_probe(spec, options, progress) if progress else run_probe(spec, options)


def codes(report: Report, *severities: str) -> set[str]:
    sev = set(severities) or {"error", "warning", "info"}
    return {getattr(f.code, "value", f.code) for f in report.findings if f.severity.value in sev}
