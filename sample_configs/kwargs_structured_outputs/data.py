"""Tokenized batches as a tokenizer returns them: a dict of input_ids, attention_mask and labels.

Sequences are right-padded with id 0 to `seq_len`; the class depends on which ids a sequence holds,
so the model can learn it. `empty_at: [batch, [samples]]` makes those samples empty texts (all
padding: attention_mask all 0), as a blank line in a corpus does after tokenization.
"""

import numpy as np


def build_loader(batches=30, batch_size=8, seq_len=12, vocab_size=64, empty_at=None):
    rng = np.random.default_rng(3)
    out = []
    for b in range(batches):
        lengths = rng.integers(3, seq_len + 1, size=batch_size)
        ids = np.zeros((batch_size, seq_len), dtype="int64")
        mask = np.zeros((batch_size, seq_len), dtype="int64")
        labels = rng.integers(0, 3, size=batch_size).astype("int64")
        for i, n in enumerate(lengths):
            band = 1 + labels[i] * (vocab_size - 1) // 3  # each class draws its ids from its own band
            ids[i, :n] = rng.integers(band, band + (vocab_size - 1) // 3, size=n)
            mask[i, :n] = 1
        if empty_at is not None and b == empty_at[0]:
            for i in empty_at[1]:
                ids[i] = 0
                mask[i] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out
