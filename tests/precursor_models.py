"""Small GPT-style decoders that blow up the way large ones do, for the precursor tests (issue 35).

Pre-LN blocks, a causal attention whose scores are made by their own sublayer (`attn.scores`, so a plain
loop's forward hook can record the attention logits the ground truth needs without any help from
nandoctor), AdamW with a linear warmup to a peak learning rate. Three ways to go wrong: a too-high peak
LR (attention logits grow and the entropy collapses), the same with qk-layernorm (the FC2 output grows
instead), and no final LayerNorm with a hand-written log(sum(exp(logits))) loss (log Z drifts until exp
overflows). The data are made here: every sequence steps through the vocabulary by a fixed stride from a
random start, so a healthy run learns it to a low loss.

`gpt(softmax=...)` makes the attention weights each way a model's code may (SOFTMAX_WAYS: Paddle's softmax
under the names this file imports before any monitor starts; KERNEL_WAYS, GPU_KERNEL_WAYS: fused kernels that
compute it inside), with the same weights and numbers, for tests/test_attention_seen.py.

Referenced from specs written by tests/test_precursors.py as "<this file>:<callable>".
"""

from __future__ import annotations

import math

import numpy as np
import paddle
import paddle.incubate.nn.functional as IF
import paddle.nn.functional as F
import paddle.nn.functional.flash_attention as FA
from paddle import nn
from paddle.nn.functional import scaled_dot_product_attention
from paddle.nn.functional import softmax as softmax_by_name
from paddle.nn.functional.flash_attention import flash_attention

SOFTMAX_ALIAS = F.softmax  # bound when the module is imported, before any monitor starts
# How the attention weights are made (`gpt(softmax=...)`): Paddle's softmax under every name a model's code
# uses, and the fused kernels, which compute theirs inside from q and k
SOFTMAX_WAYS = ("F", "by_name", "alias", "paddle", "tensor", "layer")
KERNEL_WAYS = ("sdpa", "flash")  # run on this CPU (a math path there)
GPU_KERNEL_WAYS = ("flash_unpadded", "fused_mha")  # no CPU kernel in Paddle 3.3.1

VOCAB = 64
SEQ = 16


class Scores(nn.Layer):
    """q k^T / sqrt(d): the attention logits, as their own layer's output."""

    def forward(self, q, k):
        return paddle.matmul(q, k, transpose_y=True) / math.sqrt(q.shape[-1])


class CausalSelfAttention(nn.Layer):
    def __init__(self, d: int, heads: int, qk_norm: bool, softmax: str = "F") -> None:
        super().__init__()
        self.heads = heads
        self.softmax = softmax
        self.act = nn.Softmax(-1)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.scores = Scores()
        self.qk_norm = qk_norm
        # qk-layernorm without a learned scale, as the qk_norm remedy's replay makes it; a test switches it on
        # from a step in the model's own code (the plain loop's ground truth)
        self.plain_qk_norm = False
        if qk_norm:
            self.q_norm = nn.LayerNorm(d // heads)
            self.k_norm = nn.LayerNorm(d // heads)
        mask = np.triu(np.full((SEQ, SEQ), -1.0e9, dtype="float32"), 1)
        self.register_buffer("mask", paddle.to_tensor(mask), persistable=False)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        if self.softmax == "fused_mha":
            return self._fused_mha(x)
        qkv = self.qkv(x).reshape([b, t, 3, h, d // h]).transpose([2, 0, 3, 1, 4])
        q, k, v = qkv[0], qkv[1], qkv[2]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.plain_qk_norm:
            q, k = F.layer_norm(q, d // h), F.layer_norm(k, d // h)
        if self.softmax in KERNEL_WAYS or self.softmax == "flash_unpadded":
            return self.proj(self._kernel(*(z.transpose([0, 2, 1, 3]) for z in (q, k, v))).reshape([b, t, d]))
        att = self._weights(self.scores(q, k) + self.mask[:t, :t])
        out = paddle.matmul(att, v).transpose([0, 2, 1, 3]).reshape([b, t, d])
        return self.proj(out)

    def _weights(self, s):
        how = self.softmax
        if how == "exp":  # by hand, without subtracting the maximum: exp overflows past ~88
            w = paddle.exp(s)
            return w / w.sum(axis=-1, keepdim=True)
        if how == "by_name":
            return softmax_by_name(s, axis=-1)
        if how == "alias":
            return SOFTMAX_ALIAS(s, axis=-1)
        if how == "paddle":
            return paddle.softmax(s, dim=-1)
        if how == "tensor":
            return s.softmax(-1)
        if how == "layer":
            return self.act(s)
        return F.softmax(s, axis=-1)

    def _kernel(self, q, k, v):
        """[batch, seq, heads, dim] in and out, causal."""
        if self.softmax == "sdpa":
            return scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.softmax == "flash":
            return flash_attention(q, k, v, causal=True)[0]
        b, t, h, dh = q.shape
        cu = paddle.arange(0, (b + 1) * t, t, dtype="int32")
        packed = [z.reshape([b * t, h, dh]) for z in (q, k, v)]
        out = FA.flash_attn_unpadded(*packed, cu, cu, t, t, 1.0 / math.sqrt(dh), causal=True)[0]
        return out.reshape([b, t, h, dh])

    def _fused_mha(self, x):
        """fused_multi_head_attention with this layer's own QKV and output projections (its causal mask as an
        additive one); the residual is the block's, not the kernel's."""
        b, t, d = x.shape
        h = self.heads
        qkv_w = self.qkv.weight.transpose([1, 0]).reshape([3, h, d // h, d])
        mask = self.mask[:t, :t].reshape([1, 1, t, t]).expand([b, h, t, t])
        return IF.fused_multi_head_attention(
            x, qkv_w, self.proj.weight, qkv_bias=self.qkv.bias.reshape([3, h, d // h]), linear_bias=self.proj.bias,
            attn_mask=mask, dropout_rate=0.0, attn_dropout_rate=0.0, add_residual=False)


class Block(nn.Layer):
    def __init__(self, d: int, heads: int, qk_norm: bool, softmax: str = "F") -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads, qk_norm, softmax)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Layer):
    def __init__(self, d: int = 32, layers: int = 2, heads: int = 4, qk_norm: bool = False,
                 final_ln: bool = True, softmax: str = "F") -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(SEQ, d)
        self.blocks = nn.LayerList([Block(d, heads, qk_norm, softmax) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d) if final_ln else None
        self.head = nn.Linear(d, VOCAB)

    def forward(self, ids):
        t = ids.shape[1]
        x = self.tok(ids) + self.pos(paddle.arange(t).unsqueeze(0))
        for block in self.blocks:
            x = block(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        return self.head(x)


def gpt(d: int = 32, layers: int = 2, heads: int = 4, qk_norm: bool = False, final_ln: bool = True,
        softmax: str = "F") -> GPT:
    return GPT(d, layers, heads, qk_norm, final_ln, softmax)


def tokens(batches: int = 200, batch_size: int = 16, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, label) batches of sequences that step through the vocabulary by a stride of 1-3 from a random
    start: the next token is known after two, so a healthy run learns them well."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(batches):
        start = rng.integers(0, VOCAB, size=(batch_size, 1))
        stride = rng.integers(1, 4, size=(batch_size, 1))
        seq = (start + stride * np.arange(SEQ + 1)[None, :]) % VOCAB
        out.append((seq[:, :-1].astype("int64"), seq[:, 1:].astype("int64")))
    return out


def cross_entropy(logits, label):
    """The usual token cross-entropy (the stable one)."""
    return F.cross_entropy(logits.reshape([-1, VOCAB]), label.reshape([-1, 1]))


def plain_qk_norm(model: GPT, on: bool = True) -> None:
    """qk-layernorm (per head, no learned scale) switched on or off in every block's attention."""
    for block in model.blocks:
        block.attn.plain_qk_norm = on


def with_z_loss(loss_fn, coef: float = 1.0e-4):
    """`loss_fn` plus a z-loss on the logits it gets: coef * mean(logsumexp(logits, -1)^2) (PaLM)."""
    def loss(logits, label):
        return loss_fn(logits, label) + coef * paddle.logsumexp(logits, axis=-1).square().mean()
    return loss


def naive_cross_entropy(logits, label):
    """log(sum(exp(logits))) minus the target's logit, as written by hand: exp overflows float32 once the
    logits pass ~88 (what a drifting log Z ends in)."""
    flat = logits.reshape([-1, VOCAB])
    log_z = paddle.log(paddle.exp(flat).sum(axis=-1))
    target = paddle.take_along_axis(flat, label.reshape([-1, 1]), axis=-1).squeeze(-1)
    return (log_z - target).mean()
