"""Short text records read by a Dataset and tokenized in a collate_fn, loaded by 2 worker processes.

Record 37 is a truncated line with no label column: `__getitem__` raises ValueError for it, inside a
worker. Paddle alone reports `SystemError: Blocking queue is killed` and prints the worker's traceback.
"""

import numpy as np
import paddle

VOCAB = {w: i + 1 for i, w in enumerate("the a cat dog sat ran on under mat rug fast slow".split())}
MAX_LEN = 8


def _records(n):
    rng = np.random.default_rng(5)
    words = list(VOCAB)
    lines = []
    for i in range(n):
        text = " ".join(rng.choice(words, size=int(rng.integers(3, MAX_LEN + 1))))
        lines.append(f"{text}\t{i % 2}")
    lines[37] = lines[37].split("\t")[0]  # the broken record: the label column is missing
    return lines


class TextDataset(paddle.io.Dataset):
    def __init__(self, n=96):
        self.lines = _records(n)

    def __len__(self):
        return len(self.lines)

    def __getitem__(self, index):
        parts = self.lines[index].split("\t")
        if len(parts) != 2:
            raise ValueError(f"record {index} has {len(parts)} column(s), expected text<TAB>label")
        return parts[0], int(parts[1])


def collate(samples):
    """A tokenizer-like collate_fn: words -> ids, padded to the longest text, plus a mask."""
    ids = [[VOCAB[w] for w in text.split()] for text, _ in samples]
    width = max(len(row) for row in ids)
    input_ids = np.zeros((len(ids), width), dtype="int64")
    mask = np.zeros((len(ids), width), dtype="float32")
    for r, row in enumerate(ids):
        input_ids[r, : len(row)] = row
        mask[r, : len(row)] = 1.0
    labels = np.array([label for _, label in samples], dtype="int64")
    return input_ids, mask, labels


def build_loader(batch_size=8, num_workers=2):
    return paddle.io.DataLoader(TextDataset(), batch_size=batch_size, shuffle=False, num_workers=num_workers,
                                collate_fn=collate)
