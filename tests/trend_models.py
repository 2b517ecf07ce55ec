"""A small regression MLP and its batches for the loss-trend tests (tests/test_loss_trend.py): trained at a
warmup to a too-high peak learning rate its loss falls, then rises several-fold without a NaN; with one batch of
scaled-up inputs mid-run its loss spikes and recovers; at a lower rate it stays quiet."""

from __future__ import annotations

import numpy as np
import paddle
from paddle import nn

FEATURES = 8


class MLP(nn.Layer):
    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(FEATURES, hidden)
        self.fc2 = nn.Linear(hidden, 1)

    def forward(self, x):
        return self.fc2(paddle.tanh(self.fc1(x)))


def mlp(hidden: int = 32) -> MLP:
    return MLP(hidden)


def batches(n: int = 120, batch_size: int = 16, spike_at: int = -1, scale: float = 30.0, noise: float = 0.1,
            seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """`n` batches of x -> y = tanh(x @ w) + noise; batch `spike_at` has its inputs and targets scaled by `scale`."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(FEATURES, 1)) / np.sqrt(FEATURES)
    out = []
    for i in range(n):
        x = rng.normal(size=(batch_size, FEATURES))
        y = np.tanh(x @ w) + noise * rng.normal(size=(batch_size, 1))
        if i == spike_at:
            x, y = x * scale, y * scale
        out.append((x.astype("float32"), y.astype("float32")))
    return out


def loss_with_exp(out, y):
    """MSE, plus an exp of the prediction that weighs nothing until it overflows float32 (a prediction above
    ~88.7): a diverging run then faults at that step, after its loss has diverged."""
    return paddle.nn.functional.mse_loss(out, y) + 0.0 * paddle.exp(out).mean()
