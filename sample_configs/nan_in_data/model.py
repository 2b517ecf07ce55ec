"""A small MLP classifier: 16 features -> 4 classes."""

import paddle
import paddle.nn as nn


def build_model(in_features=16, hidden=32, num_classes=4):
    paddle.seed(0)
    return nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))
