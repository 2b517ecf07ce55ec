"""A count-feature regressor: the root model's own forward scales the encoding by sqrt(total count)."""

from __future__ import annotations

import paddle
from paddle import nn


class Head(nn.Layer):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, 1)

    def forward(self, hidden_states: paddle.Tensor) -> paddle.Tensor:
        return self.proj(hidden_states).squeeze(-1)


class CountRegressor(nn.Layer):
    def __init__(self, in_features: int, hidden: int) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(in_features, hidden), nn.Tanh())
        self.head = Head(hidden)

    def forward(self, counts: paddle.Tensor) -> paddle.Tensor:
        h = self.encoder(counts)
        scale = paddle.sqrt(counts.sum(axis=-1, keepdim=True))  # the bug: a negative total (a -1 sentinel) is NaN
        return self.head(hidden_states=h * scale)  # called by keyword, as many model heads are


def build_model(in_features: int = 6, hidden: int = 16) -> nn.Layer:
    paddle.seed(0)
    return CountRegressor(in_features, hidden)


class PairScorer(nn.Layer):
    """Scores a pair from one item's encoding plus the distance between the two, computed in its own forward."""

    def __init__(self, in_features: int, hidden: int) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(in_features, hidden), nn.Tanh())
        self.head = Head(hidden)

    def forward(self, a: paddle.Tensor, b: paddle.Tensor) -> paddle.Tensor:
        ea, eb = self.encoder(a), self.encoder(b)
        dist = paddle.sqrt(((ea - eb) ** 2).sum(axis=-1))  # the bug: sqrt'(0) = inf for a duplicate pair
        return self.head(hidden_states=ea) + dist


def build_pair_model(in_features: int = 6, hidden: int = 16) -> nn.Layer:
    paddle.seed(0)
    return PairScorer(in_features, hidden)
