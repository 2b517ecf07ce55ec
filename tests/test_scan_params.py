"""Parameter scan: NaN/Inf in parameters and buffers, the fan-in scale rule (quiet on every Paddle default,
loud on N(0, 1) with a large fan-in, right about Paddle's weight layouts), and all-zero weights."""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn as nn
import pytest

from nandoctor.diagnosis.params import scan_params
from nandoctor.findings import Code, Phase, Severity


def normal(std: float) -> paddle.ParamAttr:
    return paddle.ParamAttr(initializer=nn.initializer.Normal(0.0, std))


def findings(model: nn.Layer):
    return scan_params(model)[0]


@pytest.mark.parametrize("make", [
    lambda: nn.Linear(512, 256), lambda: nn.Linear(2, 8192), lambda: nn.Linear(8192, 2),
    lambda: nn.Conv1D(16, 32, 5), lambda: nn.Conv2D(3, 64, 7), lambda: nn.Conv3D(4, 8, 3),
    lambda: nn.Conv2D(256, 1, 1), lambda: nn.Conv2DTranspose(16, 32, 3),
    lambda: nn.Conv2DTranspose(1, 256, 4),
    lambda: nn.Embedding(50_000, 64), lambda: nn.Embedding(10, 512),
    lambda: nn.LSTM(64, 32, num_layers=2), lambda: nn.GRU(4096, 4), lambda: nn.SimpleRNN(8, 128),
    lambda: nn.LayerNorm(64), lambda: nn.BatchNorm2D(8), lambda: nn.MultiHeadAttention(64, 4),
    lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64), 2),
])
def test_paddle_default_initialisations_are_quiet(make):
    paddle.seed(0)
    assert findings(make()) == []


def test_normal_one_with_fan_in_512_is_too_big():
    model = nn.Sequential(nn.Linear(512, 64, weight_attr=normal(1.0)), nn.ReLU(), nn.Linear(64, 10))
    [f] = findings(model)
    assert f.code == Code.PARAM_INIT_SCALE and f.severity == Severity.WARNING
    assert f.location.parameter == "0.weight" and f.location.phase == Phase.PARAMS
    assert f.evidence["fan_in"] == 512
    assert f.evidence["expected_std"] == pytest.approx([(1 / 512) ** 0.5, (2 / 512) ** 0.5])
    assert f.evidence["ratio"] == pytest.approx(16, rel=0.1)
    assert "0.weight" in f.message and "512" in f.message


def test_linear_fan_in_is_the_first_dim():
    # Linear weight is [in, out] in Paddle: N(0, 1) with 8 inputs is fine, with 512 inputs it is not.
    assert findings(nn.Linear(8, 512, weight_attr=normal(1.0))) == []
    assert [f.evidence["fan_in"] for f in findings(nn.Linear(512, 8, weight_attr=normal(1.0)))] == [512]


def test_conv_fan_in_is_in_channels_times_kernel():
    # Conv weight is [out, in, kh, kw]: fan-in 4 accepts std 1; fan-in 512 does not.
    assert findings(nn.Conv2D(4, 512, 1, weight_attr=normal(1.0))) == []
    [f] = findings(nn.Conv2D(512, 4, 1, weight_attr=normal(1.0)))
    assert f.evidence["fan_in"] == 512


def test_far_too_small_is_flagged_and_modest_custom_init_is_not():
    [f] = findings(nn.Conv2D(16, 32, 3, weight_attr=normal(1e-4)))
    assert f.code == Code.PARAM_INIT_SCALE and f.evidence["ratio"] < 1 / 30 and "smaller" in f.message
    assert findings(nn.Linear(768, 768, weight_attr=normal(0.02))) == []  # the BERT-style 0.02 is fine


def test_embeddings_judged_against_unit_scale():
    assert findings(nn.Embedding(1000, 64, weight_attr=normal(1.0))) == []
    [f] = findings(nn.Embedding(1000, 64, weight_attr=normal(30.0)))
    assert f.code == Code.PARAM_INIT_SCALE and f.location.parameter == "weight"


class WithCheckpoint(nn.Layer):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        self.head = nn.Linear(8, 2)
        self.register_buffer("scale", paddle.ones([3]))


def test_nonfinite_parameter_and_buffer_named_as_the_user_knows_them():
    model = WithCheckpoint()
    w = model.encoder[0].weight.numpy().copy()
    w[2, 5], w[0, 1] = np.nan, np.inf
    model.encoder[0].weight.set_value(w)
    model.scale.set_value(np.array([1.0, np.nan, 1.0], "float32"))
    found = {f.location.parameter: f for f in findings(model)}
    assert set(found) == {"encoder.0.weight", "scale"}
    f = found["encoder.0.weight"]
    assert f.code == Code.PARAM_NONFINITE and f.severity == Severity.ERROR
    assert f.location.phase == Phase.PARAMS
    assert (f.evidence["nan"], f.evidence["inf"], f.evidence["shape"]) == (1, 1, [8, 8])
    assert f.evidence["first_index"] == [0, 1] and f.location.layer == "encoder.0"
    assert found["scale"].evidence["buffer"] is True and found["scale"].message.startswith("Buffer 'scale'")
    assert "linear_" not in f.message  # never Paddle's internal name


def test_zero_weight_matrix_but_not_zero_bias():
    zero = paddle.ParamAttr(initializer=nn.initializer.Constant(0.0))
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4, weight_attr=zero))
    [f] = findings(model)
    assert f.code == Code.PARAM_ZERO and f.location.parameter == "1.weight" and f.severity == Severity.WARNING


def test_summary_counts():
    _, summary = scan_params(WithCheckpoint())
    assert summary == {"parameters": 4, "buffers": 1, "numel": 8 * 8 + 8 + 8 * 2 + 2}


def test_nan_rows_of_an_embedding_are_named_as_token_ids():
    """A resumed checkpoint with two NaN rows in an embedding table: which rows, how many, as token ids."""
    paddle.seed(0)
    model = nn.Sequential(nn.Embedding(40, 8), nn.Linear(8, 2))
    w = model[0].weight.numpy()
    w[[5, 31]] = np.nan
    w[31, 2] = np.inf
    model[0].weight.set_value(w)
    [f] = findings(model)
    assert f.code == Code.PARAM_NONFINITE and f.severity == Severity.ERROR and f.location.parameter == "0.weight"
    ev = f.evidence
    assert ev["rows"] == ev["token_ids"] == [5, 31] and ev["num_rows"] == 2 and not ev["wholly_nonfinite"]
    assert (ev["nan"], ev["inf"]) == (15, 1)
    assert "token id(s) 5, 31 (2 of 40 rows)" in f.message and "only batches holding these ids" in f.message
    assert "token id(s) 5, 31 of 0.weight" in f.advice[0]


def test_nan_rows_of_a_linear_weight_and_a_frozen_parameter():
    paddle.seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.Linear(4, 2))
    w = model[0].weight.numpy()
    w[3, 1] = np.nan
    model[0].weight.set_value(w)
    model[1].bias.set_value(np.full([2], np.nan, dtype="float32"))
    model[1].bias.stop_gradient = True
    by_name = {f.location.parameter: f for f in findings(model)}
    lin, frozen = by_name["0.weight"], by_name["1.bias"]
    assert lin.evidence["rows"] == [3] and "token_ids" not in lin.evidence and "row(s) 3 (1 of 6)" in lin.message
    assert frozen.evidence["wholly_nonfinite"] and frozen.evidence["frozen"] and "frozen" in frozen.message
