"""Memory is bounded (issue 22): the probe holds at most one batch (or one copy of a tensor) more than
the step it runs. The replays hold the batch they train on and no other; the NaN/Inf checks of a batch
and the float64 recheck of overflowing gradients read a few MB at a time, never a whole copy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import memory_models
import numpy as np
import paddle
import pytest
import yaml

from nandoctor.engine import batch_tape
from nandoctor.engine.monitors import StepMonitor
from nandoctor.probe import ProbeOptions, run_probe
from nandoctor.spec import load_spec
from nandoctor.tensors import finite as batches


@pytest.mark.parametrize("tape", ["keeps none", "keeps one"])
def test_the_replays_hold_no_batch_but_the_one_they_train_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            tape: str) -> None:
    if tape == "keeps none":  # as with 100 MB batches (over KEPT_BYTES): every replay reads the loader again
        monkeypatch.setattr(batch_tape, "KEPT_BYTES", 1)
    else:  # as with 16 MB batches (over KEPT_FLOOR): the tape keeps the latest batch only
        monkeypatch.setattr(batch_tape, "KEPT_FLOOR", 0)
    memory_models.ALIVE.clear()
    memory_models.DRAWS.clear()
    monkeypatch.setattr(memory_models, "PHASE", ["loop"])
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({
        "version": 1, "model": {"entry": "memory_models:build_model"},
        "data": {"entry": "memory_models:build_loader", "fields": ["x", "label"], "label": "label"},
        "loss": {"builtin": "cross_entropy"}, "optimizer": {"name": "Adam", "args": {"learning_rate": 0.01}}}))
    held_by_the_loop: set[int] = set()

    def progress(done: int, total: int | None, what: str) -> None:
        if what != "probe step" and what != "building the model" and memory_models.PHASE[0] == "loop":
            memory_models.PHASE[0] = "replays"  # what the loop's objects still hold is not the replays' doing
            held_by_the_loop.update(memory_models.ALIVE)

    report = run_probe(load_spec(tmp_path / "config.yaml"), ProbeOptions(steps=10, seed=0, device="cpu"), progress)
    assert report.first_fault is not None and report.first_fault.step == 5
    assert any(r["remedy"] == "drop_samples" and r["outcome"] == "fixed" for r in report.remedies)
    draws = [(i, alive - held_by_the_loop) for phase, i, alive, _ in memory_models.DRAWS
             if phase == "replays"]
    assert len(draws) > 8  # the control replay and drop_samples read the loader again from batch 0
    # while a batch is made, the replay (and the tape) hold at most the one before it, as a plain loop's
    # variable does
    worst = max(draws, key=lambda d: len(d[1]))
    assert len(worst[1]) <= 2, f"drawing batch {worst[0]}, the replays held {len(worst[1]) - 1} other batch(es)"


def test_the_batch_checks_read_a_chunk_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2048, 512)).astype(np.float32)  # 4 MB
    x[[7, 1500], [3, 400]] = [np.nan, np.inf]
    mask = np.where(rng.random((2048, 512)) < 0.5, np.float32(0), np.float32(-np.inf))
    mask[9, 0] = np.nan
    truth_x = np.flatnonzero(~np.isfinite(x).all(axis=1)).tolist()
    monkeypatch.setattr(batches, "CHECK_CHUNK", 4096)
    for value, want in ((x, truth_x), (mask, [9])):  # a mask's -inf is intended: only the NaN row counts
        tracemalloc.start()
        got = batches.harmful_rows(value)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert got == want
        assert peak < value.nbytes // 16, f"{peak} bytes for a {value.nbytes}-byte batch"
    assert batches.nonfinite_rows(mask) == sorted(set(np.flatnonzero(~np.isfinite(mask).all(axis=1)).tolist()))
    # a tensor reaches the host a chunk at a time, never whole
    copied: list[int] = []
    to_numpy = batches.to_numpy
    monkeypatch.setattr(batches, "to_numpy", lambda v: copied.append(int(np.prod(v.shape))) or to_numpy(v))
    assert batches.harmful_rows(paddle.to_tensor(x)) == truth_x
    assert copied and max(copied) <= 4096 < x.size


def test_the_gradient_recheck_reads_a_chunk_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    paddle.seed(0)
    model = paddle.nn.Linear(256, 64)
    x = paddle.to_tensor(np.full((4, 256), 1e18, dtype=np.float32))
    model(x).sum().backward()  # finite gradients whose squares overflow float32
    grads = [np.asarray(p.grad.numpy(), dtype=np.float64) for p in model.parameters()]
    assert all(np.isfinite(g).all() for g in grads)
    monitor = StepMonitor(model)
    stats = monitor.read(paddle.to_tensor(1.0))
    assert not stats.grads_finite  # the float32 norm overflowed
    copied: list[int] = []
    to_numpy = batches.to_numpy
    monkeypatch.setattr(batches, "CHECK_CHUNK", 1024)
    monkeypatch.setattr(batches, "to_numpy", lambda v: copied.append(int(np.prod(v.shape))) or to_numpy(v))
    assert monitor.recheck_grads(stats)
    assert stats.grad_norm == pytest.approx(np.sqrt(sum(float((g * g).sum()) for g in grads)), rel=1e-9)
    assert max(copied) <= 1024 < grads[0].size


def test_the_loop_holds_one_batch_beyond_its_own_and_none_after_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   no_stats_steps: None) -> None:
    """A many-tensor model's parameters are checked only now and then, so an update fault may name an update
    many steps back: the watcher keeps where those updates were, not their batches (the probe reads an update
    fault's batch back from its tape). While a batch is made, the loop holds only the one before it; after
    the loop, only the fault's own batch."""
    from nandoctor.engine import monitors
    from nandoctor.engine.loop import ProbeLoop

    monkeypatch.setattr(batch_tape, "KEPT_BYTES", 1)  # the tape keeps none (100 MB batches)
    monkeypatch.setattr(monitors, "SMALL_MODEL_TENSORS", 0)  # the parameters checked on stats steps only
    memory_models.ALIVE.clear()
    memory_models.DRAWS.clear()
    monkeypatch.setattr(memory_models, "PHASE", ["loop"])
    after_loop: list[tuple[set[int], set[int]]] = []
    run = ProbeLoop.run

    def watched_run(loop: ProbeLoop) -> object:
        res = run(loop)
        memory_models.PHASE[0] = "after"
        fault = res.fault
        own = {fault.batch_index} if fault is not None and fault.fields is not None else set()
        after_loop.append((set(memory_models.ALIVE.values()), own))
        return res

    monkeypatch.setattr(ProbeLoop, "run", watched_run)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({
        "version": 1, "model": {"entry": "memory_models:build_model"},
        "data": {"entry": "memory_models:build_loader", "fields": ["x", "label"], "label": "label"},
        "loss": {"builtin": "cross_entropy"}, "optimizer": {"name": "Adam", "args": {"learning_rate": 0.01}}}))
    report = run_probe(load_spec(tmp_path / "config.yaml"), ProbeOptions(steps=10, seed=0, device="cpu"))
    assert report.first_fault is not None and report.first_fault.step == 5
    draws = [(i, held) for phase, i, _, held in memory_models.DRAWS if phase == "loop"]
    assert len(draws) == 6  # batches 0-5: the fault at 5 ends the loop
    worst = max(draws, key=lambda d: len(d[1]))
    assert len(worst[1]) <= 2, f"drawing batch {worst[0]}, the loop held batches {worst[1]}"
    [(alive, own)] = after_loop
    assert alive <= own, f"after the loop, batches {sorted(alive - own)} were still held beside the fault's"


@pytest.mark.parametrize("tape", ["keeps them", "keeps none"])
def test_an_update_fault_s_batch_is_read_back_for_the_bundle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            no_stats_steps: None, tape: str) -> None:
    """The update that wrote NaN is named by its position; the bundle's batch is that step's batch as the
    loader yields it (read back from the tape's kept batches, or from a fresh loader), not the step's after."""
    import probe_models as pm
    from probe_spec import probe

    from nandoctor.engine.snapshots import SnapshotRing

    if tape == "keeps none":
        monkeypatch.setattr(batch_tape, "KEPT_BYTES", 1)
    # no snapshot to roll back to: the update fault over the unread steps stands, named at its first candidate
    monkeypatch.setattr(SnapshotRing, "latest", lambda self, at_most: None)
    data = {"zero_batch": 6, "zero_rows": [3], "batches": 12}
    report = probe(tmp_path, model="deep_dist", data_args=data, steps=12)
    ff = report.first_fault
    finding = next(f for f in report.findings if f.code.value == "update.nonfinite")
    first = finding.evidence["update_steps"][0]
    assert ff.step == first and ff.batch_index == first  # one epoch: the step is the batch index
    assert "rollback" in report.details and first not in (report.details["steps_run"], 0)
    x, label = pm.loader(**data)[first]
    kept = report.artifacts["batch"]
    assert report.artifacts["batch_index"] == first
    np.testing.assert_array_equal(kept["x"], x)
    np.testing.assert_array_equal(kept["label"], label)


def test_a_large_captured_batch_waits_for_the_bundle_on_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fault's batch is copied for the bundle at the fault and held until the bundle is written, through
    every replay: a large field is written out at once, without a copy in memory, and still reads back as
    the batch was at the fault (the loader may reuse its buffer afterwards)."""
    from nandoctor.engine import artifacts

    monkeypatch.setattr(artifacts, "SPILL_BYTES", 1 << 20)
    x = np.random.default_rng(0).normal(size=(1024, 1024)).astype(np.float32)  # 4 MB: over the patched limit
    label = np.arange(1024, dtype=np.int64)  # 8 KB: under it, copied in memory
    truth = x.copy()
    tracemalloc.start()
    kept = artifacts.batch_arrays({"x": x, "label": label, "ids": paddle.to_tensor(label)})
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < x.nbytes // 4, f"{peak} bytes in memory to capture a {x.nbytes}-byte field"
    x[:] = 0.0  # the loader reuses its buffer
    label[:] = -1
    np.testing.assert_array_equal(kept["x"], truth)
    np.testing.assert_array_equal(kept["label"], np.arange(1024))
    np.testing.assert_array_equal(kept["ids"], np.arange(1024))


def test_the_captured_model_state_waits_for_the_bundle_on_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model state captured at the fault (for the bundle) is the weights as they were then, however the
    replays change the model; a large tensor's copy is on disk, not a model's size more in memory."""
    from nandoctor.engine import artifacts

    monkeypatch.setattr(artifacts, "SPILL_BYTES", 1 << 20)
    paddle.seed(0)
    model = paddle.nn.Linear(1024, 1024)  # a 4 MB weight, a 4 KB bias
    truth = {name: value.numpy().copy() for name, value in model.state_dict().items()}
    state = artifacts.model_state(model)
    with paddle.no_grad():
        model.weight.set_value(paddle.zeros([1024, 1024]))
        model.bias.set_value(paddle.ones([1024]))
    assert set(state) == set(truth)
    for name, value in truth.items():
        np.testing.assert_array_equal(state[name], value)
    assert isinstance(state["weight"], np.memmap) and not isinstance(state["bias"], np.memmap)


def test_the_loop_holds_no_batch_of_a_quiet_stretch_but_the_steps_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     pinned_schedule: int) -> None:
    """The probe's quiet steps (StepWatcher.quiet_until) note each step for the watcher's catch-up at the
    window's end: the batches of the window must not be kept for it (a window of 16 MB batches was +68 MB
    peak RSS on the benchmarks' wide_batch), nor the batch of the step before the window."""
    from nandoctor.engine.watcher import READ_ALL_STEPS, StepWatcher

    monkeypatch.setattr(batch_tape, "KEPT_BYTES", 1)  # the tape keeps none: what is alive is the loop's
    memory_models.ALIVE.clear()
    memory_models.DRAWS.clear()
    monkeypatch.setattr(memory_models, "PHASE", ["loop"])
    n = READ_ALL_STEPS + 4 * pinned_schedule
    quiet: list[int] = []
    quiet_steps = StepWatcher.quiet_steps
    monkeypatch.setattr(StepWatcher, "quiet_steps", lambda self, steps, fields: (
        quiet.append(len(steps)), quiet_steps(self, steps, fields)))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({
        "version": 1, "model": {"entry": "memory_models:build_model"},
        "data": {"entry": "memory_models:build_loader", "args": {"batches": n, "fault_at": -1},
                 "fields": ["x", "label"], "label": "label"},
        "loss": {"builtin": "cross_entropy"}, "optimizer": {"name": "Adam", "args": {"learning_rate": 0.01}}}))
    report = run_probe(load_spec(tmp_path / "config.yaml"), ProbeOptions(steps=n, seed=0, device="cpu"))
    assert report.first_fault is None and sum(quiet) > 2 * pinned_schedule
    worst = max((d for d in memory_models.DRAWS if d[0] == "loop"), key=lambda d: len(d[2]))
    assert len(worst[2]) <= 2, f"drawing batch {worst[1]}, the loop held batches {worst[3]}"


def _run_measured(cmd: list[str]) -> tuple[float, int, str]:
    """(peak RSS in MB, exit status, stderr) of one child process: its own peak, from wait4."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    err = proc.stderr.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_maxrss / 1024, proc.returncode, err


def test_a_scan_of_large_batches_peaks_within_one_batch_of_a_plain_loop(tmp_path: Path) -> None:
    """Issue 34: `nandoctor scan` of a generator of 48 MB batches of narrow rows (a NaN in one) peaks at most
    one batch above a plain loop reading the same generator, each in its own process (peak RSS from wait4).
    Before, the model's first forward ran on the whole batch (activations twice the batch), and the checks
    made float64 copies, whole-batch masks and per-sample arrays, and kept the NaN batch twice: 4.7 batches
    more on 100 MB batches."""
    here = Path(memory_models.__file__).resolve()
    args = {"rows": 3 << 19, "features": 8, "batches": 6, "nan_at": 2}
    batch_mb = args["rows"] * args["features"] * 4 / 2**20  # 48 MB of float32, and 12 MB of int64 labels
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({
        "version": 1, "model": {"entry": f"{here}:build_narrow_model"},
        "data": {"entry": f"{here}:build_narrow_loader", "args": args, "fields": ["x", "label"], "label": "label"},
        "loss": {"builtin": "cross_entropy"}}))
    plain_mb, code, err = _run_measured([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(here.parent)!r}); "
                                         f"import memory_models; memory_models.read_narrow_loader(**{args!r})"])
    assert code == 0, err
    report = tmp_path / "report.json"
    scan_mb, code, err = _run_measured([sys.executable, "-m", "nandoctor", "scan", str(tmp_path / "config.yaml"),
                                        "--json", str(report), "-q"])
    found = json.loads(report.read_text(encoding="utf-8"))
    assert code == 1, err  # the NaN: the scan read every batch and found it
    [nan] = [f for f in found["findings"] if f["code"] == "data.nonfinite"]
    assert nan["location"]["batch_index"] == 2 and nan["location"]["sample_indices"] == [5]
    assert found["details"]["batches"] == args["batches"] and found["details"]["num_classes"] == 2
    extra = scan_mb - plain_mb
    shown = f"scan {scan_mb:.0f} MB, plain loop {plain_mb:.0f} MB: {extra / batch_mb:+.2f} batch(es)"
    print(shown)
    assert extra <= batch_mb, shown
