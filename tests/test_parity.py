"""Parity: `nandoctor probe`, `nandoctor run` and `nandoctor.watch` name the same first fault on the same workload.

Every sample config is trained three ways:

- probe: `nandoctor probe CONFIG --no-try-fixes --device cpu --json P`, through the CLI in this process (typer's
  CliRunner; the reference: its answers are held against a float64 / tensor-checker ground truth by
  tests/test_probe_samples.py);
- run:   `python -m nandoctor run --json R -- python tests/parity/plain_train.py CONFIG`, as a real subprocess:
  `run` watches a child process, a plain Paddle script that never imports nandoctor (what a user's
  unmodified script is);
- watch: `python tests/parity/plain_train.py CONFIG --watch DIR`, the same loop with `nandoctor.watch`, its
  report read from DIR/report.json; the script runs in this process, as `python` would run it
  (tests/in_process.py puts back what it changed): what is checked is its report and exit status, not a process.

For a config whose probe reports a first fault, each other entry point must report the same step, phase,
layer, op and sample_indices. For a config the probe finds no fault in, each entry point must exit 0 and
report no first fault. A combination that does not match today is a strict xfail whose reason says what
was measured, so a fix turns it into an XPASS failure and the list below has to be brought up to date.
`test_plain_script_trains_like_the_probe` holds the script itself (in this process too): its losses are the
probe's, step for step, so a mismatch above is the entry point's and not a different workload's.

Cost: each probe runs once per module (a cache); `run` is one real subprocess per config (the `nandoctor run`
process and its child); the rest runs in this process, which saves a Python and Paddle start-up (3-4 s) each.
A config whose DataLoader has worker processes (WORKER_LOADERS) runs every entry point as a real subprocess.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from in_process import run_cli, run_in_process

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_configs"
SCRIPT = ROOT / "tests" / "parity" / "plain_train.py"
LIMIT = 300  # seconds per subprocess (`run`); each takes a few seconds on 2 cores
KEYS = ("step", "phase", "layer", "op", "parameter", "sample_indices")
ENTRIES = ("run", "watch")

# "folder" = folder/config.yaml; "folder/variant" = folder/variant.yaml
FAULTS = [
    "bad_init_overflow", "causal_padding_decoder", "crash_in_user_code", "div_by_zero_layer", "embedding_nan_row",
    "empty_mask_mean", "exp_overflow", "exploding_rnn", "gated_mlp_backward", "gated_mlp_backward/residual",
    "empty_batch", "kwargs_structured_outputs/empty_text", "label_crash", "label_out_of_range", "llama_masked_row",
    "loader_crash", "loader_worker_crash", "log_of_zero", "lr_divergence", "masked_attention", "masked_where_grad",
    "nan_checkpoint", "nan_in_data", "nan_parameter", "neg_fractional_pow", "nonfinite_update", "outlier_sample",
    "seq_too_long", "sqrt_at_zero", "transformer_lr_divergence", "warmup_needed/no_warmup",
    "log_inf_before_nan", "root_forward_sqrt", "root_forward_sqrt/backward", "whole_batch_overflow",
    "target_scale_divergence", "nan_in_images",
    "stream_loader", "bad_record_epochs", "vae_exp", "lbfgs_closure",
]
# the probe reports no first fault (bad_init and fp16_overflow_risk: warnings only, at_risk, exit 0)
NO_FAULT = [
    "bad_init", "causal_padding_decoder/healthy", "fp16_overflow_risk", "healthy_cnn", "healthy_mlp", "healthy_rnn",
    "healthy_transformer", "kwargs_structured_outputs", "kwargs_structured_outputs/logits",
    "llama_masked_row/healthy", "masked_attention/healthy", "warmup_needed",
]
# (config, entry point) -> what differs today (probe value vs the other's). Every NaN/Inf sample and every
# crash of the user's code matches under both, but one: a DataLoader worker's exception.
_WORKER = ("probe: step 4, data (the worker's own KeyError, which the probe's loader guard brings back); "
           "{entry}: step 3, data, SystemError 'Blocking queue is killed': the main process sees the killed queue "
           "at the batch it asks for next, and how many batches the workers had queued before one raised depends "
           "on timing (Paddle keeps the worker's exception in the worker's own traceback)")
KNOWN: dict[tuple[str, str], str] = {("loader_worker_crash", entry): _WORKER.format(entry=entry)
                                     for entry in ("run", "watch")}
# (target_scale_divergence under `run`, whose MSE overflows for 13 of 32 samples alone, names them as the probe
# does since the checked pass bisects the batch through the loss function it catches: zero_change/loss_samples.py)


# paddle.io.DataLoader(num_workers > 0): its worker processes are forked from the process that trains. Forked
# from pytest's, a worker the crash leaves waiting is joined by a later garbage collection, which then waits for
# ever; their process ends them. These configs run every entry point as a real subprocess.
WORKER_LOADERS = {"loader_worker_crash"}


def config_of(name: str) -> Path:
    return SAMPLES / (f"{name}.yaml" if "/" in name else f"{name}/config.yaml")


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}


def _sub(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=LIMIT, env=_env())


def _read(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _fault(report: dict[str, Any] | None) -> dict[str, Any] | None:
    """The first fault's compared fields. No sample named is the same answer whether it was measured
    (`[]`: no strict subset is special) or could not be (None: `run` cannot try apart the samples of a
    fault in the script's own loss code when no gradient row reached the model)."""
    if report is None or report.get("first_fault") is None:
        return None
    fault = {k: report["first_fault"].get(k) for k in KEYS}
    fault["sample_indices"] = fault["sample_indices"] or None
    return fault


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory):
    """probe(name) -> (exit status, JSON report or None, the end of its output); each config is probed once per
    module, by the CLI in this process (from the folder a subprocess would have run in; WORKER_LOADERS in one)."""
    cache: dict[str, tuple[int, dict[str, Any] | None, str]] = {}
    folder = tmp_path_factory.mktemp("parity_probe")

    def run(name: str) -> tuple[int, dict[str, Any] | None, str]:
        if name not in cache:
            out = folder / f"{name.replace('/', '__')}.json"
            args = ["probe", str(config_of(name)), "--no-try-fixes", "--device", "cpu", "--json", str(out)]
            if name in WORKER_LOADERS:
                proc = _sub([sys.executable, "-m", "nandoctor", *args], folder)
                cache[name] = (proc.returncode, _read(out), proc.stderr[-3000:])
            else:
                ran = run_cli(args, folder, {"COLUMNS": "120"}, (SAMPLES,))
                cache[name] = (ran.returncode, _read(out), ran.stderr[-3000:])
        return cache[name]

    return run


def _script(args: list[str], name: str, cwd: Path) -> Any:
    """`python tests/parity/plain_train.py ARGS`, run in this process, or as a subprocess for WORKER_LOADERS."""
    if name in WORKER_LOADERS:
        return _sub([sys.executable, str(SCRIPT), *args], cwd)
    return run_in_process(SCRIPT, args, cwd, (SAMPLES,))


def entry_point(entry: str, name: str, tmp_path: Path) -> tuple[int, dict[str, Any] | None, str]:
    """(exit status, JSON report or None, the end of stdout+stderr) of `run` or `watch` on a config."""
    config = str(config_of(name))
    if entry == "run":
        out = tmp_path / "run.json"
        proc: Any = _sub([sys.executable, "-m", "nandoctor", "run", "--json", str(out), "--",
                          sys.executable, str(SCRIPT), config], tmp_path)
    else:
        out = tmp_path / "watch" / "report.json"
        proc = _script([config, "--watch", str(tmp_path / "watch")], name, tmp_path)
    return proc.returncode, _read(out), (proc.stdout[-1500:] + "\n" + proc.stderr[-3000:])


def _cases(names: list[str]) -> list[Any]:
    return [pytest.param(name, entry, id=f"{name}-{entry}",
                         marks=[pytest.mark.xfail(strict=True, reason=KNOWN[(name, entry)])]
                         if (name, entry) in KNOWN else [])
            for name in names for entry in ENTRIES]


def test_every_config_is_classified():
    """A new sample config must join one of the lists, or it goes unmeasured; no stale entry either."""
    configs = {p.parent.name if p.name == "config.yaml" else f"{p.parent.name}/{p.stem}"
               for p in SAMPLES.glob("*/*.yaml")}
    listed = [*FAULTS, *NO_FAULT]
    assert len(listed) == len(set(listed)), "a config is listed twice"
    assert set(listed) == configs, (sorted(configs - set(listed)), sorted(set(listed) - configs))
    assert {name for name, _ in KNOWN} <= set(FAULTS) | set(NO_FAULT)


@pytest.mark.parametrize(("name", "entry"), _cases(FAULTS))
def test_same_first_fault_as_the_probe(name: str, entry: str, probe, tmp_path: Path) -> None:
    status, ref_report, err = probe(name)
    ref = _fault(ref_report)
    assert ref is not None, f"the probe reports no first fault on {name} (exit {status}): move it\n{err}"
    status, report, tail = entry_point(entry, name, tmp_path)
    assert report is not None, f"{entry} wrote no report (exit {status}):\n{tail}"
    got = _fault(report)
    assert got is not None, f"{entry}: no first fault; findings {[f['code'] for f in report['findings']]}"
    wrong = {k: f"{ref[k]!r} under probe, {got[k]!r} under {entry}" for k in KEYS if ref[k] != got[k]}
    assert not wrong, wrong


@pytest.mark.parametrize(("name", "entry"), _cases(NO_FAULT))
def test_no_fault_where_the_probe_finds_none(name: str, entry: str, probe, tmp_path: Path) -> None:
    status, ref_report, err = probe(name)
    assert (status, _fault(ref_report)) == (0, None), f"the probe on {name}: exit {status}\n{err}"
    status, report, tail = entry_point(entry, name, tmp_path)
    assert status == 0, f"{entry} exit {status}:\n{tail}"
    assert _fault(report) is None, report and report["first_fault"]


_STEP = re.compile(r"^step (\d+) loss (\S+)$", re.M)


@pytest.mark.parametrize("name", FAULTS + NO_FAULT)
def test_plain_script_trains_like_the_probe(name: str, probe, tmp_path: Path) -> None:
    """The script's losses are the probe's timeline, step for step, up to the probe's first fault: the
    workloads are the same, so a difference above is the entry point's."""
    _, report, _ = probe(name)
    assert report is not None
    ff = report.get("first_fault")
    # past the probe's first fault nothing is compared: the script stops after that step
    until = ["--steps", str(ff["step"] + 1)] if ff is not None and ff.get("step") is not None else []
    proc = _script([str(config_of(name)), *until], name, tmp_path)
    losses = {int(s): float(v) for s, v in _STEP.findall(proc.stdout)}
    # non-finite losses are strings in the JSON ("NaN", "Infinity")
    expected = {p["step"]: float(p["loss"]) for p in report["timeline"] if p.get("loss") is not None}
    if ff is not None and ff.get("step") is not None:  # the faulty step's loss too, when the probe got that far
        expected = {s: v for s, v in expected.items() if s <= ff["step"]}
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert len(losses) == len(report["timeline"]), "the probe and the script ran different step counts"
    assert expected, "the probe recorded no loss: nothing to compare"
    if ff is not None and ff.get("phase") == "data" and name in WORKER_LOADERS:
        # Paddle's worker loader kills its queue at a worker's exception, dropping batches already read:
        # the plain loop sees a prefix of the probe's steps, how long depends on the workers' timing
        assert sorted(losses) == list(range(len(losses))) and losses, sorted(losses)
        expected = {s: v for s, v in expected.items() if s in losses}
    for step, want in expected.items():
        assert step in losses, f"the script printed no loss for step {step}:\n{proc.stderr[-3000:]}"
        got = losses[step]
        if not math.isfinite(want):
            assert not math.isfinite(got), f"step {step}: probe {want}, script {got}"
            continue
        assert math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-6), f"step {step}: probe {want}, script {got}"
