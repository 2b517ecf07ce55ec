"""A regression target far from unit scale (issue 34, item 12): `scan` compares a float label's RMS with the
RMS of the model's initial output on the same samples, and says to standardise the target, in the spec's
terms. Ground truth: the sample's own model.py and data.py, run by plain Paddle in the test (float64 on the
host), and the same data standardised or turned into class ids, which must stay quiet."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import paddle
import pytest
import yaml
from inloop_helpers import SAMPLES, sample_module

from nandoctor.scan import run_scan
from nandoctor.scan.model_facts import FORWARD_ROWS
from nandoctor.spec import load_spec

SAMPLE = "target_scale_divergence"
REGRESSION = ["mse", "l1"]


def _truth() -> dict[str, float]:
    """The target's and the initial output's scales on the first batch, and the target's mean and std over
    every batch, from the sample's modules with plain Paddle and numpy (float64)."""
    batches = sample_module(SAMPLE, "data").build_loader()
    model = sample_module(SAMPLE, "model").build_model()  # (it seeds itself, as the scan's build does)
    x, y = batches[0]
    model.eval()
    with paddle.no_grad():
        out = model(paddle.to_tensor(x[:FORWARD_ROWS])).numpy().astype(np.float64)
    target = y[:FORWARD_ROWS].astype(np.float64)
    every = np.concatenate([b[1] for b in batches]).astype(np.float64)
    return {"target_rms": float(np.sqrt(np.mean(target ** 2))), "target_max_abs": float(np.abs(target).max()),
            "output_rms": float(np.sqrt(np.mean(out ** 2))), "output_max_abs": float(np.abs(out).max()),
            "target_mean": float(every.mean()), "target_std": float(every.std())}


@pytest.fixture(scope="module")
def truth() -> dict[str, float]:
    return _truth()


def _spec(tmp_path: Path, data: str, loss: str, label: str = "y") -> Path:
    """A spec on the sample's model with the data entry `data` (a file in tmp_path, or the sample's)."""
    config = tmp_path / f"{loss}.yaml"
    config.write_text(yaml.safe_dump({
        "version": 1, "model": {"entry": f"{SAMPLES / SAMPLE / 'model.py'}:build_model"},
        "data": {"entry": data, "fields": ["x", label], "label": label}, "loss": {"builtin": loss},
        "optimizer": {"name": "SGD", "args": {"learning_rate": 5.0e-4}}}))
    return config


def _scan(config: Path) -> tuple[list[Any], dict[str, Any] | None]:
    """The data.target_scale findings, and the comparison the scan measured (None: it did not run)."""
    report = run_scan(load_spec(config))
    assert not [f for f in report.findings if f.code.value == "user_code.error"], report.findings
    return [f for f in report.findings if f.code.value == "data.target_scale"], report.details.get("target_scale")


@pytest.mark.parametrize("loss", REGRESSION)
def test_targets_in_the_thousands_are_flagged_with_both_scales(tmp_path: Path, truth: dict[str, float],
                                                               loss: str) -> None:
    config = SAMPLES / SAMPLE / "config.yaml" if loss == "mse" else _spec(
        tmp_path, f"{SAMPLES / SAMPLE / 'data.py'}:build_loader", loss)
    [finding], measured = _scan(config)
    assert measured is not None and measured["ratio"] == finding.evidence["ratio"]
    ev = finding.evidence
    for key, value in truth.items():
        assert ev[key] == pytest.approx(value, rel=1e-5), key
    assert ev["ratio"] == pytest.approx(truth["target_rms"] / truth["output_rms"], rel=1e-5)
    assert ev["ratio"] >= 100 and ev["rows"] == 32  # the sample's batches hold 32 samples
    loc = finding.location
    assert (loc.phase.value, loc.batch_index, loc.field) == ("data", 0, "y")
    assert finding.severity.value == "warning"
    # both scales in the message, and the advice says where (the spec's data.entry) and with what numbers
    assert f"{truth['target_rms']:.4g}" in finding.message and f"{truth['output_rms']:.3g}" in finding.message
    advice = finding.advice[0]
    assert "build_loader" in advice and "data.entry" in advice
    assert f"{truth['target_mean']:.6g}" in advice and f"{truth['target_std']:.6g}" in advice


def test_the_standardised_twin_is_quiet(tmp_path: Path, truth: dict[str, float]) -> None:
    (tmp_path / "twin.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('_twin_data', {str(SAMPLES / SAMPLE / 'data.py')!r})\n"
        "data = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(data)\n\n\n"
        "def build_loader():\n"
        f"    return [(x, ((y - {truth['target_mean']!r}) / {truth['target_std']!r}).astype('float32'))\n"
        "            for x, y in data.build_loader()]\n")
    found, measured = _scan(_spec(tmp_path, "twin.py:build_loader", "mse"))
    assert found == [] and measured is not None
    # the same model and rows: the output's scale is the one measured on the raw targets, the target's ~1
    assert measured["output_rms"] == pytest.approx(truth["output_rms"], rel=1e-5)
    assert 0.5 < measured["target_rms"] < 2 and measured["ratio"] < 100


def test_class_ids_of_the_same_data_are_quiet(tmp_path: Path) -> None:
    """Integer labels (classes) under cross_entropy: no regression target, so no comparison at all."""
    (tmp_path / "classes.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('_classes_data', {str(SAMPLES / SAMPLE / 'data.py')!r})\n"
        "data = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(data)\n\n\n"
        "def build_loader():\n"
        "    return [(x, (y[:, 0] > 3000).astype('int64')) for x, y in data.build_loader()]\n")
    config = tmp_path / "classes.yaml"
    config.write_text(yaml.safe_dump({
        "version": 1, "model": {"entry": f"{SAMPLES / 'healthy_mlp' / 'model.py'}:build_model",
                                "args": {"in_features": 8, "num_classes": 2}},
        "data": {"entry": "classes.py:build_loader", "fields": ["x", "label"], "label": "label"},
        "loss": {"builtin": "cross_entropy"}}))
    report = run_scan(load_spec(config))
    assert report.findings == [] and "target_scale" not in report.details
    assert report.details["num_classes"] == 2  # the model's first forward ran (for the class count)


def _regression_samples() -> list[Path]:
    """Every sample config with a float target under mse or l1 (where the comparison runs), but the one
    whose targets are raw: all of them have targets near their outputs' scale and must stay quiet."""
    out = []
    for config in sorted(SAMPLES.glob("*/*.yaml")):
        raw = yaml.safe_load(config.read_text(encoding="utf-8"))
        if (raw.get("loss") or {}).get("builtin") in REGRESSION and config.parent.name != SAMPLE:
            out.append(config)
    return out


def test_the_other_regression_samples_are_quiet() -> None:
    configs = _regression_samples()
    assert len(configs) >= 8
    for config in configs:
        found, measured = _scan(config)
        assert found == [] and measured is not None and measured["ratio"] < 10, (config, measured)
