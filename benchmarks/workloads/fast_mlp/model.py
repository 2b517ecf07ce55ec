"""Benchmark workload: a tiny MLP whose plain step takes ~0.3 ms on CPU, trained for 20,000 steps.

Shared by `config.yaml` and `plain_fast_mlp.py`. Two Linear layers and a ReLU on 16 features: the step is
a few dozen Paddle ops, so whatever the probe adds per step (a reduction, a host read, Python
bookkeeping) shows in full, and 20,000 steps make a long run whose report and memory must stay bounded.
The loader cycles over a fixed pool of batches (drawn once), so the data costs the same on both sides.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from paddle import nn


def build_model(features: int = 16, width: int = 32, classes: int = 4) -> nn.Layer:
    return nn.Sequential(nn.Linear(features, width), nn.ReLU(), nn.Linear(width, classes))


def build_loader(batches: int = 20000, batch_size: int = 16, features: int = 16, classes: int = 4,
                 seed: int = 0, pool: int = 64) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 1, size=(features, classes)).astype(np.float32)
    xs = [rng.normal(0, 1, size=(batch_size, features)).astype(np.float32) for _ in range(pool)]
    ys = [np.argmax(x @ w, axis=1).astype(np.int64) for x in xs]
    for i in range(batches):
        yield xs[i % pool], ys[i % pool]
