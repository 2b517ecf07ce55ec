"""Healthy data: four batches of standard-normal features and labels in [0, 10)."""

import numpy as np


def build_loader(batches=4, batch_size=16, in_features=512, num_classes=10):
    rng = np.random.default_rng(5)
    return [(rng.standard_normal((batch_size, in_features)).astype("float32"),
             rng.integers(0, num_classes, size=(batch_size,)).astype("int64")) for _ in range(batches)]
