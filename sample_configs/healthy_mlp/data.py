"""A paddle.io.DataLoader over an in-memory Dataset: standardised features, labels in [0, 6)."""

import numpy as np
import paddle


class Blobs(paddle.io.Dataset):
    def __init__(self, n=256, in_features=20, num_classes=6):
        rng = np.random.default_rng(6)
        centres = rng.standard_normal((num_classes, in_features)).astype("float32")
        self.y = rng.integers(0, num_classes, size=n).astype("int64")
        self.x = (centres[self.y] + 0.5 * rng.standard_normal((n, in_features))).astype("float32")

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def __len__(self):
        return len(self.y)


def build_loader(n=256, batch_size=32, in_features=20, num_classes=6):
    return paddle.io.DataLoader(Blobs(n, in_features, num_classes), batch_size=batch_size, shuffle=False)
