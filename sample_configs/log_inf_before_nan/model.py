"""A classifier whose first layer rescales each record by the log of its total magnitude."""

from __future__ import annotations

import paddle
from paddle import nn


class LogScale(nn.Layer):
    """x * log(sum |x|): a log-magnitude feature scaling, written without a floor inside the log."""

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return paddle.log(x.abs().sum(axis=-1, keepdim=True)) * x  # the bug: log(0) = -inf on an all-zero record


class Net(nn.Layer):
    def __init__(self, in_features: int, classes: int) -> None:
        super().__init__()
        self.scale = LogScale()
        self.embed = nn.Linear(in_features, 16)
        self.head = nn.Linear(16, classes)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.head(paddle.nn.functional.relu(self.embed(self.scale(x))))


def build_model(in_features: int = 8, classes: int = 3) -> nn.Layer:
    paddle.seed(0)
    return Net(in_features, classes)
