"""Benchmark workload: a deep MLP of hundreds of tiny layers, where per-layer Python work dominates.

Shared by `config.yaml` and `plain_deep_mlp.py`. Post-norm residual blocks (Linear, ReLU, LayerNorm)
keep 128 blocks (over 500 sublayers) trainable; each layer is so small that a step's cost is Python and
dispatch, which is exactly where per-layer hooks would show.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import paddle
from paddle import nn


class Block(nn.Layer):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.act = nn.ReLU()

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.norm(x + self.act(self.fc(x)))


def build_model(features: int = 32, width: int = 32, depth: int = 128, classes: int = 10) -> nn.Layer:
    return nn.Sequential(nn.Linear(features, width), *[Block(width) for _ in range(depth)],
                         nn.Linear(width, classes))


def build_loader(batches: int = 400, batch_size: int = 64, features: int = 32, classes: int = 10,
                 seed: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 1, size=(features, classes)).astype(np.float32)
    for _ in range(batches):
        x = rng.normal(0, 1, size=(batch_size, features)).astype(np.float32)
        yield x, np.argmax(x @ w, axis=1).astype(np.int64)
