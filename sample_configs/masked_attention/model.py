"""An nn.TransformerEncoder classifier over padded token ids, with a key-padding `attn_mask` of -inf."""

from __future__ import annotations

import paddle
from paddle import nn

PAD = 0


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
        keep = (ids != PAD).astype("float32")
        # additive key-padding mask [batch, 1, 1, keys]: -inf at padding, the intended kind of Inf
        mask = paddle.where(keep > 0, paddle.zeros_like(keep), paddle.full_like(keep, float("-inf")))
        h = self.encoder(self.embed(ids) + self.position(pos), src_mask=mask.unsqueeze([1, 2]))
        # mean over the real tokens (at least one counted, so an empty sequence is not a 0/0 here)
        pooled = (h * keep.unsqueeze(-1)).sum(axis=1) / keep.sum(axis=1, keepdim=True).clip(min=1.0)
        return self.head(pooled)


def build_model(vocab: int = 32, dim: int = 32, heads: int = 4, layers: int = 2, max_len: int = 16,
                classes: int = 2) -> nn.Layer:
    paddle.seed(0)
    return TokenClassifier(vocab, dim, heads, layers, max_len, classes)
