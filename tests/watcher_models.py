"""Models, loaders and losses for tests/test_watcher.py and tests/test_signals.py: losses that cannot
train, frozen models, loaders that exit, never end, or are slow enough to be interrupted mid-run."""

from __future__ import annotations

import sys
import time

import numpy as np
import paddle
from paddle import nn

FEATURES = 6


def batches(n: int = 8, batch_size: int = 8, classes: int = 3, zero_batch: int = -1, zero_rows: list | None = None):
    rng = np.random.default_rng(0)
    out = []
    for b in range(n):
        x = rng.normal(size=(batch_size, FEATURES)).astype("float32")
        y = rng.integers(0, classes, size=(batch_size,)).astype("int64")
        if b == zero_batch:
            x[zero_rows or [0]] = 0.0
        out.append((x, y))
    return out


def classifier(frozen: bool = False, log: bool = False):
    paddle.seed(0)
    model = Net(log)
    if frozen:
        for p in model.parameters():
            p.stop_gradient = True
    return model


class Net(nn.Layer):
    def __init__(self, log: bool = False):
        super().__init__()
        self.log = log
        self.body = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU())
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        if self.log:  # -inf for a row that is all zero: a forward fault in the model's own forward
            x = paddle.log(x.abs().sum(-1, keepdim=True) + 0 * x)
        return self.head(self.body(x))


def step_per_sample(model, batch):
    """The user's mistake: reduction='none' and no mean: a loss of shape [batch]."""
    out = model(paddle.to_tensor(batch["x"]))
    return nn.functional.cross_entropy(out, paddle.to_tensor(batch["label"]).unsqueeze(-1),
                                       reduction="none").squeeze(-1)


def step_detached(model, batch):
    """The user's mistake: the loss is computed from a detached output."""
    out = model(paddle.to_tensor(batch["x"])).detach()
    return nn.functional.cross_entropy(out, paddle.to_tensor(batch["label"]).unsqueeze(-1))


def step_constant(model, batch):
    """The user's mistake: a loss that does not use the model at all (but requires a gradient)."""
    w = paddle.to_tensor(np.ones([1], "float32"), stop_gradient=False)
    return (w * 2.0).sum()


def exiting_loader(after: int = 2, code: int = 3):
    """A loader whose third batch calls sys.exit (a script's habit carried into a data module)."""
    for i, item in enumerate(batches(8)):
        if i == after:
            sys.exit(code)
        yield item


def endless_loader(batch_size: int = 4):
    """A generator with no length that never ends."""
    rng = np.random.default_rng(0)
    while True:
        yield (rng.normal(size=(batch_size, FEATURES)).astype("float32"),
               rng.integers(0, 3, size=(batch_size,)).astype("int64"))


def _mark(marker: str, i: int, after: int) -> None:
    if marker and i == after:
        with open(marker, "w", encoding="utf-8") as fh:
            fh.write(str(i))


def slow_loader(n: int = 100000, delay: float = 0.05, marker: str = "", mark_after: int = 3):
    """A healthy loader slow enough that a signal lands mid-run; writes `marker` after a few batches."""
    items = batches(8)
    for i in range(n):
        time.sleep(delay)
        _mark(marker, i, mark_after)
        yield items[i % len(items)]


class _Slow(paddle.io.Dataset):
    def __init__(self, n: int, delay: float, marker: str):
        self.n, self.delay, self.marker = n, delay, marker

    def __getitem__(self, i):
        time.sleep(self.delay)
        _mark(self.marker, i, 24)
        rng = np.random.default_rng(i)
        return rng.normal(size=(FEATURES,)).astype("float32"), np.int64(i % 3)

    def __len__(self):
        return self.n


def worker_loader(n: int = 100000, delay: float = 0.01, marker: str = ""):
    """A paddle DataLoader with two worker processes alive while the probe runs."""
    return paddle.io.DataLoader(_Slow(n, delay, marker), batch_size=4, num_workers=2, shuffle=False)


def exiting_model():
    """A model factory that calls sys.exit (argument parsing left in a factory)."""
    sys.exit(2)


def step_float(model, batch):
    """The user's mistake: the loss turned into a Python float (.item()) before it is returned."""
    out = model(paddle.to_tensor(batch["x"]))
    return float(nn.functional.cross_entropy(out, paddle.to_tensor(batch["label"]).unsqueeze(-1)).item())


def slow_model(marker: str = "", seconds: float = 60.0):
    """A model whose build takes long (weights downloaded, say): a signal lands during the build."""
    if marker:
        with open(marker, "w", encoding="utf-8") as fh:
            fh.write("building")
    time.sleep(seconds)
    return classifier()
