"""grouped.per_tensor: one value per tensor from stacked groups must equal the per-tensor float64 answer,
in the tensors' own order, whether a group is stacked or (over the size cap) reduced tensor by tensor."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from nandoctor.tensors import grouped


@pytest.mark.parametrize("cap", [grouped.STACK_MAX_NUMEL, 1])
def test_per_tensor_matches_numpy_in_order(monkeypatch, cap):
    monkeypatch.setattr(grouped, "STACK_MAX_NUMEL", cap)
    rng = np.random.default_rng(0)
    shapes = [(4, 3), (5,), (4, 3), (2, 2, 2), (5,), (4, 3), (7, 1)]
    arrays = [rng.normal(size=s, scale=i + 1).astype("float32") for i, s in enumerate(shapes)]
    arrays[2][1, 1] = np.nan
    arrays[4][0] = np.inf
    tensors = [paddle.to_tensor(a) for a in arrays]
    with paddle.no_grad():
        ok = grouped.per_tensor(tensors, grouped.all_finite_rows)
        std = grouped.per_tensor(tensors, grouped.std_rows)
    assert ok.tolist() == [float(np.isfinite(a).all()) for a in arrays]
    for a, s in zip(arrays, std):
        if np.isfinite(a).all():
            assert s == pytest.approx(np.asarray(a, "float64").std(), rel=1e-5)
        else:
            assert not np.isfinite(s)
