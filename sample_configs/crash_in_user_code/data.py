"""A paddle.io.DataLoader over 100 seeded samples, batch 16, drop_last False (last batch has 4)."""

from __future__ import annotations

import numpy as np
import paddle


class Flat(paddle.io.Dataset):
    def __init__(self, samples: int) -> None:
        rng = np.random.default_rng(12)
        self.x = rng.normal(size=(samples, 24)).astype("float32")
        self.y = (np.abs(self.x[:, :3]).argmax(axis=1)).astype("int64")

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.x[i], self.y[i]


def build_loader(samples: int = 100, batch_size: int = 16) -> paddle.io.DataLoader:
    return paddle.io.DataLoader(Flat(samples), batch_size=batch_size, shuffle=False, drop_last=False)
