"""Tiny models, loaders and losses for the probe's unit tests, each with one planted fault.

Referenced from specs written by `tests/test_probe_*.py` as "<this file>:<callable>"; every fault is
triggered by named samples of a named batch so the tests can assert exactly where it is.
"""

from __future__ import annotations

import numpy as np
import paddle
from paddle import nn

FEATURES = 6


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


# ---- loaders --------------------------------------------------------------------------------------
def loader(batches: int = 8, batch_size: int = 8, classes: int = 3, nan_batch: int = -1, nan_rows: list | None = None,
           zero_batch: int = -1, zero_rows: list | None = None, zero_col: int = -1, label_batch: int = -1,
           label_row: int = 0, label_value: int = 0, tensors: bool = False, interrupt_at: int = -1,
           scale: float = 1.0, regression: bool = False, spike_batch: int = -1, spike_rows: list | None = None,
           spike: float = 100.0):
    """(x, label) batches: x ~ N(0, scale); plants NaN rows, all-zero rows, rows of one large value `spike`, a
    zero column, or a bad label."""
    rng = _rng()
    out = []
    for b in range(batches):
        x = (rng.normal(size=(batch_size, FEATURES)) * scale).astype("float32")
        if regression:
            y = (x @ np.linspace(-1, 1, FEATURES)).astype("float32")[:, None]
        else:
            y = rng.integers(0, classes, size=(batch_size,)).astype("int64")
        if zero_col >= 0:
            x[:, zero_col] = 0.0
        if b == nan_batch:
            x[nan_rows or [0], 1] = np.nan
        if b == zero_batch:
            x[zero_rows or [0]] = 0.0
        if b == spike_batch:
            x[spike_rows or [0]] = spike
        if b == label_batch:
            y[label_row if label_row >= 0 else slice(None)] = label_value
        out.append((paddle.to_tensor(x), paddle.to_tensor(y)) if tensors else (x, y))

    def gen():
        for b, item in enumerate(out):
            if b == interrupt_at:
                raise KeyboardInterrupt
            yield item

    return gen() if interrupt_at >= 0 else out


def token_loader(batches: int = 4, batch_size: int = 4, vocab: int = 20, long_batch: int = 2, long_len: int = 12,
                 seq_len: int = 6, bad_id_batch: int = -1, bad_id_row: int = 0):
    """(ids, label) batches; batch `long_batch` is longer than the position table."""
    rng = _rng()
    out = []
    for b in range(batches):
        length = long_len if b == long_batch else seq_len
        ids = rng.integers(1, vocab, size=(batch_size, length)).astype("int64")
        if b == bad_id_batch:
            ids[bad_id_row, 0] = vocab + 5
        out.append((ids, rng.integers(0, 2, size=(batch_size,)).astype("int64")))
    return out


# ---- models ---------------------------------------------------------------------------------------
class LogLayer(nn.Layer):
    """log(|x0| * x1 ...): -inf where a row is all zero (the forward fault lives in this layer)."""

    def forward(self, x):
        return paddle.log(paddle.abs(x) + (x.abs().sum(-1, keepdim=True) > 0).astype(x.dtype) * 1e-3)


class Dist(nn.Layer):
    """sqrt(sum((x * w)^2)): finite at 0 in forward, infinite gradient there (a backward fault)."""

    def __init__(self):
        super().__init__()
        self.w = self.create_parameter([FEATURES], default_initializer=nn.initializer.Constant(1.0))

    def forward(self, x):
        return paddle.sqrt(((x * self.w) ** 2).sum(-1, keepdim=True))


class Classifier(nn.Layer):
    def __init__(self, kind: str = "plain", classes: int = 3, hidden: int = 16, crash_at_batch_size: int = 0):
        super().__init__()
        self.kind = kind
        self.crash_at_batch_size = crash_at_batch_size
        self.body = nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU())
        if kind == "log":
            self.feat = LogLayer()
        if kind == "dist":
            self.dist = Dist()
            self.body = nn.Sequential(nn.Linear(1, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, classes)
        if kind == "spare":  # a layer the forward never calls (a leftover head, say)
            self.spare = nn.Linear(hidden, hidden)

    def forward(self, x):
        if self.kind == "clean":  # the user's own NaN handling: the batch's NaN never reaches the loss
            x = paddle.nan_to_num(x)
        if self.kind == "guard" and bool(paddle.isnan(x).any()):
            raise ValueError("the input holds NaN")
        if self.kind == "log":
            x = self.feat(x)
        if self.kind == "dist":
            x = self.dist(x)
        if self.crash_at_batch_size and x.shape[0] == self.crash_at_batch_size:
            x = x.reshape([self.crash_at_batch_size + 1, -1])  # the user's bug: a wrong reshape
        return self.head(self.body(x))


class MaskedAttention(nn.Layer):
    """Self-attention over a batch's additive mask (0 / -inf), as a Llama-style collator hands it in."""

    def __init__(self, classes: int = 3):
        super().__init__()
        self.q = nn.Linear(FEATURES, FEATURES)
        self.head = nn.Linear(FEATURES, classes)

    def forward(self, x, mask):
        att = paddle.nn.functional.softmax(self.q(x) @ x.transpose([0, 2, 1]) + mask, axis=-1)
        return self.head((att @ x).mean(1))


def masked_attention():
    paddle.seed(0)
    return MaskedAttention()


def mask_loader(batches: int = 6, batch_size: int = 4, tokens: int = 5, nan_batch: int = -1, nan_row: int = 0):
    """{x, mask, label} batches; `mask` is causal (-inf above the diagonal); `nan_batch` plants a NaN in x."""
    rng = _rng()
    mask = np.triu(np.full((tokens, tokens), -np.inf, "float32"), 1)
    out = []
    for b in range(batches):
        x = rng.normal(size=(batch_size, tokens, FEATURES)).astype("float32")
        if b == nan_batch:
            x[nan_row, 1, 2] = np.nan
        # the mask first: a check that takes the first non-finite field would blame it
        out.append({"mask": np.repeat(mask[None], batch_size, 0), "x": x,
                    "label": rng.integers(0, 3, size=(batch_size,)).astype("int64")})
    return out


def classifier(kind: str = "plain", classes: int = 3, nan_param: str = "", crash_at_batch_size: int = 0,
               nan_whole: bool = False, frozen: str = ""):
    """`nan_param`: a NaN in its first value (every value with `nan_whole`); `frozen`: stop_gradient on it."""
    paddle.seed(0)
    model = Classifier(kind, classes, crash_at_batch_size=crash_at_batch_size)
    if nan_param:
        p = dict(model.named_parameters())[nan_param]
        value = p.numpy()
        if nan_whole:
            value[...] = np.nan
        else:
            value.flat[0] = np.nan
        p.set_value(value)
    if frozen:
        dict(model.named_parameters())[frozen].stop_gradient = True
    return model


def regressor():
    paddle.seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 1))


class PositionModel(nn.Layer):
    def __init__(self, vocab: int = 20, dim: int = 8, max_len: int = 8):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Embedding(max_len, dim)
        self.head = nn.Linear(dim, 2)

    def forward(self, ids):
        pos = paddle.arange(ids.shape[1]).unsqueeze(0)
        return self.head((self.tok(ids) + self.pos_emb(pos)).mean(1))


def position_model(vocab: int = 20, max_len: int = 8):
    paddle.seed(0)
    return PositionModel(vocab, max_len=max_len)


def deep_mlp(layers: int = 100, width: int = 16):
    paddle.seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(nn.Linear(FEATURES, width), *mods, nn.Linear(width, 3))


# ---- losses and steps -----------------------------------------------------------------------------
def step_log_of_input(model, batch):
    """A step whose loss takes log(|x0|) outside the model: -inf for rows where x is all zero."""
    x = paddle.to_tensor(batch["x"])
    out = model(x)
    ce = paddle.nn.functional.cross_entropy(out, paddle.to_tensor(batch["label"]).unsqueeze(-1))
    return ce + 1e-3 * paddle.log(x.abs().sum(-1)).mean()


def step_masked_mean(model, batch):
    """mean of the loss over labelled rows (label != 0): 0/0 when no row of the batch is labelled."""
    x = paddle.to_tensor(batch["x"])
    label = paddle.to_tensor(batch["label"])
    per = paddle.nn.functional.cross_entropy(model(x), label.unsqueeze(-1), reduction="none").squeeze(-1)
    mask = (label != 0).astype("float32")
    return (per * mask).sum() / mask.sum()


class DeepTokenModel(nn.Layer):
    """An embedding and a deep stack of small layers: more tensors than the monitor's small-model limit."""

    def __init__(self, vocab: int, dim: int, depth: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.stack = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(dim, dim), nn.GELU())])
        self.head = nn.Linear(dim, 2)

    def forward(self, ids):
        return self.head(self.stack(self.tok(ids)).mean(axis=1))


def deep_token_model(vocab: int = 30, dim: int = 8, depth: int = 60, nan_row: int = -1, frozen: bool = False):
    """`nan_row`: that row of the embedding table is NaN (a resumed checkpoint's bad token); `frozen`: the
    table has stop_gradient set."""
    paddle.seed(0)
    model = DeepTokenModel(vocab, dim, depth)
    if nan_row >= 0:
        w = model.tok.weight.numpy()
        w[nan_row] = np.nan
        model.tok.weight.set_value(w)
    model.tok.weight.stop_gradient = frozen
    return model


class TiedHead(nn.Layer):
    """The output projection: logits against the embedding table itself (tied weights, as in many LMs)."""

    def __init__(self, table):
        super().__init__()
        self.weight = table

    def forward(self, h):
        return paddle.matmul(h, self.weight, transpose_y=True)


class TiedTokenModel(nn.Layer):
    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.out = TiedHead(self.tok.weight)
        self.head = nn.Linear(vocab, 2)

    def forward(self, ids):
        return self.head(self.out(self.tok(ids).mean(axis=1)))


def tied_token_model(vocab: int = 30, dim: int = 8, nan_row: int = 25):
    paddle.seed(0)
    model = TiedTokenModel(vocab, dim)
    w = model.tok.weight.numpy()
    w[nan_row] = np.nan
    model.tok.weight.set_value(w)
    return model


def bn_classifier(nan_variance: bool = True):
    """Linear -> BatchNorm1D -> ReLU -> Linear, restored with NaN running variances (a corrupt checkpoint)."""
    paddle.seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.BatchNorm1D(16), nn.ReLU(), nn.Linear(16, 3))
    if nan_variance:
        model[1]._variance.set_value(np.full([16], np.nan, dtype="float32"))
    return model


class DeepDist(nn.Layer):
    """`Dist` in front of a deep Linear + Tanh stack: a backward fault (sqrt at 0) in a model of more tensors
    than the monitor's small-model limit, whose gradients the probe reads only one step in a few."""

    def __init__(self, depth: int, width: int):
        super().__init__()
        self.dist = Dist()
        self.stack = nn.Sequential(nn.Linear(1, width), *[m for _ in range(depth) for m in (nn.Linear(width, width),
                                                                                            nn.Tanh())])
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        return self.head(self.stack(self.dist(x)))


def deep_dist(depth: int = 50, width: int = 8):
    paddle.seed(0)
    return DeepDist(depth, width)


def deep_dist_first_nonfinite_gradient_step(data: dict) -> int | None:
    """Ground truth without nandoctor for `deep_dist` on `loader(**data)` with Adam (lr 0.01): the first step
    whose gradients hold NaN/Inf, in a plain loop, each step's gradients checked on the host in float64."""
    model = deep_dist()
    opt = paddle.optimizer.Adam(parameters=model.parameters(), learning_rate=0.01)
    for step, (x, y) in enumerate(loader(**data)):
        loss = paddle.nn.functional.cross_entropy(model(paddle.to_tensor(x)), paddle.to_tensor(y).unsqueeze(-1))
        loss.backward()
        if not all(np.isfinite(np.asarray(p.grad.numpy(), "float64")).all() for p in model.parameters()
                   if p.grad is not None):
            return step
        opt.step()
        opt.clear_grad()
    return None


class NanMaskingMLP(nn.Layer):
    """The user zeroes NaN activations after the first layer: a NaN input row leaves the loss finite, but
    the first layer's weight gradient is NaN (x^T @ dout, with NaN * 0 = NaN). 102 tensors: "many"."""

    def __init__(self, depth: int, width: int):
        super().__init__()
        self.inp = nn.Linear(FEATURES, width)
        self.body = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])
        self.head = nn.Linear(width, 3)

    def forward(self, x):
        h = self.inp(x)
        h = paddle.where(paddle.isnan(h), paddle.zeros_like(h), h)
        return self.head(self.body(h))


def nan_masking_mlp(depth: int = 49, width: int = 8):
    paddle.seed(0)
    return NanMaskingMLP(depth, width)


class _NanRateAt(paddle.optimizer.lr.LRScheduler):
    def __init__(self, learning_rate: float, at: int):
        self.at = at
        super().__init__(learning_rate)

    def get_lr(self):
        return float("nan") if self.last_epoch == self.at else self.base_lr


def nan_rate_at(at: int = 6, learning_rate: float = 0.01):
    """A scheduler whose rate is NaN for the update of step `at` only: finite gradients, a NaN update."""
    return _NanRateAt(learning_rate, at)


class SqrtRelu(nn.Layer):
    """sqrt(fc(x) + 1), with relu after it here (`relu` "inside"), in the model's forward ("after") or nowhere
    ("none"): a row that drives fc(x) below -1 makes NaN in this layer; relu turns it into 0 (Paddle's
    relu(NaN) is 0), so the loss stays finite while the gradients go NaN, as it does without relu when the
    loss ignores that row's label (`ce_ignore`)."""

    def __init__(self, relu: str):
        super().__init__()
        self.relu = relu
        self.fc = nn.Linear(FEATURES, 8)

    def forward(self, x):
        h = paddle.sqrt(self.fc(x) + 1.0)
        return nn.functional.relu(h) if self.relu == "inside" else h


class HiddenNan(nn.Layer):
    def __init__(self, relu: str):
        super().__init__()
        self.root = SqrtRelu(relu)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.root(x)
        return self.head(nn.functional.relu(h) if self.root.relu == "after" else h)


def hidden_nan(relu: str = "inside"):
    paddle.seed(0)
    return HiddenNan(relu)


def ce_ignore(logits, label):
    """Cross-entropy that leaves out the rows labelled -100 (padding, say)."""
    return nn.functional.cross_entropy(logits, label.reshape([-1, 1]), ignore_index=-100)
