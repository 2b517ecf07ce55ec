"""In-process measurements, each run by `run.py` in a fresh child: `python worker.py MODE CONFIG PLAIN ...`.

Modes (each prints one `BENCH_RESULT {json}` line at the end):
- `steps`: the probe's steady-state step vs the plain loop's step, alternating whole short runs in one
  process; a probe step is the time between two consecutive progress callbacks ("probe step"), a plain
  step the same end-to-end span in the plain loop, so both include fetching the batch.
- `checker`: the plain loop with Paddle's tensor checker on for every step vs off, alternating blocks.
- `localize`: the probe on a config with a late fault; seconds from the fault's detection to the report.
- `scan`: `run_scan` over the whole loader vs a bare iteration over the same loader (samples per second).
- `inloop`: the plain loop vs the same loop with `nandoctor.watch` and `doctor.check(loss, batch)` after
  backward (the in-loop API), alternating whole short runs in one process.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workloads"))

RESULT_PREFIX = "BENCH_RESULT "


def load_plain(path: Path) -> ModuleType:
    """The plain_<name>.py module (its model, loader and loss), imported without running its main."""
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def probe_run(config: Path, steps: int) -> tuple[Any, list[float], float, list[float]]:
    """One `run_probe`: the report, the wall timestamps of each step's progress call, the end time, and the
    process CPU-time stamps of the same calls (CPU time shrugs off other processes on a shared machine)."""
    from nandoctor.probe import ProbeOptions, run_probe
    from nandoctor.spec import load_spec

    stamps: list[float] = []
    cpu: list[float] = []

    def progress(done: int, total: int | None, description: str) -> None:
        # Only the per-step calls: a replay or localisation phase may report progress too.
        if description == "probe step":
            stamps.append(time.perf_counter())
            cpu.append(time.process_time())

    spec = load_spec(config)
    report = run_probe(spec, ProbeOptions(steps=steps, seed=0, device="cpu"), progress)
    return report, stamps, time.perf_counter(), cpu


def diffs(stamps: list[float]) -> list[float]:
    return [b - a for a, b in zip(stamps, stamps[1:])]


def mode_steps(args: argparse.Namespace) -> dict[str, Any]:
    from plain_loop import read_settings, train

    plain = load_plain(args.plain)
    settings = read_settings(args.config)
    pairs, cpu_pairs = [], []
    for _ in range(args.runs):
        _, stamps, _, cpu = probe_run(args.config, args.steps)
        probe_steps = diffs(stamps)[args.warmup:]
        probe_cpu = diffs(cpu)[args.warmup:]
        plain_run = train(settings, plain.build_model, plain.build_loader, plain.loss_fn, args.steps, 0)
        plain_steps = plain_run["step_seconds"][args.warmup + 1:]
        plain_cpu = plain_run["step_cpu_seconds"][args.warmup + 1:]
        # The mean, not the median: a probe that samples per-layer stats every k-th step must pay for
        # those steps here, and a median would hide them.
        pairs.append((statistics.fmean(probe_steps), statistics.fmean(plain_steps)))
        cpu_pairs.append(statistics.fmean(probe_cpu) / statistics.fmean(plain_cpu))
    return {"probe_ms": [1000 * p for p, _ in pairs], "plain_ms": [1000 * q for _, q in pairs],
            "ratios": [p / q for p, q in pairs], "cpu_ratios": cpu_pairs}


def mode_checker(args: argparse.Namespace) -> dict[str, Any]:
    """Alternate blocks of plain steps and checker-on steps on one model (the checker costs ~18x)."""
    import paddle
    from paddle.amp import debugging
    from plain_loop import read_settings

    plain = load_plain(args.plain)
    settings = read_settings(args.config)
    paddle.set_device("cpu")
    paddle.seed(0)
    model = plain.build_model(**settings["model"])
    optimizer = getattr(paddle.optimizer, settings["optimizer"])(parameters=model.parameters(),
                                                                 **settings["optimizer_args"])
    batches = list(plain.build_loader(**settings["data"]))

    def step(i: int) -> float:
        t0 = time.perf_counter()
        x, y = (paddle.to_tensor(a) for a in batches[i % len(batches)])
        loss = plain.loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        float(loss)
        return time.perf_counter() - t0

    for i in range(args.warmup):
        step(i)
    pairs, i = [], args.warmup
    for _ in range(args.runs):
        off = []
        for _ in range(args.steps):
            off.append(step(i))
            i += 1
        debugging.enable_tensor_checker(debugging.TensorCheckerConfig(
            enable=True, debug_mode=debugging.DebugMode.CHECK_NAN_INF_AND_ABORT))
        try:
            on = []
            step(i)  # the first checked step pays one-off set-up; the anchor is the steady state
            for _ in range(args.checker_steps):
                on.append(step(i))
                i += 1
        finally:
            debugging.disable_tensor_checker()
        pairs.append((statistics.median(on), statistics.median(off)))
    return {"checker_ms": [1000 * p for p, _ in pairs], "plain_ms": [1000 * q for _, q in pairs],
            "ratios": [p / q for p, q in pairs]}


def mode_localize(args: argparse.Namespace) -> dict[str, Any]:
    """Localisation = end of run_probe - last step progress - one median step (the failing step itself).

    If the probe reports its own timing (a details key naming 'locali' and 'seconds') that is used too.
    """
    results = []
    for _ in range(args.runs):
        report, stamps, end, _ = probe_run(args.config, args.steps)
        steps = diffs(stamps)
        median_step = statistics.median(steps[args.warmup:] or steps or [0.0])
        derived = end - stamps[-1] - median_step if stamps else None
        own = next((v for k, v in report.details.items() if "locali" in k and "second" in k
                    and isinstance(v, (int, float))), None)
        ff = report.first_fault
        results.append({"derived_s": derived, "reported_s": own, "median_step_ms": 1000 * median_step,
                        "steps_run": len(stamps), "verdict": report.verdict.value,
                        "first_fault": ff.to_dict() if ff else None})
    return {"runs": results}


def mode_scan(args: argparse.Namespace) -> dict[str, Any]:
    from nandoctor.scan import ScanOptions, run_scan
    from nandoctor.spec import load_spec

    plain = load_plain(args.plain)
    from plain_loop import read_settings

    data_args = read_settings(args.config)["data"]
    spec = load_spec(args.config)
    pairs = []
    verdict = None
    for _ in range(args.runs):
        t0 = time.perf_counter()
        samples = 0
        for batch in plain.build_loader(**data_args):
            samples += len(batch[0])
        bare = time.perf_counter() - t0
        t0 = time.perf_counter()
        report = run_scan(spec, ScanOptions(batches=None))
        scan = time.perf_counter() - t0
        verdict = report.verdict.value
        pairs.append((samples / scan, samples / bare))
    return {"scan_sps": [s for s, _ in pairs], "bare_sps": [b for _, b in pairs],
            "ratios": [s / b for s, b in pairs], "samples": samples, "verdict": verdict}


def train_inloop(settings: dict, plain: ModuleType, steps: int, seed: int) -> dict[str, list[float]]:
    """plain_loop.train with the in-loop API added as a user adds it: watch, then check after backward."""
    import random

    import numpy as np
    import paddle

    import nandoctor

    paddle.set_device("cpu")
    paddle.seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    model = plain.build_model(**settings["model"])
    model.train()
    optimizer = getattr(paddle.optimizer, settings["optimizer"])(parameters=model.parameters(),
                                                                 **settings["optimizer_args"])
    batches = iter(plain.build_loader(**settings["data"]))
    times: list[float] = []
    cpu_times: list[float] = []
    losses: list[float] = []
    with nandoctor.watch(model, optimizer, report_dir=None) as doctor:
        last, last_cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            try:
                batch = next(batches)
            except StopIteration:
                batches = iter(plain.build_loader(**settings["data"]))
                batch = next(batches)
            x, y = (paddle.to_tensor(a) for a in batch)
            loss = plain.loss_fn(model(x), y)
            loss.backward()
            if not doctor.check(loss, (x, y)):
                raise RuntimeError("the in-loop check found a fault on a healthy workload")
            optimizer.step()
            optimizer.clear_grad()
            losses.append(float(loss))
            now, now_cpu = time.perf_counter(), time.process_time()
            times.append(now - last)
            cpu_times.append(now_cpu - last_cpu)
            last, last_cpu = now, now_cpu
    return {"loss": losses, "step_seconds": times, "step_cpu_seconds": cpu_times}


def mode_inloop(args: argparse.Namespace) -> dict[str, Any]:
    from plain_loop import read_settings, train

    plain = load_plain(args.plain)
    settings = read_settings(args.config)
    pairs, cpu_pairs = [], []
    for _ in range(args.runs):
        watched = train_inloop(settings, plain, args.steps, 0)
        bare = train(settings, plain.build_model, plain.build_loader, plain.loss_fn, args.steps, 0)
        w, b = watched["step_seconds"][args.warmup + 1:], bare["step_seconds"][args.warmup + 1:]
        wc, bc = watched["step_cpu_seconds"][args.warmup + 1:], bare["step_cpu_seconds"][args.warmup + 1:]
        pairs.append((statistics.fmean(w), statistics.fmean(b)))  # the mean: stats steps must be paid for
        cpu_pairs.append(statistics.fmean(wc) / statistics.fmean(bc))
        if watched["loss"] != bare["loss"]:
            return {"error": "the watched loop trained differently from the plain one"}
    return {"inloop_ms": [1000 * p for p, _ in pairs], "plain_ms": [1000 * q for _, q in pairs],
            "ratios": [p / q for p, q in pairs], "cpu_ratios": cpu_pairs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["steps", "checker", "localize", "scan", "inloop"])
    parser.add_argument("config", type=Path)
    parser.add_argument("plain", type=Path)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--checker-steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    modes = {"steps": mode_steps, "checker": mode_checker, "localize": mode_localize, "scan": mode_scan,
             "inloop": mode_inloop}
    result = modes[args.mode](args)
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
