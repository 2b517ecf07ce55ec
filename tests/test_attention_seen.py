"""Attention seen however the model computes its softmax (issue 35, item 1): Paddle's softmax under every name a
model's code gives it (imported by name before the monitor starts, an alias bound at import, `paddle.softmax`,
`Tensor.softmax`, `nn.Softmax`), and the fused kernels, whose logits are made again from q and k.

Ground truth: the same decoder (tests/precursor_models.py, `gpt(softmax=...)`), its attention logits computed
on the host in float64 from q and k, which a forward hook of the test takes from the QKV projection's output
(run_truth.qk_logits), for the same batch and weights. The kernels Paddle 3.3.1 does not build for the CPU
(`flash_attn_unpadded`, `fused_multi_head_attention`) are replaced by a CPU stand-in of the same signature:
what is checked there is the measurement from the kernel's arguments, not the kernel.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import paddle.incubate.nn.functional as IF
import paddle.nn.functional as F
import paddle.nn.functional.flash_attention as FA
import pytest
from paddle import _C_ops

from nandoctor.engine import attention_calls
from nandoctor.engine import precursor_rules as rules
from nandoctor.engine import precursors as pc

sys.path.insert(0, str(Path(__file__).resolve().parent))
import precursor_models as pm  # noqa: E402
from run_truth import causal_attention_stats, qk_logits  # noqa: E402

LAYERS = ["blocks.0.attn", "blocks.1.attn"]


@pytest.fixture(scope="module")
def ids() -> Any:
    return paddle.to_tensor(pm.tokens(1)[0][0])


def measured(model: Any, ids: Any) -> pc.PrecursorMonitor:
    """The first step's forward (which finds the layers) and the first sampled step's, read on the host."""
    mon = pc.PrecursorMonitor(model)
    for step in (0, pc.EVERY_ATTENTION):
        mon.begin(step)
        model(ids)
        mon.end()
    mon.read()
    return mon


def truth(model: Any, ids: Any, rows: int | None = None) -> dict[str, tuple[float, float]]:
    """Per attention layer, (largest logit, entropy) from q and k in float64: the QKV projection's output, or
    for the fused kernel, which takes the projection's weights instead, the attention layer's input times them.
    `rows`: the first sequences only (a kernel measured on those)."""
    found: dict[str, tuple[float, float]] = {}
    handles = []
    for name in LAYERS:
        attn = model.blocks[int(name.split(".")[1])].attn

        def hook(layer: Any, inputs: Any, name: str = name, attn: Any = attn) -> None:
            x = inputs[0].numpy().astype("float64")
            qkv = x @ attn.qkv.weight.numpy().astype("float64") + attn.qkv.bias.numpy().astype("float64")
            scores = qk_logits(qkv, attn.heads)
            found[name] = causal_attention_stats(scores if rows is None else scores[:rows], pc.ENTROPY_ROWS)

        handles.append(attn.register_forward_pre_hook(hook))
    try:
        model(ids)
    finally:
        for h in handles:
            h.remove()
    return found


def assert_matches(mon: pc.PrecursorMonitor, expected: dict[str, tuple[float, float]]) -> None:
    assert mon.attention == LAYERS
    for layer, (logit_max, entropy) in expected.items():
        assert mon.series[(rules.ATTN_MAX, layer)][0][1] == pytest.approx(logit_max, rel=1e-4)
        assert mon.series[(rules.ATTN_ENT, layer)][0][1] == pytest.approx(entropy, rel=1e-3)


def originals() -> dict[str, Any]:
    """What the interception replaces: each must be Paddle's (or the user's module's own) again after."""
    return {"C_ops.softmax": _C_ops.softmax, "F.sdpa": F.scaled_dot_product_attention,
            "FA.flash_attention": FA.flash_attention, "FA.flash_attn_unpadded": FA.flash_attn_unpadded,
            "IF.fused_multi_head_attention": IF.fused_multi_head_attention,
            "pm.sdpa": pm.scaled_dot_product_attention, "pm.flash_attention": pm.flash_attention,
            "pm.softmax_by_name": pm.softmax_by_name, "pm.SOFTMAX_ALIAS": pm.SOFTMAX_ALIAS}


@pytest.mark.parametrize("how", pm.SOFTMAX_WAYS + pm.KERNEL_WAYS)
def test_attention_is_seen_however_its_softmax_is_named(how: str, ids: Any) -> None:
    """Imported by name at the top of the model's file, bound to a module attribute at import, paddle.softmax,
    Tensor.softmax, nn.Softmax; scaled_dot_product_attention and flash_attention imported by name: each layer's
    logits and entropy are the plain computation's from q and k, and every original is back after."""
    before = originals()
    paddle.seed(0)
    model = pm.gpt(softmax=how)
    mon = measured(model, ids)
    assert originals() == before
    assert_matches(mon, truth(model, ids))
    how_measured = mon.measured["blocks.0.attn"]
    if how in pm.KERNEL_WAYS:
        assert "made again from q and k" in how_measured
        assert {"sdpa": "scaled_dot_product_attention", "flash": "flash_attention"}[how] in how_measured
    else:
        assert how_measured == "the softmax's input"
    assert mon.every == pc.EVERY_ATTENTION and mon.unseen() is None


def cpu_stand_in(real: Any, compute: Any) -> Any:
    """A function with `real`'s signature (inspect follows __wrapped__) that computes `compute(arguments)`."""
    signature = inspect.signature(real)

    @functools.wraps(real)
    def stand_in(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return compute(bound.arguments)

    return stand_in


def _attend(q: Any, k: Any, v: Any, scale: float, mask: Any) -> Any:
    return paddle.matmul(F.softmax(paddle.matmul(q, k, transpose_y=True) * scale + mask, axis=-1), v)


def _unpadded(a: dict[str, Any]) -> Any:
    cu = [int(c) for c in a["cu_seqlens_q"].numpy()]
    outs = []
    for i in range(len(cu) - 1):
        q, k, v = (a[n][cu[i]:cu[i + 1]].transpose([1, 0, 2]) for n in ("query", "key", "value"))
        t = q.shape[1]
        mask = paddle.to_tensor(np.triu(np.full((t, t), -1e9, dtype="float32"), 1))
        outs.append(_attend(q, k, v, a["scale"], mask).transpose([1, 0, 2]))
    return paddle.concat(outs), None


def _fused_mha(a: dict[str, Any]) -> Any:
    x, w = a["x"], a["qkv_weight"]
    qkv = paddle.einsum("bse,thde->tbhsd", x, w) + a["qkv_bias"].unsqueeze(1).unsqueeze(3)
    out = _attend(qkv[0], qkv[1], qkv[2], 1.0 / math.sqrt(w.shape[2]), a["attn_mask"])
    b, t, d = x.shape
    return paddle.matmul(out.transpose([0, 2, 1, 3]).reshape([b, t, d]), a["linear_weight"]) + a["linear_bias"]


@pytest.mark.parametrize("how", pm.GPU_KERNEL_WAYS)
def test_a_fused_kernels_logits_are_made_again_from_q_and_k(how: str, ids: Any,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """flash_attn_unpadded (its first sequences) and fused_multi_head_attention (from its input and QKV weight),
    each under a CPU stand-in: the logits and entropy the plain computation gives, and the evidence says how."""
    if how == "flash_unpadded":
        monkeypatch.setattr(FA, "flash_attn_unpadded", cpu_stand_in(FA.flash_attn_unpadded, _unpadded))
        rows = attention_calls.VARLEN_SEQUENCES
    else:
        stand_in = cpu_stand_in(IF.fused_multi_head_attention, _fused_mha)
        monkeypatch.setattr(IF, "fused_multi_head_attention", stand_in)
        monkeypatch.setattr(sys.modules["paddle.incubate.nn.functional.fused_transformer"],
                            "fused_multi_head_attention", stand_in)
        rows = None
    before = originals()
    paddle.seed(0)
    model = pm.gpt(softmax=how)
    mon = measured(model, ids)
    assert originals() == before
    assert_matches(mon, truth(model, ids, rows))
    assert {"flash_unpadded": "flash_attn_unpadded", "fused_mha": "fused_multi_head_attention"}[how] in \
        mon.measured["blocks.0.attn"]


def test_a_softmax_outside_a_sampled_step_is_paddles_own(ids: Any) -> None:
    """No cost between sampled steps: the interception exists only while a sampled step's forward runs."""
    before = originals()
    paddle.seed(0)
    model = pm.gpt(softmax="by_name")
    mon = pc.PrecursorMonitor(model)
    mon.begin(0)
    assert _C_ops.softmax is not before["C_ops.softmax"]
    model(ids)
    mon.end()
    assert originals() == before
    mon.begin(1)  # not a sampled step (every 4th once attention is seen): nothing is patched
    assert originals() == before
    model(ids)
    mon.end()
    mon.begin(4)
    model(ids)
    mon.end()
    mon.read()
    assert [s for s, _ in mon.series[(rules.ATTN_MAX, "blocks.0.attn")]] == [4]
