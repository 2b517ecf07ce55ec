"""Token + position embeddings, a 2-layer pre-norm TransformerEncoder, mean pooling, a linear head."""

from __future__ import annotations

import paddle
from paddle import nn


class TokenClassifier(nn.Layer):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int, max_len: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(max_len, dim)
        block = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=0.0,
                                           normalize_before=True)
        self.encoder = nn.TransformerEncoder(block, layers, norm=nn.LayerNorm(dim))
        self.head = nn.Linear(dim, classes)

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        pos = paddle.arange(ids.shape[1], dtype="int64").unsqueeze(0)
        h = self.encoder(self.embed(ids) + self.position(pos))
        return self.head(h.mean(axis=1))


def build_model(vocab: int = 32, dim: int = 32, heads: int = 4, layers: int = 2, max_len: int = 16,
                classes: int = 2) -> nn.Layer:
    paddle.seed(0)
    return TokenClassifier(vocab, dim, heads, layers, max_len, classes)
