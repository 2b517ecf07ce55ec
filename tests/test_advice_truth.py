"""Advice that is true for the cause found and applicable where the user ran (issue 21, "Advice and remedies").

Ground truth comes from outside nandoctor: plain Paddle loops over the samples' own model.py / data.py (the
step the loss first goes non-finite, and whether a remedy's change really trains on), numpy over the
loader's batches (which samples hold a NaN, the targets' scale in float64), and the spec validator
(`parse_spec` + `build_scheduler`) for every change a spec-mode report names.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import pytest
import yaml
from inloop_helpers import SAMPLES, sample_module
from typer.testing import CliRunner

from nandoctor.cli import app

_NOT_THIS_CAUSE = ("log of 0", "empty selection", "division by 0", "loss formula")
_YAML_WORDS = ("optimizer.grad_clip", "optimizer.args", "optimizer.lr_scheduler", "in the spec", "YAML")
_SETTINGS = ("grad_clip", "lr_x0.1", "warmup")  # the remedies that change the spec's settings


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory):
    """probe(config path) -> the JSON report of `nandoctor probe CONFIG`, once per config in this module."""
    cache: dict[str, dict[str, Any]] = {}
    folder = tmp_path_factory.mktemp("advice")

    def run(config: Path) -> dict[str, Any]:
        if str(config) not in cache:
            out = folder / f"report{len(cache)}.json"
            result = CliRunner().invoke(app, ["probe", str(config), "--json", str(out), "-q"])
            assert out.is_file(), f"no JSON report (exit {result.exit_code}):\n{result.output}"
            cache[str(config)] = json.loads(out.read_text(encoding="utf-8"))
        return cache[str(config)]

    return run


# ---------------------------------------------------------------- plain Paddle: the divergence's truth

def _plain_divergence(steps: int, *, lr: float = 5.0e-4, clip: float | None = None,
                      warmup: int | None = None) -> list[float]:
    """target_scale_divergence as its config.yaml sets it up (SGD, StepDecay(step_size=100, gamma=0.5), MSE),
    without nandoctor; `lr`/`clip`/`warmup` as a spec change would set them. The losses, up to the first
    non-finite one."""
    model = sample_module("target_scale_divergence", "model").build_model()
    loader = sample_module("target_scale_divergence", "data").build_loader()
    sched: Any = paddle.optimizer.lr.StepDecay(learning_rate=lr, step_size=100, gamma=0.5)
    if warmup:
        sched = paddle.optimizer.lr.LinearWarmup(sched, warmup_steps=warmup, start_lr=0.0, end_lr=lr)
    opt = paddle.optimizer.SGD(learning_rate=sched, parameters=model.parameters(),
                               grad_clip=paddle.nn.ClipGradByGlobalNorm(clip) if clip else None)
    losses: list[float] = []
    for x, y in loader[:steps]:
        loss = paddle.nn.functional.mse_loss(model(paddle.to_tensor(x)), paddle.to_tensor(y))
        losses.append(float(loss))
        if not math.isfinite(losses[-1]):
            break
        loss.backward()
        opt.step()
        opt.clear_grad()
        sched.step()
    return losses


def _symptom(report: dict[str, Any]) -> dict[str, Any]:
    step = report["first_fault"]["step"]
    return next(f for f in report["findings"] if f["location"]["step"] == step and f["severity"] == "error")


def _own(advice: list[str]) -> list[str]:
    """The diagnosis' advice, without the remedy replays' outcome lines."""
    return [a for a in advice if "by replay" not in a]


def _target_rms(batch: int) -> float:
    _, y = sample_module("target_scale_divergence", "data").build_loader()[batch]
    y = y.astype(np.float64)
    return float(np.sqrt(np.mean(y * y)))


def test_a_divergence_gets_step_size_and_scale_advice_in_yaml(probe):
    """The squared error overflows at the end of a divergence: the advice is the learning rate, a warmup, the
    targets' measured scale and clipping (as spec keys), never a singular op's ("log of 0", "empty mean")."""
    losses = _plain_divergence(40)
    truth_step = len(losses) - 1
    assert not math.isfinite(losses[-1]) and all(math.isfinite(v) for v in losses[:-1]) and truth_step == 8
    report = probe(SAMPLES / "target_scale_divergence" / "config.yaml")
    assert report["first_fault"]["step"] == truth_step
    symptom = _symptom(report)
    assert symptom["evidence"]["causes"][0] in ("grad.explosion", "loss.jump"), symptom
    text = " ".join(_own(symptom["advice"]))
    rms = _target_rms(truth_step)
    assert f"target field 'y' of batch {truth_step}" in text and f"root mean square {rms:.3g}" in text, text
    assert f"{int(math.log10(rms))} order(s) of magnitude" in text and "Standardise" in text
    assert _own(symptom["advice"])[0].startswith("Standardise")  # three orders off: the data is fixed first
    assert "learning rate" in text and "`optimizer.lr_scheduler.warmup: {steps:" in text
    assert "`optimizer.grad_clip: {global_norm:" in text
    assert not any(w in a for a in symptom["advice"] for w in _NOT_THIS_CAUSE), symptom["advice"]
    assert "paddle.nn.ClipGradByGlobalNorm" not in json.dumps(report["findings"])


def _divergence_setup() -> tuple[Any, Any, Any]:
    model = sample_module("target_scale_divergence", "model").build_model()
    sched = paddle.optimizer.lr.StepDecay(learning_rate=5.0e-4, step_size=100, gamma=0.5)
    return model, sched, paddle.optimizer.SGD(learning_rate=sched, parameters=model.parameters())


def _step(m: Any, batch: Any) -> Any:
    x, y = (paddle.to_tensor(v) for v in batch)
    return paddle.nn.functional.mse_loss(m(x), y)


def test_a_mean_that_overflows_at_the_end_of_a_divergence_is_not_an_empty_selection(probe):
    """whole_batch_overflow: the MSE's mean overflows at step 17 after a steady growth (features of std 30):
    the advice standardises the inputs first, citing their scale as numpy measures it, then the step size;
    nothing about an empty selection or the loss formula."""
    report = probe(SAMPLES / "whole_batch_overflow" / "config.yaml")
    symptom = _symptom(report)
    assert symptom["location"]["op"] == "mean" and symptom["evidence"]["causes"][0] == "grad.explosion"
    step = report["first_fault"]["step"]
    x, _ = sample_module("whole_batch_overflow", "data").build_loader(batches=40, batch_size=64, scale=30.0)[step]
    rms = float(np.sqrt(np.mean(x.astype(np.float64) ** 2)))
    own = _own(symptom["advice"])
    assert own[0].startswith("Standardise") and f"input field 'x' of batch {step}" in own[0], own
    assert f"root mean square {rms:.3g}" in own[0] and "learning rate" in own[1]
    assert not any(w in a for a in symptom["advice"] for w in _NOT_THIS_CAUSE), symptom["advice"]


def _watch_divergence(folder: Path, mode: Any = None) -> dict[str, Any]:
    """target_scale_divergence's loop in the user's own Python under nandoctor.watch, or (`mode`) under the
    Doctor as another way in builds it (the Trainer callback: Mode.TRAINER)."""
    import nandoctor
    from nandoctor.inloop.doctor import Doctor

    model, sched, opt = _divergence_setup()
    doctor = (nandoctor.watch(model, opt, step_fn=_step, report_dir=folder, fields=["x", "y"]) if mode is None else
              Doctor(model, opt, step_fn=_step, report_dir=folder, fields=["x", "y"], mode=mode))
    with doctor:
        for batch in sample_module("target_scale_divergence", "data").build_loader():
            loss = _step(model, batch)
            loss.backward()
            if not doctor.check(loss, batch):
                break
            opt.step()
            opt.clear_grad()
            sched.step()
    return json.loads((folder / "report.json").read_text(encoding="utf-8"))


def _fit_divergence(folder: Path) -> dict[str, Any]:
    """The same regression through paddle.Model.fit with nandoctor's hapi callback (the same batches)."""
    from paddle.static import InputSpec

    from nandoctor.hapi import NanDoctorCallback

    batches = sample_module("target_scale_divergence", "data").build_loader()
    xs, ys = np.concatenate([b[0] for b in batches]), np.concatenate([b[1] for b in batches])

    class Rows(paddle.io.Dataset):
        def __getitem__(self, i: int) -> Any:
            return xs[i], ys[i]

        def __len__(self) -> int:
            return len(xs)

    net, _, opt = _divergence_setup()
    model = paddle.Model(net, inputs=[InputSpec([None, 8], "float32", "x")],
                         labels=[InputSpec([None, 1], "float32", "y")])
    model.prepare(opt, paddle.nn.MSELoss())
    model.fit(Rows(), epochs=1, batch_size=32, shuffle=False, verbose=0,
              callbacks=[NanDoctorCallback(report_dir=folder)])
    return json.loads((folder / "report.json").read_text(encoding="utf-8"))


_SCRIPT = """
import sys
import paddle
sys.path.insert(0, {folder!r})
from data import build_loader
from model import build_model

model = build_model()
sched = paddle.optimizer.lr.StepDecay(learning_rate=5.0e-4, step_size=100, gamma=0.5)
opt = paddle.optimizer.SGD(learning_rate=sched, parameters=model.parameters())
for x, y in build_loader():
    loss = paddle.nn.functional.mse_loss(model(paddle.to_tensor(x)), paddle.to_tensor(y))
    loss.backward()
    opt.step()
    opt.clear_grad()
    sched.step()
"""


def _run_divergence(folder: Path) -> dict[str, Any]:
    """The same loop as an unmodified script under `nandoctor run`."""
    import os
    import subprocess
    import sys

    folder.mkdir(parents=True)
    script = folder / "train.py"
    script.write_text(_SCRIPT.format(folder=str(SAMPLES / "target_scale_divergence")), encoding="utf-8")
    out = folder / "report.json"
    env = {**os.environ, "PYTHONPATH": str(SAMPLES.parent)}
    done = subprocess.run([sys.executable, "-m", "nandoctor", "run", "--json", str(out), "--", sys.executable,
                           str(script)], cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    assert out.is_file(), (done.returncode, done.stdout[-2000:], done.stderr[-2000:])
    return json.loads(out.read_text(encoding="utf-8"))


@pytest.mark.parametrize(("way", "python"), [
    ("run", ["`grad_clip=paddle.nn.ClipGradByGlobalNorm(", "paddle.optimizer.lr.LinearWarmup(", "scheduler.step()"]),
    ("watch", ["`grad_clip=paddle.nn.ClipGradByGlobalNorm(", "paddle.optimizer.lr.LinearWarmup(", "scheduler.step()"]),
    ("hapi", ["`grad_clip=paddle.nn.ClipGradByGlobalNorm(", "paddle.optimizer.lr.LinearWarmup(", "Model.fit"]),
    ("trainer", ["`max_grad_norm=", "`warmup_steps=200` in your TrainingArguments", "`learning_rate=0.0001` in your "
                 "TrainingArguments"]),
])
def test_an_in_loop_divergence_gets_advice_for_the_users_script(tmp_path, way, python):
    """nandoctor run, watch, hapi and the Trainer's Doctor: the same cause (and scale) advice as the probe, with
    settings as Python for the user's own script (ClipGradByGlobalNorm passed as grad_clip, LinearWarmup) or as
    TrainingArguments fields; no spec key, no "loss formula"."""
    from nandoctor.findings import Mode

    truth_step = len(_plain_divergence(40)) - 1
    folder = tmp_path / "report"
    report = (_fit_divergence(folder) if way == "hapi" else _run_divergence(folder) if way == "run" else
              _watch_divergence(folder, Mode.TRAINER if way == "trainer" else None))
    assert report["run"]["mode"] == way and report["first_fault"]["step"] == truth_step
    symptom = _symptom(report)
    assert symptom["evidence"]["causes"][0] in ("grad.explosion", "loss.jump"), symptom
    text = " ".join(symptom["advice"])
    assert all(p in text for p in python), symptom["advice"]
    if way != "run":  # `run` sees the model's inputs only: the targets never reach the model
        assert f"field 'y' of batch {truth_step}" in text and f"root mean square {_target_rms(truth_step):.3g}" in text
    assert not any(w in a for a in symptom["advice"] for w in _NOT_THIS_CAUSE), symptom["advice"]
    for finding in report["findings"]:  # every advice line of the report, the growth warning's included
        assert not any(w in a for a in finding["advice"] for w in _YAML_WORDS), finding


# ---------------------------------------------------------------- data advice that fits the field's shape

def _filters(report: dict[str, Any]) -> list[str]:
    """The numpy expressions the data advice and the drop_samples change give for 'keep this sample'."""
    [finding] = [f for f in report["findings"] if f["code"] == "data.nonfinite"]
    spans = [s for a in finding["advice"] for s in re.findall(r"`([^`]*np\.isfinite[^`]*)`", a)]
    [row] = [r for r in report["remedies"] if r["remedy"] == "drop_samples"]
    spans += re.findall(r"keep the samples where (.+?)\), first found", row["change"])
    return spans


@pytest.mark.parametrize(("sample", "field", "ndim"), [("nan_in_images", "image", 4), ("nan_in_data", "x", 2)])
def test_the_nan_filter_fits_the_fields_shape(probe, sample, field, ndim):
    """Each filter the report gives, run on the faulting batch, yields one boolean per sample, False exactly for
    the samples numpy finds non-finite (an NCHW image's `.all(axis=1)` would give an (N, H, W) mask)."""
    batches = sample_module(sample, "data").build_loader()
    bad = [(b, i) for b, (x, _) in enumerate(batches) for i in range(len(x)) if not np.isfinite(x[i]).all()]
    report = probe(SAMPLES / sample / "config.yaml")
    ff = report["first_fault"]
    assert [(ff["batch_index"], i) for i in ff["sample_indices"]] == bad
    x = batches[ff["batch_index"]][0]
    assert x.ndim == ndim
    filters = _filters(report)
    assert len(filters) >= 2, filters
    truth = np.array([np.isfinite(sample_x).all() for sample_x in x])
    for expr in filters:
        keep = np.asarray(eval(expr, {"np": np, field: x}))  # noqa: S307 - the report's own numpy text
        assert keep.shape == (len(x),) and (keep == truth).all(), expr
    assert not any(w in a for f in report["findings"] for a in _own(f["advice"]) for w in ("learning rate", "clip"))


# ---------------------------------------------------------------- remedy changes the validator accepts

def _with_scheduler(tmp: Path, sample: str, scheduler: dict[str, Any]) -> Path:
    """A copy of a sample with `optimizer.lr_scheduler` set (a temporary folder the test removes)."""
    folder = tmp / f"{sample}_{len(list(tmp.iterdir()))}"
    shutil.copytree(SAMPLES / sample, folder, ignore=shutil.ignore_patterns("__pycache__"))
    raw = yaml.safe_load((folder / "config.yaml").read_text(encoding="utf-8"))
    raw["optimizer"]["lr_scheduler"] = scheduler
    if "values" in scheduler.get("args", {}):  # its rates are its own arguments: no base rate (the validator's rule)
        del raw["optimizer"]["args"]["learning_rate"]
    (folder / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return folder / "config.yaml"


def _apply(raw: dict[str, Any], edit: dict[str, Any]) -> dict[str, Any]:
    """Set each dotted key of `edit` in a copy of the spec, replacing what is there."""
    out = json.loads(json.dumps(raw))
    for key, value in edit.items():
        *parents, last = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return out


def _validate(config: Path, edit: dict[str, Any]) -> Any:
    """The spec with the change applied, through the validator and the scheduler's construction."""
    from nandoctor.spec import parse_spec
    from nandoctor.workload.schedulers import build_scheduler

    raw = yaml.safe_load(config.read_text(encoding="utf-8"))
    spec = parse_spec(_apply(raw, edit), config)
    build_scheduler(spec)
    return spec


_CONFIGS = {
    "target_scale_divergence": lambda tmp: SAMPLES / "target_scale_divergence" / "config.yaml",  # StepDecay
    "lr_divergence": lambda tmp: SAMPLES / "lr_divergence" / "config.yaml",  # no scheduler
    "lr_divergence+cosine": lambda tmp: _with_scheduler(tmp, "lr_divergence",
                                                        {"name": "CosineAnnealingDecay", "args": {"T_max": 100}}),
    "target_scale_divergence+warmup": lambda tmp: _with_scheduler(tmp, "target_scale_divergence",
                                                                  {"warmup": {"steps": 1, "start_lr": 0.0}}),
    "lr_divergence+piecewise": lambda tmp: _with_scheduler(
        tmp, "lr_divergence", {"name": "PiecewiseDecay", "args": {"boundaries": [100], "values": [0.03, 0.003]}}),
    "warmup_needed/no_warmup": lambda tmp: SAMPLES / "warmup_needed" / "no_warmup.yaml",
}


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("configs")
    yield {name: make(tmp) for name, make in _CONFIGS.items()}
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.parametrize("name", sorted(_CONFIGS))
def test_every_settings_change_loads_in_the_validator(probe, configs, name):
    """Each remedy that changes a setting carries `spec_change` (spec key -> value); its YAML `change` text
    loads back to that mapping, and the spec with it applied passes the validator. So do the `key: value`
    spans of the advice written for the spec."""
    config = configs[name]
    report = probe(config)
    rows = [r for r in report["remedies"] if r["remedy"] in _SETTINGS and r["outcome"] != "not_applicable"]
    assert rows, report["remedies"]
    for row in rows:
        assert "spec_change" in row, row
        assert yaml.safe_load(row["change"]) == row["spec_change"], row["change"]
        _validate(config, row["spec_change"])
    spans = [s for f in report["findings"] for a in f["advice"]
             for s in re.findall(r"`([a-z_.]+: [^`]+)` in the spec", a)]
    for span in spans:
        _validate(config, yaml.safe_load(span))
    assert any("learning_rate" in s or "values" in s for s in spans), spans  # the advice names a rate


def test_the_settings_changes_do_in_a_plain_loop_what_the_report_says(probe):
    """The settings changes the probe replayed on target_scale_divergence, applied by hand to a plain Paddle
    loop from the change's own numbers: a `fixed` one keeps every loss finite through the fault step + 20, a
    `not_fixed` one does not."""
    report = probe(SAMPLES / "target_scale_divergence" / "config.yaml")
    tried = [r for r in report["remedies"] if r["outcome"] != "not_applicable" and r["remedy"] in _SETTINGS]
    assert {r["remedy"] for r in tried if r["outcome"] == "fixed"} >= {"lr_x0.1"}, report["remedies"]
    end = report["first_fault"]["step"] + 20
    for row in tried:
        edit = yaml.safe_load(row["change"])
        kwargs: dict[str, Any] = {}
        if "optimizer.args.learning_rate" in edit:
            kwargs["lr"] = edit["optimizer.args.learning_rate"]
        if "optimizer.grad_clip" in edit:
            kwargs["clip"] = edit["optimizer.grad_clip"]["global_norm"]
        if "optimizer.lr_scheduler.warmup" in edit:
            kwargs["warmup"] = edit["optimizer.lr_scheduler.warmup"]["steps"]
        assert kwargs, row
        losses = _plain_divergence(end + 1, **kwargs)
        finite = len(losses) == end + 1 and all(math.isfinite(v) for v in losses)
        assert finite == (row["outcome"] == "fixed"), (row["change"], row["outcome"], losses[-3:])
