"""A regressor over positive features that are log-transformed by a learnable-scale "safe" log."""

from __future__ import annotations

import paddle
from paddle import nn


class SafeLog(nn.Layer):
    """log(scale * x) where x > 0, else 0; `scale` is learned per feature."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.scale = self.create_parameter([features], default_initializer=nn.initializer.Constant(1.0))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        z = x * self.scale
        # the bug: log(z) is still computed at z == 0, and its gradient there is 0 / 0 = NaN
        return paddle.where(z > 0, paddle.log(z), paddle.zeros_like(z))


class Features(nn.Layer):
    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.logfeat = SafeLog(in_features)
        self.proj = nn.Linear(in_features, 16)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return paddle.tanh(self.proj(self.logfeat(x)))


class Regressor(nn.Layer):
    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.features = Features(in_features)
        self.out = nn.Linear(16, 1)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.out(self.features(x)).squeeze(-1)


def build_model(in_features: int = 5) -> nn.Layer:
    paddle.seed(0)
    return Regressor(in_features)
