"""A classifier over raw 8-bit spectra: band energies (sum of squares) -> log1p -> MLP."""

from __future__ import annotations

import paddle
from paddle import nn


class BandEnergy(nn.Layer):
    """Energy per band: the sum of squared readings over `bins // bands` neighbouring bins."""

    def __init__(self, bins: int, bands: int) -> None:
        super().__init__()
        self.bands = bands
        self.width = bins // bands

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        # the latent bug: raw readings up to 255, squared and summed -> ~4e5 (> float16's 65504)
        return (x.reshape([-1, self.bands, self.width]) ** 2).sum(axis=-1)


class Spectrum(nn.Layer):
    def __init__(self, bins: int, bands: int) -> None:
        super().__init__()
        self.energy = BandEnergy(bins, bands)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return paddle.log1p(self.energy(x))


class Classifier(nn.Layer):
    def __init__(self, bins: int, bands: int, classes: int) -> None:
        super().__init__()
        self.spectrum = Spectrum(bins, bands)
        self.norm = nn.LayerNorm(bands)
        self.mlp = nn.Sequential(nn.Linear(bands, 32), nn.ReLU(), nn.Linear(32, classes))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.mlp(self.norm(self.spectrum(x)))


def build_model(bins: int = 64, bands: int = 8, classes: int = 3) -> nn.Layer:
    paddle.seed(0)
    return Classifier(bins, bands, classes)
