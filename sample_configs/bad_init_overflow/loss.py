"""Poisson negative log-likelihood (without the constant log(y!) term)."""

from __future__ import annotations

import paddle


def poisson_nll(rate: paddle.Tensor, counts: paddle.Tensor) -> paddle.Tensor:
    counts = counts.astype(rate.dtype)
    return (rate - counts * paddle.log(rate + 1e-8)).mean()
