"""A small CNN (Conv-ReLU x2, pooling, linear head) with Paddle's default initialisation."""

from __future__ import annotations

import paddle
import paddle.nn as nn


def build_model(channels: int = 1, num_classes: int = 4) -> nn.Layer:
    paddle.seed(0)
    return nn.Sequential(
        nn.Conv2D(channels, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2D(2),
        nn.Conv2D(8, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2D(1),
        nn.Flatten(), nn.Linear(16, num_classes))
