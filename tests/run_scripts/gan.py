"""A small GAN trained the usual way (two models, two optimizers, alternating updates), knowing nothing
of nandoctor. For `nandoctor run`'s tests (tests/test_run_gan.py).

    python gan.py healthy   # trains clean
    python gan.py g         # z of sample 2 is all zeros at step 4: G's radial sqrt has an infinite gradient
    python gan.py g0        # the same at step 0, the generator's first update (before its hooks exist)
    python gan.py d         # real sample 1 is all zeros at step 3: D's radial sqrt has an infinite gradient
    python gan.py g --watch # the same loop with nandoctor.watch on each model (two doctors in one script)

Each step: D's loss on real and G(z).detach() (one call on both halves), optD.step(); then G's loss through
D, optG.step().
"""

from __future__ import annotations

import sys

import numpy as np
import paddle
from paddle import nn
from radial import Radial  # (the script's own folder is first on sys.path)

STEPS = 8
FAULT = {"g": 4, "g0": 0, "d": 3}


class Generator(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.radial = Radial(8)
        # (a bias away from 0: G's output for an all-zero z is not itself zero, which would fault D first)
        out = nn.Linear(16, 4, bias_attr=paddle.ParamAttr(initializer=nn.initializer.Constant(0.5)))
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), out)

    def forward(self, z: paddle.Tensor) -> paddle.Tensor:
        return self.body(self.radial(z))


class Discriminator(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.radial = Radial(4)
        self.head = nn.Sequential(nn.Linear(4, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.head(self.radial(x))


def batch(kind: str, step: int) -> tuple[np.ndarray, np.ndarray]:
    """(real, z) of one step."""
    rng = np.random.default_rng(step)
    real = (rng.normal(size=(6, 4)) + 2.0).astype("float32")
    z = rng.normal(size=(6, 8)).astype("float32")
    if kind in ("g", "g0") and step == FAULT[kind]:
        z[2] = 0.0
    if kind == "d" and step == FAULT["d"]:
        real[1] = 0.0
    return real, z


def build() -> tuple[nn.Layer, nn.Layer, paddle.optimizer.Optimizer, paddle.optimizer.Optimizer]:
    paddle.seed(0)
    g, d = Generator(), Discriminator()
    opt_g = paddle.optimizer.Adam(learning_rate=0.002, parameters=g.parameters())
    opt_d = paddle.optimizer.Adam(learning_rate=0.002, parameters=d.parameters())
    return g, d, opt_g, opt_d


BCE = nn.BCEWithLogitsLoss()


def d_loss(g: nn.Layer, d: nn.Layer, real: paddle.Tensor, z: paddle.Tensor) -> paddle.Tensor:
    fake = g(z)
    logits = d(paddle.concat([real, fake.detach()]))
    target = paddle.concat([paddle.ones([real.shape[0], 1]), paddle.zeros([real.shape[0], 1])])
    return BCE(logits, target)


def g_loss(g: nn.Layer, d: nn.Layer, z: paddle.Tensor) -> paddle.Tensor:
    logits = d(g(z))
    return BCE(logits, paddle.ones([z.shape[0], 1]))


def main_watch(kind: str) -> None:
    """The same loop, each model under its own `nandoctor.watch`, each checked before its update."""
    import nandoctor

    g, d, opt_g, opt_d = build()
    doc_d = nandoctor.watch(d, opt_d, step_fn=lambda model, b: BCE(model(b[0]), b[1]), fields=["x", "label"],
                            report_dir="report_d")
    doc_g = nandoctor.watch(g, opt_g, step_fn=lambda model, z: BCE(d(model(z)), paddle.ones([z.shape[0], 1])),
                            report_dir="report_g")
    for step in range(STEPS):
        real, z = (paddle.to_tensor(a) for a in batch(kind, step))
        opt_d.clear_grad()
        x = paddle.concat([real, g(z).detach()])
        target = paddle.concat([paddle.ones([real.shape[0], 1]), paddle.zeros([real.shape[0], 1])])
        loss_d = BCE(d(x), target)
        loss_d.backward()
        if not doc_d.check(loss_d, (x, target)):
            raise SystemExit(1)
        opt_d.step()
        opt_g.clear_grad()
        loss_g = g_loss(g, d, z)
        loss_g.backward()
        if not doc_g.check(loss_g, z):
            raise SystemExit(1)
        opt_g.step()
    doc_d.close()
    doc_g.close()
    print("training finished", flush=True)


def main(kind: str) -> None:
    g, d, opt_g, opt_d = build()
    for step in range(STEPS):
        real, z = (paddle.to_tensor(a) for a in batch(kind, step))
        opt_d.clear_grad()
        loss_d = d_loss(g, d, real, z)
        loss_d.backward()
        opt_d.step()
        opt_g.clear_grad()
        loss_g = g_loss(g, d, z)
        loss_g.backward()
        opt_g.step()
        print(f"step {step} loss_d {float(loss_d):.4f} loss_g {float(loss_g):.4f}", flush=True)
    print("training finished", flush=True)


if __name__ == "__main__":
    (main_watch if "--watch" in sys.argv else main)(sys.argv[1])
