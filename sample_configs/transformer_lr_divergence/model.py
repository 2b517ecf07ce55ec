"""A small Transformer classifier over token ids with hand-written single-head attention (a naive softmax)."""

from __future__ import annotations

import math

import paddle
from paddle import nn


class SelfAttention(nn.Layer):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.scale = 1.0 / math.sqrt(dim)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        scores = paddle.matmul(self.q(x), self.k(x), transpose_y=True) * self.scale
        weights = paddle.exp(scores)  # a softmax written out by hand, without subtracting the max
        weights = weights / weights.sum(axis=-1, keepdim=True)
        return self.out(paddle.matmul(weights, self.v(x)))


class Block(nn.Layer):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class TinyTransformer(nn.Layer):
    def __init__(self, vocab: int, dim: int, layers: int, max_len: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(max_len, dim)
        self.blocks = nn.LayerList([Block(dim) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        pos = paddle.arange(ids.shape[1], dtype="int64").unsqueeze(0)
        h = self.embed(ids) + self.position(pos)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h).mean(axis=1))


def build_model(vocab: int = 32, dim: int = 32, layers: int = 2, max_len: int = 16, classes: int = 4) -> nn.Layer:
    paddle.seed(0)
    return TinyTransformer(vocab, dim, layers, max_len, classes)
