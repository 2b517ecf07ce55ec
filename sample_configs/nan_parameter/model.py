"""An MLP classifier restored from a "previous run" checkpoint (made in code) that holds a NaN."""

from __future__ import annotations

import numpy as np
import paddle
from paddle import nn


class Encoder(nn.Layer):
    def __init__(self, in_features: int, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, hidden)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return paddle.nn.functional.gelu(self.norm(self.proj(x)))


class Classifier(nn.Layer):
    def __init__(self, in_features: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.encoder = Encoder(in_features, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.head(self.encoder(x))


def previous_run_checkpoint(model: nn.Layer) -> dict[str, np.ndarray]:
    """Stands in for paddle.load('last.pdparams'): finite weights except one diverged LayerNorm scale."""
    state = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    state["encoder.norm.weight"][3] = np.nan
    return state


def build_model(in_features: int = 12, hidden: int = 24, classes: int = 4) -> nn.Layer:
    paddle.seed(0)
    model = Classifier(in_features, hidden, classes)
    model.set_state_dict(previous_run_checkpoint(model))
    return model
