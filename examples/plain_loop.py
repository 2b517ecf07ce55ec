"""A plain Paddle training loop watched by nandoctor: a Siamese distance model whose sqrt goes NaN
in backward at batch 6 (a duplicated pair, distance exactly 0).

    python examples/plain_loop.py            # writes nandoctor-report/ and exits 1
    python examples/plain_loop.py --healthy  # the same loop without the duplicate: exit 0
"""

from __future__ import annotations

import sys

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

import nandoctor


class PairDistance(nn.Layer):
    def forward(self, ea: paddle.Tensor, eb: paddle.Tensor) -> paddle.Tensor:
        return paddle.sqrt(((ea - eb) ** 2).sum(axis=-1))  # the bug: d/dx sqrt(x) is inf at x = 0


class Siamese(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 8))
        self.distance = PairDistance()

    def forward(self, a: paddle.Tensor, b: paddle.Tensor) -> paddle.Tensor:
        return self.distance(self.encoder(a), self.encoder(b))


def batches(healthy: bool, n: int = 20, bad: int = 6) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(2)
    out = []
    for i in range(n):
        a = rng.normal(size=(8, 10)).astype("float32")
        b = a + rng.normal(scale=0.5, size=a.shape).astype("float32")
        if i == bad and not healthy:
            b[3] = a[3]  # a duplicated pair: distance 0
        out.append((a, b, np.linalg.norm(a - b, axis=1).astype("float32")))
    return out


def train_step(model: nn.Layer, batch: tuple) -> paddle.Tensor:
    a, b, target = (paddle.to_tensor(v) for v in batch)
    return F.mse_loss(model(a, b), target)


def main(healthy: bool = False, report_dir: str = "nandoctor-report") -> int:
    paddle.seed(0)
    model = Siamese()
    optimizer = paddle.optimizer.Adam(learning_rate=0.003, parameters=model.parameters())
    with nandoctor.watch(model, optimizer, step_fn=train_step, report_dir=report_dir,
                         fields=["a", "b", "target"]) as doctor:
        for batch in batches(healthy):
            loss = train_step(model, batch)
            loss.backward()
            if not doctor.check(loss, batch):
                break
            optimizer.step()
            optimizer.clear_grad()
    return 1 if doctor.report is not None and doctor.report.exit_code else 0


if __name__ == "__main__":
    sys.exit(main(healthy="--healthy" in sys.argv))
