"""A regressor built from gated MLPs (down(act(gate(x)) * up(x)), as in SwiGLU), optionally in residual blocks."""

from __future__ import annotations

import paddle
from paddle import nn


class ReLU15(nn.Layer):
    """relu(x) ** 1.5 written as x * sqrt(clip(x, min=0)): finite everywhere, but at x == 0 exactly its
    gradient is sqrt_grad's 0 / 0 = NaN (negative x is fine: clip's gradient discards sqrt_grad's inf)."""

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return x * paddle.sqrt(x.clip(min=0))


class GatedMLP(nn.Layer):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.act_fn = ReLU15()
        self.gate_proj = nn.Linear(dim, hidden, bias_attr=False)
        self.up_proj = nn.Linear(dim, hidden, bias_attr=False)
        self.down_proj = nn.Linear(hidden, dim, bias_attr=False)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class RMSNorm(nn.Layer):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([dim], default_initializer=nn.initializer.Constant(1.0))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return x * paddle.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Layer):
    """Pre-norm residual block: x + mlp(norm(x))."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim)
        self.mlp = GatedMLP(dim, hidden)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return x + self.mlp(self.norm(x))


class Regressor(nn.Layer):
    def __init__(self, features: int, hidden: int, blocks: int, residual: bool) -> None:
        super().__init__()
        self.embed = nn.Linear(features, features, bias_attr=False)  # no bias: a zero record stays zero
        if residual:
            self.blocks = nn.LayerList([Block(features, hidden) for _ in range(blocks)])
        else:
            self.mlp = GatedMLP(features, hidden)
        self.head = nn.Linear(features, 1)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        x = self.embed(x)
        if hasattr(self, "blocks"):
            for block in self.blocks:
                x = block(x)
        else:
            x = self.mlp(x)
        return self.head(x).squeeze(-1)


def build_model(features: int = 8, hidden: int = 32, blocks: int = 2, residual: bool = False) -> nn.Layer:
    paddle.seed(0)
    return Regressor(features, hidden, blocks, residual)
