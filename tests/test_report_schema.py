"""The report's JSON Schema (issue 21, "JSON"): it ships in the package, the report's `schema` field names it,
and real reports of every kind validate against it (probe fault, healthy probe, scan, crash, interrupted,
`nandoctor run`, `nandoctor.watch`); one spelling of NaN/Inf; two identical runs give the same JSON apart from
`details.timings` and the remedy rows' `seconds`."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from inloop_helpers import EXAMPLES, ROOT, SAMPLES, example_module

from nandoctor.findings import SCHEMA, Code, Mode, Phase, Report, TimelinePoint, Verdict
from nandoctor.probe import ProbeOptions, run_probe
from nandoctor.report import json as json_report
from nandoctor.spec import load_spec

jsonschema = pytest.importorskip("jsonschema")

# The loader of the interrupted run: Ctrl-C arrives while batch 3 is read.
INTERRUPTING_LOADER = '''
import numpy as np


def build_loader():
    rng = np.random.default_rng(0)
    for i in range(10):
        if i == 3:
            raise KeyboardInterrupt
        yield rng.normal(size=(8, 20)).astype("float32"), rng.integers(0, 6, size=(8,)).astype("int64")
'''


def _validator() -> Any:
    schema = json_report.schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def _errors(document: dict[str, Any]) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message[:300]}" for e in _validator().iter_errors(document)]


def _probe_json(spec_path: Path, steps: int) -> dict[str, Any]:
    spec = load_spec(spec_path)
    report = run_probe(spec, ProbeOptions(steps=steps, seed=0, device="cpu"))
    return json.loads(json_report.render(report))


def _scan_json(spec_path: Path) -> dict[str, Any]:
    from nandoctor.scan import ScanOptions, run_scan

    return json.loads(json_report.render(run_scan(load_spec(spec_path), ScanOptions())))


@pytest.fixture(scope="module")
def fault_run() -> dict[str, Any]:
    return _probe_json(SAMPLES / "log_of_zero" / "config.yaml", 14)


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory, fault_run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One real report of each kind, as its JSON."""
    tmp = tmp_path_factory.mktemp("schema")
    out = {"probe fault": fault_run,
           "probe healthy": _probe_json(SAMPLES / "healthy_mlp" / "config.yaml", 5),
           "scan": _scan_json(SAMPLES / "nan_in_data" / "config.yaml"),
           "crashed": _probe_json(SAMPLES / "crash_in_user_code" / "config.yaml", 12)}
    (tmp / "interrupting.py").write_text(INTERRUPTING_LOADER, encoding="utf-8")
    spec = {"version": 1, "model": {"entry": f"{SAMPLES / 'healthy_mlp' / 'model.py'}:build_model"},
            "data": {"entry": "interrupting.py:build_loader", "fields": ["x", "label"], "label": "label"},
            "loss": {"builtin": "cross_entropy"}, "optimizer": {"name": "Adam", "args": {"learning_rate": 0.001}}}
    (tmp / "interrupted.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    out["interrupted"] = _probe_json(tmp / "interrupted.yaml", 8)
    done = subprocess.run([sys.executable, "-m", "nandoctor", "run", "--json", str(tmp / "run.json"), "-q", "--",
                           sys.executable, str(EXAMPLES / "unmodified_loop.py")], cwd=tmp, capture_output=True,
                          text=True, timeout=300, env={"PYTHONPATH": str(ROOT), **_env()})
    assert done.returncode == 1, done.stderr
    out["nandoctor run"] = json.loads((tmp / "run.json").read_text(encoding="utf-8"))
    assert example_module("plain_loop").main(report_dir=str(tmp / "watch")) == 1
    out["nandoctor.watch"] = json.loads((tmp / "watch" / "report.json").read_text(encoding="utf-8"))
    return out


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


# --- the schema and where it is ------------------------------------------------------------------------

def test_the_schema_ships_in_the_package_named_by_the_reports_schema_field():
    path = json_report.schema_path()
    assert path.is_file() and path.parent.parent == Path(json_report.__file__).parent
    assert path.name == SCHEMA.replace("/", "-") + ".schema.json"  # "nandoctor.report/1" -> its file
    schema = json_report.schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["properties"]["schema"] == {"const": SCHEMA}


def test_the_schema_lists_every_code_verdict_phase_and_mode_nandoctor_can_write():
    defs, props = json_report.schema()["$defs"], json_report.schema()["properties"]
    assert {c.value for c in Code} <= set(defs["code"]["enum"])
    assert {v.value for v in Verdict} == set(props["verdict"]["enum"])
    assert {p.value for p in Phase} == set(defs["phase"]["enum"])
    assert {m.value for m in Mode} == set(props["run"]["properties"]["mode"]["enum"])


# --- real reports validate ------------------------------------------------------------------------------

def test_real_reports_of_every_kind_validate(reports):
    verdicts = {name: data["verdict"] for name, data in reports.items()}
    assert verdicts == {"probe fault": "nan_found", "probe healthy": "healthy", "scan": "nan_found",
                        "crashed": "crashed", "interrupted": "interrupted", "nandoctor run": "nan_found",
                        "nandoctor.watch": "nan_found"}, verdicts
    assert reports["nandoctor run"]["run"]["mode"] == "run" and reports["nandoctor.watch"]["run"]["mode"] == "watch"
    assert reports["probe fault"]["remedies"], "the fault run replays remedies: their rows are validated too"
    for name, data in reports.items():
        assert _errors(data) == [], name


def test_the_schema_refuses_what_breaks_the_contract(fault_run):
    """It is a real check, not `{}`: a missing key, an unknown key, an old NaN spelling, a wrong type."""
    import copy

    for edit in (lambda d: d.pop("verdict"), lambda d: d.update(extra=1),
                 lambda d: d["timeline"][-1].update(loss="inf"), lambda d: d["first_fault"].update(step="12"),
                 lambda d: d["findings"][0].update(code="loss.weird"),
                 lambda d: d["details"].update(stats_every=1),  # a timing outside details.timings
                 lambda d: d["remedies"][0].update(outcome="maybe")):
        broken = copy.deepcopy(fault_run)
        edit(broken)
        assert _errors(broken), edit


# --- one way to write NaN and Inf -----------------------------------------------------------------------

def _strings(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return [value] if isinstance(value, str) else []


def test_non_finite_numbers_are_written_one_way(fault_run):
    # the sample's fault: log(1 - sigmoid(z)) = -inf in the loss at step 12, so the gradients are NaN
    last = fault_run["timeline"][-1]
    assert (last["step"], last["loss"], last["grad_norm"]) == (12, "Infinity", "NaN")
    spelled = {s for s in _strings(fault_run) if s.strip().lower() in {"nan", "inf", "-inf", "+inf", "infinity",
                                                                      "-infinity"}}
    assert spelled <= {"NaN", "Infinity", "-Infinity"}, spelled
    report = Report(command="probe", timeline=[TimelinePoint(step=0, loss=math.nan, grad_norm=math.inf,
                                                             lr=-math.inf)])
    text = json_report.render(report)
    data = json.loads(text, parse_constant=lambda c: pytest.fail(f"a bare {c} in the JSON"))
    assert data["timeline"] == [{"step": 0, "loss": "NaN", "grad_norm": "Infinity", "lr": "-Infinity"}]
    assert _errors(data) == []
    back = Report.from_dict(data).timeline[0]  # and they read back as the numbers they were
    assert [float(v) for v in (back.loss, back.grad_norm, back.lr)][1:] == [math.inf, -math.inf]
    assert math.isnan(float(back.loss))


# --- determinism ----------------------------------------------------------------------------------------

def _without_timings(data: dict[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(data))
    out["details"].pop("timings", None)
    for row in out.get("remedies") or []:
        row.pop("seconds", None)
    return out


def test_two_identical_probes_write_the_same_json_apart_from_the_timings(monkeypatch):
    """What the clock chose (the per-layer statistics' schedule: one step in k, k from measured step times)
    is held the same for both runs here, as the clock would on an idle machine; everything the clock
    measured must then sit in `details.timings` or a remedy row's `seconds`."""
    from nandoctor.engine.watcher import StatsSchedule

    monkeypatch.setattr(StatsSchedule, "record", lambda self, *a, **k: None)  # k stays 1: every step read
    first = _probe_json(SAMPLES / "log_of_zero" / "config.yaml", 14)
    second = _probe_json(SAMPLES / "log_of_zero" / "config.yaml", 14)
    assert first["first_fault"] == second["first_fault"] and first["findings"] == second["findings"]
    assert _without_timings(first) == _without_timings(second)
    assert first["details"]["timings"]["remedies"]["seconds"] > 0  # the figures are there, in their place
