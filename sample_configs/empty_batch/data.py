"""A loader that filters samples per batch and, for batch 2, keeps none: an empty batch (shape [0, 8])."""

import numpy as np


def build_loader(batches=5, batch_size=16, in_features=8):
    rng = np.random.default_rng(8)
    for b in range(batches):
        x = rng.standard_normal((batch_size, in_features)).astype("float32")
        y = rng.standard_normal((batch_size, 1)).astype("float32")
        keep = np.ones(batch_size, dtype=bool) if b != 2 else np.zeros(batch_size, dtype=bool)
        yield x[keep], y[keep]
