"""A Siamese encoder that predicts the distance between two items of a pair."""

from __future__ import annotations

import paddle
from paddle import nn


class PairDistance(nn.Layer):
    """Euclidean distance between paired embeddings, one value per pair."""

    def forward(self, ea: paddle.Tensor, eb: paddle.Tensor) -> paddle.Tensor:
        return paddle.sqrt(((ea - eb) ** 2).sum(axis=-1))  # the bug: d/dx sqrt(x) is inf at x = 0


class Head(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.distance = PairDistance()

    def forward(self, ea: paddle.Tensor, eb: paddle.Tensor) -> paddle.Tensor:
        return self.distance(ea, eb)


class Siamese(nn.Layer):
    def __init__(self, in_features: int, dim: int) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(in_features, 16), nn.Tanh(), nn.Linear(16, dim))
        self.head = Head()

    def forward(self, a: paddle.Tensor, b: paddle.Tensor) -> paddle.Tensor:
        return self.head(self.encoder(a), self.encoder(b))


def build_model(in_features: int = 10, dim: int = 8) -> nn.Layer:
    paddle.seed(0)
    return Siamese(in_features, dim)
