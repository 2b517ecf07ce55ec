"""A plain training script whose model is built from an installed library's layers (tests/run_libs/
site-packages/nd_runlib): the op that goes non-finite, or the check that raises, is in the library's code,
called from this script's model call. For `nandoctor run`'s and `nandoctor.watch`'s tests.

    python library_op.py log     # LogEnergy's log of a zero energy: samples 1 and 4 of step 3 are blank
    python library_op.py fwd     # LogScale's: the same log, its -inf turned into NaN in the forward
    python library_op.py raise   # Strict raises on those blank samples
"""

from __future__ import annotations

import os
import sys

import numpy as np
import paddle
import paddle.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "run_libs", "site-packages"))
from nd_runlib.layers import LogEnergy, LogScale, Strict  # noqa: E402 - the library's folder goes on the path first


def build(kind: str) -> tuple[paddle.nn.Layer, paddle.optimizer.Optimizer]:
    paddle.seed(0)
    middle = {"log": LogEnergy, "fwd": LogScale, "raise": Strict}[kind]()
    # no bias: a blank sample's hidden features are exactly 0
    model = paddle.nn.Sequential(paddle.nn.Linear(4, 8, bias_attr=False), middle, paddle.nn.Linear(8, 3))
    return model, paddle.optimizer.Adam(learning_rate=0.01, parameters=model.parameters())


def batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(step)
    x = rng.normal(size=(6, 4)).astype("float32")
    y = rng.integers(0, 3, size=(6,)).astype("int64")
    if step == 3:
        x[[1, 4]] = 0.0  # blank samples (a failed read filled with zeros)
    return x, y


def loss_of(model: paddle.nn.Layer, batch: tuple[paddle.Tensor, paddle.Tensor]) -> paddle.Tensor:
    """The step's forward and loss (also `nandoctor.watch`'s step_fn)."""
    x, y = batch
    out = model(x)  # the model call: the user's line into the library
    return F.cross_entropy(out, y)


def train_step(model: paddle.nn.Layer, x: np.ndarray, y: np.ndarray) -> paddle.Tensor:
    """Forward, loss, backward: the step without its update."""
    loss = loss_of(model, (paddle.to_tensor(x), paddle.to_tensor(y)))
    loss.backward()
    return loss


def main(kind: str) -> None:
    model, opt = build(kind)
    for step in range(6):
        train_step(model, *batch(step))
        opt.step()
        opt.clear_grad()
    print("training finished", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
