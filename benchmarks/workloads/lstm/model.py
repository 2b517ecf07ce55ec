"""Benchmark workload: a 2-layer LSTM classifying sequences of feature vectors by their last state.

Shared by `config.yaml` and `plain_lstm.py`. The label depends on the running sum of one feature, so
the recurrent state has something to carry.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import paddle
from paddle import nn


class SequenceClassifier(nn.Layer):
    def __init__(self, features: int, hidden: int, layers: int, classes: int) -> None:
        super().__init__()
        self.rnn = nn.LSTM(features, hidden, num_layers=layers)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


def build_model(features: int = 32, hidden: int = 128, layers: int = 2, classes: int = 4) -> nn.Layer:
    return SequenceClassifier(features, hidden, layers, classes)


def build_loader(batches: int = 400, batch_size: int = 32, seq_len: int = 48, features: int = 32,
                 classes: int = 4, seed: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    for _ in range(batches):
        x = rng.normal(0, 1, size=(batch_size, seq_len, features)).astype(np.float32)
        total = x[:, :, 0].sum(axis=1) / np.sqrt(seq_len)
        labels = np.clip(np.floor((total + 2) * classes / 4), 0, classes - 1).astype(np.int64)
        yield x, labels
