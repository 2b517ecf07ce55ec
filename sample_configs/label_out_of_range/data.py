"""Dict batches {'features', 'target'}; sample 9 of batch 2 has target 5, one past the last class
(a 1-based label that slipped through)."""

import numpy as np


def build_loader(batches=6, batch_size=16, in_features=12, num_classes=5):
    rng = np.random.default_rng(1)
    for b in range(batches):
        target = rng.integers(0, num_classes, size=(batch_size,)).astype("int64")
        if b == 2:
            target[9] = num_classes
        yield {"features": rng.uniform(-1, 1, (batch_size, in_features)).astype("float32"), "target": target}
