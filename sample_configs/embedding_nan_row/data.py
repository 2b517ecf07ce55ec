"""Seeded token sequences; token 37 is rare: only two samples of batch 7 hold it."""

from __future__ import annotations

import numpy as np

RARE_TOKEN = 37


def build_loader(batches: int = 12, batch_size: int = 8, seq_len: int = 10, vocab: int = 64
                 ) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(21)
    common = np.array([t for t in range(vocab) if t != RARE_TOKEN])
    out = []
    for b in range(batches):
        label = rng.integers(0, 3, size=batch_size).astype("int64")
        ids = rng.choice(common, size=(batch_size, seq_len)).astype("int64")
        ids[:, 0] = label + 1  # a class marker token, so the task is learnable
        if b == 7:  # the only two sentences in the data with the rare word
            ids[3, 4] = RARE_TOKEN
            ids[6, 8] = RARE_TOKEN
        out.append((ids, label))
    return out
