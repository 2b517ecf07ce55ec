"""A patch encoder classifier whose reshape assumes every batch has the configured size."""

from __future__ import annotations

import paddle
from paddle import nn


class PatchEncoder(nn.Layer):
    def __init__(self, batch_size: int, patches: int, patch_dim: int) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.patches = patches
        self.patch_dim = patch_dim
        self.proj = nn.Linear(patch_dim, 16)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        # the bug: a short last batch cannot be reshaped to self.batch_size rows
        patches = x.reshape([self.batch_size, self.patches, self.patch_dim])
        return paddle.nn.functional.relu(self.proj(patches)).mean(axis=1)


class Classifier(nn.Layer):
    def __init__(self, batch_size: int, patches: int, patch_dim: int) -> None:
        super().__init__()
        self.encoder = PatchEncoder(batch_size, patches, patch_dim)
        self.head = nn.Linear(16, 3)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.head(self.encoder(x))


def build_model(batch_size: int = 16, patches: int = 4, patch_dim: int = 6) -> nn.Layer:
    paddle.seed(0)
    return Classifier(batch_size, patches, patch_dim)
