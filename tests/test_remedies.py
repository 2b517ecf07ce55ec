"""Verified remedies: after a fault the probe replays each candidate fix and reports which kept training finite.

For each buggy sample the remedies table is read from the JSON report (`nandoctor probe CONFIG --json`):
the first row must be the fix a practitioner would choose (the config's own "Fix:" comment), verified
(`fixed`), and a candidate that cannot help (a lower learning rate for an op that is singular at one
input) must be shown `not_fixed`. Two of those verdicts are checked against a plain Paddle loop, without
nandoctor: the sample's own model, data, loss and optimizer with the fix applied by hand.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from nandoctor.cli import app

SAMPLES = Path(__file__).resolve().parent.parent / "sample_configs"

# sample -> (the remedy a practitioner would choose: first and fixed, remedies that must be not_fixed)
EXPECT = {
    "sqrt_at_zero": ("op_guard", {"lr_x0.1", "grad_clip"}),  # sqrt(x + eps); a lower LR cannot help
    "log_of_zero": ("op_guard", {"lr_x0.1"}),  # clamp before the log (or the fused stable loss)
    "exp_overflow": ("op_guard", {"lr_x0.1"}),  # guard the exp (subtract the max)
    "neg_fractional_pow": ("op_guard", {"lr_x0.1"}),  # clamp the base of the fractional power
    "empty_mask_mean": ("op_guard", {"lr_x0.1"}),  # divide by max(count, eps)
    "lr_divergence": ("lr_x0.1", set()),  # the learning rate is too high
    "exploding_rnn": ("grad_clip", set()),  # clip an RNN's gradients
    "bad_init_overflow": ("reinit", {"lr_x0.1"}),  # a fan-in scaled init
    "nan_in_data": ("drop_samples", set()),  # filter the NaN samples out (no rate or clip replays: not candidates)
    # re-draw the NaN row; dropping its two samples leaves the NaN row there (finite only while no batch reads it)
    "embedding_nan_row": ("reinit_rows", {"lr_x0.1", "drop_samples"}),
}


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory):
    """probe(name, *extra) -> JSON report; each distinct call runs once per module."""
    cache: dict[tuple[str, ...], dict[str, Any]] = {}
    folder = tmp_path_factory.mktemp("remedies")

    def run(name: str, *extra: str) -> dict[str, Any]:
        key = (name, *extra)
        if key not in cache:
            out = folder / f"{name}{len(cache)}.json"
            args = ["probe", str(SAMPLES / name / "config.yaml"), "--json", str(out), "-q", *extra]
            result = CliRunner().invoke(app, args)
            assert out.is_file(), f"no JSON report (exit {result.exit_code}):\n{result.output}"
            cache[key] = json.loads(out.read_text(encoding="utf-8"))
        return cache[key]

    return run


def _by_name(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["remedy"]: r for r in report["remedies"]}


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_the_practitioners_fix_is_verified_first(probe, name):
    report = probe(name)
    first, hopeless = EXPECT[name]
    rows = report["remedies"]
    assert rows, f"{name}: no remedies were tried"
    for row in rows:  # the contract's keys, and a known outcome
        assert {"remedy", "change", "outcome", "steps_run", "loss_before", "loss_after", "seconds"} <= set(row)
        assert row["outcome"] in ("fixed", "not_fixed", "not_applicable")
    assert rows[0]["remedy"] == first and rows[0]["outcome"] == "fixed", rows
    fault_step = report["first_fault"]["step"]
    top = rows[0]
    # it ran past the fault to the fault step + 20, finite, with the loss no worse than where it started
    assert top["start_step"] + top["steps_run"] == fault_step + 20
    assert math.isfinite(top["loss_after"]) and top["loss_after"] < 10 * max(abs(top["loss_before"]), 1e-3)
    by = _by_name(report)
    for remedy in hopeless:
        assert by[remedy]["outcome"] == "not_fixed", by[remedy]
        assert by[remedy].get("failed_at") is not None or "NaN weight" in by[remedy]["note"]
    outcomes = [r["outcome"] for r in rows]  # verified first, then not fixed, then not applicable
    assert outcomes == sorted(outcomes, key=["fixed", "not_fixed", "not_applicable"].index)
    info = report["details"]["remedies"]
    assert info["control"]["reproduced"] is True  # without a change the replay faults where the probe did
    timed = report["details"]["timings"]["remedies"]  # clock-dependent figures live under details.timings
    assert timed["seconds"] <= timed["budget_seconds"]
    # the fault's own finding leads its advice with what was verified
    symptom = next(f for f in report["findings"] if f["location"]["step"] == fault_step
                   and f["severity"] == "error")
    assert symptom["advice"][0].startswith(f"Verified by replay ({first})")


def test_divergence_remedies_restart_before_the_growth(probe):
    report = probe("lr_divergence")
    growth = next(f for f in report["findings"] if f["code"] == "grad.explosion")
    by = _by_name(report)
    assert by["lr_x0.1"]["start_step"] <= growth["location"]["step"] < report["first_fault"]["step"]
    assert by["warmup"]["start_step"] == 0
    assert "op_guard" not in by  # a divergence's overflow: an epsilon on its last op is not a candidate
    assert by["drop_samples"]["outcome"] == "not_applicable"  # the weights diverged, not a sample
    assert "learning_rate: 0.003" in by["lr_x0.1"]["change"]
    assert "grad_clip: {global_norm:" in by["grad_clip"]["change"]


def test_dropping_samples_gives_a_skip_list(probe):
    by = _by_name(probe("sqrt_at_zero"))
    drop = by["drop_samples"]
    assert drop["outcome"] == "fixed"
    prints = drop["skip_list"]["fingerprints"]  # a list loader: the record named by its values
    assert drop["skip_list"] == {"fingerprints": prints,
                                 "batches": [{"epoch": 0, "batch_index": 6, "step": 6, "samples": [3],
                                              "fingerprints": prints}],
                                 "skip_data_intervals": [[7, 7]]}  # PaddleFormers: 1-based global steps
    assert "paddle.sqrt(x + 1e-12)" in by["op_guard"]["change"] and "model.py:13" in by["op_guard"]["change"]


def test_no_try_fixes_and_fix_steps(probe):
    off = probe("sqrt_at_zero", "--no-try-fixes")
    assert off["remedies"] == [] and "remedies" not in off["details"]
    assert off["first_fault"]["step"] == 6
    short = probe("sqrt_at_zero", "--fix-steps", "3")
    top = short["remedies"][0]
    assert top["remedy"] == "op_guard" and top["outcome"] == "fixed"
    assert top["start_step"] + top["steps_run"] == 6 + 3
    assert short["details"]["remedies"]["end_step"] == 9


def test_markdown_and_console_show_the_remedies(tmp_path):
    md = tmp_path / "r.md"
    result = CliRunner().invoke(app, ["probe", str(SAMPLES / "sqrt_at_zero" / "config.yaml"), "--markdown", str(md)])
    assert result.exit_code == 1
    assert "remedies (replayed from a saved state)" in result.output and "verified fix" in result.output
    text = md.read_text(encoding="utf-8")
    section = text[text.index("## Remedies"):text.index("## What to do")]
    assert section.index("verified fix") < section.index("did not help")
    assert "skip_data_intervals" in section and "```json" in section


def test_user_files_are_never_modified(tmp_path):
    project = tmp_path / "sqrt"
    project.mkdir()
    for f in (SAMPLES / "sqrt_at_zero").iterdir():
        if f.is_file():
            (project / f.name).write_bytes(f.read_bytes())

    def digest() -> dict[str, str]:
        return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(project.iterdir()) if f.is_file()}

    before = digest()
    result = CliRunner().invoke(app, ["probe", str(project / "config.yaml"), "-q"])
    assert result.exit_code == 1
    assert digest() == before  # no file added or changed next to the user's config


def test_time_budget_and_model_size_limit(monkeypatch):
    from nandoctor.engine import spill
    from nandoctor.probe import ProbeOptions, run_probe
    from nandoctor.remedies import trial as remedies
    from nandoctor.spec import load_spec

    spec = load_spec(SAMPLES / "sqrt_at_zero" / "config.yaml")
    monkeypatch.setenv(spill.MEMORY_ENV, "0")  # no room for a snapshot anywhere: no ring
    monkeypatch.setenv(spill.DISK_ENV, "0")
    report = run_probe(spec, ProbeOptions(steps=20, device="cpu"))
    ring = report.details["snapshots"]
    assert ring["enabled"] is False and "verified on the failing step alone" in ring["note"]
    by = {r["remedy"]: r for r in report.remedies}
    assert by["op_guard"]["outcome"] == "fixed" and by["op_guard"]["start_step"] == 6  # from the failing step
    assert by["warmup"]["outcome"] == "not_applicable"  # needs the first step's state
    # a small time budget decides nothing: the same rows (the replays are bounded in steps)
    monkeypatch.setenv(remedies.BUDGET_ENV, "0")
    small = run_probe(spec, ProbeOptions(steps=20, device="cpu"))
    assert [(r["remedy"], r["outcome"]) for r in small.remedies] == [(r["remedy"], r["outcome"])
                                                                     for r in report.remedies]
    # the safety net reached (a machine far slower than during the probe): said, never judged
    monkeypatch.setattr(remedies, "SAFETY_MIN_SECONDS", 0.0)
    report = run_probe(spec, ProbeOptions(steps=20, device="cpu"))
    assert report.remedies and all(r["outcome"] == "not_applicable" for r in report.remedies)
    assert "safety time limit" in report.remedies[0]["note"]
    assert report.details["remedies"]["time_limit_hit"] is True


def test_op_guard_acts_only_at_the_reported_line():
    import paddle

    from nandoctor.engine.op_guards import guard_for, guarded

    x = paddle.zeros([3])
    line = sys._getframe().f_lineno + 3
    with guarded(guard_for("log"), f"{Path(__file__).name}:{line} in test") as hits:
        other = paddle.log(x)  # another line: untouched
        here = paddle.log(x)  # the reported line: clamped
    assert hits["calls"] == 1
    assert math.isinf(float(other[0])) and math.isfinite(float(here[0]))
    assert math.isinf(float(paddle.log(x)[0]))  # put back afterwards
    assert guard_for("sqrt_grad").op == "sqrt" and guard_for("matmul") is None


# --- ground truth without nandoctor: a plain Paddle loop over the sample's own code ---------------------

def _load(sample: str, module: str) -> Any:
    path = SAMPLES / sample / f"{module}.py"
    spec = importlib.util.spec_from_file_location(f"_gt_{sample}_{module}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _plain_loop(sample: str, lr: float, steps: int, optimizer: str, model_args: dict[str, Any],
                data_args: dict[str, Any], patch: Any = None) -> int | None:
    """The first step whose loss or gradient is non-finite (float64 check on the host), or None."""
    import paddle
    import paddle.nn.functional as F

    paddle.seed(0)
    np.random.seed(0)
    model = _load(sample, "model").build_model(**model_args)
    if patch is not None:
        patch(model)
    opt = getattr(paddle.optimizer, optimizer)(parameters=model.parameters(), learning_rate=lr)
    data = _load(sample, "data").build_loader(**data_args)
    step = 0
    while step < steps:
        for *inputs, y in data:
            if step >= steps:
                break
            out = model(*[paddle.to_tensor(v) for v in inputs])
            loss = F.mse_loss(out, paddle.to_tensor(y).astype(out.dtype).reshape(out.shape))
            if not np.isfinite(np.float64(loss.numpy())):
                return step
            loss.backward()
            if not all(np.isfinite(p.grad.numpy().astype("float64")).all() for p in model.parameters()
                       if p.grad is not None):
                return step
            opt.step()
            opt.clear_grad()
            step += 1
    return None


def test_ground_truth_sqrt_at_zero():
    """Adam at lr 0.003 -> inf gradient at step 6; x0.1 the LR still faults at step 6 (the gradient of
    sqrt at 0 is infinite at any LR); an epsilon inside the sqrt trains 26 steps finite."""
    import paddle

    args = dict(optimizer="Adam", model_args={"in_features": 10, "dim": 8},
                data_args={"batches": 20, "batch_size": 8, "bad_batch": 6, "duplicate_sample": 3})
    assert _plain_loop("sqrt_at_zero", 0.003, 26, **args) == 6
    assert _plain_loop("sqrt_at_zero", 0.0003, 26, **args) == 6

    def eps(model: Any) -> None:
        model.head.distance.forward = lambda ea, eb: paddle.sqrt(((ea - eb) ** 2).sum(axis=-1) + 1e-12)

    assert _plain_loop("sqrt_at_zero", 0.003, 26, patch=eps, **args) is None


def test_ground_truth_lr_divergence():
    """SGD at lr 0.03 overflows at step 16; at 0.003 (x0.1) it trains 36 steps finite."""
    args = dict(optimizer="SGD", model_args={"in_features": 10, "hidden": 8},
                data_args={"batches": 40, "batch_size": 32})
    assert _plain_loop("lr_divergence", 0.03, 36, **args) == 16
    assert _plain_loop("lr_divergence", 0.003, 36, **args) is None


def test_bundle_reproduce_with_remedy(tmp_path):
    """reproduce.py --with-remedy NAME: the step runs clean with a verified per-step remedy (exit 0), faults
    without it (exit 1), and a many-step remedy is explained rather than faked (exit 2)."""
    import subprocess

    bundle = tmp_path / "b"
    result = CliRunner().invoke(app, ["probe", str(SAMPLES / "sqrt_at_zero" / "config.yaml"), "--bundle", str(bundle),
                                      "-q"])
    assert result.exit_code == 1, result.output

    def reproduce(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(bundle / "reproduce.py"), *args], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)

    plain = reproduce()
    assert plain.returncode == 1 and "op=sqrt_grad" in plain.stdout
    for remedy in ("op_guard", "drop_samples"):
        fixed = reproduce("--with-remedy", remedy)
        assert fixed.returncode == 0, fixed.stdout + fixed.stderr
        assert "no fault: with this remedy" in fixed.stdout
    many = reproduce("--with-remedy", "lr_x0.1")
    assert many.returncode == 2 and "acts over many steps" in many.stderr
    unknown = reproduce("--with-remedy", "nope")
    assert unknown.returncode == 2 and "op_guard" in unknown.stderr


def test_a_bug_in_the_replays_keeps_the_diagnosis(monkeypatch):
    """nandoctor's own failure while replaying is reported as ours, and the first fault is still there."""
    from nandoctor.probe import ProbeOptions, run_probe
    from nandoctor.remedies import trial as remedies
    from nandoctor.report import markdown as markdown_report
    from nandoctor.spec import load_spec

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(remedies, "replay", broken)
    report = run_probe(load_spec(SAMPLES / "sqrt_at_zero" / "config.yaml"), ProbeOptions(steps=20, device="cpu"))
    assert report.first_fault is not None and report.first_fault.op == "sqrt_grad"
    assert report.remedies == []
    error = report.details["remedies"]["error"]
    assert "nandoctor bug, not yours" in error and "boom" in error
    assert error in markdown_report.render(report)


def test_cause_findings_mark_their_verified_advice(probe):
    report = probe("lr_divergence")
    growth = next(f for f in report["findings"] if f["code"] == "grad.explosion")
    assert growth["advice"][0].startswith("Clip") or "clip" in growth["advice"][0]  # its own advice first
    assert any(a.startswith("Verified by replay (lr_x0.1)") for a in growth["advice"][1:])
    init = probe("bad_init_overflow")
    scale = [f for f in init["findings"] if f["code"] == "param.init_scale"]
    assert scale and all(f["advice"][-1].startswith("Verified by replay (reinit)") for f in scale)


def test_a_saved_report_rerenders_its_remedies(probe):
    """`nandoctor report report.json` (a teammate's bundle) shows the same remedies table."""
    from nandoctor.findings import Report
    from nandoctor.report import markdown as markdown_report

    data = probe("sqrt_at_zero")
    again = Report.from_dict(data)
    assert again.remedies == data["remedies"]
    text = markdown_report.render(again)
    assert "## Remedies" in text and "verified fix" in text and "the fault reproduced" in text


# --- an op made in library code, a NaN weight row ------------------------------------------------------

def test_op_guard_widens_to_calls_inside_the_reported_line():
    """A guard at a line that only calls the op's maker (a helper, a library) fires once widened to "within"."""
    import paddle

    from nandoctor.engine.op_guards import guard_for, guarded

    def helper(x: paddle.Tensor) -> paddle.Tensor:
        return paddle.log(x)  # the op is made here, not at the reported line

    x = paddle.zeros([3])
    line = sys._getframe().f_lineno + 4
    source = f"{Path(__file__).name}:{line} in test"
    for scope, fired in (("line", 0), ("within", 1), ("any", 2)):
        with guarded(guard_for("log"), source, scope) as hits:
            out = helper(x)  # the reported line
            helper(x)  # another line: only "any" reaches it
        assert hits["calls"] == fired, scope
        assert math.isfinite(float(out[0])) == (scope != "line")
    made = f"{Path(__file__).name}:{helper.__code__.co_firstlineno + 1} in helper"
    assert hits["sites"] == {made: 2}  # the line that made the op, where the guard changed a value


def test_a_guard_that_never_fired_is_not_applicable():
    """Never reached at the line, within it or anywhere: not_applicable with a note, never not_fixed."""
    from nandoctor.engine.op_guards import guard_for
    from nandoctor.engine.replay import Change, Replay
    from nandoctor.remedies.guard import replay_guard
    from nandoctor.remedies.trial import NOT_APPLICABLE, Candidate, _judge

    scopes: list[str] = []

    def run(change: Change) -> Replay:  # a replay in which no divide on a tensor was ever called
        scopes.append(change.guard_scope)
        return Replay(6, steps_run=0, finite=False, failed_at=6, guard_calls=0)

    r, change = replay_guard(run, Change(guard=guard_for("divide"), source="train.py:10 in compute_loss"))
    assert scopes == ["line", "within", "any"]
    outcome, note = _judge(r, 6, 26, Candidate("op_guard", "", change, None), None)
    assert outcome == NOT_APPLICABLE and "never applied" in note and "train.py:10" in note


def test_op_guard_in_library_code_is_fixed(tmp_path, monkeypatch):
    """empty_mask_mean with its loss moved into a package under site-packages (library code to the user-file
    rule): the report's source is the user's call into it, where the guard never fires; widened to the
    divides made while that call runs, it fires in the library's line and fixes the run."""
    import shutil

    proj, lib = tmp_path / "proj", tmp_path / "site-packages" / "nd_fakelib"
    shutil.copytree(SAMPLES / "empty_mask_mean", proj)
    lib.mkdir(parents=True)
    (lib / "__init__.py").write_text("", encoding="utf-8")
    (lib / "tokloss.py").write_text((proj / "loss.py").read_text(encoding="utf-8"), encoding="utf-8")
    (proj / "loss.py").write_text(
        "from nd_fakelib.tokloss import masked_token_loss as lib_loss\n\n\n"
        "def masked_token_loss(logits, tags):\n"
        "    return lib_loss(logits, tags)  # the user's call into the library\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path / "site-packages"))
    monkeypatch.delitem(sys.modules, "nd_fakelib", raising=False)
    monkeypatch.delitem(sys.modules, "nd_fakelib.tokloss", raising=False)
    out = tmp_path / "r.json"
    result = CliRunner().invoke(app, ["probe", str(proj / "config.yaml"), "--json", str(out), "-q"])
    assert out.is_file(), result.output
    report = json.loads(out.read_text(encoding="utf-8"))
    sys.modules.pop("nd_fakelib.tokloss", None)
    sys.modules.pop("nd_fakelib", None)
    assert report["first_fault"]["step"] == 4 and report["first_fault"]["op"] == "divide"
    assert report["details"]["source"].startswith("loss.py:5")  # the user's line, not the library's
    by = _by_name(report)
    guard = by["op_guard"]
    assert guard["outcome"] == "fixed", guard
    assert report["remedies"][0]["remedy"] == "op_guard"
    assert guard["guard"]["scope"] == "within" and guard["guard"]["calls"] >= 1
    lib_line = next(iter(guard["guard"]["sites"]))
    assert lib_line.startswith("nd_fakelib/tokloss.py:") and lib_line.endswith("in masked_token_loss")
    assert lib_line in guard["change"] and "loss.py:5" in guard["change"]  # where the epsilon goes
    assert "never fired at loss.py:5" in guard["note"]
    assert by["lr_x0.1"]["outcome"] == "not_fixed"


def test_nan_embedding_row_remedies(probe):
    """A NaN row in the weights: re-drawing it is verified; dropping the two samples that read it is not (left
    out in every epoch by their fingerprint, they dodge the row but leave it NaN), and the note says so."""
    by = _by_name(probe("embedding_nan_row"))
    rows = by["reinit_rows"]
    assert rows["outcome"] == "fixed" and rows["note"] is None
    assert "row(s) 37 of embed.weight (token id(s) 37)" in rows["change"]
    drop = by["drop_samples"]
    assert drop["outcome"] == "not_fixed"
    assert "embed.weight still holds 16 NaN/Inf value(s)" in drop["note"] and "later batch" in drop["note"]


def _bag_loop(steps: int, drop: tuple[int, int, list[int]] | None = None, reinit_row: bool = False) -> int | None:
    """embedding_nan_row in a plain Paddle loop (AdamW 0.003, cross-entropy, the data repeated per epoch):
    the first step whose loss or gradient is non-finite (float64 on the host), or None."""
    import paddle
    import paddle.nn.functional as F

    paddle.seed(0)
    model = _load("embedding_nan_row", "model").build_model(vocab=64, dim=16, classes=3)
    if reinit_row:
        w = model.embed.weight.numpy()
        ok = np.isfinite(w).all(axis=1)
        w[~ok] = np.random.default_rng(0).normal(w[ok].mean(), w[ok].std(), w[~ok].shape)
        model.embed.weight.set_value(w)
    opt = paddle.optimizer.AdamW(parameters=model.parameters(), learning_rate=0.003)
    data = _load("embedding_nan_row", "data").build_loader(batches=12, batch_size=8, seq_len=10)
    for step in range(steps):
        epoch, index = divmod(step, len(data))
        ids, label = data[index]
        if drop is not None and (epoch, index) == drop[:2]:
            keep = [i for i in range(len(ids)) if i not in drop[2]]
            ids, label = ids[keep], label[keep]
        loss = F.cross_entropy(model(paddle.to_tensor(ids)), paddle.to_tensor(label))
        if not np.isfinite(np.float64(loss.numpy())):
            return step
        loss.backward()
        if not all(np.isfinite(p.grad.numpy().astype("float64")).all() for p in model.parameters()
                   if p.grad is not None):
            return step
        opt.step()
        opt.clear_grad()
    return None


def test_ground_truth_nan_embedding_row():
    """Without nandoctor: NaN at step 7; samples [3, 6] of batch 7 left out -> NaN at step 19 (epoch 1's
    batch 7 reads row 37 again); row 37 re-drawn -> 27 steps finite."""
    assert _bag_loop(27) == 7
    assert _bag_loop(27, drop=(0, 7, [3, 6])) == 19
    assert _bag_loop(27, reinit_row=True) is None
