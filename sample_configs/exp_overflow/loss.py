"""Negative log-likelihood of the true class, from probabilities."""

from __future__ import annotations

import paddle


def nll_of_probs(probs: paddle.Tensor, label: paddle.Tensor) -> paddle.Tensor:
    picked = paddle.take_along_axis(probs, label.astype("int64").reshape([-1, 1]), axis=1)
    return -paddle.log(picked + 1e-8).mean()
