"""Benchmark workload: large batches through a model of many small tensors (the peak-memory guard).

Shared by `config.yaml` and `plain_wide_batch.py`. Each batch is 1024 samples of 4096 float32 features
(16 MB); the model is a Linear 4096 -> 16, 60 Linear 16 x 16 + ReLU pairs and a linear head: 124 parameter
tensors, so the probe takes it for a many-tensor model (it checks the parameters only before stats
steps). It stands in for an image model on large batches, where the batch, not the model, fills memory:
a probe that keeps batches alive between its checks shows here as peak RSS, not on the other workloads.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from paddle import nn


def build_model(features: int = 4096, width: int = 16, depth: int = 60, classes: int = 2) -> nn.Layer:
    layers: list[nn.Layer] = [nn.Linear(features, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def build_loader(batches: int = 200, batch_size: int = 1024, features: int = 4096, classes: int = 2,
                 pool: int = 4, seed: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """`pool` distinct batches made once and yielded in turn as fresh copies (a real loader hands out new
    arrays every batch; drawing 4M normals a step would cost more than the step itself)."""
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 1, size=(features, classes)).astype(np.float32)
    made = []
    for _ in range(pool):
        x = rng.normal(0, 1, size=(batch_size, features)).astype(np.float32)
        made.append((x, np.argmax(x @ w, axis=1).astype(np.int64)))
    for i in range(batches):
        x, y = made[i % pool]
        yield x.copy(), y.copy()
