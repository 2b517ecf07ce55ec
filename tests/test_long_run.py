"""Bounded long runs (issue 23, 2): a 20,000-step probe of a small, fast model keeps a bounded number of step
records (memory constant per step, asserted through the records, not RSS), writes report.json under 2 MB and
report.md under 200 KB, and its timeline keeps every step around where trouble began (a gradient-norm
explosion at step 5000) and before the fault (a NaN batch near the end, on an unread step, still named at
its exact step). ~20 s: 20,000 steps are the length the issue measures."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import yaml
from typer.testing import CliRunner

from nandoctor.cli import app
from nandoctor.engine.watcher import AROUND_MARKS, MAX_MARKS, MAX_RECORDS, MAX_UNREAD, RECENT_STEPS

STEPS = 20_000
# batches scaled 1e4 for longer than the longest unread stretch: gradient norms ~1e4x their early level, read
# on some step of it (Adam keeps the weights finite)
SPIKE, SPIKE_LEN = 5_000, 400
NAN_STEP, NAN_ROW = STEPS - 37, 3

LOADER = '''
import numpy as np
from paddle import nn


def build_model():
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


def build_loader(steps, spike, spike_len, nan_step, nan_row):
    rng = np.random.default_rng(0)
    xs = [rng.normal(size=(8, 6)).astype("float32") for _ in range(64)]
    ys = [rng.integers(0, 3, size=(8,)).astype("int64") for _ in range(64)]
    for i in range(steps):
        x = xs[i % 64]
        if spike <= i < spike + spike_len:
            x = x * 1e4
        if i == nan_step:
            x = x.copy()
            x[nan_row, 1] = np.nan
        yield x, ys[i % 64]
'''


def _batch(i: int) -> np.ndarray:
    """The loader's batch `i`, rebuilt here (ground truth from the data, not from nandoctor)."""
    ns: dict = {}
    exec(LOADER, ns)  # noqa: S102 - the test's own loader source, shared with the spec
    for j, (x, _) in enumerate(ns["build_loader"](STEPS, SPIKE, SPIKE_LEN, NAN_STEP, NAN_ROW)):
        if j == i:
            return x
    raise AssertionError(i)


def test_a_20000_step_probe_keeps_bounded_records_and_small_reports(tmp_path: Path) -> None:
    bad = _batch(NAN_STEP)
    assert [int(r) for r in np.where(~np.isfinite(bad).all(axis=1))[0]] == [NAN_ROW]
    (tmp_path / "long.py").write_text(LOADER, encoding="utf-8")
    spec = {"version": 1, "model": {"entry": "long.py:build_model"},
            "data": {"entry": "long.py:build_loader", "fields": ["x", "label"], "label": "label",
                     "args": {"steps": STEPS, "spike": SPIKE, "spike_len": SPIKE_LEN, "nan_step": NAN_STEP,
                              "nan_row": NAN_ROW}},
            "loss": {"builtin": "cross_entropy"}, "optimizer": {"name": "Adam", "args": {"learning_rate": 0.01}}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    out = CliRunner(env={"COLUMNS": "100", "NO_COLOR": "1"}).invoke(app, [
        "probe", str(tmp_path / "config.yaml"), "--steps", str(STEPS), "--json", str(tmp_path / "report.json"),
        "--markdown", str(tmp_path / "report.md")])
    assert out.exit_code == 1, out.output
    assert (tmp_path / "report.json").stat().st_size < 2 * 2**20
    assert (tmp_path / "report.md").stat().st_size < 200 * 2**10
    report = json.loads((tmp_path / "report.json").read_text(encoding="utf-8"))

    ff = report["first_fault"]
    assert (ff["step"], ff["phase"], ff["sample_indices"]) == (NAN_STEP, "data", [NAN_ROW])
    assert NAN_STEP in report["details"]["rollback"]["unread_steps"]  # found at a later read, replayed

    # memory constant per step: the records are bounded whatever the length (the recent ones, the thinned
    # older ones, and the neighbourhoods of at most MAX_MARKS marked steps)
    steps = [p["step"] for p in report["timeline"]]
    assert len(steps) <= MAX_RECORDS + MAX_MARKS * (2 * AROUND_MARKS + 1) and len(steps) < NAN_STEP / 3
    assert report["details"]["timeline_thinned"]["steps_kept"] == len(steps)
    # the steps before the fault, in full (a data fault's own step is not a training step of the timeline)
    assert steps[-(RECENT_STEPS - 1):] == list(range(NAN_STEP - RECENT_STEPS + 1, NAN_STEP))
    # the explosion warning, and every step around where it began, kept although that stretch was thinned
    [boom] = [f for f in report["findings"] if f["code"] == "grad.explosion"]
    start = boom["location"]["step"]
    # (past the first READ_ALL_STEPS steps the norm is read one step in k, so the growth is placed on read
    # steps: within one read interval of where it began)
    assert SPIKE - MAX_UNREAD <= start < SPIKE + SPIKE_LEN
    kept = set(steps)
    assert set(range(start - AROUND_MARKS, start + AROUND_MARKS + 1)) <= kept
    assert not set(range(1000, 2000)) <= kept  # an uneventful old stretch is thinned
