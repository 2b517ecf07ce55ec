"""The probe's cost policy on cheap steps: the stats schedule must keep measuring what it spends."""

from __future__ import annotations


def test_stats_schedule_recovers_from_one_slow_plain_step():
    """A first plain step slowed by first-call costs makes stats look free (k = 1); with stats on every
    step no plain step would be measured again and k would stay 1 for the whole run (the probe costing
    up to 2x a plain step on a deep model). A plain step now and then lets k find its real value."""
    from nandoctor.probe.loop import StatsSchedule

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
    assert sched.k == 34  # 10 ms extra per stats step, 3% of a 10 ms step
    assert plain_steps > 150
    sched.alert = True
    assert all(sched.want(s) for s in range(200, 240))  # after a warning sign: stats on every step
