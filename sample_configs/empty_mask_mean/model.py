"""A tiny per-token tagger: embedding, a 1-D convolution over the sequence, per-token logits."""

from __future__ import annotations

import paddle
from paddle import nn


class Tagger(nn.Layer):
    def __init__(self, vocab: int, dim: int, tags: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.conv = nn.Conv1D(dim, dim, kernel_size=3, padding=1)
        self.head = nn.Linear(dim, tags)

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        h = self.embed(ids).transpose([0, 2, 1])
        h = paddle.nn.functional.relu(self.conv(h)).transpose([0, 2, 1])
        return self.head(h)


def build_model(vocab: int = 40, dim: int = 16, tags: int = 5) -> nn.Layer:
    paddle.seed(0)
    return Tagger(vocab, dim, tags)
