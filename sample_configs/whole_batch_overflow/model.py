"""A linear regressor (one nn.Linear): the simplest model a too-large step on raw features diverges."""

from __future__ import annotations

import paddle
from paddle import nn


def build_model(in_features: int = 4) -> nn.Layer:
    paddle.seed(0)
    return nn.Sequential(nn.Linear(in_features, 1))
