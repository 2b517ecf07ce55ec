"""NanDoctorCallback in `paddle.Model.fit`: the probe's first fault, the faulty update never applied,
hapi's own objects as they were afterwards."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import paddle
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
    def forward(self, out: Any, target: Any) -> Any:
        return paddle.nn.functional.mse_loss(out, target.reshape(out.shape))


def _fit(tmp_path: Path, *, bad_batch: int = 6, stop: bool = True) -> tuple[NanDoctorCallback, Any, list[int]]:
    paddle.seed(0)
    net = sample_module("sqrt_at_zero", "model").build_model(in_features=10, dim=8)
    model = paddle.Model(net, inputs=[InputSpec([None, 10], "float32", "a"), InputSpec([None, 10], "float32", "b")],
                         labels=[InputSpec([None, 1], "float32", "target")])
    opt = paddle.optimizer.Adam(learning_rate=0.003, parameters=net.parameters())
    model.prepare(opt, _Mse())
    updates: list[int] = []
    real = opt._apply_optimize

    def counted(*args: Any, **kwargs: Any) -> Any:  # every update hapi's minimize really applies
        updates.append(1)
        return real(*args, **kwargs)

    opt._apply_optimize = counted
    cb = NanDoctorCallback(report_dir=tmp_path / "report", stop_training=stop)
    model.fit(_Pairs(bad_batch), epochs=1, batch_size=8, shuffle=False, verbose=0, callbacks=[cb])
    assert "minimize" not in vars(opt) and "train_batch" not in vars(model)  # hapi's objects restored
    assert sum(len(layer._forward_pre_hooks) + len(layer._forward_post_hooks)
               for layer in [net, *net.sublayers()]) == 0
    return cb, net, updates


def test_fit_stops_at_the_probes_first_fault(tmp_path: Path) -> None:
    expected = probe_first_fault("sqrt_at_zero")
    cb, net, updates = _fit(tmp_path)
    assert fault_of(cb.report) == expected
    assert len(updates) == 6  # steps 0-5 updated; step 6's NaN update was never applied
    for name, p in net.named_parameters():
        assert bool(paddle.isfinite(p).all()), name
    data = json.loads((tmp_path / "report" / "report.json").read_text(encoding="utf-8"))
    assert data["first_fault"]["layer"] == "head.distance"
    batch = np.load(tmp_path / "report" / "batch.npz", allow_pickle=False)
    assert sorted(batch.files) == ["a", "b", "target"]


def test_fit_goes_on_without_the_faulty_update(tmp_path: Path) -> None:
    cb, net, updates = _fit(tmp_path, stop=False)
    assert fault_of(cb.report)["sample_indices"] == [3]
    assert len(updates) == 19  # 20 batches, the faulty one skipped
    for name, p in net.named_parameters():
        assert bool(paddle.isfinite(p).all()), name


def test_healthy_fit_has_no_report(tmp_path: Path) -> None:
    cb, _, updates = _fit(tmp_path, bad_batch=-1)
    assert cb.report is None and len(updates) == 20
    assert not (tmp_path / "report").exists()


def test_hapi_example(tmp_path: Path) -> None:
    example_module("plain_loop")
    hapi = example_module("hapi_fit")
    assert hapi.main(report_dir=str(tmp_path / "r")) == 1
    data = json.loads((tmp_path / "r" / "report.json").read_text(encoding="utf-8"))
    assert (data["first_fault"]["step"], data["first_fault"]["layer"]) == (6, "distance")
