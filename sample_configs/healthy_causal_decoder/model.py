"""A small hand-written causal decoder (GPT-style) with a padding mask, trained as a language model."""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle import nn

PAD = 0


class CausalSelfAttention(nn.Layer):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: paddle.Tensor, mask: paddle.Tensor) -> paddle.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).reshape([b, s, 3, self.heads, d // self.heads]).transpose([2, 0, 3, 1, 4])
        scores = paddle.matmul(q, k, transpose_y=True) / (d // self.heads) ** 0.5 + mask
        # a hand-written stable softmax: a row with every key masked is -inf - (-inf) = NaN here
        rowmax = scores.max(axis=-1, keepdim=True)
        e = paddle.exp(scores - rowmax)
        att = e / e.sum(axis=-1, keepdim=True)
        out = paddle.matmul(att, v).transpose([0, 2, 1, 3]).reshape([b, s, d])
        return self.proj(out)


class Block(nn.Layer):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: paddle.Tensor, mask: paddle.Tensor) -> paddle.Tensor:
        x = x + self.attn(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class Decoder(nn.Layer):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, max_len: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(max_len, dim)
        self.blocks = nn.LayerList([Block(dim, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        s = ids.shape[1]
        # additive mask: -inf above the diagonal (causal) and at padded keys; intended, not a fault
        causal = paddle.triu(paddle.full([s, s], float("-inf")), diagonal=1)
        padding = paddle.where(ids == PAD, paddle.full(ids.shape, float("-inf")), paddle.zeros(ids.shape))
        mask = causal.unsqueeze(0).unsqueeze(0) + padding.unsqueeze(1).unsqueeze(1)
        pos = paddle.arange(s, dtype="int64").unsqueeze(0)
        x = self.embed(ids) + self.position(pos)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def lm_loss(logits: paddle.Tensor, labels: paddle.Tensor) -> paddle.Tensor:
    """Next-token cross-entropy; padded positions carry label -100 and are ignored."""
    return F.cross_entropy(logits.reshape([-1, logits.shape[-1]]), labels.reshape([-1]), ignore_index=-100)


def build_model(vocab: int = 48, dim: int = 32, heads: int = 4, layers: int = 2, max_len: int = 16) -> nn.Layer:
    paddle.seed(0)
    return Decoder(vocab, dim, heads, layers, max_len)
