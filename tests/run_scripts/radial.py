"""The layer the run scripts' faults go through (gan.py, forked.py), imported from the script's own folder."""

from __future__ import annotations

import paddle
from paddle import nn


class Radial(nn.Layer):
    """p / (1 + |p|) of a projection p: the norm's sqrt has an infinite gradient where p is exactly 0."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.proj = nn.Linear(n, n, bias_attr=False)

    def forward(self, h: paddle.Tensor) -> paddle.Tensor:
        p = self.proj(h)
        r = paddle.sqrt((p * p).sum(axis=1, keepdim=True))
        return p / (1.0 + r)
