"""The probe's cost policy on cheap steps: the stats schedule must keep measuring what it spends."""

from __future__ import annotations


def test_stats_schedule_recovers_from_one_slow_plain_step():
    """A first plain step slowed by first-call costs makes stats look free (k = 1); with stats on every
    step no plain step would be measured again and k would stay 1 for the whole run (the probe costing
    up to 2x a plain step on a deep model). A plain step now and then lets k find its real value."""
    from nandoctor.engine.loop import StatsSchedule

    sched = StatsSchedule()
    assert sched.want(0)
    sched.record(0, True, 1.0)
    assert not sched.want(1)
    sched.record(1, False, 0.050)  # slow: first calls, a load spike
    plain_steps = 0
    for step in range(2, 200):
        stats = sched.want(step)
        plain_steps += not stats
        sched.record(step, stats, 0.020 if stats else 0.010)
    from nandoctor.engine.watcher import _TOTAL_BUDGET

    assert sched.k == round(0.010 / (_TOTAL_BUDGET * 0.010))  # 10 ms extra per stats step, the budget of a 10 ms step
    assert plain_steps > 150
    sched.alert = True
    assert all(sched.want(s) for s in range(200, 240))  # after a warning sign: stats on every step


def test_one_slow_plain_step_costs_a_few_stats_steps_not_thirty():
    """Under `nandoctor run`, and in a pair sharing one core, step 1 (the one plain step measured) was often
    slow, and stats then ran on 30 of the first 32 steps of a 500-layer MLP (~20 ms each over a 27 ms step):
    now odd steps stay plain until three plain steps were measured, and k finds its value at once. Fed
    made-up durations (no clock): a stats step costs 10 ms more than a 10 ms plain step."""
    from nandoctor.engine.loop import StatsSchedule
    from nandoctor.engine.watcher import NORM_GRID

    sched = StatsSchedule()
    stats_steps = []
    for step in range(NORM_GRID):
        stats = sched.want(step)
        if stats:
            stats_steps.append(step)
        seconds = 1.0 if step == 0 else 0.050 if step == 1 else 0.020 if stats else 0.010  # step 1: slow
        sched.record(step, stats, seconds)
    assert stats_steps == [0, 2, 4]  # the fixed ones (0, 2), and one more before k was measured (100)
    assert sched.k == 100


def _narrow_mlp(depth: int):
    """The narrow_mlp benchmark's model (Linear + Tanh pairs, a head of its own shape): > 96 tensors, so
    the grouped path, with two one-tensor shapes (the head's weight and bias) that skip the stack."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "workloads" / "narrow_mlp" / "model.py"
    spec = importlib.util.spec_from_file_location("narrow_mlp_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_model(features=16, width=16, depth=depth, classes=10)


def test_grouped_read_matches_float64_norms_and_sees_a_nan_in_any_gradient():
    """The every-step read (global norm only) and the stats-step read (per parameter) on a many-tensor
    model equal the float64 norms computed on the host, and a NaN planted in
    any single gradient (a stacked shape or a one-tensor shape) makes the global norm non-finite."""
    import numpy as np
    import paddle

    from nandoctor.engine.monitors import StepMonitor

    paddle.seed(0)
    model = _narrow_mlp(60)
    mon = StepMonitor(model)
    try:
        assert not mon.small and mon._grouped and any(len(idx) == 1 for idx, _ in mon._groups)
        loss = paddle.nn.functional.cross_entropy(model(paddle.randn([8, 16])), paddle.randint(0, 10, [8, 1]))
        loss.backward()
        want = np.array([float(np.sum(np.asarray(p.grad.numpy(), "float64") ** 2)) for p in mon.params])
        light = mon.read(loss, full=False)
        full = mon.read(loss, full=True)
        assert light.grad_sq is None and np.isclose(light.grad_norm, np.sqrt(want.sum()), rtol=1e-4)
        assert np.allclose(full.grad_sq, want, rtol=1e-4, atol=1e-12)
        assert np.isclose(light.loss, float(loss), rtol=1e-6)
        for i in (0, len(mon.params) - 1, len(mon.params) - 2):  # first weight, head bias, head weight
            g = mon.params[i].grad
            saved = g.numpy().copy()
            bad = saved.copy()
            bad.reshape(-1)[0] = np.nan
            g.set_value(bad)
            st = mon.read(loss, full=False)
            assert not st.grads_finite, mon.param_names[i]
            g.set_value(saved)
        assert mon.read(loss, full=False).grads_finite
    finally:
        mon.close()
