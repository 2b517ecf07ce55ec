"""A plain training script whose fault comes past the steps `nandoctor run` reads in full, so that the step
goes unread and a later read finds it: the rollback must name it as if read live. For tests/test_run_unread.py.

    python unread.py KIND [STEPS]

KIND: dist     row 2 of step FAULT is all zeros and the model's Dist layer takes the square root of each row's
               norm: an inf gradient in the model's backward; the loss is a loss layer (nn.CrossEntropyLoss)
      dist_fn  the same, the loss written as a function (F.cross_entropy): a replay backpropagates the
               gradient recorded at the model's outputs
      dropout  dist_fn behind a dropout, and the script draws a random number between steps: a replay needs
               each step's own RNG state for its masks
      log      loss code: log(1 - sigmoid(z)) is -inf for rows 1 and 4 of step FAULT (a NaN loss)
      sqrt     loss code: sqrt of a distance exactly 0 for row 2 of step FAULT (an inf gradient)
      healthy  no fault
      drop_ok  dropout and a random draw between steps, no fault

Under `nandoctor run` (NANDOCTOR_RUN set) the reads are spaced as far apart as the snapshot ring allows (as
tests/test_fast_steps.py pins them for the probe, so the fault's step is surely unread), and the host reads
made during the training are counted into reads.txt.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from nandoctor.engine.watcher import READ_ALL_STEPS

FAULT = READ_ALL_STEPS + 13
ROWS = 8


class Dist(nn.Layer):
    """Each row's Euclidean norm: its gradient is inf where a row is exactly 0."""

    def forward(self, h: paddle.Tensor) -> paddle.Tensor:
        return paddle.sqrt((h * h).sum(axis=1, keepdim=True))


class Net(nn.Layer):
    def __init__(self, dropout: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8, bias_attr=False)  # (no bias: a zero input row stays a zero row)
        self.drop = nn.Dropout(0.3) if dropout else None
        self.dist = Dist()
        self.head = nn.Linear(1, 3)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        h = self.fc(x)
        if self.drop is not None:
            h = self.drop(h)
        return self.head(self.dist(h))


class Plain(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.head(F.relu(self.fc(x)))


def build(kind: str) -> tuple[nn.Layer, paddle.optimizer.Optimizer, nn.Layer | None]:
    """(model, optimizer, loss layer or None for loss code written as functions)."""
    paddle.seed(0)
    model = Net(kind in ("dropout", "drop_ok")) if kind in ("dist", "dist_fn", "dropout", "drop_ok") else Plain()
    opt = paddle.optimizer.Adam(learning_rate=0.01, parameters=model.parameters())
    return model, opt, nn.CrossEntropyLoss() if kind == "dist" else None


def batch(kind: str, step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(step)
    x = rng.normal(size=(ROWS, 4)).astype("float32")
    y = rng.integers(0, 3, size=(ROWS, 1)).astype("int64")
    if step == FAULT and kind in ("dist", "dist_fn", "dropout"):
        x[2] = 0.0
    if kind == "log":
        y = (y > 0).astype("float32")
        if step == FAULT:
            x[[1, 4], 0] = 1000.0  # a feature in the wrong unit: the logit saturates the sigmoid
    if kind == "sqrt":
        y = np.ones((ROWS, 1), dtype="float32")
        if step == FAULT:
            y[2] = 0.0
    return x, y


def between_steps(kind: str) -> None:
    """What a script may do between steps that moves Paddle's RNG (a random augmentation, a sampled noise)."""
    if kind in ("dropout", "drop_ok"):
        paddle.randn([3])


def loss_of(kind: str, out: paddle.Tensor, y: paddle.Tensor, loss_layer: nn.Layer | None) -> paddle.Tensor:
    if loss_layer is not None:
        return loss_layer(out, y)
    if kind == "log":  # a hand-written binary cross-entropy
        p = F.sigmoid(out[:, :1])
        return -(y * paddle.log(p) + (1 - y) * paddle.log(1 - p)).mean()
    if kind == "sqrt":
        target = out.detach() + y  # a distance of exactly 0 where y is 0
        return paddle.sqrt(((out - target) ** 2).sum(axis=1)).mean()
    return F.cross_entropy(out, y)


def _watched() -> list[int]:
    """Under `nandoctor run`: reads spaced as far as the ring allows, and counted (test instrumentation)."""
    from nandoctor.engine import watcher

    watcher._READ_SHARE = 1e-9
    reads = [0]
    read_step = watcher.StepWatcher._read_step

    def counted(self, *args, **kwargs):
        reads[0] += 1
        return read_step(self, *args, **kwargs)

    watcher.StepWatcher._read_step = counted
    return reads


def _taped() -> None:
    """Under `nandoctor run`: how many steps the tape holds, and how many with an RNG state (taped.json)."""
    import json

    from nandoctor.zero_change import runtime

    tape = runtime.SESSION.watches[0].tape
    with open("taped.json", "w") as out:
        json.dump({"steps": len(tape), "with_rng": sum(1 for entry in tape.values() if entry[0] is not None)}, out)


def main(kind: str, steps: int) -> None:
    reads = _watched() if os.environ.get("NANDOCTOR_RUN") else None
    model, opt, loss_layer = build(kind)
    for step in range(steps):
        x, y = batch(kind, step)
        between_steps(kind)
        loss = loss_of(kind, model(paddle.to_tensor(x)), paddle.to_tensor(y), loss_layer)
        loss.backward()
        opt.step()
        opt.clear_grad()
    if reads is not None:
        with open("reads.txt", "w") as out:
            out.write(str(reads[0]))
        _taped()
    print(f"trained {steps} steps", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else FAULT + 20)
