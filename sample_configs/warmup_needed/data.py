"""Sensor features and event counts drawn from a Poisson law whose rate is around 1."""

import numpy as np


def build_loader(batches=100, batch_size=32, in_features=8):
    rng = np.random.default_rng(1)
    w = rng.normal(size=in_features) * 0.3
    out = []
    for _ in range(batches):
        x = rng.normal(size=(batch_size, in_features)).astype("float32")
        counts = rng.poisson(np.exp(x @ w)).astype("float32")
        out.append((x, counts))
    return out
