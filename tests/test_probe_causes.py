"""Causes before symptoms: NaN rows traced to the step and samples that read them, frozen or unused NaN
parameters trained past, and (below) the growth that led to a fault."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from probe_spec import codes, probe

from nandoctor.engine.loop import StepRecord
from nandoctor.engine.warnings import growth_before_fault
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

    build_model, build_loader = _import_sample(folder)
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
    [symptom] = [f for f in report.findings if f.code.value == "activation.nonfinite"]
    assert "It read token id(s) 37 of embed.weight" in symptom.message


def test_partly_nan_parameter_no_step_reads_trains_on_and_says_so(tmp_path):
    """An embedding table the model uses, whose NaN row no batch of the probe holds: an error (a later batch
    will read it), training went on, and the report says no step read it."""
    report = probe(tmp_path, model="deep_token_model", model_args={"nan_row": 25, "depth": 2}, data="token_loader",
                   data_args={"batches": 6, "long_batch": -1}, steps=6)
    assert len(report.timeline) == 6 and codes(report) == {"param.nonfinite"}
    [p] = report.findings
    assert p.severity.value == "error" and "No batch held these ids in the 6 step(s) probed" in p.message
    ff = report.first_fault
    assert (ff.step, ff.phase, ff.parameter) == (None, Phase.PARAMS, "tok.weight")
    assert report.exit_code == 1


def test_partly_nan_parameter_the_loss_never_uses_is_a_warning(tmp_path):
    report = probe(tmp_path, model_args={"kind": "spare", "nan_param": "spare.weight"}, steps=6)
    assert len(report.timeline) == 6 and report.first_fault is None
    [p] = report.findings
    assert (p.code.value, p.severity.value, p.evidence["unused"]) == ("param.nonfinite", "warning", True)
    assert "No gradient reached it in the 6 step(s)" in p.message and "not trained" in p.message
    assert report.exit_code == 0


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


# ---- the growth before a fault ------------------------------------------------------------------
def _records(norms: list[float], fault_loss: float = float("nan"), lr: float | None = None) -> list[StepRecord]:
    out = [StepRecord(i, 1.0, n, None, None) for i, n in enumerate(norms)]
    out.append(StepRecord(len(norms), fault_loss, float("nan"), None, None))
    if lr is not None:
        for r in out:
            r.lr = lr * (1 + r.step)  # a scheduler's value per step, as the watcher records it
    return out


@pytest.mark.parametrize("norms, start", [
    ([2.0, 2.1, 1.9, 2.0, 6.5], None),  # one step of 3.25x after a flat stretch: noise can do that
    ([2.0, 2.1, 1.9, 2.0, 3.0, 6.5], 3),  # 3.25x over 2 rising steps, 3x above the level before
    ([1.0, 2.0, 4.0], 0),  # the shortest history: growth from the first step
    ([1.0, 1.1, 0.9, 1.0, 1e6], 3),  # 1e6x in the single step right before the NaN
    # a spike that fell back for a step before the NaN (SGD at lr 0.8 on transformer_lr_divergence)
    ([0.47, 0.50, 0.72, 0.59, 0.83, 1.36, 10.6, 0.76], 3),
])
def test_growth_before_the_fault_is_found_with_where_it_began(norms, start):
    found = growth_before_fault(_records(norms), len(norms), fallback_lr=0.5)
    if start is None:
        assert found is None
        return
    assert found is not None and found.location.step == start
    assert found.evidence["learning_rate"] == 0.5 and found.evidence["fault_step"] == len(norms)
    clip = found.evidence["clip_threshold"]
    assert clip > 0 and f"global_norm: {clip:.3g}" in " ".join(found.advice)


@pytest.mark.parametrize("norms", [
    [5.0, 4.0, 1.0, 2.0, 4.0],  # a recovery from a dip back to the usual level
    [3.0, 2.5, 2.8, 2.6, 2.9, 2.7],  # flat noise
    [4.0, 3.0, 2.0, 1.0],  # falling
    [1.0],  # one step: nothing to compare
    [1.0, 1.2, 0.9, 1.4, 3.1, 1.0],  # a noisy bump that fell back is no cause: not 10x above the level
])
def test_no_growth_no_finding(norms):
    assert growth_before_fault(_records(norms), len(norms), fallback_lr=0.5) is None


def test_growth_names_the_learning_rate_recorded_at_its_start():
    found = growth_before_fault(_records([1.0, 1.0, 1.0, 2.0, 4.0], lr=0.1), 5, fallback_lr=9.0)
    assert found.location.step == 2 and found.evidence["learning_rate"] == pytest.approx(0.3)
    assert "0.3 at step 2" in " ".join(found.advice)


def test_modest_growth_beside_a_fault_that_a_few_samples_make_alone_is_only_a_note():
    """Early training's norm can triple over three steps while the fault is one sample's log(0): the
    growth is then an info note, not the cause named in the fault's message."""
    norms = [0.245, 0.5, 0.747]
    assert growth_before_fault(_records(norms), 3, fallback_lr=0.5).severity.value == "warning"
    found = growth_before_fault(_records(norms), 3, fallback_lr=0.5, samples_alone=[2, 5])
    assert found.severity.value == "info" and "sample(s) 2, 5 of its batch alone" in found.message
    huge = growth_before_fault(_records([1.0, 1.1, 1e6]), 3, fallback_lr=0.5, samples_alone=[2])
    assert huge.severity.value == "warning"  # a 1e6x jump is the cause whatever the samples


def _import_sample(folder: Path) -> tuple[Any, Any]:
    sys.path.insert(0, str(folder))
    try:
        from data import build_loader  # type: ignore[import-not-found]
        from model import build_model  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("data", None)
        sys.modules.pop("model", None)
    return build_model, build_loader


def _plain_loop_divergence(folder: Path) -> tuple[int, list[float], str, str | None]:
    """Ground truth without nandoctor: SGD at lr 1.0 on the sample's model and data; the gradient norm per step
    in float64 on the host, the first step whose loss is NaN, and the op and innermost layer Paddle's tensor
    checker names when that step is replayed."""
    import math
    import re

    import paddle
    import paddle.nn.functional as F
    from paddle.amp import debugging

    build_model, build_loader = _import_sample(folder)
    paddle.seed(0)
    model = build_model(32, 32, 2, 16, 4)
    opt = paddle.optimizer.SGD(learning_rate=1.0, parameters=model.parameters())
    norms: list[float] = []
    for step, (ids, label) in enumerate(build_loader(60, 16, 12)):
        x, y = paddle.to_tensor(ids), paddle.to_tensor(label)
        loss = F.cross_entropy(model(x), y)
        if not math.isfinite(float(loss)):
            stack: list[str] = []
            hooks = []
            for name, layer in model.named_sublayers():
                hooks.append(layer.register_forward_pre_hook(lambda _l, _i, n=name, s=stack: s.append(n)))
                hooks.append(layer.register_forward_post_hook(lambda _l, _i, _o, s=stack: s.pop() and None))
            debugging.enable_tensor_checker(debugging.TensorCheckerConfig(
                enable=True, debug_mode=debugging.DebugMode.CHECK_NAN_INF_AND_ABORT))
            try:
                model(x)
                op = "none"
            except Exception as exc:  # noqa: BLE001 - the checker's abort
                op = re.search(r"op=([A-Za-z0-9_]+)", str(exc)).group(1)
            finally:
                debugging.disable_tensor_checker()
                for h in hooks:
                    h.remove()
            return step, norms, op, stack[-1] if stack else None
        loss.backward()
        norms.append(math.sqrt(sum(float((p.grad.astype("float64") ** 2).sum()) for p in model.parameters())))
        opt.step()
        opt.clear_grad()
    raise AssertionError("the plain loop never went NaN")


def test_transformer_lr_divergence_reports_where_the_growth_began():
    step, norms, op, layer = _plain_loop_divergence(SAMPLES / "transformer_lr_divergence")
    assert (step, op, layer) == (5, "exp", "blocks.0.attn")
    assert norms[3] / norms[2] > 2 and norms[4] / norms[2] > 4 and norms[2] < min(norms[:2])  # began at 2
    report = _sample_report("transformer_lr_divergence")
    ff = report.first_fault
    assert (ff.step, ff.op, ff.layer) == (step, op, layer)
    assert [round(p.grad_norm, 3) for p in report.timeline[:step]] == [round(n, 3) for n in norms]
    [g] = [f for f in report.findings if f.code.value == "grad.explosion"]
    assert g.location.step == 2 and g.evidence["step_now"] == 4 and g.evidence["learning_rate"] == 1.0
    assert 4 < g.evidence["growth"] < 4.3  # 3.71 -> 15.4, as the plain loop measured
    clip = g.evidence["clip_threshold"]
    assert 5 < clip < 15 and f"global_norm: {clip:.3g}" in g.advice[0]
    assert "learning rate (1 at step 2)" in g.advice[1]
    [symptom] = [f for f in report.findings if f.code.value == "activation.nonfinite"]
    assert symptom.evidence["causes"] == ["grad.explosion"] and "Likely cause" in symptom.message


def test_bad_init_overflow_carries_its_cause():
    report = _sample_report("bad_init_overflow")
    assert report.first_fault.step == 0 and report.first_fault.op == "exp"
    inits = [f for f in report.findings if f.code.value == "param.init_scale"]
    assert inits and all(f.severity.value == "warning" and f.evidence["ratio"] > 8 for f in inits)
    assert {f.location.parameter for f in inits} <= {"body.0.weight", "body.2.weight", "log_rate.weight"}
    [symptom] = [f for f in report.findings if f.code.value == "activation.nonfinite"]
    assert symptom.evidence["causes"] == ["param.init_scale"] and "fan-in" in symptom.message


def test_nan_row_in_a_many_tensor_model_is_not_blamed_on_an_update(tmp_path, monkeypatch):
    """Above the small-model limit the parameter check runs only on stats steps; the NaN row that was there
    before training must still be named as read at its step, not as written by an earlier update."""
    from nandoctor.engine.loop import StatsSchedule

    monkeypatch.setattr(StatsSchedule, "want", lambda self, step: step == 0)  # as if stats were costly
    report = probe(tmp_path, model="deep_token_model", model_args={"nan_row": 25}, data="token_loader",
                   data_args={"batches": 8, "long_batch": -1, "bad_id_batch": 5, "bad_id_row": 2}, steps=8)
    ff = report.first_fault
    assert (ff.step, ff.phase, ff.layer, ff.parameter, ff.sample_indices) == (5, Phase.FORWARD, "tok",
                                                                              "tok.weight", [2])
    assert "update.nonfinite" not in codes(report)


def test_frozen_nan_parameter_in_a_many_tensor_model_is_not_blamed_on_an_update(tmp_path, monkeypatch):
    from nandoctor.engine.loop import StatsSchedule

    monkeypatch.setattr(StatsSchedule, "want", lambda self, step: step == 0)
    report = probe(tmp_path, model="deep_token_model", model_args={"nan_row": 25, "frozen": True},
                   data="token_loader", data_args={"batches": 6, "long_batch": -1}, steps=6)
    assert len(report.timeline) == 6 and report.first_fault is None
    assert codes(report) == {"param.nonfinite"} and codes(report, "warning") == {"param.nonfinite"}


def test_parameter_left_out_of_the_optimizer_groups_counts_as_frozen():
    import paddle

    from nandoctor.diagnosis.nan_params import inspect

    model = paddle.nn.Sequential(paddle.nn.Linear(4, 4), paddle.nn.Linear(4, 2))
    model[1].bias.set_value(np.array([np.nan, 0.0], dtype="float32"))
    model[0].bias.set_value(np.array([np.nan, 0.0, 0.0, 0.0], dtype="float32"))
    groups = [{"params": [model[0].weight, model[0].bias]}, {"params": [model[1].weight], "learning_rate": 0.1}]
    opt = paddle.optimizer.Adam(learning_rate=0.01, parameters=groups)
    bad = {b.name: b for b in inspect(model, opt, ["0.bias", "1.bias"])}
    assert not bad["0.bias"].frozen and bad["1.bias"].frozen
    assert bad["0.bias"].facts.rows == [0] and not bad["0.bias"].stops_training


def test_tied_table_read_through_the_output_projection_is_tied_to_the_fault(tmp_path):
    """No batch holds the bad id, but the tied output projection reads every row: step 0, layer proj."""
    report = probe(tmp_path, model="tied_token_model", data="token_loader",
                   data_args={"batches": 4, "long_batch": -1}, steps=4)
    ff = report.first_fault
    [p] = [f for f in report.findings if f.code.value == "param.nonfinite"]
    assert ff.step == 0 and ff.parameter == "tok.weight", ff
    assert p.evidence["first_read_step"] == 0 and "First read at step 0" in p.message
    assert "tied weights" in p.message and ff.layer == "out"


def test_nan_batchnorm_statistics_do_not_stop_training_but_are_reported(tmp_path):
    """Train-mode batch norm reads batch statistics, not the running ones: training is fine, eval is not."""
    report = probe(tmp_path, model="bn_classifier", steps=5)
    assert len(report.timeline) == 5 and codes(report) == {"param.nonfinite"}
    [p] = report.findings
    assert p.location.parameter == "1._variance" and p.evidence["buffer"] and p.evidence["wholly_nonfinite"]
    assert "batch-norm running statistics" in p.message and "model.eval()" in p.message
    assert p.severity.value == "error"
    assert report.first_fault.phase == Phase.PARAMS


def test_advice_follows_the_cause_found_not_the_ops_generic_advice():
    """lr_divergence (plain loop: the norm grows for steps, every sample alone overflows at step 16): the
    first advice is the learning rate in use, not the matmul's "check the initialisation". embedding_nan_row
    (plain loop: samples 3 and 6 read the NaN row of token 37 at step 7): the op only read a NaN parameter,
    so nothing about overflow is advised."""
    report = _sample_report("lr_divergence")
    [symptom] = [f for f in report.findings if f.code.value == "activation.nonfinite"]
    assert symptom.location.op == "matmul" and symptom.evidence["causes"][0] == "grad.explosion"
    advice = _own_advice(symptom)
    assert advice[0].startswith("The fault follows from the step size") and \
        "learning rate (0.03 at step" in advice[0], advice
    assert "global_norm" in advice[1]
    report = _sample_report("embedding_nan_row")
    [symptom] = [f for f in report.findings if f.code.value == "activation.nonfinite"]
    assert symptom.evidence["causes"] == ["param.nonfinite"]
    advice = _own_advice(symptom)
    assert advice[0].startswith("Nothing overflowed here: the op read embed.weight"), advice
    assert not any("overflow" in a and "Nothing" not in a for a in advice)


def _own_advice(finding) -> list[str]:
    """The diagnosis' advice, without the remedy replays' outcome lines put in front of it."""
    return [a for a in finding.advice if "by replay" not in a]


@pytest.mark.parametrize(("lr", "words"), [
    (1e3, ["(1000 now) is far beyond any usual value", "If 1e-3 was meant", "minus sign"]),
    (5.0, ["(5 now) is far beyond any usual value", "e.g. 1e-3"]),
    (0.3, ["(0.3 now) by about 10x (to 0.03 or less)"]),
    (0.01, ["(0.01 now) by 3-10x"]),
    (None, ["by 3-10x"]),
])
def test_learning_rate_advice_is_scaled_to_the_rate_in_use(lr, words):
    from nandoctor.advice import advice_for

    advice = advice_for("grad.explosion", clip_norm=5.0, learning_rate=lr, lr_step=None, typical_norm=3.0)
    text = " ".join(advice)
    assert all(w in text for w in words), advice
    # a rate beyond any usual value comes first: clipping would only hide it
    assert ("far beyond" in advice[0]) == (lr is not None and lr > 1)


_SILU_MLP = """
import numpy as np
import paddle
from paddle import nn


def model():
    paddle.seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Silu(), nn.Linear(64, 64), nn.Silu(), nn.Linear(64, 10))


def data():
    rng = np.random.default_rng(0)
    return [{"x": rng.normal(size=(8, 16)).astype("float32"), "label": rng.integers(0, 10, size=(8,)).astype("int64")}
            for _ in range(10)]
"""


def test_a_one_step_loss_jump_at_a_huge_learning_rate_is_named_as_the_cause(tmp_path):
    """b3 of the real-model report in small: SGD at lr 1e3 (1e-3 meant) on Linear-SiLU layers. A plain
    loop (same model, data and seed, no nandoctor) measured: step 0 loss 2.313, gradients finite; step 1
    loss 64.0 (finite, cross_entropy's clamp) and NaN gradients (silu_grad at inputs near 1e38). With one
    step of history there is no grad.explosion: the loss jump and the learning rate are the cause, and the
    advice must say so first, not "an op with an infinite derivative (sqrt, log...)"."""
    import yaml

    (tmp_path / "silu_mlp.py").write_text(_SILU_MLP, encoding="utf-8")
    spec = {"version": 1, "model": {"entry": "silu_mlp.py:model"},
            "data": {"entry": "silu_mlp.py:data", "fields": ["x", "label"], "label": "label"},
            "loss": {"builtin": "cross_entropy"}, "optimizer": {"name": "SGD", "args": {"learning_rate": 1000.0}}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    report = run_probe(load_spec(tmp_path / "config.yaml"), ProbeOptions(steps=5, seed=0, device="cpu",
                                                                          try_fixes=False))
    ff = report.first_fault
    assert (ff.step, ff.phase.value) == (1, "backward"), ff
    assert [round(p.loss, 3) for p in report.timeline[:2]] == [2.313, 64.0]
    [symptom] = [f for f in report.findings if f.code.value == "grad.nonfinite"]
    assert symptom.evidence["causes"] == ["loss.jump"] and "the loss jumped 27.7x in one update" in symptom.message
    assert symptom.advice[0].startswith("The fault follows from the step size"), symptom.advice
    assert "(1000) is far beyond any usual value" in symptom.advice[0] and "If 1e-3 was meant" in symptom.advice[0]
    assert not any("infinite derivative" in a for a in symptom.advice)
