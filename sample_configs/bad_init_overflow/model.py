"""A Poisson regressor: an MLP predicts a log-rate, `rate` exponentiates it."""

from __future__ import annotations

import paddle
from paddle import nn


class Exp(nn.Layer):
    def forward(self, z: paddle.Tensor) -> paddle.Tensor:
        return paddle.exp(z)


class PoissonRegressor(nn.Layer):
    def __init__(self, in_features: int, hidden: int, init_std: float) -> None:
        super().__init__()
        # the bug: N(0, init_std) with init_std = 1.0, whatever the layer's fan-in
        w = paddle.ParamAttr(initializer=nn.initializer.Normal(mean=0.0, std=init_std))
        self.body = nn.Sequential(nn.Linear(in_features, hidden, weight_attr=w), nn.ReLU(),
                                  nn.Linear(hidden, hidden, weight_attr=w), nn.ReLU())
        self.log_rate = nn.Linear(hidden, 1, weight_attr=w)
        self.rate = Exp()

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.rate(self.log_rate(self.body(x))).squeeze(-1)


def build_model(in_features: int = 32, hidden: int = 256, init_std: float = 1.0) -> nn.Layer:
    paddle.seed(0)
    return PoissonRegressor(in_features, hidden, init_std)
