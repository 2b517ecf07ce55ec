"""A small regression MLP: 8 features -> 1 value."""

import paddle
import paddle.nn as nn


def build_model(in_features=8, hidden=16):
    paddle.seed(0)
    return nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, 1))
