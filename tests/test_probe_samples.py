"""Every probe sample config through the real CLI (`nandoctor probe CONFIG --json PATH`), vs. ground truth.

The expectations below were measured without nandoctor: a plain Paddle loop over each sample's own model,
data, loss and optimizer, with per-layer forward hooks, per-step gradient and parameter checks, a replay
of the failing step under Paddle's tensor checker (CHECK_NAN_INF_AND_ABORT) for the op, and a replay of
each sample of the failing batch alone for the sample indices. Each config.yaml's comment says the same
in words. Each probe runs once per module (a cache), so the file costs one short probe per sample.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from nandoctor.cli import app

SAMPLES = Path(__file__).resolve().parent.parent / "sample_configs"


class _Any:
    """A first_fault value the ground truth does not pin down (say, which samples, when all of them fail)."""

    def __repr__(self) -> str:
        return "ANY"


ANY: Any = _Any()
FAULT_KEYS = ("step", "phase", "layer", "op", "parameter", "batch_index", "sample_indices")


@dataclass
class Expect:
    verdict: str
    exit_code: int
    # first_fault: the exact dict, None for no fault; a value may be ANY or a frozenset of accepted values
    fault: dict[str, Any] | None
    # error and warning codes that must all be present; any other error/warning code fails the test
    codes: set[str]
    # error/warning codes that may also appear (true, but not what the sample is about)
    allowed: set[str] = field(default_factory=set)
    # info codes that must be present (other info codes are ignored)
    info: set[str] = field(default_factory=set)
    # code -> location fields its finding must have
    where: dict[str, dict[str, Any]] = field(default_factory=dict)
    # warning codes that must be reported at a step before first_fault.step
    before_fault: set[str] = field(default_factory=set)


def fault(step: int | None, phase: Any, layer: Any = None, op: Any = None, parameter: Any = None,
          batch_index: Any = None, sample_indices: Any = None) -> dict[str, Any]:
    return dict(zip(FAULT_KEYS, (step, phase, layer, op, parameter, batch_index, sample_indices)))


NAN = "nan_found"
ENCODER_PARAMS = frozenset({None, "encoder.0.weight", "encoder.0.bias", "encoder.2.weight", "encoder.2.bias"})
EXPECTED: dict[str, Expect] = {
    # loss: log(1 - sigmoid(z)) = -inf for the two samples whose feature was in the wrong unit
    "log_of_zero": Expect(NAN, 1, fault(12, "loss", None, "log", None, 12, [3, 11]), {"loss.nonfinite"}),
    # 0/0 in a masked mean pool for the two all-padding sequences
    "div_by_zero_layer": Expect(NAN, 1, fault(9, "forward", "pool", "divide", None, 9, [2, 5]),
                                {"activation.nonfinite"}),
    # forward finite; sqrt'(0) = inf for the duplicate pair. Every encoder gradient turns NaN, so the
    # parameter named (if any; the contract's own example leaves it null) must be one of them.
    "sqrt_at_zero": Expect(NAN, 1, fault(6, "backward", "head.distance", "sqrt_grad", ENCODER_PARAMS, 6, [3]),
                           {"grad.nonfinite"}),
    "exp_overflow": Expect(NAN, 1, fault(8, "forward", "head.softmax", "exp", None, 8, [1, 4]),
                           {"activation.nonfinite"}),
    "neg_fractional_pow": Expect(NAN, 1, fault(5, "forward", "features.compress", "pow", None, 5, [0, 4]),
                                 {"activation.nonfinite"}),
    # the forward log's -inf is discarded by where(); the first NaN that reaches training is log_grad's
    # (only features.logfeat.scale gets a NaN gradient, if the probe names a parameter)
    "masked_where_grad": Expect(NAN, 1, fault(7, "backward", "features.logfeat", "log_grad",
                                              frozenset({None, "features.logfeat.scale"}), 7, [2, 6]),
                                {"grad.nonfinite"}),
    # the whole batch has no labelled token: no subset of samples is to blame
    "empty_mask_mean": Expect(NAN, 1, fault(4, "loss", None, "divide", None, 4, []), {"loss.nonfinite"}),
    # weights diverge: every sample alone overflows too, so it is the batch as a whole (empty)
    "lr_divergence": Expect(NAN, 1, fault(16, "forward", "out", "matmul", None, 16, []),
                            {"activation.nonfinite", "grad.explosion"}, before_fault={"grad.explosion"}),
    # targets around 3000 under MSE: the squared error overflows at step 8 at the end of a growth (plain loop:
    # the first non-finite loss at step 8; tests/test_advice_truth.py); which samples overflow alone: ANY
    "target_scale_divergence": Expect(NAN, 1, fault(8, "loss", None, "square", None, 8, ANY),
                                      {"loss.nonfinite", "grad.explosion"}, before_fault={"grad.explosion"}),
    # a NaN pixel, images[2, 0, 4, 7] of batch 3 (NCHW): the data check stops the step before the update
    "nan_in_images": Expect(NAN, 1, fault(3, "data", None, None, None, 3, [2]), {"data.nonfinite"},
                            where={"data.nonfinite": {"field": "image"}}),
    "exploding_rnn": Expect(NAN, 1, fault(14, "forward", "rnn", "rnn_intermediate", None, 14, []),
                            {"activation.nonfinite", "grad.explosion"}, before_fault={"grad.explosion"}),
    # the probe runs the init-scale check before training, so the cause comes with the symptom
    "bad_init_overflow": Expect(NAN, 1, fault(0, "forward", "rate", "exp", None, 0, [5]),
                                {"activation.nonfinite", "param.init_scale"}),
    # SGD at lr 1.0: a plain loop's gradient norm is 4.71, 7.07, 3.71, 9.53, 15.4 (steps 0-4), then step 5's
    # loss is NaN for every sample alone; the checker names exp in blocks.0.attn (the hand-written softmax)
    "transformer_lr_divergence": Expect(NAN, 1, fault(5, "forward", "blocks.0.attn", "exp", None, 5, []),
                                        {"activation.nonfinite", "grad.explosion"},
                                        where={"grad.explosion": {"step": 2}}, before_fault={"grad.explosion"}),
    # Adam with epsilon 0: 0/0 in the update of the weight row fed by an always-zero input channel
    "nonfinite_update": Expect(NAN, 1, fault(0, "optimizer", frozenset({None, "encoder.0"}),
                                             frozenset({"adam_", "adam"}), "encoder.0.weight", 0, None),
                               {"update.nonfinite"},
                               where={"update.nonfinite": {"parameter": "encoder.0.weight"}}),
    # one NaN in a LayerNorm scale (not the whole tensor): the probe trains on, and step 0's forward reads it
    # (plain loop: step 0's loss is NaN for every sample alone; the checker names layer_norm_intermediate)
    "nan_parameter": Expect(NAN, 1, fault(0, "forward", "encoder.norm", "layer_norm_intermediate",
                                          "encoder.norm.weight", 0, []),
                            {"param.nonfinite", "activation.nonfinite"},
                            where={"param.nonfinite": {"parameter": "encoder.norm.weight", "phase": "params"}}),
    # one NaN row (token 37) of an embedding table: a plain loop's loss is first NaN at step 7, whose samples
    # 3 and 6 (the only ones holding token 37) are NaN alone; the checker names op embedding
    "embedding_nan_row": Expect(NAN, 1, fault(7, "forward", "embed", "embedding", "embed.weight", 7, [3, 6]),
                                {"param.nonfinite", "activation.nonfinite"},
                                where={"param.nonfinite": {"parameter": "embed.weight", "phase": "params"}}),
    "crash_in_user_code": Expect("crashed", 1, fault(6, "forward", "encoder", None, None, 6, None),
                                 {"user_code.error"}),
    "fp16_overflow_risk": Expect("at_risk", 0, None, {"precision.fp16_overflow"}, info={"amp.inactive"},
                                 where={"precision.fp16_overflow": {"layer": "spectrum.energy"}}),
    # the CPU crash in cross_entropy, translated; the raw user_code.error may come along
    "label_crash": Expect("crashed", 1, fault(3, frozenset({"data", "loss"}), ANY, ANY, None, 3, [5]),
                          {"data.label_range"}, allowed={"user_code.error"}),
    # Masked attention. The plain loop's checker log (CHECK_NAN_INF) shows the masks' intended -inf first
    # (full/full_like, triu, where, add, max: Inf only); the first op with a NaN is the fault, in the first
    # layer whose output holds NaN while its inputs do not; each faulty sample alone faults too.
    # nn.TransformerEncoder, two empty sequences (all keys masked), rows of width 6: F.softmax gives NaN
    "masked_attention": Expect(NAN, 1, fault(9, "forward", "encoder.layers.0.self_attn", "softmax", None, 9, [2, 7]),
                               {"activation.nonfinite"}),
    # hand-written causal decoder, left padding: a padded query's row is all -inf, scores - rowmax = NaN;
    # the loss stays finite (ignored labels), the gradients do not
    "causal_padding_decoder": Expect(NAN, 1, fault(5, "forward", "blocks.0.attn", "subtract", None, 5, [1, 6]),
                                     {"activation.nonfinite"}),
    # Llama-style decoder, mask filled with -inf, left padding: the same NaN in the eager softmax
    "llama_masked_row": Expect(NAN, 1, fault(3, "forward", "layers.0.self_attn", "subtract", None, 3, [0, 4]),
                               {"activation.nonfinite"}),
    # Backward faults in branched layers: the checker on backward only aborts at sqrt_grad; the stack Paddle
    # prints for it runs through the act sublayer's forward (x * sqrt(clip(x, min=0)) at an all-zero row).
    # The gradient hooks alone name up_proj (its input, shared with gate_proj, gets the NaN gradient too).
    "gated_mlp_backward": Expect(NAN, 1, fault(6, "backward", "mlp.act_fn", "sqrt_grad", ANY, 6, [3]),
                                 {"grad.nonfinite"}),
    # two residual blocks, both fed the zero rows; backward meets blocks.1's act first
    "gated_mlp_backward/residual": Expect(NAN, 1, fault(4, "backward", "blocks.1.mlp.act_fn", "sqrt_grad", ANY, 4,
                                                        [2, 5]), {"grad.nonfinite"}),
    # log(0) = -inf on two all-zero records, then -inf * 0 = NaN: the checker in abort mode stops at log
    # (tests/test_attribution_truth.py measures it, with the layer and samples)
    "log_inf_before_nan": Expect(NAN, 1, fault(4, "forward", "scale", "log", None, 4, [2, 5]),
                                 {"activation.nonfinite"}),
    # sqrt of a negative total in the root model's own forward; head, called by keyword, only carries it
    "root_forward_sqrt": Expect(NAN, 1, fault(5, "forward", None, "sqrt", None, 5, [6]), {"activation.nonfinite"}),
    # sqrt at a duplicate pair in the root's own forward: the backward's sqrt_grad, not head.proj's
    "root_forward_sqrt/backward": Expect(NAN, 1, fault(3, "backward", None, "sqrt_grad",
                                                       frozenset({None, "encoder.0.bias", "encoder.0.weight"}), 3,
                                                       [2]), {"grad.nonfinite"}),
    # a steady divergence overflows the loss's sum: no strict subset of the batch is special
    "whole_batch_overflow": Expect(NAN, 1, fault(17, "loss", None, "mean", None, 17, []),
                                   {"loss.nonfinite", "grad.explosion"}, before_fault={"grad.explosion"},
                                   where={"grad.explosion": {"step": 0}}),
    # the remedy-truth samples (tests/test_remedy_truth.py checks their remedies against plain loops)
    # log_of_zero's bug read from a stream that never yields the same records again
    "stream_loader": Expect(NAN, 1, fault(12, "loss", None, "log", None, 12, [3, 11]), {"loss.nonfinite"}),
    # record 37 (x1000) in a shuffled map-style dataset: first -inf in epoch 2, batch 4, sample 14
    "bad_record_epochs": Expect(NAN, 1, fault(16, "loss", None, "log", None, 4, [14]), {"loss.nonfinite"}),
    # a VAE's std = exp(0.5 * logvar) overflows for the one x1000 sample
    "vae_exp": Expect(NAN, 1, fault(10, "forward", ANY, "exp", None, 10, [3]), {"activation.nonfinite"}),
    # sqrt_at_zero trained with LBFGS.step(closure)
    "lbfgs_closure": Expect(NAN, 1, fault(6, "backward", "head.distance", "sqrt_grad", ENCODER_PARAMS, 6, [3]),
                            {"grad.nonfinite"}, allowed={"grad.explosion"}),
}
# healthy_mlp and healthy_cnn are the scan helper's; they have no probe defaults, hence the step count
HEALTHY_STEPS = {"healthy_rnn": None, "healthy_transformer": None, "healthy_mlp": 30, "healthy_cnn": 30,
                 # masks full of intended -inf (and, for llama_masked_row/healthy, fully masked rows filled with
                 # finfo.min): the plain loop saw finite losses and gradients on every step
                 "masked_attention/healthy": None, "causal_padding_decoder/healthy": None,
                 "llama_masked_row/healthy": None}


def config_of(name: str) -> Path:
    """A sample's spec: "folder" is folder/config.yaml; "folder/variant" is folder/variant.yaml, a second
    config over the same model and data (a healthy twin, another setting)."""
    return SAMPLES / (f"{name}.yaml" if "/" in name else f"{name}/config.yaml")


HEALTHY = sorted(n for n in HEALTHY_STEPS if config_of(n).is_file())


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory):
    """probe(name) -> (exit status, JSON report); each sample is probed once per module."""
    cache: dict[str, tuple[int, dict[str, Any]]] = {}
    folder = tmp_path_factory.mktemp("probe_samples")

    def run(name: str) -> tuple[int, dict[str, Any]]:
        if name not in cache:
            out = folder / f"{name.replace('/', '__')}.json"
            args = ["probe", str(config_of(name)), "--json", str(out)]
            if HEALTHY_STEPS.get(name):
                args += ["--steps", str(HEALTHY_STEPS[name])]
            result = CliRunner().invoke(app, args)
            assert out.is_file(), f"no JSON report written (exit {result.exit_code}):\n{result.output}"
            cache[name] = (result.exit_code, json.loads(out.read_text(encoding="utf-8")))
        return cache[name]

    return run


def _matches(actual: Any, expected: Any) -> bool:
    if expected is ANY:
        return True
    if isinstance(expected, frozenset):
        return actual in expected
    return actual == expected


def test_every_sample_folder_has_an_expectation():
    """A new probe sample without a row here would go untested; scan samples live in test_scan_samples."""
    from test_scan_samples import EXPECTED as SCAN_EXPECTED
    from test_spec_samples import TESTED_HERE as SPEC_SAMPLES

    folders = {p.parent.name for p in SAMPLES.glob("*/config.yaml")}
    untested = folders - set(EXPECTED) - set(HEALTHY) - set(SCAN_EXPECTED) - {"healthy_mlp", "healthy_cnn"}
    untested -= SPEC_SAMPLES
    variants = {f"{p.parent.name}/{p.stem}" for p in SAMPLES.glob("*/*.yaml") if p.name != "config.yaml"}
    untested |= {v for v in variants - set(EXPECTED) - set(HEALTHY) if v.split("/")[0] not in SPEC_SAMPLES}
    assert not untested, f"sample configs with no expectation: {sorted(untested)}"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_first_fault(name, probe):
    exp = EXPECTED[name]
    _, report = probe(name)
    ff = report["first_fault"]
    if exp.fault is None:
        assert ff is None, ff
        return
    assert ff is not None, f"no first_fault; findings: {[f['code'] for f in report['findings']]}"
    wrong = {k: (ff.get(k), v) for k, v in exp.fault.items() if not _matches(ff.get(k), v)}
    assert not wrong, f"first_fault fields (got, expected): {wrong}; first_fault = {ff}"


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_verdict_exit_status_and_codes(name, probe):
    exp = EXPECTED[name]
    status, report = probe(name)
    assert report["command"] == "probe"
    serious = {f["code"] for f in report["findings"] if f["severity"] in ("error", "warning")}
    info = {f["code"] for f in report["findings"] if f["severity"] == "info"}
    assert exp.codes <= serious, f"missing {exp.codes - serious}; got {sorted(serious)}"
    assert serious <= exp.codes | exp.allowed, f"unexpected {serious - exp.codes - exp.allowed}"
    assert exp.info <= info, f"missing info {exp.info - info}; got {sorted(info)}"
    assert (report["verdict"], status) == (exp.verdict, exp.exit_code)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_findings_say_where_and_what_to_do(name, probe):
    """The fault's finding carries the first_fault location; every finding has a message and advice."""
    exp = EXPECTED[name]
    _, report = probe(name)
    for f in report["findings"]:
        if f["severity"] in ("error", "warning"):
            assert f["message"] and f["advice"], f
    for code, fields in exp.where.items():
        locs = [f["location"] for f in report["findings"] if f["code"] == code]
        assert any(all(_matches(loc.get(k), v) for k, v in fields.items()) for loc in locs), (code, locs)
    ff = report["first_fault"]
    if ff is not None and ff["phase"] not in ("data",):
        steps = {(f["location"]["step"], f["location"]["phase"]) for f in report["findings"]
                 if f["severity"] == "error" and f["code"] in exp.codes}
        assert (ff["step"], ff["phase"]) in steps, f"no error finding at the first fault {ff}: {steps}"


@pytest.mark.parametrize("name", sorted(n for n, e in EXPECTED.items() if e.before_fault))
def test_warning_comes_before_the_fault(name, probe):
    _, report = probe(name)
    fault_step = report["first_fault"]["step"]
    for code in EXPECTED[name].before_fault:
        steps = [f["location"]["step"] for f in report["findings"] if f["code"] == code]
        assert any(s is not None and s < fault_step for s in steps), (code, steps, fault_step)


@pytest.mark.parametrize("name", HEALTHY)
def test_healthy_sample_is_clean(name, probe):
    status, report = probe(name)
    serious = [(f["code"], f["message"]) for f in report["findings"] if f["severity"] in ("error", "warning")]
    assert serious == [] and report["first_fault"] is None
    assert (report["verdict"], status) == ("healthy", 0)
    assert len(report["timeline"]) >= 10  # it really trained


def test_crash_names_the_users_line(probe):
    """The crash sample's user_code.error points at the reshape in model.py (line 19), where the fix goes."""
    _, report = probe("crash_in_user_code")
    [f] = [f for f in report["findings"] if f["code"] == "user_code.error"]
    assert "model.py:19" in f["message"] + json.dumps(f["evidence"]), f


@pytest.mark.parametrize(("name", "batch"), [("lr_divergence", 16), ("empty_mask_mean", 4)])
def test_every_sample_faulting_alone_is_said_as_such(name, batch, probe):
    """Ground truth (the plain loop, each sample alone): every sample of the failing batch faults on its
    own. sample_indices is empty (all positions would name no sample and make "leave these samples out"
    drop the batch); the message and `samples_scope` say which case was measured."""
    _, report = probe(name)
    assert report["first_fault"]["sample_indices"] == []
    [f] = [f for f in report["findings"] if f["severity"] == "error" and f["location"]["step"] == batch]
    assert f"every sample of batch {batch} faults on its own" in f["message"], f["message"]
    assert "no subset" not in f["message"] and "as a whole" not in f["message"]
    assert f["evidence"]["samples_scope"] == "not_sample_specific"
    assert f["evidence"]["samples_reason"] == "every_sample" and "not sample-specific" in f["message"].lower()


def test_samples_named_when_a_strict_subset_faults(probe):
    _, report = probe("div_by_zero_layer")
    [f] = [f for f in report["findings"] if f["code"] == "activation.nonfinite"]
    assert f["evidence"]["samples_scope"] == "samples" and "sample(s) 2, 5 of batch 9" in f["message"]
