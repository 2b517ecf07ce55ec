"""Every scan sample config through the real CLI (`nandoctor scan CONFIG --json PATH`): exit status, the exact
set of finding codes, and exact locations; every healthy_* config scans clean."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nandoctor.cli import app

SAMPLES = Path(__file__).resolve().parent.parent / "sample_configs"

# name -> (exit status, verdict, {code: location fields that must match exactly})
EXPECTED = {
    "nan_in_data": (1, "nan_found", {"data.nonfinite": {"phase": "data", "batch_index": 3,
                                                         "sample_indices": [5], "field": "x"}}),
    "label_out_of_range": (1, "error_found", {"data.label_range": {"phase": "data", "batch_index": 2,
                                                               "sample_indices": [9], "field": "target"}}),
    "seq_too_long": (1, "error_found", {"data.seq_len": {"phase": "data", "batch_index": 2, "sample_indices": [3],
                                                     "field": "ids", "layer": "pos_embedding"}}),
    "outlier_sample": (0, "at_risk", {"data.range": {"phase": "data", "batch_index": 4, "sample_indices": [2],
                                                     "field": "x"}}),
    "nan_checkpoint": (1, "nan_found", {"param.nonfinite": {"phase": "params",
                                                            "parameter": "classifier.weight",
                                                            "batch_index": None}}),
    "target_scale_divergence": (0, "at_risk", {"data.target_scale": {"phase": "data", "batch_index": 0,
                                                                      "field": "y"}}),
    "bad_init": (0, "at_risk", {"param.init_scale": {"phase": "params", "parameter": "encoder.weight"}}),
    "empty_batch": (1, "error_found", {"data.empty": {"phase": "data", "batch_index": 2}}),
    "loader_crash": (1, "crashed", {"user_code.error": {"phase": "data", "batch_index": 3}}),
}
HEALTHY = sorted(p.name for p in SAMPLES.glob("healthy_*") if (p / "config.yaml").is_file())


def scan(name: str, tmp_path: Path) -> tuple[int, dict]:
    out = tmp_path / "report.json"
    result = CliRunner().invoke(app, ["scan", str(SAMPLES / name / "config.yaml"), "--json", str(out)])
    assert out.is_file(), result.output
    return result.exit_code, json.loads(out.read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_sample_reports_exactly_its_finding(name, tmp_path):
    status, verdict, expected = EXPECTED[name]
    code, report = scan(name, tmp_path)
    assert report["command"] == "scan"
    assert sorted(f["code"] for f in report["findings"]) == sorted(expected), report["findings"]
    for finding in report["findings"]:
        loc = finding["location"]
        for key, value in expected[finding["code"]].items():
            assert loc[key] == value, (key, loc)
        assert finding["advice"] and finding["message"]
    assert code == status and report["verdict"] == verdict


def test_first_fault_for_the_nan_samples(tmp_path):
    _, data = scan("nan_in_data", tmp_path)
    assert data["first_fault"] == {"step": None, "phase": "data", "layer": None, "op": None,
                                   "parameter": None, "batch_index": 3, "sample_indices": [5], "rank": None}
    _, params = scan("nan_checkpoint", tmp_path)
    assert params["first_fault"]["parameter"] == "classifier.weight"


def test_loader_crash_names_the_users_line(tmp_path):
    _, report = scan("loader_crash", tmp_path)
    [f] = report["findings"]
    assert f["evidence"]["origin"].startswith("data.py:14") and "KeyError" in f["message"]
    assert report["details"]["batches"] == 3  # the batches before the crash were scanned


def test_healthy_samples_exist():
    assert {"healthy_mlp", "healthy_cnn"} <= set(HEALTHY)


@pytest.mark.parametrize("name", HEALTHY)
def test_healthy_sample_is_clean(name, tmp_path):
    code, report = scan(name, tmp_path)
    bad = [f for f in report["findings"] if f["severity"] in ("error", "warning")]
    assert bad == [] and report["verdict"] == "healthy" and code == 0
    assert report["details"]["batches"] > 0 and report["details"]["fields"]
