"""A regressor over count features, square-root compressed first."""

from __future__ import annotations

import paddle
from paddle import nn


class PowerCompress(nn.Layer):
    def __init__(self, exponent: float = 0.5) -> None:
        super().__init__()
        self.exponent = exponent

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return x ** self.exponent  # the bug: a fractional power of a negative number is NaN


class Features(nn.Layer):
    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.compress = PowerCompress(0.5)
        self.proj = nn.Linear(in_features, 16)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return paddle.nn.functional.relu(self.proj(self.compress(x)))


class Regressor(nn.Layer):
    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.features = Features(in_features)
        self.out = nn.Linear(16, 1)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.out(self.features(x)).squeeze(-1)


def build_model(in_features: int = 6) -> nn.Layer:
    paddle.seed(0)
    return Regressor(in_features)
