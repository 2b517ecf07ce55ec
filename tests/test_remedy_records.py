"""A bad record is left out wherever it comes back (issue 34, item 4): a loader with no batch sampler (a plain
list of batches, a generator) names its records by nothing, so the drop_samples remedy names the record by a
fingerprint of its values and leaves it out in every epoch; a DataLoader with shuffle=True names it by the
dataset index its sampler gives. The ground truth is the data itself (which record is bad, its fingerprint
computed here by the recipe the report gives) and a plain Paddle loop: training that reads the record goes
NaN, training that skips it wherever it comes stays finite well past the replays' horizon.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import pytest
import records_data as rd
import yaml
from run_truth import step_went_nonfinite

from nandoctor.probe import ProbeOptions, run_probe
from nandoctor.spec import load_spec

HERE = Path(__file__).resolve().parent
SAMPLE = HERE.parent / "sample_configs" / "log_of_zero"  # its classifier and hand-written BCE: log(1 - sigmoid)
STEPS = 24  # six epochs of four batches


def _probe(tmp_path: Path, loader: str) -> Any:
    raw = {"version": 1,
           "model": {"entry": f"{SAMPLE / 'model.py'}:build_model", "args": {"in_features": 8, "hidden": 16}},
           "data": {"entry": f"{HERE / 'records_data.py'}:{loader}", "fields": ["x", "y"], "label": "y"},
           "loss": {"entry": f"{SAMPLE / 'loss.py'}:bce_loss"},
           "optimizer": {"name": "Adam", "args": {"learning_rate": 0.01}}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return run_probe(load_spec(path), ProbeOptions(steps=STEPS, seed=0, device="cpu"))


def _fingerprint(x_row: np.ndarray, y_row: np.ndarray) -> str:
    """The report's recipe, done by hand: blake2b (6 bytes) over each field's row, fields in name order."""
    h = hashlib.blake2b(digest_size=6)
    for name, row in (("x", x_row), ("y", y_row)):
        h.update(f"{name}:{row.dtype.str}:".encode())
        h.update(np.ascontiguousarray(row).tobytes())
    return h.hexdigest()


def _plain_loop(steps: int, skip: int | None) -> int | None:
    """Ground truth: the sample's model and loss in a plain Paddle loop over shuffled epochs of the records,
    record `skip` left out wherever it comes; the first step whose loss or gradients hold NaN/Inf (float64 on
    the host), or None."""
    import importlib.util

    mods = []
    for name in ("model", "loss"):
        spec = importlib.util.spec_from_file_location(f"truth_records_{name}", SAMPLE / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mods.append(mod)
    model_mod, loss_mod = mods
    net = model_mod.build_model(8, 16)
    opt = paddle.optimizer.Adam(parameters=net.parameters(), learning_rate=0.01)
    x, y = rd.records()
    rng = np.random.default_rng(1)
    step = 0
    while step < steps:
        order = rng.permutation(rd.RECORDS)
        for start in range(0, rd.RECORDS, rd.BATCH):
            idx = [i for i in order[start:start + rd.BATCH] if i != skip]
            loss = loss_mod.bce_loss(net(paddle.to_tensor(x[idx])), paddle.to_tensor(y[idx]))
            loss.backward()
            if step_went_nonfinite(loss, net):
                return step
            opt.step()
            opt.clear_grad()
            step += 1
    return None


@pytest.fixture(scope="module")
def truth() -> dict[str, Any]:
    x, y = rd.records()
    bad = [int(i) for i in np.flatnonzero(np.abs(x[:, 2]) > 100)]
    return {"bad": bad, "fingerprint": _fingerprint(x[bad[0]], y[bad[0]]),
            "with_it": _plain_loop(8, None), "without_it": _plain_loop(4 * STEPS, bad[0])}


def _drop(report: Any) -> dict[str, Any]:
    return next(r for r in report.remedies if r["remedy"] == "drop_samples")


def _check_ground_truth(truth: dict[str, Any], report: Any) -> None:
    assert truth["bad"] == [rd.BAD]
    assert truth["with_it"] is not None and truth["with_it"] < 4  # read in the first epoch, it goes NaN there
    horizon = report.details["remedies"]["end_step"]
    assert truth["without_it"] is None and 4 * STEPS > horizon  # left out everywhere: finite past the replays


@pytest.mark.parametrize("loader", ["list_loader", "generator_loader"])
def test_a_loader_without_a_sampler_names_the_bad_record_by_its_fingerprint(tmp_path, truth, loader):
    report = _probe(tmp_path, loader)
    _check_ground_truth(truth, report)
    ff = report.first_fault
    assert ff.step < 4 and len(ff.sample_indices) == 1
    drop = _drop(report)
    assert drop["outcome"] == "fixed", drop
    assert drop["skip_list"]["fingerprints"] == [truth["fingerprint"]] and truth["fingerprint"] in drop["change"]
    batches = drop["skip_list"]["batches"]
    assert all(b["fingerprints"] == [truth["fingerprint"]] for b in batches)
    epochs = [b["epoch"] for b in batches]  # it came back each epoch the replay read, and was left out there
    assert len(set(epochs)) >= 3 and epochs == sorted(epochs)


def test_a_shuffling_dataloader_names_the_bad_record_by_its_dataset_index(tmp_path, truth):
    report = _probe(tmp_path, "shuffled_dataloader")
    _check_ground_truth(truth, report)
    drop = _drop(report)
    assert drop["outcome"] == "fixed", drop
    assert drop["skip_list"]["records"] == truth["bad"] and f"record(s) {truth['bad']}" in drop["change"]
    epochs = [b["epoch"] for b in drop["skip_list"]["batches"]]
    assert len(set(epochs)) >= 3 and all(b["records"] == truth["bad"] for b in drop["skip_list"]["batches"])
