"""A small MLP regressor (no non-linearity between its layers, like a factorised linear model)."""

from __future__ import annotations

import paddle
from paddle import nn


class Regressor(nn.Layer):
    def __init__(self, in_features: int, hidden: int) -> None:
        super().__init__()
        self.hidden = nn.Linear(in_features, hidden)
        self.out = nn.Linear(hidden, 1)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.out(self.hidden(x))


def build_model(in_features: int = 10, hidden: int = 8) -> nn.Layer:
    paddle.seed(0)
    return Regressor(in_features, hidden)
