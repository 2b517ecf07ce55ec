"""A bag-of-tokens classifier resumed from a "previous run" checkpoint (made in code) with one NaN row.

GELU, not ReLU: Paddle's CPU ReLU turns NaN into 0, so the loss would stay finite (the model silently dead).
"""

from __future__ import annotations

import numpy as np
import paddle
from paddle import nn

BAD_TOKEN = 37  # the rare token whose embedding row diverged in the earlier run


class BagClassifier(nn.Layer):
    def __init__(self, vocab: int, dim: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 32), nn.GELU(), nn.Linear(32, classes))

    def forward(self, ids: paddle.Tensor) -> paddle.Tensor:
        return self.mlp(self.embed(ids).mean(axis=1))


def previous_run_checkpoint(model: nn.Layer) -> dict[str, np.ndarray]:
    """Stands in for paddle.load('last.pdparams'): finite weights except one row of the embedding table,
    a rare token whose update overflowed just before the run was checkpointed."""
    state = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    state["embed.weight"][BAD_TOKEN] = np.nan
    return state


def build_model(vocab: int = 64, dim: int = 16, classes: int = 3) -> nn.Layer:
    paddle.seed(0)
    model = BagClassifier(vocab, dim, classes)
    model.set_state_dict(previous_run_checkpoint(model))
    return model
