"""A model and loader for tests/test_resume.py: a regression whose learning rate grows every step
(ExponentialDecay with gamma > 1), so its weights diverge and overflow some 30 steps in; deterministic
(no shuffle, no dropout), 3 batches an epoch (4, 4, 2 samples)."""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn as nn

SAMPLES, BATCH = 10, 4


class Net(nn.Layer):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.body = nn.Linear(4, hidden)
        self.out = nn.Linear(hidden, 1)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.out(self.body(x))


def build_model(hidden: int = 16) -> Net:
    paddle.seed(7)
    return Net(hidden)


class Data(paddle.io.Dataset):
    reads: list[int] = []  # every __getitem__, for the test that skipped batches are never loaded

    def __init__(self) -> None:
        rng = np.random.default_rng(3)
        self.x = rng.normal(size=(SAMPLES, 4)).astype("float32") * 3
        self.y = rng.normal(size=(SAMPLES, 1)).astype("float32")

    def __getitem__(self, i: int):  # noqa: ANN204
        Data.reads.append(i)
        return self.x[i], self.y[i]

    def __len__(self) -> int:
        return SAMPLES


def build_loader() -> paddle.io.DataLoader:
    return paddle.io.DataLoader(Data(), batch_size=BATCH, shuffle=False)


def build_generator():  # noqa: ANN201
    """The same batches from a plain generator (no len, no batch sampler): skipped by iterating."""
    data = Data()
    for start in range(0, SAMPLES, BATCH):
        rows = range(start, min(start + BATCH, SAMPLES))
        yield np.stack([data.x[i] for i in rows]), np.stack([data.y[i] for i in rows])
