"""Seeded token sequences of length `seq_len`; in one batch two sequences are shorter and padded."""

from __future__ import annotations

import numpy as np

PAD = 0


def build_loader(batches: int = 12, batch_size: int = 8, seq_len: int = 12, vocab: int = 48,
                 short_batch: int = 5, short_samples: tuple[int, ...] = (1, 6), short_lens: tuple[int, ...] = (7, 9),
                 padding_side: str = "left") -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(11)
    out = []
    for b in range(batches):
        ids = rng.integers(1, vocab, size=(batch_size, seq_len + 1)).astype("int64")
        if b == short_batch:
            for s, n in zip(short_samples, short_lens):
                real = ids[s, : n + 1].copy()
                ids[s] = PAD
                if padding_side == "left":
                    ids[s, seq_len + 1 - (n + 1):] = real
                else:
                    ids[s, : n + 1] = real
        x, y = ids[:, :-1], ids[:, 1:].copy()
        y[y == PAD] = -100
        y[x == PAD] = -100
        out.append((x, y))
    return out
