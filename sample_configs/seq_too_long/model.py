"""A tiny token classifier with a learned position table of 32 positions (`pos_embedding`)."""

import paddle
import paddle.nn as nn


class TinyEncoder(nn.Layer):
    def __init__(self, vocab=100, max_len=32, dim=16, num_classes=3):
        super().__init__()
        self.tok_embedding = nn.Embedding(vocab, dim)
        self.pos_embedding = nn.Embedding(max_len, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, ids):
        positions = paddle.arange(ids.shape[1]).unsqueeze(0)
        h = self.norm(self.tok_embedding(ids) + self.pos_embedding(positions))
        return self.head(h.mean(axis=1))


def build_model(vocab=100, max_len=32, dim=16, num_classes=3):
    paddle.seed(0)
    return TinyEncoder(vocab, max_len, dim, num_classes)
