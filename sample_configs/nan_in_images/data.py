"""Eight batches of 8 single-channel 12x12 images (NCHW, float32 in [0, 1]) with labels in [0, 4); one pixel
of sample 2 in batch 3 is NaN (a corrupt file decoded to NaN, say)."""

from __future__ import annotations

import numpy as np


def build_loader(batches: int = 8, batch_size: int = 8, size: int = 12, num_classes: int = 4):
    rng = np.random.default_rng(5)
    out = []
    for b in range(batches):
        images = rng.uniform(0.0, 1.0, (batch_size, 1, size, size)).astype("float32")
        labels = rng.integers(0, num_classes, size=(batch_size,)).astype("int64")
        if b == 3:
            images[2, 0, 4, 7] = np.nan
        out.append((images, labels))
    return out
