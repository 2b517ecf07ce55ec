"""Attribution details the sample configs do not pin down alone: a fault in the model's own forward,
the replayer leaving RNG/flags/buffers as it found them, and the op choice among the checker's log lines."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import paddle
import pytest
import yaml

from nandoctor.diagnosis.diagnose import spec_target
from nandoctor.diagnosis.localize import Replayer, localize
from nandoctor.diagnosis.origin import INF, NAN, OpLine, pick
from nandoctor.probe import ProbeOptions, run_probe
from nandoctor.spec import load_spec
from nandoctor.workload.build import build_workload

# The root's own forward divides each row by its sum: an all-zero row (sample 5 of batch 3) is 0/0.
# Ground truth (plain loop + CHECK_NAN_INF log, no nandoctor): step 3, first NaN op `divide`, in
# Net.forward itself (no sublayer's output is the first non-finite one), only sample 5 faults alone.
MODEL = '''
import numpy as np
import paddle
from paddle import nn


class Net(nn.Layer):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 3)
        self.norm = nn.BatchNorm1D(3)

    def forward(self, x):
        share = x / x.sum(axis=-1, keepdim=True)
        return self.norm(self.proj(share))


def build_model():
    paddle.seed(0)
    return Net()


def build_loader(bad_batch=3, bad_sample=5):
    rng = np.random.default_rng(0)
    out = []
    for b in range(6):
        x = np.abs(rng.normal(size=(8, 4))).astype("float32") + 0.1
        if b == bad_batch:
            x[bad_sample] = 0.0
        out.append((x, rng.integers(0, 3, size=8).astype("int64")))
    return out
'''


def _spec(tmp_path: Path):
    (tmp_path / "net.py").write_text(MODEL, encoding="utf-8")
    raw = {"version": 1, "model": {"entry": "net.py:build_model"},
           "data": {"entry": "net.py:build_loader", "fields": ["x", "label"], "label": "label"},
           "loss": {"builtin": "cross_entropy"}, "optimizer": {"name": "Adam", "args": {"learning_rate": 0.01}}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
    return load_spec(tmp_path / "config.yaml")


def test_fault_in_the_models_own_forward_is_named_so(tmp_path: Path) -> None:
    report = run_probe(_spec(tmp_path), ProbeOptions(steps=6, seed=0, device="cpu"))
    ff = report.first_fault
    assert ff is not None
    assert (ff.step, ff.phase.value, ff.layer, ff.op, ff.sample_indices) == (3, "forward", None, "divide", [5])
    line = MODEL.splitlines().index("        share = x / x.sum(axis=-1, keepdim=True)") + 1
    assert report.details["source"] == f"net.py:{line} in forward"
    from rich.console import Console

    from nandoctor.report import console as console_report

    screen = Console(width=120, record=True, force_terminal=False)
    console_report.render(report, screen)
    panel = screen.export_text().split("first fault", 1)[1].split("╰", 1)[0]
    assert "the model's forward" in panel and "None" not in panel


def test_replayer_puts_rng_flags_and_buffers_back(tmp_path: Path) -> None:
    workload = build_workload(_spec(tmp_path))
    x, y = _batch(tmp_path)
    fields = {"x": paddle.to_tensor(x), "label": paddle.to_tensor(y)}
    model = workload.model
    model.train()
    np.random.seed(7)
    random.seed(7)
    paddle.seed(7)
    before_np, before_py, before_pd = np.random.get_state()[1].copy(), random.getstate(), paddle.get_rng_state()
    flags = paddle.get_flags(["FLAGS_check_nan_inf", "FLAGS_call_stack_level"])
    stats = {k: v.numpy().copy() for k, v in model.state_dict().items() if "_mean" in k or "_variance" in k}
    assert stats
    with Replayer(spec_target(workload), before_pd) as rp:
        rp.forward_origin(fields, rp.trace(fields))
        rp.checked_backward(fields)
        rp.traced_backward(fields)
    assert (np.random.get_state()[1] == before_np).all() and random.getstate() == before_py
    assert paddle.get_flags(list(flags)) == flags
    for k, v in model.state_dict().items():
        if k in stats:
            np.testing.assert_array_equal(v.numpy(), stats[k])
    drawn = paddle.rand([4]).numpy()
    paddle.set_rng_state(before_pd)
    np.testing.assert_array_equal(drawn, paddle.rand([4]).numpy())
    # localize() hands back a replayer whose restore() the caller still uses
    loc, rp = localize(spec_target(workload), fields, before_pd, loss_finite=False)
    rp.restore()
    assert (loc.phase.value, loc.layer, loc.op) == ("forward", None, "divide")
    assert paddle.get_flags(list(flags)) == flags


def _batch(tmp_path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("net_for_test", tmp_path / "net.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_loader()[3]


def _line(op: str, numel: int, nan: int, inf: int, zero: int, mx: str) -> OpLine:
    return OpLine(op, numel, nan, inf, zero, mx, 0)


@pytest.mark.parametrize(("lines", "level", "expected"), [
    # attention: the mask (full, where: only 0 and -inf), its add and the row max carry intended -inf;
    # the NaN is born at scores - rowmax
    ([_line("full", 9, 0, 9, 0, "-inf"), _line("where", 9, 0, 3, 6, "0.000000e+00"),
      _line("add", 9, 0, 3, 0, "1.2"), _line("max", 3, 0, 1, 0, "1.2"), _line("subtract", 9, 3, 2, 1, "0.0"),
      _line("exp", 9, 3, 0, 0, "1.0")], NAN, "subtract"),
    # an overflow feeding a NaN: exp's +inf is the origin, not the inf/inf divide after it
    ([_line("exp", 4, 0, 2, 0, "inf"), _line("divide", 4, 2, 0, 0, "1.0")], NAN, "exp"),
    # no NaN: the first Inf that is not a mask (log of 0), not the +inf the negation makes of it later
    ([_line("where", 4, 0, 1, 3, "0.000000e+00"), _line("log", 4, 0, 1, 0, "-0.3"),
      _line("scale", 1, 0, 1, 0, "inf")], INF, "log"),
    ([_line("full", 4, 0, 4, 0, "-inf")], INF, None),
])
def test_op_choice_skips_mask_infs(lines, level, expected) -> None:
    chosen = pick(lines, level)
    assert (chosen.op if chosen else None) == expected


def test_line_tracer_gives_back_a_running_tracer(tmp_path: Path) -> None:
    """A debugger's or coverage's tracer is still installed after the replay's line tracing."""
    import sys

    def outer(frame, event, arg):  # noqa: ARG001 - the signature sys.settrace wants
        return None

    workload = build_workload(_spec(tmp_path))
    x, y = _batch(tmp_path)
    fields = {"x": paddle.to_tensor(x), "label": paddle.to_tensor(y)}
    previous = sys.gettrace()
    sys.settrace(outer)
    try:
        with Replayer(spec_target(workload), paddle.get_rng_state()) as rp:
            loc = rp.forward_origin(fields, rp.trace(fields))
        assert sys.gettrace() is outer
    finally:
        sys.settrace(previous)
    assert loc.op == "divide"


# Two instances of one activation class, called from different lines; only `right` sees exact zeros
# (all-zero rows of batch 2), where x * sqrt(clip(x, min=0)) has a 0/0 gradient. Ground truth (plain
# loop, checker in log mode on backward only): the first backward op with a NaN is right's sqrt_grad.
BRANCHES = '''
import numpy as np
import paddle
from paddle import nn


class Act(nn.Layer):
    def forward(self, x):
        return x * paddle.sqrt(x.clip(min=0))


class Net(nn.Layer):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 4, bias_attr=False)
        self.left = Act()
        self.right = Act()
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        h = self.inp(x)
        a = self.left(h + 1.0)
        b = self.right(h)
        return self.head(a + b).squeeze(-1)


def build_model():
    paddle.seed(0)
    return Net()


def build_loader():
    rng = np.random.default_rng(1)
    out = []
    for b in range(4):
        x = rng.normal(size=(8, 4)).astype("float32")
        if b == 2:
            x[[1, 6]] = 0.0
        out.append((x, rng.normal(size=8).astype("float32")))
    return out
'''


def _probe_branches(tmp_path: Path, source: str):
    (tmp_path / "net.py").write_text(source, encoding="utf-8")
    raw = {"version": 1, "model": {"entry": "net.py:build_model"},
           "data": {"entry": "net.py:build_loader", "fields": ["x", "y"], "label": "y"},
           "loss": {"builtin": "mse"}, "optimizer": {"name": "SGD", "args": {"learning_rate": 0.01}}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw), encoding="utf-8")
    return run_probe(load_spec(tmp_path / "config.yaml"), ProbeOptions(steps=4, seed=0, device="cpu"))


def test_backward_inf_a_layer_discards_is_not_blamed(tmp_path: Path) -> None:
    """`left` sees negative values: its sqrt_grad makes an Inf that clip's gradient discards, and the
    checker (abort mode) stops there first; the fault is right's NaN."""
    ff = _probe_branches(tmp_path, BRANCHES).first_fault
    assert ff is not None
    assert (ff.step, ff.phase.value, ff.layer, ff.op, ff.sample_indices) == (2, "backward", "right", "sqrt_grad",
                                                                              [1, 6])


def test_backward_layer_told_apart_by_calling_line(tmp_path: Path) -> None:
    """left's input is positive (no Inf there); right's output is gated by `gain`, a Linear over the same
    input, so the gradient hooks alone would name gain (its input gradient is NaN, its output's is not).
    The creation stack runs through Act.forward, called for left and right from different lines."""
    source = BRANCHES.replace("a = self.left(h + 1.0)", "a = self.left(h * h + 1.0)").replace(
        "b = self.right(h)", "b = self.right(h) * self.gain(h)").replace(
        "self.head = nn.Linear(4, 1)", "self.gain = nn.Linear(4, 4)\n        self.head = nn.Linear(4, 1)")
    report = _probe_branches(tmp_path, source)
    ff = report.first_fault
    assert ff is not None
    assert (ff.step, ff.phase.value, ff.layer, ff.op, ff.sample_indices) == (2, "backward", "right", "sqrt_grad",
                                                                              [1, 6])
    notes = report.findings[0].evidence["notes"]
    assert any("would have named gain" in n for n in notes), notes


# A layer outputs log(x), -inf at a zero feature; the next layer replaces Infs by 0, so the loss is
# finite, and where's gradient sends 0 into log_grad: 0 / 0 = NaN. Ground truth (plain loop): step 1,
# loss finite, the checker on backward only stops at log_grad; only sample 3 (the zero) faults alone.
REMOVED_INF = '''
import numpy as np
import paddle
from paddle import nn


class LogFeature(nn.Layer):
    def forward(self, x):
        return paddle.log(x)


class DropInf(nn.Layer):
    def forward(self, h):
        return paddle.where(paddle.isinf(h), paddle.zeros_like(h), h)


class Net(nn.Layer):
    def __init__(self):
        super().__init__()
        self.scale = nn.Linear(4, 4)
        self.logf = LogFeature()
        self.clean = DropInf()
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.clean(self.logf(x * self.scale.weight.abs().sum(0)))).squeeze(-1)


def build_model():
    paddle.seed(0)
    return Net()


def build_loader():
    rng = np.random.default_rng(2)
    out = []
    for b in range(3):
        x = rng.lognormal(size=(8, 4)).astype("float32")
        if b == 1:
            x[3, 2] = 0.0
        out.append((x, rng.normal(size=8).astype("float32")))
    return out
'''


def test_inf_removed_before_the_loss_is_not_a_forward_fault(tmp_path: Path) -> None:
    ff = _probe_branches(tmp_path, REMOVED_INF).first_fault
    assert ff is not None
    assert (ff.step, ff.phase.value, ff.layer, ff.op, ff.sample_indices) == (1, "backward", "logf", "log_grad", [3])


def test_fault_in_the_models_own_forward_reads_so_in_message_and_markdown(tmp_path: Path) -> None:
    from nandoctor.report import markdown as markdown_report

    report = run_probe(_spec(tmp_path), ProbeOptions(steps=6, seed=0, device="cpu"))
    message = next(f.message for f in report.findings if f.code.value == "activation.nonfinite")
    assert message.startswith("A value computed in the model's own forward") and "None" not in message
    first_fault = markdown_report.render(report).split("## First fault", 1)[1].split("##", 1)[0]
    assert "the model's forward" in first_fault and "None" not in first_fault


class _CountReplayer:
    """The loss is NaN when the subset holds all of `together`, or any sample of `alone`, or at least
    `size` samples (a loss whose sum overflows over any large enough part of the batch)."""

    params: list = []

    def __init__(self, together: set[int], alone: set[int], size: int = 0) -> None:
        self.together, self.alone, self.size = together, alone, size

    def reset_rng(self) -> None:
        pass

    def clear(self) -> None:
        pass

    def loss(self, part: dict) -> paddle.Tensor:
        ids = {int(i) for i in np.asarray(part["id"]).ravel()}
        bad = bool(ids & self.alone) or (bool(self.together) and self.together <= ids)
        bad = bad or bool(self.size and len(ids) >= self.size)
        return paddle.to_tensor(float("nan") if bad else 1.0)


@pytest.mark.parametrize(("together", "alone", "size", "samples", "scope", "reason"), [
    (set(), {0, 1, 2, 3, 4, 5}, 0, [], "not_sample_specific", "every_sample"),
    (set(range(6)), set(), 0, [], "not_sample_specific", "whole_batch"),
    # any two samples fault together: the parts found ([1, 2], [4, 5]) are no more to blame than the rest
    (set(), set(), 2, [], "not_sample_specific", "rest_of_batch_faults"),
    (set(), {1, 4}, 0, [1, 4], "samples", None),
])
def test_bisection_says_which_case_it_measured(together, alone, size, samples, scope, reason) -> None:
    from nandoctor.diagnosis.samples import find_samples

    fields = {"id": np.arange(6, dtype="int64")}
    bis = find_samples(_CountReplayer(together, alone, size), fields, "loss")
    assert (bis.samples, bis.scope, bis.reason) == (samples, scope, reason)
