"""Eight batches of standardised features; one feature of sample 2 in batch 4 is 5e5 (a value in the
wrong unit, say), about 200,000x the typical scale of the field."""

import numpy as np


def build_loader(batches=8, batch_size=16, in_features=8):
    rng = np.random.default_rng(3)
    out = []
    for b in range(batches):
        x = rng.standard_normal((batch_size, in_features)).astype("float32")
        y = rng.standard_normal((batch_size, 1)).astype("float32")
        if b == 4:
            x[2, 6] = 5.0e5
        out.append((x, y))
    return out
