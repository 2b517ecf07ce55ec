"""A remedy is verified only against a replay without any change that met the fault on the training's own batch
(issue 34, item 7). When the batches the probe kept cannot cover every replay (large batches: the tape holds a
few), the replays re-read the loader; a stream then gives other data, and a replay of other data is no evidence
for a remedy. The ground truth is the data: stream_loader's records at step 12 carry the x1000 unit; its stream
never yields them again, while log_of_zero's list (the same model, loss and fault) is re-read the same.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from nandoctor.engine import batch_tape
from nandoctor.probe import ProbeOptions, run_probe
from nandoctor.spec import load_spec

SAMPLES = Path(__file__).resolve().parent.parent / "sample_configs"
KEPT = 5  # batches the tape may hold: fewer than the replays from step 0 to the fault need


def _probe(name: str, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The sample's probe with the tape's room cut to KEPT of its batches (x: 16 x 8 and y: 16, float32)."""
    monkeypatch.setattr(batch_tape, "KEPT_FLOOR", KEPT * (16 * 8 + 16) * 4)
    for module in list(sys.modules.values()):  # the stream from its start, as a new process reads it
        if getattr(module, "__file__", None) == str(SAMPLES / name / "data.py") and hasattr(module, "_POSITION"):
            module._POSITION[0] = 0
    spec = load_spec(SAMPLES / name / "config.yaml")
    return run_probe(spec, ProbeOptions(steps=spec.probe.steps, seed=0, device="cpu"))


def test_a_stream_re_read_gives_other_data_so_no_remedy_is_verified(monkeypatch):
    report = _probe("stream_loader", monkeypatch)
    ff = report.first_fault
    assert (ff.step, ff.sample_indices) == (12, [3, 11])  # the data's two bad records, at step 12
    control = report.details["remedies"]["control"]
    assert control["reproduced"] is False
    assert report.remedies and not any(r["outcome"] == "fixed" for r in report.remedies), report.remedies
    tried = [r for r in report.remedies if r["remedy"] in ("op_guard", "lr_x0.1")]
    assert tried and all("did not reproduce the fault at step 12" in r["note"] for r in tried), tried
    assert all("stream" in r["note"] for r in tried), tried
    assert "did not reproduce the fault at step 12" in control["note"]


def test_a_re_readable_loader_with_the_same_room_verifies_the_guard(monkeypatch):
    report = _probe("log_of_zero", monkeypatch)
    ff = report.first_fault
    assert (ff.step, ff.sample_indices) == (12, [3, 11])
    assert report.details["remedies"]["control"]["reproduced"] is True
    guard = next(r for r in report.remedies if r["remedy"] == "op_guard")
    assert guard["outcome"] == "fixed", guard


def test_a_replay_that_meets_the_fault_on_other_data_verifies_nothing(tmp_path, monkeypatch):
    """With no batch kept (a resumed run), every replay re-reads the loader: an unseeded augmentation gives the
    bad records other values, so the replay without any change goes NaN at step 12 again, but on another batch
    than the training read. That is no control: no remedy is verified, and the note names the step."""
    import yaml

    import nandoctor.remedies.trial as remedies

    real = remedies.try_remedies

    def without_kept_batches(report: Any, res: Any, workload: Any, optimizer: Any, ring: Any, **kw: Any) -> None:
        ring.batches = None  # the replays re-read the loader, as a resumed run's do
        real(report, res, workload, optimizer, ring, **kw)

    monkeypatch.setattr(remedies, "try_remedies", without_kept_batches)
    sample, here = SAMPLES / "log_of_zero", Path(__file__).resolve().parent
    raw = {"version": 1,
           "model": {"entry": f"{sample / 'model.py'}:build_model", "args": {"in_features": 8, "hidden": 16}},
           "data": {"entry": f"{here / 'records_data.py'}:augmented_loader", "fields": ["x", "y"], "label": "y"},
           "loss": {"entry": f"{sample / 'loss.py'}:bce_loss"},
           "optimizer": {"name": "Adam", "args": {"learning_rate": 0.01}}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
    report = run_probe(load_spec(tmp_path / "config.yaml"), ProbeOptions(steps=20, seed=0, device="cpu"))
    ff = report.first_fault
    assert (ff.step, ff.sample_indices) == (12, [3, 11])
    control = report.details["remedies"]["control"]
    assert control["failed_at"] == 12 and control["reproduced"] is False  # the same step, another batch
    assert report.remedies and not any(r["outcome"] == "fixed" for r in report.remedies), report.remedies
    assert "did not reproduce the fault at step 12: it read another batch at step 12" in control["note"]
    guard = next(r for r in report.remedies if r["remedy"] == "op_guard")  # (its own replay read another too)
    assert "another batch at step 12 than the training did" in guard["note"], guard
