"""NanDoctorCallback in `paddle.Model.fit`: the probe's first fault, the faulty update never applied,
hapi's own objects as they were afterwards."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import pytest
from inloop_helpers import example_module, fault_of, probe_first_fault, sample_module
from paddle.static import InputSpec

from nandoctor.hapi import NanDoctorCallback


class _Pairs(paddle.io.Dataset):
    """sqrt_at_zero's batches one sample at a time; fit(batch_size=8, shuffle=False) rebuilds them."""

    def __init__(self, bad_batch: int = 6) -> None:
        data = sample_module("sqrt_at_zero", "data").build_loader(batches=20, batch_size=8, bad_batch=bad_batch,
                                                                  duplicate_sample=3)
        self.items = [(a[i], b[i], t[i:i + 1]) for a, b, t in data for i in range(len(a))]

    def __getitem__(self, i: int) -> Any:
        return self.items[i]

    def __len__(self) -> int:
        return len(self.items)


class _Mse(paddle.nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0  # hapi's training calls and the callback's replays alike

    def forward(self, out: Any, target: Any) -> Any:
        self.calls += 1
        return paddle.nn.functional.mse_loss(out, target.reshape(out.shape))


@dataclass
class _Run:
    cb: NanDoctorCallback
    net: Any
    updates: list[int]  # one entry per update hapi's minimize really applied
    trained: int  # batches hapi's adapter ran (forward and backward), replays not counted
    begun: list[tuple[int, int]]  # (epoch, step) of every batch fit took from the loader and began
    eval_losses: list[float]  # hapi's eval loss, one entry per evaluation fit ran
    loss: Any = None  # the loss layer (its calls counted)


class _Counter(paddle.callbacks.Callback):
    def __init__(self, run: _Run) -> None:
        super().__init__()
        self.run, self.epoch = run, -1

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.epoch = epoch

    def on_train_batch_begin(self, step: int, logs: dict | None = None) -> None:
        self.run.begun.append((self.epoch, step))

    def on_eval_end(self, logs: dict | None = None) -> None:
        self.run.eval_losses.append(float(np.asarray(logs["loss"]).ravel()[0]))


def _fit(tmp_path: Path, *, bad_batch: int = 6, stop: bool = True, epochs: int = 1,
         eval_data: Any = None, extra: list[Any] | None = None) -> _Run:
    paddle.seed(0)
    net = sample_module("sqrt_at_zero", "model").build_model(in_features=10, dim=8)
    model = paddle.Model(net, inputs=[InputSpec([None, 10], "float32", "a"), InputSpec([None, 10], "float32", "b")],
                         labels=[InputSpec([None, 1], "float32", "target")])
    opt = paddle.optimizer.Adam(learning_rate=0.003, parameters=net.parameters())
    loss = _Mse()
    model.prepare(opt, loss)
    cb = NanDoctorCallback(report_dir=tmp_path / "report", stop_training=stop)
    run = _Run(cb, net, [], 0, [], [], loss)
    real, adapter = opt._apply_optimize, model._adapter
    real_batch = adapter.train_batch

    def counted(*args: Any, **kwargs: Any) -> Any:  # every update hapi's minimize really applies
        run.updates.append(1)
        return real(*args, **kwargs)

    def counted_batch(*args: Any, **kwargs: Any) -> Any:  # below the callback's train_batch: what really ran
        run.trained += 1
        return real_batch(*args, **kwargs)

    opt._apply_optimize = counted
    adapter.train_batch = counted_batch
    loss_layer = model._loss
    try:
        model.fit(_Pairs(bad_batch), eval_data, epochs=epochs, batch_size=8, shuffle=False, verbose=0,
                  callbacks=[cb, _Counter(run), *(extra or [])])
    finally:  # hapi's objects as they were, also when fit raised: no patch left, no hook on the network
        del adapter.train_batch
        assert "minimize" not in vars(opt) and "step" not in vars(opt)
        assert "train_batch" not in vars(model) and "_run_one_epoch" not in vars(model)
        assert model._loss is loss_layer
        assert sum(len(layer._forward_pre_hooks) + len(layer._forward_post_hooks)
                   for layer in [net, *net.sublayers()]) == 0
    return run


def test_fit_stops_at_the_probes_first_fault(tmp_path: Path) -> None:
    expected = probe_first_fault("sqrt_at_zero")
    run = _fit(tmp_path)
    assert fault_of(run.cb.report) == expected
    assert len(run.updates) == 6  # steps 0-5 updated; step 6's NaN update was never applied
    for name, p in run.net.named_parameters():
        assert bool(paddle.isfinite(p).all()), name
    data = json.loads((tmp_path / "report" / "report.json").read_text(encoding="utf-8"))
    assert data["first_fault"]["layer"] == "head.distance"
    batch = np.load(tmp_path / "report" / "batch.npz", allow_pickle=False)
    assert sorted(batch.files) == ["a", "b", "target"]
    extra = run.loss.calls - run.trained  # the replays' calls of the network and loss, as the loss counted them
    assert extra > 0 and data["details"]["replay_calls"] == {"count": extra, "code": "your network and loss"}


def test_fit_trains_no_batch_after_the_fault(tmp_path: Path) -> None:
    """The epoch ends right after the faulting batch 6 of 20, and fit starts no second epoch."""
    expected = probe_first_fault("sqrt_at_zero")
    run = _fit(tmp_path, epochs=2)
    assert fault_of(run.cb.report) == expected and expected["step"] == 6
    assert run.begun == [(0, step) for step in range(7)]  # batch 7 never taken from the loader
    assert run.trained == 7 and len(run.updates) == 6


def test_fit_evaluates_the_last_finite_weights_once(tmp_path: Path) -> None:
    """With eval_data, hapi's evaluation of the stopped epoch still runs (as after EarlyStopping), on the
    weights before the faulty update, and no further epoch or evaluation follows."""
    run = _fit(tmp_path, epochs=3, eval_data=_Pairs(-1))
    assert run.begun[-1] == (0, 6) and run.trained == 7
    assert len(run.eval_losses) == 1 and np.isfinite(run.eval_losses[0])


def test_fit_that_raises_leaves_hapi_as_it_was(tmp_path: Path) -> None:
    """hapi calls no on_train_end when fit raises: the callback undoes its patches itself (_fit checks)."""

    class Boom(paddle.callbacks.Callback):
        def on_train_batch_end(self, step: int, logs: dict | None = None) -> None:
            if step == 2:
                raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        _fit(tmp_path, extra=[Boom()])


def test_fit_goes_on_without_the_faulty_update(tmp_path: Path) -> None:
    run = _fit(tmp_path, stop=False)
    assert fault_of(run.cb.report)["sample_indices"] == [3]
    assert len(run.updates) == 19 and run.trained == 20  # 20 batches, the faulty one not applied
    for name, p in run.net.named_parameters():
        assert bool(paddle.isfinite(p).all()), name


def test_healthy_fit_has_no_report(tmp_path: Path) -> None:
    run = _fit(tmp_path, bad_batch=-1, epochs=2)
    assert run.cb.report is None and len(run.updates) == run.trained == 40
    assert not (tmp_path / "report").exists()


def test_hapi_example(tmp_path: Path) -> None:
    example_module("plain_loop")
    hapi = example_module("hapi_fit")
    assert hapi.main(report_dir=str(tmp_path / "r")) == 1
    data = json.loads((tmp_path / "r" / "report.json").read_text(encoding="utf-8"))
    assert (data["first_fault"]["step"], data["first_fault"]["layer"]) == (6, "distance")


def test_a_network_that_raises_in_fit_is_reported_where_it_raised(tmp_path: Path) -> None:
    """The user's network raises at batch 4 (a shape bug, say): fit still raises it, and the report names
    step 4, phase forward and the layer, as the probe names a crash in the model. (A dataset that raises
    inside fit is not tried: Paddle's own loader then hangs hapi, callback or not.)"""
    paddle.seed(0)
    net = sample_module("sqrt_at_zero", "model").build_model(in_features=10, dim=8)
    calls = []

    def pre(_layer: Any, _inputs: Any) -> None:
        calls.append(1)
        if len(calls) == 5:
            raise ValueError("a reshape that does not fit this batch")

    hook = net.head.register_forward_pre_hook(pre)
    model = paddle.Model(net, inputs=[InputSpec([None, 10], "float32", "a"), InputSpec([None, 10], "float32", "b")],
                         labels=[InputSpec([None, 1], "float32", "target")])
    model.prepare(paddle.optimizer.Adam(learning_rate=0.003, parameters=net.parameters()), _Mse())
    cb = NanDoctorCallback(report_dir=tmp_path / "report")
    try:
        with pytest.raises(ValueError, match="reshape"):
            model.fit(_Pairs(-1), epochs=1, batch_size=8, shuffle=False, verbose=0, callbacks=[cb])
    finally:
        hook.remove()
    ff = fault_of(cb.report)
    assert (ff["step"], ff["phase"], ff["layer"]) == (4, "forward", "head")
    assert cb.report.run["mode"] == "hapi"
    data = json.loads((tmp_path / "report" / "report.json").read_text(encoding="utf-8"))
    assert data["verdict"] == "crashed" and data["findings"][0]["code"] == "user_code.error"
