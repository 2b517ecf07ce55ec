"""Benchmark workload: a small CNN (three conv blocks with batch norm) classifying 32x32 colour images.

Shared by `config.yaml` and `plain_cnn.py`. Images are class-dependent blobs plus noise, so the loss
falls and the gradients are those of a real training run, not of noise.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from paddle import nn


def build_model(channels: int = 32, classes: int = 10) -> nn.Layer:
    c = channels

    def block(cin: int, cout: int) -> list[nn.Layer]:
        return [nn.Conv2D(cin, cout, 3, padding=1), nn.BatchNorm2D(cout), nn.ReLU(), nn.MaxPool2D(2)]

    return nn.Sequential(*block(3, c), *block(c, 2 * c), *block(2 * c, 2 * c), nn.Flatten(),
                         nn.Linear(2 * c * 4 * 4, 128), nn.ReLU(), nn.Linear(128, classes))


def build_loader(batches: int = 400, batch_size: int = 32, classes: int = 10, seed: int = 0
                 ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    centres = rng.normal(0, 1, size=(classes, 3, 32, 32)).astype(np.float32)
    for _ in range(batches):
        labels = rng.integers(0, classes, size=batch_size, dtype=np.int64)
        images = centres[labels] + rng.normal(0, 1, size=(batch_size, 3, 32, 32)).astype(np.float32)
        yield images, labels
