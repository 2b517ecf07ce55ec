"""The bug: binary cross-entropy written by hand from probabilities instead of logits."""

from __future__ import annotations

import paddle
import paddle.nn.functional as F


def bce_loss(logits: paddle.Tensor, y: paddle.Tensor) -> paddle.Tensor:
    p = F.sigmoid(logits)
    y = y.astype(p.dtype)
    # log(1 - p) is -inf once sigmoid rounds to exactly 1.0 (logit > ~17 in float32)
    return -(y * paddle.log(p) + (1 - y) * paddle.log(1 - p)).mean()
