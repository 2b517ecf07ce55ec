"""A small VAE: the encoder gives mu and logvar; std = exp(0.5 * logvar) samples the latent."""

from __future__ import annotations

import paddle
from paddle import nn


class VAE(nn.Layer):
    def __init__(self, features: int, latent: int) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(features, 32), nn.ReLU())
        self.mu = nn.Linear(32, latent)
        self.logvar = nn.Linear(32, latent)
        self.dec = nn.Sequential(nn.Linear(latent, 32), nn.ReLU(), nn.Linear(32, features))

    def forward(self, x: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        h = self.enc(x)
        mu, logvar = self.mu(h), self.logvar(h)
        std = paddle.exp(0.5 * logvar)  # the bug: logvar is never clamped
        z = mu + std * paddle.randn(mu.shape, dtype=mu.dtype)
        return self.dec(z), mu, logvar, std


def build_model(features: int = 16, latent: int = 4) -> nn.Layer:
    paddle.seed(0)
    return VAE(features, latent)
