"""A count-regression MLP that predicts the log of a Poisson rate (rate = exp(output)).

The output bias starts at 4.0 (a rate of ~55), copied from a model for a busier sensor; this data's
counts are around 1, so the first gradients are large.
"""

import paddle
import paddle.nn as nn


class CountRegressor(nn.Layer):
    def __init__(self, in_features=8, hidden=32, init_log_rate=4.0):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(in_features, hidden), nn.Tanh())
        self.log_rate = nn.Linear(hidden, 1)
        self.log_rate.bias.set_value(paddle.full([1], init_log_rate))

    def forward(self, x):
        return self.log_rate(self.body(x)).squeeze(-1)


def build_model(in_features=8, hidden=32, init_log_rate=4.0):
    paddle.seed(0)
    return CountRegressor(in_features, hidden, init_log_rate)
