"""Resuming from the user's checkpoint (issue 23, 4): the spec's `resume` block and `probe --resume DIR`.

Ground truth comes from a plain Paddle loop in the test: it trains the diverging regression of
tests/resume_models.py, saves a checkpoint after N steps with paddle.save, and goes on until its first
non-finite value (forward hooks name the layer). The probe resumed from that checkpoint must name the same
step, with the plain loop's losses on every step in between (weights, momentum, the scheduler's state and
the loader's position all loaded right), and the same layer and op as a probe from step 0.
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
import yaml
from typer.testing import CliRunner

from nandoctor.cli import app
from nandoctor.probe import ProbeOptions, run_probe
from nandoctor.report import json as json_report
from nandoctor.spec import load_spec

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import resume_models as rm  # noqa: E402

MODELS = HERE / "resume_models.py"
N = 13  # the checkpoint's step: epoch 4, batch 1 (three batches an epoch), so the skip crosses epochs
LR = 0.1


def _spec(folder: Path, resume: dict[str, Any] | None = None, *, data: str = "build_loader",
          model_args: dict[str, Any] | None = None, optimizer: str = "Momentum", extra: dict | None = None,
          warmup: int = 100) -> Path:
    raw: dict[str, Any] = {
        "version": 1,
        "model": {"entry": f"{MODELS}:build_model", "args": model_args or {}},
        "data": {"entry": f"{MODELS}:{data}", "fields": ["x", "y"], "label": "y"},
        "loss": {"builtin": "mse"},
        "optimizer": {"name": optimizer, "args": {"learning_rate": LR, **({"momentum": 0.9} if optimizer ==
                                                                            "Momentum" else {})},
                      "lr_scheduler": {"warmup": {"steps": warmup, "start_lr": 0.0}}},
    }
    if resume is not None:
        raw["resume"] = resume
    raw.update(extra or {})
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def _plain(ckpt: Path, optimizer: str = "Momentum", warmup: int = 100, n: int = N) -> dict[str, Any]:
    """The user's own loop, as nandoctor's step runs it (forward, mse, backward, step, clear_grad, the
    warmup's step): saves a checkpoint after N steps, stops at the first non-finite output, loss or
    gradient. Returns the losses by step, the fault's step and the first sublayer whose output was
    non-finite on that step."""
    model = rm.build_model()
    sched = paddle.optimizer.lr.LinearWarmup(learning_rate=LR, warmup_steps=warmup, start_lr=0.0, end_lr=LR)
    kw = {"momentum": 0.9} if optimizer == "Momentum" else {}
    opt = getattr(paddle.optimizer, optimizer)(learning_rate=sched, parameters=model.parameters(), **kw)
    bad_layers: list[str] = []
    hooks = [layer.register_forward_post_hook(
        lambda _l, _i, out, name=name: bad_layers.append(name) if not np.isfinite(out.numpy()).all() else None)
        for name, layer in model.named_sublayers()]
    losses: dict[int, float] = {}
    step = 0
    try:
        for _epoch in range(1000):
            for x, y in rm.build_loader():
                if step == n:
                    ckpt.mkdir(parents=True, exist_ok=True)
                    paddle.save(model.state_dict(), str(ckpt / "model.pdparams"))
                    paddle.save(opt.state_dict(), str(ckpt / "opt.pdopt"))
                    paddle.save(sched.state_dict(), str(ckpt / "sched.pdparams"))
                bad_layers.clear()
                loss = F.mse_loss(model(x), y.astype("float32").reshape([-1, 1]))
                losses[step] = float(loss)
                if bad_layers or not math.isfinite(losses[step]):
                    return {"losses": losses, "fault": step, "layer": bad_layers[0] if bad_layers else None}
                loss.backward()
                if any(not np.isfinite(p.grad.numpy()).all() for p in model.parameters() if p.grad is not None):
                    return {"losses": losses, "fault": step, "layer": None}
                opt.step()
                opt.clear_grad()
                sched.step()
                step += 1
    finally:
        for h in hooks:
            h.remove()
    raise AssertionError("the plain loop never went non-finite")


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("resume")
    truth = _plain(folder / "ckpt")
    truth["folder"] = folder
    assert truth["fault"] > N + 3  # a late fault: several resumed steps, epochs crossed, before it
    return truth


def _probe(config: Path, steps: int = 30) -> dict[str, Any]:
    return json.loads(json_report.render(run_probe(load_spec(config), ProbeOptions(steps=steps, seed=0,
                                                                                   device="cpu"))))


RESUME = {"model": "ckpt/model.pdparams", "optimizer": "ckpt/opt.pdopt", "lr_scheduler": "ckpt/sched.pdparams",
          "step": N}


def test_resumed_probe_names_the_plain_loops_step_layer_and_op(plain: dict[str, Any], tmp_path: Path) -> None:
    folder = plain["folder"]
    full = _probe(_spec(tmp_path), steps=60)
    resumed = _probe(_spec(folder, RESUME), steps=30)
    fault = plain["fault"]
    assert full["first_fault"]["step"] == fault
    assert resumed["first_fault"]["step"] == fault  # absolute, not counted from the resume point
    for key in ("phase", "layer", "op", "batch_index"):
        assert resumed["first_fault"][key] == full["first_fault"][key], key
    assert resumed["first_fault"]["layer"] == plain["layer"]
    assert resumed["first_fault"]["batch_index"] == fault % 3  # the loader's position within its epoch
    # the timeline goes on from step N with the plain loop's losses: weights, momentum, the scheduler's
    # state and the loader's position were all as the checkpoint left them
    kept = {p["step"]: p["loss"] for p in resumed["timeline"] if p["loss"] is not None}
    assert min(kept) == N
    for step in range(N, fault):
        assert kept[step] == pytest.approx(plain["losses"][step], rel=1e-5), step
    assert resumed["details"]["steps_run"] == fault - N
    info = resumed["details"]["resumed"]
    assert info["step"] == N and info["model"].endswith("model.pdparams") and info["optimizer"].endswith("opt.pdopt")
    assert info["optimizer_state"]["parameters_without_state"] == 0
    assert any(f["code"] == "run.resumed" and f["severity"] == "info" for f in resumed["findings"])
    # remedies replay from the ring after the resume, at absolute steps
    tried = [r for r in resumed["remedies"] if r["outcome"] != "not_applicable"]
    assert tried and all(r["start_step"] >= N and r["steps_run"] > 0 for r in tried)


def test_without_the_optimizer_state_the_run_differs(plain: dict[str, Any]) -> None:
    """The momentum buffers matter: leaving `optimizer` out changes the loss right after the first update,
    which is what the test above would see if the optimizer's state were not loaded."""
    folder = plain["folder"]
    no_opt = {k: v for k, v in RESUME.items() if k != "optimizer"}
    rep = _probe(_spec(folder, no_opt), steps=3)
    losses = {p["step"]: p["loss"] for p in rep["timeline"]}
    assert losses[N] == pytest.approx(plain["losses"][N], rel=1e-5)  # the weights alone decide the first loss
    assert losses[N + 1] != pytest.approx(plain["losses"][N + 1], rel=1e-3)
    assert "optimizer starts fresh" in rep["details"]["resumed"]["note"]


def test_resume_at_skips_across_epochs_without_loading_the_skipped_batches(plain: dict[str, Any]) -> None:
    from nandoctor.workload.build import build_workload

    spec = load_spec(_spec(plain["folder"], RESUME))
    w = build_workload(spec)
    epochs: list[int] = []
    reads = sys.modules[type(w.model).__module__].Data.reads  # the entry's module as nandoctor imported it
    reads.clear()
    epoch, batch_index, it = w.resume_at(N, epochs.append)
    assert (epoch, batch_index) == divmod(N, 3) == (4, 1)
    assert epochs == [4]
    first = next(iter(it))
    # the skipped batch (samples 0-3) was never read nor collated; the reader thread may have fetched ahead
    assert reads[:4] == [4, 5, 6, 7] and not {0, 1, 2, 3} & set(reads)
    plain_batches = list(rm.build_loader())
    assert np.array_equal(first[0].numpy(), plain_batches[1][0].numpy())


def test_a_loader_without_length_is_skipped_by_iterating(plain: dict[str, Any]) -> None:
    from nandoctor.workload.build import build_workload

    w = build_workload(load_spec(_spec(plain["folder"], RESUME, data="build_generator")))
    epochs: list[int] = []
    epoch, batch_index, it = w.resume_at(N, epochs.append)
    assert (epoch, batch_index) == (4, 1) and epochs == [0, 1, 2, 3, 4]
    x, _ = next(it)
    assert np.array_equal(x, rm.Data().x[4:8])


def _cli(*args: str) -> Any:
    return CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"}).invoke(app, list(args))


def _trainer_folder(plain: dict[str, Any], root: Path) -> Path:
    """A Trainer's checkpoint-N folder as PaddleNLP's `_save_checkpoint` writes it, made with paddle.save."""
    ckpt, src = root / "out" / f"checkpoint-{N}", plain["folder"] / "ckpt"
    ckpt.mkdir(parents=True)
    (ckpt / "model_state.pdparams").write_bytes((src / "model.pdparams").read_bytes())
    (ckpt / "optimizer.pdopt").write_bytes((src / "opt.pdopt").read_bytes())
    (ckpt / "scheduler.pdparams").write_bytes((src / "sched.pdparams").read_bytes())
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": N, "epoch": N / 3, "log_history": []}))
    rng = {"python": random.getstate(), "numpy": np.random.get_state(), "cuda": paddle.get_rng_state(),
           "cpu": paddle.framework.core.default_cpu_generator().get_state()}  # as _save_checkpoint writes it
    paddle.save(rng, str(ckpt / "rng_state.pth"))
    return ckpt


def test_resume_dir_takes_a_trainer_checkpoint_folder(plain: dict[str, Any], tmp_path: Path) -> None:
    ckpt = _trainer_folder(plain, tmp_path)
    out = tmp_path / "report.json"
    result = _cli("probe", str(_spec(tmp_path)), "--resume", str(ckpt), "--steps", "30", "--json", str(out), "-q")
    assert result.exit_code == 1, result.output
    rep = json.loads(out.read_text())
    assert rep["first_fault"]["step"] == plain["fault"]
    info = rep["details"]["resumed"]
    assert info["trainer_global_step"] == N and info["step"] == N
    assert info["lr_scheduler"].endswith("scheduler.pdparams")
    assert info["rng"].startswith("restored from") and info["rng"].endswith("rng_state.pth")
    assert "--resume" in rep["run"]["command_line"] and f"checkpoint-{N}" in rep["run"]["command_line"]


def _fails(result: Any, *words: str) -> None:
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    for word in words:
        assert word in text, (word, text)
    assert "Traceback" not in result.output


def test_a_missing_checkpoint_file_is_exit_2_naming_it(plain: dict[str, Any]) -> None:
    config = _spec(plain["folder"], {**RESUME, "model": "ckpt/nope.pdparams"})
    _fails(_cli("probe", str(config)), "resume.model", "nope.pdparams", "does not exist")


def test_a_key_the_model_does_not_have_is_exit_2_naming_it(plain: dict[str, Any], tmp_path: Path) -> None:
    state = paddle.load(str(plain["folder"] / "ckpt" / "model.pdparams"))
    state["body.weightt"] = state.pop("body.weight")
    (tmp_path / "ckpt").mkdir()
    paddle.save(state, str(tmp_path / "ckpt" / "model.pdparams"))
    _fails(_cli("probe", str(_spec(tmp_path, {"model": "ckpt/model.pdparams", "step": N}))),
           "'body.weightt'", "model.pdparams", "did you mean 'body.weight'")


def test_a_shape_mismatch_is_exit_2_naming_the_key(plain: dict[str, Any]) -> None:
    config = _spec(plain["folder"], RESUME, model_args={"hidden": 8})
    _fails(_cli("probe", str(config)), "'body.weight'", "[4, 16]", "[4, 8]", "model.pdparams")


def test_another_optimizers_state_is_exit_2_naming_the_key(plain: dict[str, Any]) -> None:
    config = _spec(plain["folder"], RESUME, optimizer="Adam")
    _fails(_cli("probe", str(config)), "opt.pdopt", "_velocity_0'", "Adam", "optimizer.name")


@pytest.mark.parametrize("step, words", [(-1, ["resume.step", "-1"]), ("2000", ["resume.step", "'2000'"]),
                                         (13, ["resume.step", "multiple of optimizer.accumulate_steps (2)"])])
def test_a_bad_step_is_exit_2(plain: dict[str, Any], step: Any, words: list[str]) -> None:
    extra = None
    if step == 13:  # with accumulate_steps 2, 13 batches is mid-accumulation
        extra = {"optimizer": {"name": "Momentum", "args": {"learning_rate": LR, "momentum": 0.9},
                               "accumulate_steps": 2}}
    config = _spec(plain["folder"], {**RESUME, "step": step}, extra=extra)
    _fails(_cli("probe", str(config)), *words)


def test_unknown_resume_key_suggests_the_closest(plain: dict[str, Any]) -> None:
    config = _spec(plain["folder"], {"modle": "ckpt/model.pdparams", "step": N})
    _fails(_cli("scan", str(config)), "resume.modle", "did you mean 'model'")


def test_resume_dir_without_trainer_state_is_exit_2(plain: dict[str, Any], tmp_path: Path) -> None:
    ckpt = _trainer_folder(plain, tmp_path)
    (ckpt / "trainer_state.json").unlink()
    _fails(_cli("probe", str(_spec(tmp_path)), "--resume", str(ckpt)), "trainer_state.json", "does not exist")


def test_scan_checks_the_checkpoints_weights(plain: dict[str, Any], tmp_path: Path) -> None:
    """A NaN saved in the checkpoint is param.nonfinite in a scan of the spec that resumes from it."""
    state = paddle.load(str(plain["folder"] / "ckpt" / "model.pdparams"))
    weight = state["out.weight"].numpy()
    weight[2, 0] = np.nan
    state["out.weight"] = paddle.to_tensor(weight)
    (tmp_path / "ckpt").mkdir()
    paddle.save(state, str(tmp_path / "ckpt" / "model.pdparams"))
    bad = [k for k, v in state.items() if not np.isfinite(v.numpy()).all()]
    out = tmp_path / "scan.json"
    result = _cli("scan", str(_spec(tmp_path, {"model": "ckpt/model.pdparams", "step": N})), "--json", str(out))
    assert result.exit_code == 1, result.output
    rep = json.loads(out.read_text())
    found = [f for f in rep["findings"] if f["code"] == "param.nonfinite"]
    assert [f["location"]["parameter"] for f in found] == bad == ["out.weight"]


def test_a_report_never_overwrites_the_checkpoint(plain: dict[str, Any]) -> None:
    target = plain["folder"] / "ckpt" / "opt.pdopt"
    before = target.read_bytes()
    _fails(_cli("probe", str(_spec(plain["folder"], RESUME)), "--json", str(target)), "opt.pdopt", "overwrite")
    assert target.read_bytes() == before


def test_resume_dir_reads_sharded_weights(plain: dict[str, Any], tmp_path: Path) -> None:
    """save_pretrained's sharded layout: model_state.pdparams.index.json naming the shard of every key."""
    ckpt = _trainer_folder(plain, tmp_path)
    state = paddle.load(str(ckpt / "model_state.pdparams"))
    (ckpt / "model_state.pdparams").unlink()
    shards = {"model_state-00001-of-00002.pdparams": [k for k in state if k.startswith("body.")],
              "model_state-00002-of-00002.pdparams": [k for k in state if not k.startswith("body.")]}
    for name, keys in shards.items():
        paddle.save({k: state[k] for k in keys}, str(ckpt / name))
    index = {"weight_map": {k: name for name, keys in shards.items() for k in keys}}
    (ckpt / "model_state.pdparams.index.json").write_text(json.dumps(index))
    out = tmp_path / "report.json"
    result = _cli("probe", str(_spec(tmp_path)), "--resume", str(ckpt), "--steps", "30", "--json", str(out), "-q")
    assert result.exit_code == 1, result.output
    rep = json.loads(out.read_text())
    assert rep["first_fault"]["step"] == plain["fault"]
    assert rep["details"]["resumed"]["model"].endswith("model_state.pdparams.index.json")


def test_resume_with_nproc_is_refused(plain: dict[str, Any]) -> None:
    _fails(_cli("probe", str(_spec(plain["folder"], RESUME)), "--nproc", "2"), "--nproc 2", "not supported")


def test_a_late_fault_after_the_resume_is_named_where_reads_are_spaced_out(tmp_path: Path) -> None:
    """A fault some 130 steps after the resume point, past the steps the probe reads in full: the snapshot
    ring (taken from the resumed step on) and the spaced reads still name the plain loop's step and layer."""
    n, warmup = 100, 250
    truth = _plain(tmp_path / "ckpt", warmup=warmup, n=n)
    assert truth["fault"] > n + 100
    rep = _probe(_spec(tmp_path, {**RESUME, "step": n}, warmup=warmup), steps=200)
    assert rep["first_fault"]["step"] == truth["fault"]
    assert rep["first_fault"]["layer"] == truth["layer"]
    kept = {p["step"]: p["loss"] for p in rep["timeline"] if p["loss"] is not None}
    for step in (n, n + 1, n + 50):
        assert kept[step] == pytest.approx(truth["losses"][step], rel=1e-5), step
    rollback = rep["details"].get("rollback")
    if rollback is not None and "replayed_from_step" in rollback:  # the fault was on an unread step
        assert rollback["replayed_from_step"] >= n
