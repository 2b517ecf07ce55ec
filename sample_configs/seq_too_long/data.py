"""Dict batches of padded token ids with a mask. Sequences are 5..20 tokens long, except sample 3
of batch 2, which has 40 tokens: the batch is padded to 40, beyond the model's 32 positions."""

import numpy as np


def build_loader(batches=5, batch_size=8, vocab=100, num_classes=3):
    rng = np.random.default_rng(2)
    out = []
    for b in range(batches):
        lengths = rng.integers(5, 21, size=batch_size)
        if b == 2:
            lengths[3] = 40
        width = int(lengths.max())
        ids = np.zeros((batch_size, width), dtype="int64")
        mask = np.zeros((batch_size, width), dtype="int64")
        for i, n in enumerate(lengths):
            ids[i, :n] = rng.integers(1, vocab, size=n)
            mask[i, :n] = 1
        out.append({"ids": ids, "mask": mask, "label": rng.integers(0, num_classes, size=batch_size)})
    return out
