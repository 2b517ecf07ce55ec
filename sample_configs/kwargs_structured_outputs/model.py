"""A tiny sequence classifier in the Hugging Face style: keyword inputs, an output object, its own loss.

`forward(input_ids=..., attention_mask=..., labels=...)` returns `SequenceClassifierOutput` with
`.logits` and, when labels are given, `.loss`, as `transformers`/`paddleformers` models do.
"""

from dataclasses import dataclass
from typing import Optional

import paddle
import paddle.nn as nn
import paddle.nn.functional as F


@dataclass
class SequenceClassifierOutput:
    loss: Optional[paddle.Tensor] = None
    logits: Optional[paddle.Tensor] = None


class MaskedMeanPool(nn.Layer):
    """Mean of the token states over the real (mask = 1) tokens of each sequence."""

    def forward(self, hidden, attention_mask):
        mask = attention_mask.astype(hidden.dtype).unsqueeze(-1)
        return (hidden * mask).sum(axis=1) / mask.sum(axis=1)


class TinyEncoderForSequenceClassification(nn.Layer):
    def __init__(self, vocab_size=64, hidden_size=32, num_labels=3):
        super().__init__()
        self.embeddings = nn.Embedding(vocab_size, hidden_size)
        self.encoder = nn.Sequential(nn.Linear(hidden_size, hidden_size), nn.GELU(),
                                     nn.Linear(hidden_size, hidden_size))
        self.norm = nn.LayerNorm(hidden_size)
        self.pool = MaskedMeanPool()
        self.classifier = nn.Linear(hidden_size, num_labels)

    def forward(self, input_ids, attention_mask=None, labels=None):
        if attention_mask is None:
            attention_mask = paddle.ones_like(input_ids)
        hidden = self.embeddings(input_ids)
        hidden = self.norm(hidden + self.encoder(hidden))
        logits = self.classifier(self.pool(hidden, attention_mask))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits, labels.unsqueeze(-1))
        return SequenceClassifierOutput(loss=loss, logits=logits)


def build_model(vocab_size=64, hidden_size=32, num_labels=3):
    paddle.seed(0)
    return TinyEncoderForSequenceClassification(vocab_size, hidden_size, num_labels)
