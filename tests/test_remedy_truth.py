"""The remedy replays tell the truth (issues 21 and 22): a remedy is "fixed" only when the replay without any
change met the fault on the very batches the training read; the replays run on the batches the probe kept
instead of re-reading the user's dataset; an optimizer the replays cannot drive makes a remedy not
applicable, never a fault of the user's; the candidates follow the cause; a bad record is left out in every
epoch, by its dataset index. Each case is a real probe (or watch) run; the ground truth comes from the data
itself or a plain Paddle loop run here.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F
import probe_models as pm
from run_truth import step_went_nonfinite

import nandoctor
from nandoctor.findings import Phase
from nandoctor.probe import ProbeOptions, run_probe
from nandoctor.spec import load_spec

SAMPLES = Path(__file__).resolve().parent.parent / "sample_configs"


def _probe(name: str, steps: int | None = None, progress: Any = None) -> Any:
    loaded = [m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == str(SAMPLES / name / "data.py")]
    for module in loaded:  # a stream goes on where it stopped: each test's probe starts it afresh
        if hasattr(module, "_POSITION"):
            module._POSITION[0] = 0
    spec = load_spec(SAMPLES / name / "config.yaml")
    options = ProbeOptions(steps=steps or spec.probe.steps, seed=0, device="cpu")
    return run_probe(spec, options, progress) if progress else run_probe(spec, options)


def _rows(report: Any) -> dict[str, dict[str, Any]]:
    return {r["remedy"]: r for r in report.remedies}


def _data_module(name: str) -> Any:
    """The sample's data.py as the probe imported it (its read counters live there)."""
    path = str(SAMPLES / name / "data.py")
    return next(m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == path)


# -- 1. verified only on the same batches ----------------------------------------------------------------------


def test_a_stream_loaders_faulty_batch_is_replayed_from_the_kept_batches():
    """A stream never yields the same records again: the replays run on the batches the probe read, so the
    replay without any change meets the fault at its step, and the guard is verified on that very batch."""
    report = _probe("stream_loader")
    ff = report.first_fault
    # ground truth from the data: records 12*16+3 and 12*16+11 carry the x1000 unit, at step 12
    assert (ff.step, ff.sample_indices) == (12, [3, 11])
    control = report.details["remedies"]["control"]
    assert control["reproduced"] is True and control["failed_at"] == 12
    by = _rows(report)
    assert by["op_guard"]["outcome"] == "fixed"
    assert by["lr_x0.1"]["outcome"] == "not_fixed" and by["lr_x0.1"]["failed_at"] == 12
    # the report says what the replays read, and that the loader does not give the same batches again
    said = report.details["remedies"]["data"]
    assert "ran on the batches the probe read" in said and "a stream" in said


def test_no_remedy_is_verified_when_the_no_change_replay_never_met_the_fault(monkeypatch):
    """With no batch kept, the replays re-read the stream and see other records: the replay without any change
    stays finite, so no remedy is verified (nor failed): not applicable, saying why."""
    import nandoctor.remedies.trial as remedies

    real = remedies.try_remedies

    def without_kept_batches(report: Any, res: Any, workload: Any, optimizer: Any, ring: Any, **kw: Any) -> None:
        ring.batches = None  # the replays re-read the loader, as they all did before the batches were kept
        real(report, res, workload, optimizer, ring, **kw)

    monkeypatch.setattr(remedies, "try_remedies", without_kept_batches)
    report = _probe("stream_loader")
    assert report.first_fault.step == 12
    assert report.details["remedies"]["control"]["reproduced"] is False
    assert report.remedies and all(r["outcome"] == "not_applicable" for r in report.remedies), report.remedies
    tried = [r for r in report.remedies if r["remedy"] in ("op_guard", "lr_x0.1")]
    # each replay read other records at the fault's step than the training did, and says so; so did the control
    assert all("another batch at step 12 than the training did" in r["note"] for r in tried), tried
    assert "did not reproduce the fault at step 12" in report.details["remedies"]["control"]["note"]


# -- 2. replays read the kept batches, not the user's dataset ------------------------------------------------


def test_the_replays_read_the_kept_batches_instead_of_the_dataset(monkeypatch):
    """Counted at the dataset's __getitem__: the replays read the batches the probe kept and re-read the
    loader only for the steps after the fault the probe never read (kept then for the later replays);
    re-reading from batch 0 for every replay costs more than twice that."""
    import nandoctor.probe as probe_pkg

    _probe("bad_record_epochs")
    data = _data_module("bad_record_epochs")

    def reads(**options: Any) -> tuple[Any, int]:
        data.GETITEM[0] = 0
        spec = load_spec(SAMPLES / "bad_record_epochs" / "config.yaml")
        report = run_probe(spec, ProbeOptions(steps=spec.probe.steps, seed=0, device="cpu", **options))
        return report, data.GETITEM[0]

    _, probe_only = reads(try_fixes=False)
    kept, with_tape = reads()
    monkeypatch.setattr(probe_pkg, "_keep_batches", lambda loop: None, raising=False)  # every replay re-reads
    reread, without = reads()
    assert kept.first_fault.step == reread.first_fault.step == 16
    # (re-read, a shuffled epoch is only the training's when the RNG it was drawn with was kept: not always)
    assert _rows(kept)["op_guard"]["outcome"] == "fixed" and kept.details["remedies"]["control"]["reproduced"]
    end, batch = kept.details["remedies"]["end_step"], 16
    assert with_tape - probe_only <= 2 * end * batch  # each position the replays need, about once
    assert 2 * (with_tape - probe_only) <= without - probe_only, (probe_only, with_tape, without)


# -- 3. an optimizer the replays cannot drive -------------------------------------------------------------------


class HandSGD:
    """A hand-written optimizer: no paddle.optimizer.Optimizer underneath, so no `_grad_clip`."""

    def __init__(self, parameters: Any, learning_rate: float) -> None:
        self._parameter_list = list(parameters)
        self.lr = learning_rate

    def step(self) -> None:
        with paddle.no_grad():
            for p in self._parameter_list:
                if p.grad is not None:
                    p.set_value(p - self.lr * p.grad)

    def clear_grad(self) -> None:
        for p in self._parameter_list:
            p.clear_gradient()

    def get_lr(self) -> float:
        return self.lr


def _step(model: Any, batch: Any) -> Any:
    x, y = (paddle.to_tensor(v) for v in batch)
    return F.cross_entropy(model(x), y.unsqueeze(-1))


def _first_nonfinite_gradient_step(data: dict[str, Any]) -> int | None:
    """Ground truth, a plain Paddle loop with HandSGD: each step's gradients checked on the host in float64."""
    model = pm.deep_dist(depth=58)
    opt = HandSGD(model.parameters(), 0.01)
    for step, batch in enumerate(pm.loader(**data)):
        _step(model, batch).backward()
        if not all(np.isfinite(np.asarray(p.grad.numpy(), "float64")).all() for p in model.parameters()
                   if p.grad is not None):
            return step
        opt.step()
        opt.clear_grad()
    return None


def test_a_hand_written_optimizer_on_a_120_tensor_model_is_rolled_back_to_the_real_fault(tmp_path, no_stats_steps):
    data = {"zero_batch": 6, "zero_rows": [3], "batches": 12}
    assert _first_nonfinite_gradient_step(data) == 6
    model = pm.deep_dist(depth=58)
    assert len(model.parameters()) >= 120
    opt = HandSGD(model.parameters(), 0.01)
    with nandoctor.watch(model, opt, step_fn=_step, report_dir=tmp_path / "r", fields=["x", "label"]) as doctor:
        for batch in pm.loader(**data):
            loss = _step(model, batch)
            loss.backward()
            if not doctor.check(loss, batch):
                break
            opt.step()
            opt.clear_grad()
    assert 6 in doctor.watcher.unread  # the fault's gradients went unread: only the rollback names it
    assert doctor.report.details["rollback"]["found"] == {"step": 6, "kind": "grad"}
    ff = doctor.report.first_fault
    assert (ff.step, ff.phase, ff.layer, ff.op) == (6, Phase.BACKWARD, "dist", "sqrt_grad")


# -- 4. candidates by cause -----------------------------------------------------------------------------------


def test_a_nan_in_the_data_gets_data_remedies_only():
    report = _probe("nan_in_data")
    assert report.first_fault.phase == Phase.DATA
    names = {r["remedy"] for r in report.remedies}
    assert "drop_samples" in names and not names & {"lr_x0.1", "grad_clip", "warmup", "op_guard"}
    assert _rows(report)["drop_samples"]["outcome"] == "fixed"


def test_an_overflow_at_the_end_of_a_divergence_gets_step_size_remedies_not_an_op_guard():
    report = _probe("lr_divergence")
    assert any(f.code.value == "grad.explosion" for f in report.findings)
    by = _rows(report)
    assert "op_guard" not in by
    assert {"lr_x0.1", "grad_clip", "warmup"} <= set(by) and by["lr_x0.1"]["outcome"] == "fixed"
    assert by["drop_samples"]["outcome"] == "not_applicable"  # the whole batch, not its samples


def test_a_whole_batch_overflow_at_the_end_of_a_divergence_gets_no_guard_and_no_skip_list():
    """The attention's exp overflows because the weights diverged (no strict subset of the batch is special):
    no op_guard on the exp, no drop_samples, no skip list; the learning rate is the verified fix."""
    report = _probe("transformer_lr_divergence")
    assert report.first_fault.op == "exp" and not report.first_fault.sample_indices
    by = _rows(report)
    assert "op_guard" not in by
    assert by["drop_samples"]["outcome"] == "not_applicable" and "not sample-specific" in by["drop_samples"]["note"]
    assert not any(r.get("skip_list") for r in report.remedies)
    assert by["lr_x0.1"]["outcome"] == "fixed"


# -- 6. records, not positions --------------------------------------------------------------------------------


def test_a_bad_record_is_left_out_in_every_epoch_by_its_dataset_index():
    report = _probe("bad_record_epochs")
    data = _data_module("bad_record_epochs")
    # ground truth from the data: the one record with feature 2 in the wrong unit
    bad = [int(i) for i in np.flatnonzero(np.abs(data.Records(96, 37).x[:, 2]) > 100)]
    assert bad == [37]
    drop = _rows(report)["drop_samples"]
    assert drop["outcome"] == "fixed", drop
    assert drop["skip_list"]["records"] == bad and "record(s) [37]" in drop["change"]
    epochs = [b["epoch"] for b in drop["skip_list"]["batches"]]
    assert all(b["records"] == bad for b in drop["skip_list"]["batches"])  # each drop names the record
    assert len(set(epochs)) >= 3 and epochs == sorted(epochs)  # the record came again, each epoch, and was left out


def test_without_a_batch_sampler_the_drop_names_the_records_by_their_values():
    """log_of_zero's list of batches: no sampler index, so the two records are named by their fingerprints
    (the full check, epoch after epoch: test_remedy_records.py)."""
    report = _probe("log_of_zero")
    drop = _rows(report)["drop_samples"]
    assert "records" not in (drop.get("skip_list") or {})
    assert "no batch sampler names them by index" in drop["change"]
    assert len(drop["skip_list"]["fingerprints"]) == 2 and drop["outcome"] == "fixed"


# -- 8. the progress display while remedies replay --------------------------------------------------------------


def test_the_progress_display_names_the_remedy_being_replayed():
    seen: list[str] = []
    report = _probe("sqrt_at_zero", progress=lambda done, total, what: seen.append(what))
    tried = [r for r in report.remedies if r["outcome"] != "not_applicable"]
    shown = [w for w in seen if w.startswith("trying remedy")]
    assert shown == [f"trying remedy {k}/{len(tried)}: {r['remedy']}" for k, r in enumerate(tried, 1)] or \
        len(shown) == len(tried)
    assert shown[0].startswith(f"trying remedy 1/{len(shown)}: ")


# -- 5. a clamp that works -------------------------------------------------------------------------------------


def _load(path: Path) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"truth_{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _vae_steps(limit: float, steps: int = 30) -> int | None:
    """Ground truth, a plain Paddle loop over vae_exp with exp's input clamped at `limit`: the first step whose
    loss or gradients hold NaN/Inf (float64 on the host), or None."""
    vae_data, vae_model = (_load(SAMPLES / "vae_exp" / f"{name}.py") for name in ("data", "model"))
    net = vae_model.build_model()
    opt = paddle.optimizer.Adam(parameters=net.parameters(), learning_rate=0.003)
    real_exp = paddle.exp
    for step, x in enumerate(vae_data.build_loader()[:steps]):
        x = paddle.to_tensor(x)
        paddle.exp = lambda z: real_exp(paddle.clip(z, max=limit))  # the guard the remedy names
        try:
            recon, mu, logvar, std = net(x)
        finally:
            paddle.exp = real_exp
        loss = ((recon - x) ** 2).sum(-1).mean() + 0.5 * (mu ** 2 + std ** 2 - logvar - 1).sum(-1).mean()
        loss.backward()
        if step_went_nonfinite(loss, net):
            return step
        opt.step()
        opt.clear_grad()
    return None


def test_the_exp_clamp_is_searched_until_it_verifies_and_the_bundle_agrees(tmp_path):
    """exp clamped at 60 is ~1e26, squared downstream: still inf. The search goes tighter and reports the
    clamp that verified; a plain loop confirms both; the bundle's reproduce.py applies that same clamp."""
    from test_bundle_parity import FIXED_LINE, _reproduce
    from test_bundle_parity import _probe as bundle_probe

    report = bundle_probe(SAMPLES / "vae_exp" / "config.yaml", tmp_path / "b")
    assert (report["first_fault"]["step"], report["first_fault"]["op"]) == (10, "exp")
    row = next(r for r in report["remedies"] if r["remedy"] == "op_guard")
    assert row["outcome"] == "fixed", row
    limit = row["threshold"]
    assert limit < 60 and f"max={limit:g}" in row["change"] and "clamped at 60" in row["note"]
    assert _vae_steps(60.0) == 10  # the usual clamp does not help
    assert _vae_steps(limit) is None  # the one found does, through every step
    done = _reproduce(tmp_path / "b", tmp_path, "--with-remedy", "op_guard")
    assert done.returncode == 0 and FIXED_LINE in done.stdout.splitlines(), done.stdout + done.stderr


def test_a_dropped_record_verified_by_the_probe_verifies_in_the_bundle(tmp_path):
    from test_bundle_parity import FIXED_LINE, _reproduce
    from test_bundle_parity import _probe as bundle_probe

    report = bundle_probe(SAMPLES / "bad_record_epochs" / "config.yaml", tmp_path / "b")
    row = next(r for r in report["remedies"] if r["remedy"] == "drop_samples")
    assert row["outcome"] == "fixed" and row["skip_list"]["records"] == [37]
    done = _reproduce(tmp_path / "b", tmp_path, "--with-remedy", "drop_samples")
    assert done.returncode == 0 and FIXED_LINE in done.stdout.splitlines(), done.stdout + done.stderr


def _lbfgs_first_nonfinite_gradient_step() -> int | None:
    """Ground truth, a plain Paddle loop with LBFGS and its closure: the first step whose gradients (after the
    closure's backward) hold NaN/Inf, in float64 on the host."""
    data, model = (_load(SAMPLES / "lbfgs_closure" / f"{name}.py") for name in ("data", "model"))
    net = model.build_model(in_features=10, dim=8)
    opt = paddle.optimizer.LBFGS(parameters=net.parameters(), learning_rate=0.003)
    for step, (a, b, target) in enumerate(data.build_loader(batches=20, batch_size=8, bad_batch=6,
                                                            duplicate_sample=3)):
        def closure(a: Any = a, b: Any = b, target: Any = target) -> Any:
            opt.clear_grad()
            loss = F.mse_loss(net(paddle.to_tensor(a), paddle.to_tensor(b)), paddle.to_tensor(target))
            loss.backward()
            return loss

        closure()
        if not all(np.isfinite(np.asarray(p.grad.numpy(), "float64")).all() for p in net.parameters()
                   if p.grad is not None):
            return step
        opt.step(closure)
        opt.clear_grad()
    return None


def test_an_optimizer_whose_step_takes_a_closure_is_trained_and_replayed_with_one():
    """LBFGS.step(closure): the probe's loop and the replays hand it one; today's probe said "crashed, fix
    your code" (the step called without it)."""
    assert _lbfgs_first_nonfinite_gradient_step() == 6
    report = _probe("lbfgs_closure")
    assert not report.crashed
    ff = report.first_fault
    assert (ff.step, ff.phase, ff.op, ff.sample_indices) == (6, Phase.BACKWARD, "sqrt_grad", [3])
    assert report.details["remedies"]["control"]["reproduced"] is True
    assert report.remedies and not any("raised" in (r["note"] or "") for r in report.remedies), report.remedies
