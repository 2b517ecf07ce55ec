"""The VAE's step: reconstruction error plus the KL term, which squares std again."""

from __future__ import annotations

import paddle


def vae_step(model: paddle.nn.Layer, batch: dict) -> paddle.Tensor:
    x = batch["x"]
    recon, mu, logvar, std = model(x)
    rec = ((recon - x) ** 2).sum(-1).mean()
    kl = 0.5 * (mu ** 2 + std ** 2 - logvar - 1).sum(-1).mean()
    return rec + kl
