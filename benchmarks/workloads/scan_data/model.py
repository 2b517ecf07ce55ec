"""Benchmark workload for scan throughput: 200k samples of 32 float features and an integer label.

The loader is a lean numpy pipeline, the kind a user writes when the data fits in memory: a shuffled
index, fancy-indexed batches (a copy, as any real loader makes) and per-feature standardisation. It is
deliberately cheap, so the scan's per-batch cost shows rather than hides behind a slow loader.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from paddle import nn


def build_model(features: int = 32, hidden: int = 64, classes: int = 10) -> nn.Layer:
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def build_loader(samples: int = 200_000, batch_size: int = 256, features: int = 32, classes: int = 10,
                 seed: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    x = rng.normal(3.0, 2.0, size=(samples, features)).astype(np.float32)
    y = rng.integers(0, classes, size=samples, dtype=np.int64)
    mean, std = x.mean(axis=0), x.std(axis=0)
    order = rng.permutation(samples)
    for start in range(0, samples, batch_size):
        idx = order[start:start + batch_size]
        yield (x[idx] - mean) / std, y[idx]
