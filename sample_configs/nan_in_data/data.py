"""Eight batches of 16 samples; one feature of sample 5 in batch 3 is NaN (a failed parse, say)."""

import numpy as np


def build_loader(batches=8, batch_size=16, in_features=16, num_classes=4):
    rng = np.random.default_rng(0)
    out = []
    for b in range(batches):
        x = rng.standard_normal((batch_size, in_features)).astype("float32")
        y = rng.integers(0, num_classes, size=(batch_size,)).astype("int64")
        if b == 3:
            x[5, 7] = np.nan
        out.append((x, y))
    return out
