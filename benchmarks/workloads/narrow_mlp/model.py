"""Benchmark workload: a narrow MLP of a few hundred layers and a cheap step (~25 ms at batch 32).

Shared by `config.yaml` and `plain_narrow_mlp.py`. A plain stack of Linear + Tanh pairs, no residuals
and no norms: every sublayer is a direct child of one `nn.Sequential`, each is tiny, and the step is so
cheap (dispatch, not arithmetic) that any per-layer or per-step work of the probe shows in full, over a
run long enough (600 steps) that start-up is not all of the whole-process ratio. Tanh and Xavier
initialisation keep the signal alive through the depth, so the run stays healthy.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from paddle import nn


def build_model(features: int = 16, width: int = 16, depth: int = 150, classes: int = 10) -> nn.Layer:
    layers: list[nn.Layer] = [nn.Linear(features, width), nn.Tanh()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.Tanh()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def build_loader(batches: int = 1000, batch_size: int = 32, features: int = 16, classes: int = 10,
                 seed: int = 0) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 1, size=(features, classes)).astype(np.float32)
    for _ in range(batches):
        x = rng.normal(0, 1, size=(batch_size, features)).astype(np.float32)
        yield x, np.argmax(x @ w, axis=1).astype(np.int64)

