"""Seeded variable-length token sequences (length 2-6), right-padded with 0; in one batch some
sequences are empty (every position padding), as a tokenizer gives for an empty text."""

from __future__ import annotations

import numpy as np

PAD = 0


def build_loader(batches: int = 16, batch_size: int = 8, seq_len: int = 6, vocab: int = 32, empty_batch: int = -1,
                 empty_samples: tuple[int, ...] = ()) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(21)
    out = []
    for b in range(batches):
        ids = np.full((batch_size, seq_len), PAD, dtype="int64")
        for i in range(batch_size):
            n = int(rng.integers(2, seq_len + 1))
            ids[i, :n] = rng.integers(1, vocab, size=n)
        if b == empty_batch:
            ids[list(empty_samples)] = PAD
        label = (ids % 2).sum(axis=1) % 2
        out.append((ids, label.astype("int64")))
    return out
