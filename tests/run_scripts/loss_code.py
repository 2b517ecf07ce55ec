"""A plain training script whose fault is in its own loss code, not in the model, and which writes files as
real training does (a log appended and a checkpoint saved every step). For `nandoctor run`'s tests.

    python loss_code.py log    # log(1 - sigmoid(z)) is -inf for samples 1 and 4 of step 3: the loss is NaN
    python loss_code.py sqrt   # sqrt of a distance that is exactly 0 for sample 2 of step 4: its gradient is inf
    python loss_code.py weight # a weighted mean whose weights are sqrt of a column of y, negative for sample 2
                               # of step 4: the loss is NaN, and its gradient at every row of the output too
    python loss_code.py inline # the same loss written inline in the loop: no function of it to call again
"""

from __future__ import annotations

import os
import sys

import numpy as np
import paddle
import paddle.nn.functional as F


def batch(kind: str, step: int) -> tuple[np.ndarray, np.ndarray]:
    """(x, y): for `log`, y is the binary label; for `sqrt`, y is 0 for a sample that hits its target exactly."""
    rng = np.random.default_rng(step)
    x = rng.normal(size=(6, 4)).astype("float32")
    if kind == "log":
        y = rng.integers(0, 2, size=(6, 1)).astype("float32")
        if step == 3:
            x[[1, 4], 0] = 1000.0  # a feature in the wrong unit: the logit saturates the sigmoid
        return x, y
    if kind in ("weight", "inline"):  # (target, weight): a corrupt weight of -1 for sample 2 of step 4
        y = np.stack([rng.normal(size=6), rng.uniform(0.5, 1.5, size=6)], axis=1).astype("float32")
        if step == 4:
            y[2, 1] = -1.0
        return x, y
    y = np.ones((6, 1), dtype="float32")
    if step == 4:
        y[2] = 0.0
    return x, y


def loss_of(kind: str, out: paddle.Tensor, y: paddle.Tensor) -> paddle.Tensor:
    if kind == "log":  # a hand-written binary cross-entropy
        p = F.sigmoid(out[:, :1])
        return -(y * paddle.log(p) + (1 - y) * paddle.log(1 - p)).mean()
    if kind in ("weight", "inline"):  # a weighted mean: one NaN weight makes every row's gradient NaN
        w = paddle.sqrt(y[:, 1:])
        return (w * (out[:, :1] - y[:, :1]) ** 2).sum() / w.sum()
    target = out.detach() + y  # a distance of exactly 0 where y is 0
    return paddle.sqrt(((out - target) ** 2).sum(axis=1)).mean()


def train_step(kind: str, model: paddle.nn.Layer, x: np.ndarray, y: np.ndarray) -> paddle.Tensor:
    """Forward, the loss code, backward: the step without its update."""
    out, target = model(paddle.to_tensor(x)), paddle.to_tensor(y)
    if kind == "inline":  # loss_of's weighted mean, written inline
        w = paddle.sqrt(target[:, 1:])
        loss = (w * (out[:, :1] - target[:, :1]) ** 2).sum() / w.sum()
    else:
        loss = loss_of(kind, out, target)
    loss.backward()
    return loss


def build() -> tuple[paddle.nn.Layer, paddle.optimizer.Optimizer]:
    paddle.seed(0)
    model = paddle.nn.Sequential(paddle.nn.Linear(4, 16), paddle.nn.ReLU(), paddle.nn.Linear(16, 3))
    for p in model.parameters():  # large enough weights that a feature of 1000 saturates the sigmoid
        p.set_value(p * 4.0)
    return model, paddle.optimizer.Adam(learning_rate=0.01, parameters=model.parameters())


def main(kind: str) -> None:
    model, opt = build()
    os.makedirs("ckpt", exist_ok=True)
    for step in range(8):
        loss = train_step(kind, model, *batch(kind, step))
        opt.step()
        opt.clear_grad()
        with open("train.log", "a") as log:
            log.write(f"step {step} loss {float(loss):.4f}\n")
        paddle.save(model.state_dict(), os.path.join("ckpt", "model.pdparams"))
    print("training finished", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
