"""Poisson negative log-likelihood on the log-rate (the constant log(y!) left out)."""

import paddle


def poisson_nll(log_rate, counts):
    return (paddle.exp(log_rate) - counts.astype(log_rate.dtype) * log_rate).mean()
