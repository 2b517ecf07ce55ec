"""One post-run assembly (diagnosis/assemble.py) for every way in: the same checks through each door.

A model whose first layer starts 16x off its fan-in's scale (sample_configs/bad_init) is trained through
the probe, `nandoctor.watch`, the hapi callback and `nandoctor run`; each report must name the same
weights in `param.init_scale`, the ones a float64 reading on the host (outside nandoctor) finds off scale.
AMP's loss-scale collapse cannot happen on a CPU (Paddle's GradScaler is inert there), so it is checked
on the one assembly every way in calls, with the records a GPU run makes.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "sample_configs" / "bad_init" / "config.yaml"
SCRIPT = ROOT / "tests" / "parity" / "plain_train.py"
STEPS = 4


def _model_and_data() -> tuple[Any, list[tuple[np.ndarray, np.ndarray]], Any]:
    from nandoctor.spec import load_spec
    from nandoctor.workload.build import build_optimizer, build_workload

    spec = load_spec(CONFIG)
    workload = build_workload(spec)
    return workload.model, list(workload.make_loader())[:STEPS], build_optimizer(spec, workload.model)


def off_scale_weights() -> set[str]:
    """Ground truth: the 2-D weights whose standard deviation (float64, on the host) is more than 8x
    sqrt(2 / fan_in), Kaiming's upper end; the rule's own band is narrower, this one is unmistakable."""
    model, _, _ = _model_and_data()
    out = set()
    for name, p in model.named_parameters():
        w = p.numpy().astype(np.float64)
        if w.ndim == 2 and w.std() > 8 * math.sqrt(2.0 / w.shape[0]):
            out.add(name)
    return out


def _init_scale(report: dict[str, Any]) -> list[tuple[str | None, str]]:
    return sorted((f["location"].get("parameter"), f["message"]) for f in report["findings"]
                  if f["code"] == "param.init_scale")


def via_probe() -> dict[str, Any]:
    from nandoctor.probe import ProbeOptions, run_probe
    from nandoctor.spec import load_spec

    report = run_probe(load_spec(CONFIG), ProbeOptions(steps=STEPS, try_fixes=False, bundle=False, device="cpu"))
    return report.to_dict()


def via_watch() -> dict[str, Any]:
    import nandoctor

    model, batches, optimizer = _model_and_data()
    with nandoctor.watch(model, optimizer, report_dir=None, fields=["x", "label"]) as doctor:
        for x, y in batches:
            loss = F.cross_entropy(model(paddle.to_tensor(x)), paddle.to_tensor(y))
            loss.backward()
            doctor.check(loss, (x, y))
            optimizer.step()
            optimizer.clear_grad()
        return doctor.summary().to_dict()


def via_hapi() -> dict[str, Any]:
    from paddle.static import InputSpec

    from nandoctor.hapi import NanDoctorCallback

    net, batches, optimizer = _model_and_data()

    class Rows(paddle.io.Dataset):
        def __init__(self) -> None:
            self.items = [(x[i], y[i:i + 1]) for x, y in batches for i in range(len(x))]

        def __getitem__(self, i: int) -> Any:
            return self.items[i]

        def __len__(self) -> int:
            return len(self.items)

    model = paddle.Model(net, inputs=[InputSpec([None, 512], "float32", "x")],
                         labels=[InputSpec([None, 1], "int64", "label")])
    model.prepare(optimizer, paddle.nn.CrossEntropyLoss())
    callback = NanDoctorCallback(report_dir=None)
    model.fit(Rows(), epochs=1, batch_size=len(batches[0][0]), shuffle=False, verbose=0, callbacks=[callback])
    return callback.doctor.summary().to_dict()


def via_run(tmp_path: Path) -> dict[str, Any]:
    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, "-m", "nandoctor", "run", "--json", str(out), "--", sys.executable,
                           str(SCRIPT), str(CONFIG)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.is_file(), proc.stderr[-3000:]
    return json.loads(out.read_text(encoding="utf-8"))


@pytest.mark.parametrize("way", ["probe", "watch", "hapi", "run"])
def test_every_way_in_reports_the_initial_scale(way: str, tmp_path: Path) -> None:
    truth = off_scale_weights()
    assert truth == {"encoder.weight"}, truth  # the sample is what its comment says
    report = {"probe": via_probe, "watch": via_watch, "hapi": via_hapi}[way]() if way != "run" else via_run(tmp_path)
    found = _init_scale(report)
    assert {p for p, _ in found} == truth, found
    assert found == _init_scale(via_probe()), "the same finding, word for word, as the probe's"
    assert report["verdict"] == "at_risk"


def _records(scales: list[float], skipped: list[bool]) -> list[Any]:
    from nandoctor.engine.watcher import StepRecord

    return [StepRecord(step, 1.0, 1.0, None, None, scale, skip) for step, (scale, skip) in
            enumerate(zip(scales, skipped))]


class _Watcher:
    """What assemble reads of a run's watcher, for records a GPU's GradScaler leaves."""

    def __init__(self, records: list[Any]) -> None:
        from nandoctor.engine.monitors import StepMonitor

        self.records, self.stats_every = records, []
        self.monitor = StepMonitor.__new__(StepMonitor)
        self.monitor.layer_names, self.monitor.param_names = [], []

    def warnings(self, fault: Any) -> list[Any]:
        return []


@pytest.mark.parametrize(("scales", "skipped", "warned"), [
    ([65536.0 / 2**k for k in range(12)], [True] * 12, True),  # halved at every step: collapse
    ([65536.0] * 12, [False] * 12, False),  # a steady scale: nothing to say
])
def test_assemble_warns_of_a_collapsing_loss_scale(scales, skipped, warned) -> None:
    from nandoctor.diagnosis.assemble import RunFacts, assemble, new_report
    from nandoctor.diagnosis.diagnose import StepTarget
    from nandoctor.findings import Code, Mode

    report = new_report("gpu:0", Mode.WATCH)
    assemble(report, RunFacts(_Watcher(_records(scales, skipped)), len(scales), None,
                              StepTarget(model=None, replay_loss=None, base_dir=ROOT), None,
                              init_loss_scale=65536.0))
    collapse = [f for f in report.findings if f.code == Code.AMP_SCALE_COLLAPSE]
    assert bool(collapse) == warned, [f.code for f in report.findings]
    if warned:
        assert collapse[0].evidence["final_scale"] == scales[-1] and collapse[0].location.step == 0
