"""A ReLU SimpleRNN sequence regressor whose recurrent weights start with gain above 1."""

from __future__ import annotations

import paddle
from paddle import nn


class SeqRegressor(nn.Layer):
    def __init__(self, in_features: int, hidden: int, recurrent_gain: float) -> None:
        super().__init__()
        # the bug: an orthogonal recurrent matrix scaled by `recurrent_gain` > 1, with a ReLU cell:
        # the hidden state (and the gradient through time) is multiplied by ~gain at every time step
        hh = paddle.ParamAttr(initializer=nn.initializer.Orthogonal(gain=recurrent_gain))
        self.rnn = nn.SimpleRNN(in_features, hidden, activation="relu", weight_hh_attr=hh)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        _, h = self.rnn(x)
        return self.head(h[-1])


def build_model(in_features: int = 4, hidden: int = 16, recurrent_gain: float = 1.3) -> nn.Layer:
    paddle.seed(0)
    return SeqRegressor(in_features, hidden, recurrent_gain)
