"""A VAE whose logvar feeds two exp calls (issue 34, item 5): std = exp(0.5 * logvar) in the model and
exp(logvar) in the KL term of the step. One sample of one batch is 1000x too large, so logvar overflows both.
Referenced from specs as "<this file>:<callable>".
"""

from __future__ import annotations

import numpy as np
import paddle
from paddle import nn


class VAE(nn.Layer):
    def __init__(self, features: int = 16, latent: int = 4) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(features, 32), nn.ReLU())
        self.mu = nn.Linear(32, latent)
        self.logvar = nn.Linear(32, latent)
        self.dec = nn.Sequential(nn.Linear(latent, 32), nn.ReLU(), nn.Linear(32, features))

    def forward(self, x: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        h = self.enc(x)
        mu, logvar = self.mu(h), self.logvar(h)
        std = paddle.exp(0.5 * logvar)  # the first exp of logvar
        z = mu + std * paddle.randn(mu.shape, dtype=mu.dtype)
        return self.dec(z), mu, logvar


def build_model(features: int = 16, latent: int = 4) -> nn.Layer:
    paddle.seed(0)
    return VAE(features, latent)


def vae_step(model: nn.Layer, batch: dict) -> paddle.Tensor:
    x = batch["x"]
    recon, mu, logvar = model(x)
    rec = ((recon - x) ** 2).sum(-1).mean()
    kl = 0.5 * (mu ** 2 + paddle.exp(logvar) - logvar - 1).sum(-1).mean()  # the second exp of logvar
    return rec + kl


def build_loader(batches: int = 30, batch_size: int = 16, bad_batch: int = 10, bad_sample: int = 3,
                 scale: float = 1000.0) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    out = []
    for b in range(batches):
        x = rng.normal(size=(batch_size, 16)).astype("float32")
        if b == bad_batch:
            x[bad_sample] *= scale
        out.append(x)
    return out
