"""qk-layernorm verified by replay (issue 35, item 3): the query and key projections a model exposes are found
(a fused qkv Linear, nn.MultiHeadAttention's q_proj/k_proj), their outputs layer-normed per head by forward
hooks in the replay, and the verdict judged as every remedy's.

Ground truth from outside nandoctor: the same decoder (tests/precursor_models.py, its attention softmax written
by hand, so the attention logits' growth under a warmup to a 10x peak rate ends in an exp overflow) trained by
a plain AdamW loop that switches qk-layernorm on in the model's own code at the replay's start step
(run_truth.changed_from); nn.MultiHeadAttention's output against q and k normalised by hand in float64.
"""

from __future__ import annotations

import math

import numpy as np
import paddle
import precursor_models as pm
import pytest
from run_truth import changed_from
from test_precursors import WARMUP, probe

from nandoctor.engine.model_changes import changed_model, qk_normed
from nandoctor.remedies.qk_sites import qk_sites

PEAK, STEPS = 0.2, 40


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory):
    return probe(tmp_path_factory.mktemp("qk"), peak=PEAK, steps=STEPS, softmax="exp")


def _plain(start: int | None, steps: int) -> tuple[list[float], int | None]:
    """The plain loop, seeded as the probe seeds; qk-layernorm on in the model's code from `start` (None: never)."""
    paddle.seed(0)
    np.random.seed(0)
    model = pm.gpt(softmax="exp")
    return changed_from(model, pm.tokens(steps), pm.cross_entropy, peak_lr=PEAK, warmup=WARMUP,
                        start=start if start is not None else steps, change=lambda: pm.plain_qk_norm(model))


def test_qk_norm_is_verified_where_a_plain_loop_with_it_stays_finite(report) -> None:
    """The hand-written softmax overflows as the attention logits grow; qk-layernorm on the fused qkv outputs,
    replayed from the fault's state (no growth warning came before it: the monitors cannot see a softmax
    written by hand), is fixed, as the plain loop with qk-layernorm in its code from that step shows."""
    unchanged, fault = _plain(None, STEPS)
    assert fault is not None and report.first_fault is not None
    assert abs(report.first_fault.step - fault) <= 2 and report.first_fault.layer.endswith(".attn")
    row = next(r for r in report.remedies if r["remedy"] == "qk_norm")
    start = row["start_step"]
    assert start <= report.first_fault.step
    truth, truth_fault = _plain(start, report.first_fault.step + 20)
    hi = max(unchanged[:fault])
    assert truth_fault is None and all(math.isfinite(v) and v <= hi for v in truth)
    assert row["outcome"] == "fixed", row
    assert abs(row["loss_after"] - sum(truth[-3:]) / 3) < 0.05 * hi, (row["loss_after"], truth[-3:])
    assert row["qk_norm"]["layers"] == ["blocks.0.attn", "blocks.1.attn"]
    assert row["qk_norm"]["projections"][0] == {"layer": "blocks.0.attn.qkv", "heads": 4, "parts": [[0, 32], [32, 64]]}
    assert "F.layer_norm(q, 8), F.layer_norm(k, 8)" in row["change"] and "blocks.0.attn.qkv" in row["change"]


def test_the_fused_hooks_are_the_models_own_qk_norm() -> None:
    """The replay's hooks on the fused qkv projection give the output the model's own qk-layernorm code gives."""
    paddle.seed(0)
    model = pm.gpt()
    ids = paddle.to_tensor(pm.tokens(1)[0][0])
    sites = qk_sites(model, ["blocks.0.attn"])
    assert not sites.unknown and sites.fused
    with qk_normed(model, tuple(sites.projections)) as hits:
        hooked = model(ids).numpy()
    assert hits[0] == 2
    pm.plain_qk_norm(model)
    np.testing.assert_allclose(hooked, model(ids).numpy(), rtol=1e-5, atol=1e-5)
    pm.plain_qk_norm(model, False)
    assert not np.allclose(model(ids).numpy(), hooked, atol=1e-3)  # the hooks are gone


def test_multihead_attention_projections_are_normalised_per_head() -> None:
    """nn.MultiHeadAttention exposes q_proj and k_proj and num_heads: its output with the hooks is attention
    over q and k layer-normed per head, computed by hand in float64."""
    paddle.seed(0)
    mha = paddle.nn.MultiHeadAttention(16, 2)
    x = paddle.randn([3, 5, 16])
    sites = qk_sites(paddle.nn.Sequential(mha), ["0"])
    assert [(p.layer, p.heads, p.parts) for p in sites.projections] == [("0.q_proj", 2, ((0, 16),)),
                                                                       ("0.k_proj", 2, ((0, 16),))]
    model = paddle.nn.Sequential(mha)
    with qk_normed(model, tuple(sites.projections)):
        out = model(x).numpy().astype("float64")

    def heads(t: paddle.Tensor) -> np.ndarray:
        return t.numpy().astype("float64").reshape(3, 5, 2, 8).transpose(0, 2, 1, 3)

    def norm(a: np.ndarray) -> np.ndarray:
        return (a - a.mean(-1, keepdims=True)) / np.sqrt(a.var(-1, keepdims=True) + 1e-5)

    q, k, v = norm(heads(mha.q_proj(x))), norm(heads(mha.k_proj(x))), heads(mha.v_proj(x))
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(8)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ctx = (p @ v).transpose(0, 2, 1, 3).reshape(3, 5, 16)
    w, b = mha.out_proj.weight.numpy().astype("float64"), mha.out_proj.bias.numpy().astype("float64")
    np.testing.assert_allclose(out, ctx @ w + b, rtol=1e-4, atol=1e-5)


def test_attention_whose_projections_cannot_be_identified_is_said() -> None:
    """A fused qkv without a head count cannot be split into heads: the layer is named with the reason."""

    class NoHeads(paddle.nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = paddle.nn.Linear(8, 24)

        def forward(self, x):
            return self.qkv(x)

    sites = qk_sites(paddle.nn.Sequential(NoHeads()), ["0"])
    assert not sites.projections and "names no head count" in sites.unknown["0"]


def test_the_bundle_says_it_cannot_replay_a_model_change() -> None:
    """reproduce.py replays one step; z_loss and qk_norm act over many steps: it says so, naming the outcome."""
    from nandoctor.standalone.reproduce import BundleError, replayable_remedy

    for name in ("z_loss", "qk_norm"):
        report = {"remedies": [{"remedy": name, "change": "...", "outcome": "fixed"}]}
        with pytest.raises(BundleError, match="acts over many steps"):
            replayable_remedy(report, name)


def test_the_model_changes_apply_from_their_start_step() -> None:
    """A replay restarts from the snapshot before the growth and changes the model from the step the growth
    began: before it, the forward and loss are the run's own; from it, qk-layernorm is on and the loss gains
    1e-4 * mean(logsumexp(head output)^2), the term computed here in float64 on the model's own qk-norm output."""
    paddle.seed(0)
    model = pm.gpt()
    ids, label = (paddle.to_tensor(a) for a in pm.tokens(1)[0])
    plain = model(ids).numpy()
    pm.plain_qk_norm(model)
    normed = model(ids).numpy().astype("float64")
    pm.plain_qk_norm(model, False)
    sites = qk_sites(model, [])
    with changed_model(model, ("head", 1e-4), tuple(sites.projections), from_step=3) as changes:
        changes.begin(2)
        out = model(ids)
        loss = pm.cross_entropy(out, label)
        assert changes.loss(loss) is loss and np.array_equal(out.numpy(), plain)
        changes.begin(3)
        out = model(ids)
        loss = pm.cross_entropy(out, label)
        total = float(changes.loss(loss))
    np.testing.assert_allclose(out.numpy(), normed, rtol=1e-5, atol=1e-5)
    m = normed.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(normed - m).sum(-1, keepdims=True)))[..., 0]
    assert total == pytest.approx(float(loss) + 1e-4 * (lse ** 2).mean(), rel=1e-6)
    assert np.array_equal(model(ids).numpy(), plain)  # every hook removed on exit


def _found(model: paddle.nn.Layer, growth_layers: list[str]):
    """What the candidates follow from, with an attention.logit_growth warning at step 5 naming `growth_layers`
    (the first as its layer) before a fault at step 20."""
    from types import SimpleNamespace

    from nandoctor.findings import Code, Finding, Location, Report, Severity
    from nandoctor.remedies.candidates import _ModelChanges

    growth = Finding(Code.ATTENTION_LOGIT_GROWTH, Severity.WARNING, "", Location(step=5, layer=growth_layers[0]),
                     {"layers": [{"layer": n} for n in growth_layers]}, [])
    report = Report(command="probe", findings=[growth])
    # the warnings up to the fault's step 20, the change from the growth's step 5 and the state before it
    return _ModelChanges(report, SimpleNamespace(model=model), 20, 5, "before-growth", None)


def test_an_attention_growth_offers_qk_norm_on_every_attention_layer_from_where_it_began() -> None:
    """After attention.logit_growth the qk_norm candidate changes every attention layer the model exposes
    (nn.TransformerEncoder's q_proj/k_proj), from the growth's step and the state before it; an attention
    that exposes no head count is a not-applicable row whose change is the code to write, with the reason."""
    from nandoctor.remedies.candidates import _qk_norm

    paddle.seed(0)
    enc = paddle.nn.TransformerEncoder(paddle.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0), 2)
    [cand] = _qk_norm(_found(enc, ["layers.1.self_attn"]))
    assert cand.why_not is None and cand.start == "before-growth" and cand.change.from_step == 5
    assert [p.layer for p in cand.change.qk_norm] == ["layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj",
                                                      "layers.1.self_attn.q_proj", "layers.1.self_attn.k_proj"]
    assert cand.extra["qk_norm"]["layers"] == ["layers.0.self_attn", "layers.1.self_attn"]

    class NoHeads(paddle.nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = paddle.nn.Linear(8, 24)

    [cand] = _qk_norm(_found(paddle.nn.Sequential(NoHeads()), ["0"]))
    assert cand.start is None and cand.why_not and not cand.change.qk_norm
    assert "F.layer_norm(q, head_dim)" in cand.change_text and "0: it names no head count" in cand.change_text
