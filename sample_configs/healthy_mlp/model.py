"""A small MLP classifier with Paddle's default initialisation."""

import paddle
import paddle.nn as nn


def build_model(in_features=20, hidden=64, num_classes=6):
    paddle.seed(0)
    return nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU(), nn.Dropout(0.1),
                         nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))
