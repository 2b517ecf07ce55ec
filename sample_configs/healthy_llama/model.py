"""A small Llama-style decoder: RMSNorm, rotary position embeddings, SwiGLU MLP, causal + padding mask."""

from __future__ import annotations

import paddle
import paddle.nn.functional as F
from paddle import nn

PAD = 0


class RMSNorm(nn.Layer):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([dim], default_initializer=nn.initializer.Constant(1.0))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return x * paddle.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: paddle.Tensor) -> paddle.Tensor:
    a, b = x.chunk(2, axis=-1)
    return paddle.concat([-b, a], axis=-1)


class RotaryEmbedding(nn.Layer):
    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        self.inv_freq = 1.0 / base ** (paddle.arange(0, head_dim, 2, dtype="float32") / head_dim)

    def forward(self, positions: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
        freqs = positions.astype("float32").unsqueeze(-1) * self.inv_freq  # [batch, seq, head_dim / 2]
        emb = paddle.concat([freqs, freqs], axis=-1).unsqueeze(1)  # [batch, 1, seq, head_dim]
        return emb.cos(), emb.sin()


class LlamaAttention(nn.Layer):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q_proj = nn.Linear(dim, dim, bias_attr=False)
        self.k_proj = nn.Linear(dim, dim, bias_attr=False)
        self.v_proj = nn.Linear(dim, dim, bias_attr=False)
        self.o_proj = nn.Linear(dim, dim, bias_attr=False)

    def forward(self, x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, mask: paddle.Tensor) -> paddle.Tensor:
        b, s, d = x.shape
        q, k, v = (p(x).reshape([b, s, self.heads, self.head_dim]).transpose([0, 2, 1, 3])
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        scores = paddle.matmul(q, k, transpose_y=True) / self.head_dim ** 0.5 + mask
        # eager attention's softmax, written out in float32
        weights = paddle.exp(scores - scores.max(axis=-1, keepdim=True))
        weights = weights / weights.sum(axis=-1, keepdim=True)
        return self.o_proj(paddle.matmul(weights, v).transpose([0, 2, 1, 3]).reshape([b, s, d]))


class LlamaMLP(nn.Layer):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias_attr=False)
        self.up_proj = nn.Linear(dim, hidden, bias_attr=False)
        self.down_proj = nn.Linear(hidden, dim, bias_attr=False)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Layer):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(dim)
        self.self_attn = LlamaAttention(dim, heads)
        self.post_attention_layernorm = RMSNorm(dim)
        self.mlp = LlamaMLP(dim, hidden)

    def forward(self, x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor, mask: paddle.Tensor) -> paddle.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Layer):
    def __init__(self, vocab: int, dim: int, heads: int, hidden: int, layers: int, mask_value: str) -> None:
        super().__init__()
        self.mask_value = float("-inf") if mask_value == "-inf" else float(paddle.finfo(paddle.float32).min)
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.rotary_emb = RotaryEmbedding(dim // heads)
        self.layers = nn.LayerList([LlamaDecoderLayer(dim, heads, hidden) for _ in range(layers)])
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias_attr=False)

    def forward(self, input_ids: paddle.Tensor) -> paddle.Tensor:
        b, s = input_ids.shape
        keep = input_ids != PAD
        # position ids count real tokens only (left padding), as generation code does
        positions = (keep.astype("int64").cumsum(axis=-1) - 1).clip(min=0)
        cos, sin = self.rotary_emb(positions)
        causal = paddle.tril(paddle.ones([s, s], dtype="bool"))
        allowed = causal.unsqueeze(0).unsqueeze(0) & keep.unsqueeze(1).unsqueeze(1)  # [batch, 1, query, key]
        mask = paddle.where(allowed, paddle.zeros(allowed.shape), paddle.full(allowed.shape, self.mask_value))
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.lm_head(self.norm(x))


def lm_loss(logits: paddle.Tensor, labels: paddle.Tensor) -> paddle.Tensor:
    """Next-token cross-entropy; padded positions carry label -100 and are ignored."""
    return F.cross_entropy(logits.reshape([-1, logits.shape[-1]]), labels.reshape([-1]), ignore_index=-100)


def build_model(vocab: int = 64, dim: int = 32, heads: int = 4, hidden: int = 64, layers: int = 2,
                mask_value: str = "min") -> nn.Layer:
    paddle.seed(0)
    return LlamaForCausalLM(vocab, dim, heads, hidden, layers, mask_value)
