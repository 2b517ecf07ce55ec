"""An exp overflow whose argument also feeds a second exp (issue 34, item 5): a VAE's logvar reaches
exp(0.5 * logvar) in the model and exp(logvar) in the KL term. A clamp at the reported call cannot help, at any
bound; the report says where else the same value overflows, and verifies the clamp of logvar where it is made.
Ground truth: plain Paddle loops over the same model and data, the loss and gradients checked in float64 on
the host: one with exp's input clamped at the reported call only (still NaN), one with the layer's output
clamped at the bound the report gives (finite through the replays' horizon and beyond).
"""

from __future__ import annotations

import inspect
import runpy
from pathlib import Path
from typing import Any

import paddle
import pytest
import two_exp
import yaml
from run_truth import step_went_nonfinite

from nandoctor.probe import ProbeOptions, run_probe
from nandoctor.report.bundle import write_bundle
from nandoctor.spec import load_spec

HERE = Path(__file__).resolve().parent
STEPS = 30


def _line(text: str) -> int:
    """The line of two_exp.py holding `text` (the exp calls the report must name)."""
    lines, _ = inspect.getsourcelines(two_exp)  # (a module's lines, from its first)
    return next(i + 1 for i, line in enumerate(lines) if text in line)


def _plain(steps: int, *, at_call: float | None = None, at_source: float | None = None) -> int | None:
    """The first step whose loss or gradients hold NaN/Inf, or None: exp's input clamped at the model's call only
    (`at_call`), or logvar's output clamped where it is made (`at_source`)."""
    net = two_exp.build_model()
    opt = paddle.optimizer.Adam(parameters=net.parameters(), learning_rate=0.003)
    data = two_exp.build_loader(batches=steps)
    for step, x in enumerate(data):
        x = paddle.to_tensor(x)
        h = net.enc(x)
        mu, logvar = net.mu(h), net.logvar(h)
        if at_source is not None:
            logvar = paddle.clip(logvar, max=at_source)
        half = 0.5 * logvar
        std = paddle.exp(paddle.clip(half, max=at_call) if at_call is not None else half)
        recon = net.dec(mu + std * paddle.randn(mu.shape, dtype=mu.dtype))
        loss = ((recon - x) ** 2).sum(-1).mean() + 0.5 * (mu ** 2 + paddle.exp(logvar) - logvar - 1).sum(-1).mean()
        loss.backward()
        if step_went_nonfinite(loss, net):
            return step
        opt.step()
        opt.clear_grad()
    return None


@pytest.fixture(scope="module")
def probed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """The probe's report on two_exp.py, and its spec (for a bundle)."""
    folder = tmp_path_factory.mktemp("two_exp")
    entry = f"{HERE / 'two_exp.py'}"
    raw = {"version": 1, "model": {"entry": f"{entry}:build_model"},
           "data": {"entry": f"{entry}:build_loader", "fields": ["x"]}, "step": {"entry": f"{entry}:vae_step"},
           "optimizer": {"name": "Adam", "args": {"learning_rate": 0.003}}}
    (folder / "config.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
    spec = load_spec(folder / "config.yaml")
    return run_probe(spec, ProbeOptions(steps=STEPS, seed=0, device="cpu")), spec


@pytest.fixture(scope="module")
def report(probed: tuple[Any, Any]) -> Any:
    return probed[0]


def test_the_clamp_at_one_call_says_the_same_value_overflows_at_the_other(report):
    model_line, loss_line = _line("std = paddle.exp(0.5 * logvar)"), _line("paddle.exp(logvar)")
    ff = report.first_fault
    assert (ff.step, ff.op) == (10, "exp")
    guard = next(r for r in report.remedies if r["remedy"] == "op_guard")
    assert f"two_exp.py:{model_line}" in guard["change"]
    # the truth: no clamp at that call helps (the bound the row tried, and a far tighter one)
    assert _plain(STEPS, at_call=guard["threshold"]) == 10 and _plain(STEPS, at_call=1.0) == 10
    assert guard["outcome"] == "not_fixed"
    assert f"overflows exp at another call too: two_exp.py:{loss_line} in vae_step" in guard["note"], guard
    assert "layer logvar's output" in guard["note"]


def test_the_value_clamped_where_it_is_made_is_verified(report):
    row = next(r for r in report.remedies if r["remedy"] == "source_clamp")
    assert row["outcome"] == "fixed", row
    assert report.remedies[0]["outcome"] == "fixed"
    limit = row["threshold"]
    assert f"paddle.clip(self.logvar(...), max={limit:g})" in row["change"]
    horizon = report.details["remedies"]["end_step"]
    assert _plain(STEPS) == 10  # unclamped, the bad sample overflows both exps at step 10
    assert horizon <= STEPS and _plain(2 * STEPS, at_source=limit) is None  # clamped at the source: finite
    symptom = next(f for f in report.findings if f.location.step == 10 and f.severity.value == "error")
    assert any(a.startswith("Verified by replay (source_clamp)") for a in symptom.advice)


def test_reproduce_py_applies_the_source_clamp(probed: tuple[Any, Any], tmp_path: Path,
                                                capfd: pytest.CaptureFixture[str]):
    """The bundle's reproduce.py replays the faulting step as is (exp overflows) and with the row's clamp of
    logvar's output (clean), the layer and bound read from report.json."""
    report, spec = probed
    bundle = write_bundle(report, spec, tmp_path / "b")
    main = runpy.run_path(str(bundle / "reproduce.py"), run_name="bundle_reproduce")["main"]
    capfd.readouterr()
    assert main([]) == 1
    assert "exp" in capfd.readouterr().out
    assert main(["--with-remedy", "source_clamp"]) == 0
    row = next(r for r in report.remedies if r["remedy"] == "source_clamp")
    out = capfd.readouterr().out
    assert f"clipping layer logvar's output at {row['clamp']['max']:g}" in out and "no fault" in out, out
    assert row["clamp"] == {"layer": "logvar", "max": row["threshold"]}
