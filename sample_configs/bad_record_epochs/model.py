"""A small binary classifier returning one logit per sample."""

from __future__ import annotations

import paddle
from paddle import nn


class Classifier(nn.Layer):
    def __init__(self, in_features: int, hidden: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(),
                                  nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.head(self.body(x)).squeeze(-1)


def build_model(in_features: int = 8, hidden: int = 16) -> nn.Layer:
    paddle.seed(0)
    return Classifier(in_features, hidden)
