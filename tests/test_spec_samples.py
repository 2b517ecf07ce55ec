"""The spec helper's sample configs through the real CLI, against ground truth from plain Paddle loops.

Ground truth (measured without nandoctor; each config's comment says the same in words):
- kwargs_structured_outputs/config.yaml: the model called as `model(input_ids=, attention_mask=, labels=)`
  and its own `.loss`, AdamW(1e-3), 30 steps: all finite; losses 1.42587 (step 0), 1.11958 (step 1),
  0.549096 (step 29). logits.yaml (`.logits` + cross_entropy): the same losses (max difference 0.0).
- kwargs_structured_outputs/empty_text.yaml: forward hooks see layer `pool` non-finite first, at step 9;
  the tensor checker names op divide (64 NaN of 256); samples 2 and 5 alone give a NaN loss.
- warmup_needed/no_warmup.yaml: SGD(0.2): losses 68.6097, 17198.4, then at step 2 exp() in the loss
  overflows (the model's output is finite); checker op exp; these 18 of 32 samples alone are non-finite.
- warmup_needed/config.yaml: SGD(0.2) under LinearWarmup(0.2, 20, 0.0, 0.2) stepped after every optimizer
  step: 100 steps, all finite; loss 68.6097 -> 0.4657 at step 99; lr 0.0, 0.01, ..., 0.2 from step 20.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from nandoctor.cli import app
from nandoctor.engine.loop import StepRecord

SAMPLES = Path(__file__).resolve().parent.parent / "sample_configs"
# Sample folders tested here and in test_loader_workers.py (test_probe_samples checks every folder is tested)
TESTED_HERE = {"kwargs_structured_outputs", "warmup_needed", "loader_worker_crash"}
NO_WARMUP_SAMPLES = [0, 1, 5, 6, 8, 10, 11, 12, 13, 16, 19, 20, 22, 23, 25, 26, 28, 31]
LR_STEPPED = "lr" in getattr(StepRecord, "__dataclass_fields__", {})  # the probe loop steps schedulers


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory):
    cache: dict[str, tuple[int, dict[str, Any]]] = {}
    folder = tmp_path_factory.mktemp("spec_samples")

    def run(config: str) -> tuple[int, dict[str, Any]]:
        if config not in cache:
            out = folder / (config.replace("/", "_") + ".json")
            result = CliRunner().invoke(app, ["probe", str(SAMPLES / config), "--json", str(out)])
            assert out.is_file(), f"no JSON report (exit {result.exit_code}):\n{result.output}"
            cache[config] = (result.exit_code, json.loads(out.read_text(encoding="utf-8")))
        return cache[config]

    return run


def _serious(report: dict[str, Any]) -> list[tuple[str, str]]:
    return [(f["code"], f["message"]) for f in report["findings"] if f["severity"] in ("error", "warning")]


@pytest.mark.parametrize("config", ["kwargs_structured_outputs/config.yaml", "kwargs_structured_outputs/logits.yaml"])
def test_keyword_inputs_and_structured_outputs_train_like_the_plain_loop(config: str, probe):
    status, report = probe(config)
    assert (report["verdict"], status) == ("healthy", 0) and _serious(report) == []
    losses = [p["loss"] for p in report["timeline"]]
    assert len(losses) == 30
    assert losses[0] == pytest.approx(1.42587, abs=1e-4) and losses[1] == pytest.approx(1.11958, abs=1e-4)
    assert losses[29] == pytest.approx(0.549096, abs=1e-4)


def test_empty_text_through_keyword_inputs_is_localised(probe):
    status, report = probe("kwargs_structured_outputs/empty_text.yaml")
    assert (report["verdict"], status) == ("nan_found", 1)
    ff = report["first_fault"]
    assert {k: ff[k] for k in ("step", "phase", "layer", "op", "batch_index", "sample_indices")} == {
        "step": 9, "phase": "forward", "layer": "pool", "op": "divide", "batch_index": 9, "sample_indices": [2, 5]}
    assert {c for c, _ in _serious(report)} == {"activation.nonfinite"}


def test_no_warmup_overflows_at_step_2(probe):
    status, report = probe("warmup_needed/no_warmup.yaml")
    assert (report["verdict"], status) == ("nan_found", 1)
    ff = report["first_fault"]
    assert (ff["step"], ff["phase"], ff["layer"], ff["op"], ff["batch_index"]) == (2, "loss", None, "exp", 2)
    assert ff["sample_indices"] == NO_WARMUP_SAMPLES
    assert [round(p["loss"], 1) for p in report["timeline"][:2]] == [68.6, 17198.4]


def test_warmup_scheduler_from_the_spec_reproduces_the_plain_loop():
    """The spec's scheduler, stepped as the plain loop steps it, trains the model to the same loss."""
    from nandoctor.spec import load_spec
    from nandoctor.workload.build import build_optimizer, build_workload, lr_scheduler

    spec = load_spec(SAMPLES / "warmup_needed" / "config.yaml")
    w = build_workload(spec)
    opt = build_optimizer(spec, w.model)
    sched = lr_scheduler(opt)
    rates, losses = [], []
    for step, batch in enumerate(w.make_loader()):
        rates.append(opt.get_lr())
        loss = w.compute_loss(w.model, w.layout.fields(batch, step))
        losses.append(float(loss))
        loss.backward()
        opt.step()
        opt.clear_grad()
        sched.step()
    assert np.isfinite(losses).all() and len(losses) == 100
    assert losses[0] == pytest.approx(68.6097, abs=1e-3) and losses[-1] == pytest.approx(0.4657, abs=1e-3)
    assert rates[:3] == pytest.approx([0.0, 0.01, 0.02]) and rates[20:] == pytest.approx([0.2] * 80)


@pytest.mark.skipif(not LR_STEPPED, reason="the probe loop steps lr schedulers once the watcher's change is in")
def test_warmup_keeps_the_probe_healthy(probe):
    status, report = probe("warmup_needed/config.yaml")
    assert (report["verdict"], status) == ("healthy", 0) and _serious(report) == []
    timeline = report["timeline"]
    assert len(timeline) == 100 and timeline[-1]["loss"] == pytest.approx(0.4657, abs=1e-3)
    assert timeline[0]["lr"] == pytest.approx(0.0) and timeline[1]["lr"] == pytest.approx(0.01)
    assert timeline[20]["lr"] == pytest.approx(0.2)
