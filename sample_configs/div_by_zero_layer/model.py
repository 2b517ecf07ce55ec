"""A bag-of-embeddings text classifier whose pooling divides by the count of real tokens."""

from __future__ import annotations

import paddle
from paddle import nn


class MaskedMeanPool(nn.Layer):
    """Mean over the non-padding positions (padding id is 0)."""

    def forward(self, emb: paddle.Tensor, ids: paddle.Tensor) -> paddle.Tensor:
        mask = (ids != 0).astype(emb.dtype).unsqueeze(-1)
        total = (emb * mask).sum(axis=1)
        count = mask.sum(axis=1)
        return total / count  # the bug: count is 0 for an all-padding sequence


class TextClassifier(nn.Layer):
    def __init__(self, vocab: int, dim: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pool = MaskedMeanPool()
        self.head = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, classes))

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        return self.head(self.pool(self.embed(ids), ids))


def build_model(vocab: int = 50, dim: int = 16, classes: int = 3) -> nn.Layer:
    paddle.seed(0)
    return TextClassifier(vocab, dim, classes)
