"""loss.divergence and loss.spike against a plain Paddle loop (issue 35): the same small regression MLP
(tests/trend_models.py) trained by a plain loop that records every step's loss, and by `nandoctor probe` and
`nandoctor.watch`. The minimum, its step, the level at the end and the spike's batch come from the plain loop's
losses in float64, not from nandoctor's; the lower-rate and spike-free twins must stay `healthy`."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import pytest
import trend_models as tm
import yaml

MODELS = Path(__file__).resolve().parent / "trend_models.py"
STEPS = 100
WARMUP, START_LR = 60, 0.001
DIVERGING, TWIN = 1.0, 0.1  # the peak learning rates: a too-high one, and 10x lower
SPIKE_LR, SPIKE_AT, SPIKE_STEPS = 0.01, 60, 100


def plain_losses(peak: float, *, warmup: int = WARMUP, n: int = STEPS, spike_at: int = -1, optimizer: str = "Adam",
                 start_lr: float = START_LR, lr_x: tuple[int, float] | None = None, epochs: int = 1,
                 clip: tuple[int, float] | None = None, grad_norms: list[float] | None = None) -> np.ndarray:
    """Every step's loss of a plain Paddle loop (MSE, the probe's seeding and order of calls), float64, up to and
    including the first non-finite one. `lr_x` (step, factor): the scheduler's rate times factor from that step;
    `clip` (step, norm): the gradients' global norm clipped there from that step (ClipGradByGlobalNorm);
    `grad_norms`: filled with each step's global gradient norm before any clip (float64, on the host)."""
    paddle.seed(0)
    np.random.seed(0)
    random.seed(0)
    model = tm.mlp()
    sched = paddle.optimizer.lr.LinearWarmup(peak, warmup, start_lr, peak) if warmup else peak
    opt = getattr(paddle.optimizer, optimizer)(learning_rate=sched, parameters=model.parameters())
    out = []
    for step, (x, y) in enumerate(tm.batches(n, spike_at=spike_at) * epochs):
        if lr_x is not None and step >= lr_x[0] and warmup:
            sched.last_lr = float(sched.get_lr()) * lr_x[1]
        elif lr_x is not None and step == lr_x[0]:  # (a constant rate: cut once, from that step)
            opt.set_lr(peak * lr_x[1])
        if clip is not None and step == clip[0]:
            opt._grad_clip = paddle.nn.ClipGradByGlobalNorm(clip[1])
        loss = paddle.nn.functional.mse_loss(model(paddle.to_tensor(x)), paddle.to_tensor(y))
        if not np.isfinite(float(loss)):
            out.append(float(loss))
            break
        loss.backward()
        if grad_norms is not None:
            grad_norms.append(float(np.sqrt(sum(float((p.grad.numpy().astype("float64") ** 2).sum())
                                                for p in model.parameters() if p.grad is not None))))
        opt.step()
        opt.clear_grad()
        if warmup:
            sched.step()
        out.append(float(loss))
    return np.asarray(out, dtype=np.float64)


def trend_spec(tmp_path: Path, peak: float, *, warmup: int = WARMUP, n: int = STEPS, spike_at: int = -1,
               optimizer: str = "Adam", start_lr: float = START_LR, loss: str | None = None) -> Path:
    """A spec for tests/trend_models.py: `optimizer` warmed up from `start_lr` to `peak` over `warmup` steps."""
    raw: dict[str, Any] = {
        "version": 1, "model": {"entry": f"{MODELS}:mlp"},
        "data": {"entry": f"{MODELS}:batches", "args": {"n": n, "spike_at": spike_at}, "fields": ["x", "y"],
                 "label": "y"},
        "loss": {"entry": f"{MODELS}:{loss}"} if loss else {"builtin": "mse"},
        "optimizer": {"name": optimizer, "args": {"learning_rate": peak}},
        "probe": {"steps": n},  # (a plain script of the spec, under `nandoctor run`, trains as many)
    }
    if warmup:
        raw["optimizer"]["lr_scheduler"] = {"warmup": {"steps": warmup, "start_lr": start_lr}}
    path = tmp_path / f"trend_{optimizer}_{peak}_{warmup}_{n}_{spike_at}_{loss}.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def probe(tmp_path: Path, peak: float, *, try_fixes: bool = False, **kw: Any) -> dict[str, Any]:
    from nandoctor.probe import ProbeOptions, run_probe
    from nandoctor.spec import load_spec

    n = kw.get("n", STEPS)
    return run_probe(load_spec(trend_spec(tmp_path, peak, **kw)),
                     ProbeOptions(steps=n, seed=0, device="cpu", try_fixes=try_fixes)).to_dict()


def watched(peak: float, *, warmup: int = WARMUP, n: int = STEPS, spike_at: int = -1) -> dict[str, Any]:
    """The same training in the user's own loop under `nandoctor.watch`: the report its `close()` made (a run
    with warnings gets one, as a faulty one does), else the summary of a healthy one."""
    import nandoctor

    paddle.seed(0)
    np.random.seed(0)
    random.seed(0)
    model = tm.mlp()
    sched = paddle.optimizer.lr.LinearWarmup(peak, warmup, START_LR, peak) if warmup else peak
    opt = paddle.optimizer.Adam(learning_rate=sched, parameters=model.parameters())
    with nandoctor.watch(model, opt, report_dir=None, fields=["x", "y"]) as doctor:
        for x, y in tm.batches(n, spike_at=spike_at):
            loss = paddle.nn.functional.mse_loss(model(paddle.to_tensor(x)), paddle.to_tensor(y))
            loss.backward()
            doctor.check(loss, (x, y))
            opt.step()
            opt.clear_grad()
            if warmup:
                sched.step()
    return doctor.report.to_dict() if doctor.report is not None else doctor.summary().to_dict()


def of_code(report: dict[str, Any], code: str) -> list[dict[str, Any]]:
    return [f for f in report["findings"] if f["code"] == code]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("trend")
    return {
        "diverging": probe(tmp, DIVERGING), "twin": probe(tmp, TWIN),
        "spike": probe(tmp, SPIKE_LR, warmup=0, n=SPIKE_STEPS, spike_at=SPIKE_AT),
        "spike_twin": probe(tmp, SPIKE_LR, warmup=0, n=SPIKE_STEPS),
        "truth_diverging": plain_losses(DIVERGING), "truth_twin": plain_losses(TWIN),
        "truth_spike": plain_losses(SPIKE_LR, warmup=0, n=SPIKE_STEPS, spike_at=SPIKE_AT),
    }


def _timeline(report: dict[str, Any]) -> np.ndarray:
    return np.asarray([p["loss"] for p in report["timeline"]], dtype=np.float64)


def test_probe_sees_the_plain_loops_losses(runs: dict[str, Any]) -> None:
    """The findings below are read from these losses: the probe's must be the plain loop's, step for step."""
    np.testing.assert_allclose(_timeline(runs["diverging"]), runs["truth_diverging"], rtol=1e-5)
    np.testing.assert_allclose(_timeline(runs["spike"]), runs["truth_spike"], rtol=1e-5)


def test_divergence_names_the_minimum_the_rise_and_the_level(runs: dict[str, Any]) -> None:
    truth = runs["truth_diverging"]
    report = runs["diverging"]
    assert report["verdict"] == "at_risk"
    [found] = of_code(report, "loss.divergence")
    ev = found["evidence"]
    start = found["location"]["step"]
    assert found["severity"] == "warning" and ev["start_step"] == start
    # the minimum: the plain loop's lowest loss before the rise began, at its step
    assert ev["min_step"] == int(np.argmin(truth[:start + 1]))
    assert ev["min_loss"] == pytest.approx(truth[:start + 1].min(), rel=1e-5)
    # the level at the report: the median of the last steps, several-fold above the minimum
    stretch = ev["stretch"]
    assert ev["level"] == pytest.approx(float(np.median(truth[-stretch:])), rel=1e-5)
    assert ev["level_step"] == STEPS - 1 and ev["level"] >= 3 * ev["min_loss"]
    # the rise began there: after it the loss stays several-fold above the minimum's neighbourhood, before it not
    near_min = float(np.median(truth[max(0, ev["min_step"] - 5):ev["min_step"] + 6]))
    assert np.median(truth[start + 10:]) >= 3 * near_min
    assert np.median(truth[max(0, start - 10):start + 1]) < 2 * near_min
    assert str(start) in found["message"] and f"{ev['min_loss']:.3g}" in found["message"]
    assert any("learning rate" in a.lower() for a in found["advice"])


def test_lower_rate_twin_stays_healthy(runs: dict[str, Any]) -> None:
    truth = runs["truth_twin"]
    assert np.median(truth[-10:]) < 3 * truth.min() or np.median(truth[-10:]) < truth[:5].mean()  # truly quiet
    assert runs["twin"]["verdict"] == "healthy", runs["twin"]["findings"]
    assert runs["spike_twin"]["verdict"] == "healthy", runs["spike_twin"]["findings"]


def test_spike_that_recovers_names_its_steps_and_batch(runs: dict[str, Any]) -> None:
    truth = runs["truth_spike"]
    report = runs["spike"]
    assert report["verdict"] == "at_risk"
    [found] = of_code(report, "loss.spike")
    ev = found["evidence"]
    top = int(np.argmax(truth))  # the plain loop's highest loss: the batch of scaled-up inputs
    assert top == SPIKE_AT
    assert ev["peak_step"] == top and ev["top"][0]["batch_index"] == top
    assert found["location"]["batch_index"] == top
    assert ev["start_step"] <= top <= ev["end_step"] < ev["recovered_step"] < SPIKE_STEPS
    before = truth[max(0, ev["start_step"] - 50):ev["start_step"]]
    assert ev["early_level"] == pytest.approx(float(np.median(before)), rel=1e-5)
    assert truth[ev["recovered_step"]] < 3 * np.median(before)
    assert not of_code(report, "loss.divergence")


def test_run_reports_the_same_divergence(runs: dict[str, Any], tmp_path: Path) -> None:
    """`nandoctor run` on a plain script training the same spec (tests/parity/plain_train.py): the child process
    is what this door is, so it runs as one."""
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, "-m", "nandoctor", "run", "--json", str(out), "--", sys.executable,
                           str(root / "tests" / "parity" / "plain_train.py"), str(trend_spec(tmp_path, DIVERGING))],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert out.is_file(), proc.stderr[-3000:]
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["verdict"] == "at_risk" and proc.returncode == 0
    [found] = of_code(report, "loss.divergence")
    [probed] = of_code(runs["diverging"], "loss.divergence")
    for key in ("start_step", "min_step", "level_step", "stretch"):
        assert found["evidence"][key] == probed["evidence"][key]


def test_watch_reports_the_same_divergence(runs: dict[str, Any]) -> None:
    """One engine, one answer: the user's own loop under nandoctor.watch gets the probe's finding."""
    report = watched(DIVERGING)
    assert report["verdict"] == "at_risk" and report["run"]["mode"] == "watch"
    [found] = of_code(report, "loss.divergence")
    [probed] = of_code(runs["diverging"], "loss.divergence")
    for key in ("start_step", "min_step", "level_step", "stretch"):
        assert found["evidence"][key] == probed["evidence"][key]
    assert found["evidence"]["min_loss"] == pytest.approx(probed["evidence"]["min_loss"], rel=1e-5)
    assert "optimizer.args" not in " ".join(found["advice"])  # Python for a script, not the spec's YAML


FAULTY = {"warmup": 200, "n": 170, "optimizer": "SGD", "start_lr": 0.01}  # overflows at step ~169 (SGD, peak 1.0)


def test_a_fault_after_a_divergence_says_so(tmp_path: Path) -> None:
    """The plain loop's loss diverges, then goes non-finite: the fault's finding names the divergence before it
    (its start and lead time), rather than the last batch alone."""
    truth = plain_losses(1.0, **FAULTY)
    fault_step = len(truth) - 1
    assert not np.isfinite(truth[-1]) and fault_step > 64
    report = probe(tmp_path, 1.0, **FAULTY)
    assert report["first_fault"]["step"] == fault_step
    [found] = of_code(report, "loss.divergence")
    ev = found["evidence"]
    start = ev["start_step"]
    assert ev["fault_step"] == fault_step and ev["lead_steps"] == fault_step - start > 0
    assert ev["min_step"] == int(np.argmin(truth[:start + 1]))
    assert ev["min_loss"] == pytest.approx(truth[:start + 1].min(), rel=1e-5)
    [fault] = [f for f in report["findings"] if f["severity"] == "error"]
    assert fault["location"]["step"] == fault_step
    assert fault["evidence"]["precursor"] == {"code": "loss.divergence", "start_step": start,
                                              "lead_steps": fault_step - start}
    assert f"after the loss began to diverge (step {start}" in fault["message"]


def test_lower_rate_remedy_starts_exactly_where_the_growth_began(tmp_path: Path) -> None:
    """lr_x0.1 replays from the growth's step, whichever snapshot the ring held before it: its losses are the
    plain loop's with the rate x0.1 from that step on (the steps before it replayed as they were)."""
    report = probe(tmp_path, 1.0, try_fixes=True, **FAULTY)
    [growth] = of_code(report, "grad.explosion")
    [row] = [r for r in report["remedies"] if r["remedy"] == "lr_x0.1"]
    start = growth["location"]["step"]
    assert row["start_step"] == start > 0 and row["outcome"] == "fixed"
    truth = plain_losses(1.0, **FAULTY, lr_x=(start, 0.1), epochs=2)  # the replay reads on into a second epoch
    replayed = truth[start:start + row["steps_run"]]
    assert len(replayed) == row["steps_run"] and np.isfinite(replayed).all()
    assert row["loss_after"] == pytest.approx(float(np.mean(replayed[-3:])), rel=1e-4)


def test_a_note_that_blames_the_samples_names_the_divergence_before_them() -> None:
    """A modest gradient growth before a fault that some samples reproduce alone is said as "those samples, not
    the growth, made it" (engine/warnings.py); after a divergence of the loss that note must not stand alone:
    it names the divergence, its start and its lead, as the fault's finding does."""
    from nandoctor.diagnosis.precursor_link import link_precursors
    from nandoctor.engine.warnings import Rise, _growth_message
    from nandoctor.findings import Code, Finding, Location, Phase, Report, Severity

    severity, message = _growth_message("global gradient norm", Rise(160, 1.0, 168, 3.0, 1.0), 169, 0.5, [3])
    assert severity == Severity.INFO and "those samples, not the growth, made it" in message
    report = Report(command="probe")
    report.findings = [
        Finding(Code.LOSS_DIVERGENCE, Severity.WARNING, "the loss diverged", Location(step=116),
                {"early_level": 0.00722, "level": 3.56e22, "lead_steps": 53}),
        Finding(Code.GRAD_EXPLOSION, severity, message, Location(step=160, phase=Phase.BACKWARD)),
    ]
    link_precursors(report, 169)
    note = report.findings[1]
    assert "not the growth, made it" not in note.message
    assert "the loss grew from 0.00722 to 3.56e+22 from step 116, 53 steps before it (loss.divergence)" in note.message
    assert note.evidence["precursors"] == [{"code": "loss.divergence", "layer": None, "start_step": 116,
                                            "lead_steps": 53}]
    assert report.findings[0].message == "the loss diverged"  # (the fault's own finding names it: loss_trend)
