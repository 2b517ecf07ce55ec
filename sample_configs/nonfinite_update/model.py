"""A small MLP classifier over sensor channels; channel 5 is a reserved slot that is always 0."""

from __future__ import annotations

import paddle
from paddle import nn


class Classifier(nn.Layer):
    def __init__(self, channels: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(channels, hidden), nn.Tanh())
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.head(self.encoder(x))


def build_model(channels: int = 6, hidden: int = 16, classes: int = 3) -> nn.Layer:
    paddle.seed(0)
    return Classifier(channels, hidden, classes)
