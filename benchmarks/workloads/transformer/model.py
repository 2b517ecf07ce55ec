"""Benchmark workload: a 4-layer Transformer encoder classifying token sequences.

Shared by `config.yaml` (what nandoctor runs) and `plain_transformer.py` (the same training as a plain
Paddle loop), so both sides of a benchmark train exactly the same model on exactly the same batches.
`empty_sample_at: [step, sample]` makes one sample of one batch all padding: the masked mean in
`MaskedMeanPool` is then 0/0 = NaN in the forward pass, a realistic late fault for the localisation row.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import paddle
from paddle import nn

PAD = 0


class MaskedMeanPool(nn.Layer):
    """Mean of the token states over the non-padding positions (NaN for an all-padding sample)."""

    def forward(self, h: paddle.Tensor, mask: paddle.Tensor) -> paddle.Tensor:
        m = mask.astype(h.dtype).unsqueeze(-1)
        return (h * m).sum(axis=1) / m.sum(axis=1)


class TextEncoder(nn.Layer):
    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, seq_len: int, classes: int) -> None:
        super().__init__()
        self.tok_embedding = nn.Embedding(vocab, d_model)
        self.pos_embedding = nn.Embedding(seq_len, d_model)
        block = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.1)
        self.encoder = nn.TransformerEncoder(block, layers)
        self.pool = MaskedMeanPool()
        self.head = nn.Linear(d_model, classes)

    def forward(self, tokens: paddle.Tensor) -> paddle.Tensor:
        positions = paddle.arange(tokens.shape[1]).unsqueeze(0)
        h = self.tok_embedding(tokens) + self.pos_embedding(positions)
        mask = tokens != PAD
        h = self.encoder(h)
        return self.head(self.pool(h, mask))


def build_model(vocab: int = 2000, d_model: int = 128, heads: int = 4, layers: int = 4, seq_len: int = 64,
                classes: int = 10) -> nn.Layer:
    return TextEncoder(vocab, d_model, heads, layers, seq_len, classes)


def build_loader(batches: int = 400, batch_size: int = 16, seq_len: int = 64, vocab: int = 2000,
                 classes: int = 10, seed: int = 0, empty_sample_at: list[int] | None = None
                 ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Token batches whose label is a learnable function of the tokens (the sum of a few ids mod classes)."""
    rng = np.random.default_rng(seed)
    for b in range(batches):
        tokens = rng.integers(1, vocab, size=(batch_size, seq_len), dtype=np.int64)
        lengths = rng.integers(seq_len // 2, seq_len + 1, size=batch_size)
        tokens[np.arange(seq_len)[None, :] >= lengths[:, None]] = PAD
        labels = (tokens[:, :4].sum(axis=1) % classes).astype(np.int64)
        if empty_sample_at is not None and b == empty_sample_at[0]:
            tokens[empty_sample_at[1]] = PAD
        yield tokens, labels
