"""A GRU over the sequence, classifying from the last hidden state."""

from __future__ import annotations

import paddle
from paddle import nn


class GRUClassifier(nn.Layer):
    def __init__(self, in_features: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.gru = nn.GRU(in_features, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        _, h = self.gru(x)
        return self.head(h[-1])


def build_model(in_features: int = 3, hidden: int = 24, classes: int = 2) -> nn.Layer:
    paddle.seed(0)
    return GRUClassifier(in_features, hidden, classes)
