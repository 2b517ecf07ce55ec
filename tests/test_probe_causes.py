"""Causes before symptoms: NaN rows traced to the step and samples that read them, frozen or unused NaN
parameters trained past, and (below) the growth that led to a fault."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from probe_spec import codes, probe

from nandoctor.findings import Phase
from nandoctor.probe import ProbeOptions, run_probe
from nandoctor.spec import load_spec

SAMPLES = Path(__file__).resolve().parent.parent / "sample_configs"


def _sample_report(name: str):
    spec = load_spec(SAMPLES / name / "config.yaml")
    return run_probe(spec, ProbeOptions(steps=spec.probe.steps or 20, seed=0, device="cpu"))


def _plain_loop_first_nan(folder: Path) -> tuple[int, list[int], list[int]]:
    """Ground truth without nandoctor: the sample's own model and data in a plain AdamW loop; the first step
    whose loss is NaN, the samples holding the bad row's token id, and the samples whose loss alone is NaN."""
    import paddle
    import paddle.nn.functional as F

    sys.path.insert(0, str(folder))
    try:
        from data import build_loader  # type: ignore[import-not-found]
        from model import build_model  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("data", None)
        sys.modules.pop("model", None)
    paddle.seed(0)
    model = build_model(64, 16, 3)
    bad = np.where(~np.isfinite(model.embed.weight.numpy()).all(axis=1))[0].tolist()
    opt = paddle.optimizer.AdamW(learning_rate=0.003, parameters=model.parameters())
    for step, (ids, label) in enumerate(build_loader(12, 8, 10)):
        x, y = paddle.to_tensor(ids), paddle.to_tensor(label)
        loss = F.cross_entropy(model(x), y)
        if not np.isfinite(float(loss)):
            carry = [i for i in range(len(ids)) if np.isin(ids[i], bad).any()]
            alone = [i for i in range(len(ids))
                     if not np.isfinite(float(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1])))]
            return step, carry, alone
        loss.backward()
        opt.step()
        opt.clear_grad()
    raise AssertionError("the plain loop never went NaN")


def test_embedding_nan_row_traced_to_the_step_samples_and_token_ids():
    step, carry, alone = _plain_loop_first_nan(SAMPLES / "embedding_nan_row")
    assert (step, carry, alone) == (7, [3, 6], [3, 6])  # recorded: the sample's comment says the same
    report = _sample_report("embedding_nan_row")
    ff = report.first_fault
    assert (ff.step, ff.phase, ff.layer, ff.parameter, ff.batch_index, ff.sample_indices) == (
        step, Phase.FORWARD, "embed", "embed.weight", step, carry)
    assert len(report.timeline) == step + 1  # it trained on through the steps that never read row 37
    [p] = [f for f in report.findings if f.code.value == "param.nonfinite"]
    assert p.severity.value == "error" and p.location.phase == Phase.PARAMS
    assert p.evidence["token_ids"] == [37] and p.evidence["num_rows"] == 1
    assert p.evidence["first_read_step"] == step and p.evidence["samples"] == carry
    assert p.evidence["token_ids_read"] == [37]
    assert f"First read at step {step}" in p.message and "token id(s) 37" in p.message
    assert any("37" in a for a in p.advice)


def test_partly_nan_parameter_no_step_reads_trains_on_and_says_so(tmp_path):
    report = probe(tmp_path, model_args={"kind": "spare", "nan_param": "spare.weight"}, steps=6)
    assert len(report.timeline) == 6 and codes(report, "error") == {"param.nonfinite"}
    [p] = report.findings
    assert "No step read these entries in the 6 step(s) probed" in p.message
    ff = report.first_fault
    assert (ff.step, ff.phase, ff.parameter) == (None, Phase.PARAMS, "spare.weight")
    assert report.exit_code == 1


def test_frozen_unused_nan_parameter_is_a_warning_and_training_goes_on(tmp_path):
    report = probe(tmp_path, model_args={"kind": "spare", "nan_param": "spare.weight", "nan_whole": True,
                                         "frozen": "spare.weight"}, steps=6)
    assert len(report.timeline) == 6 and report.first_fault is None
    [p] = report.findings
    assert (p.code.value, p.severity.value, p.location.parameter) == ("param.nonfinite", "warning", "spare.weight")
    assert p.evidence["frozen"] and "frozen" in p.message and "frozen" in p.advice[0]
    assert report.exit_code == 0


def test_frozen_nan_parameter_that_the_model_reads_is_the_fault(tmp_path):
    report = probe(tmp_path, model_args={"nan_param": "head.bias", "nan_whole": True, "frozen": "head.bias"})
    ff = report.first_fault
    assert (ff.step, ff.phase, ff.layer, ff.parameter) == (0, Phase.FORWARD, "head", "head.bias")
    assert codes(report, "warning") == {"param.nonfinite"} and "activation.nonfinite" in codes(report, "error")


def test_wholly_nan_trained_parameter_still_stops_before_training(tmp_path):
    report = probe(tmp_path, model_args={"nan_param": "body.0.weight", "nan_whole": True})
    assert report.timeline == [] and report.first_fault.phase == Phase.PARAMS
    [p] = report.findings
    assert "did not train" in p.message and p.evidence["tensors"]["body.0.weight"]["wholly_nonfinite"]
