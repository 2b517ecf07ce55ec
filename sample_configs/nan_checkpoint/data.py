"""Healthy data: six batches of standard-normal features and labels in [0, 4)."""

import numpy as np


def build_loader(batches=6, batch_size=16, in_features=16, num_classes=4):
    rng = np.random.default_rng(4)
    return [(rng.standard_normal((batch_size, in_features)).astype("float32"),
             rng.integers(0, num_classes, size=(batch_size,)).astype("int64")) for _ in range(batches)]
