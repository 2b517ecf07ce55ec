"""Peak memory of `nandoctor probe` against a plain Paddle loop when the batches, not the model, are large
(issue 22, "memory is bounded": the probe may hold at most one batch more than the loop does).

The workload: `wide_batch`'s model (Linear 4096 -> 16 + Tanh, 60 Linear 16 x 16 + Tanh pairs, a linear head: a
small model, 124 tensors) on batches of `--rows` x 4096 float32 features (6400 rows: 100 MB a batch), a
fresh array each batch, with one NaN feature in one sample of batch `--fault-at` (a corrupt record): the
probe finds it, localises it and replays its remedies (dropping that sample among them), so every path
that could keep a batch alive runs.

    .venv/bin/python benchmarks/big_batches.py                 # 100 MB batches, no bundle
    .venv/bin/python benchmarks/big_batches.py --bundle        # ... with --bundle (a copy of the fault's batch)
    .venv/bin/python benchmarks/big_batches.py --phases        # ... and the probe's peak RSS in each phase

Each side runs in its own process; peak RSS is the process's `ru_maxrss` from `wait4`. The probe's peak moves
with its read schedule (set from measured step times: which batches its watcher still holds at the fault),
so it runs `--repeat` times (3) and the median and the worst run are shown. The plain loop is
seeded as the probe seeds and stops at the first non-finite loss, as the probe's loop does. `--phases` runs
the probe in-process and reads (and resets) its `VmHWM` at each of the probe's progress messages: the peak of
each phase (the loop, the localisation after it, each remedy replay).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from large_model import measure  # (this folder is first on sys.path: both are run as scripts)

HERE = Path(__file__).resolve()
FEATURES = 4096
BATCHES = 40


def build_model(features: int = FEATURES, width: int = 16, depth: int = 60) -> Any:
    from paddle import nn

    layers: list[Any] = [nn.Linear(features, width), nn.Tanh()]
    for _ in range(depth):  # (Tanh, not ReLU: a CPU ReLU turns the NaN into 0, and the loss would stay finite)
        layers += [nn.Linear(width, width), nn.Tanh()]
    layers.append(nn.Linear(width, 2))
    return nn.Sequential(*layers)


def build_loader(rows: int = 6400, features: int = FEATURES, batches: int = BATCHES,
                 fault_at: int = 12) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """A fresh array each batch (one base drawn once, scaled per batch: drawing 26M normals a step would
    cost more than the step); sample 3 of batch `fault_at` holds a NaN."""
    rng = np.random.default_rng(0)
    base = rng.normal(size=(rows, features)).astype(np.float32)
    labels = (base[:, 0] > 0).astype(np.int64)
    for i in range(batches):
        x = base * np.float32(1.0 + 0.01 * (i % 7))
        if i == fault_at:
            x[3, 5] = np.nan
        yield x, labels.copy()


def write_config(folder: Path, rows: int, steps: int, fault_at: int) -> Path:
    config = folder / "config.yaml"
    config.write_text(
        "version: 1\n"
        f'model: {{entry: "{HERE}:build_model"}}\n'
        f'data: {{entry: "{HERE}:build_loader", args: {{rows: {rows}, fault_at: {fault_at}}}, '
        "fields: [x, label], inputs: [x], label: label}\n"
        "loss: {builtin: cross_entropy}\n"
        "optimizer: {name: AdamW, args: {learning_rate: 3.0e-4}}\n"
        f"probe: {{steps: {steps}, seed: 0, device: cpu}}\n", encoding="utf-8")
    return config


def plain(rows: int, steps: int, fault_at: int) -> None:
    """The user's loop: forward, loss, backward, step, clear_grad, the loss read every step."""
    import random

    import paddle
    import paddle.nn.functional as F

    paddle.set_device("cpu")
    paddle.seed(0)
    np.random.seed(0)
    random.seed(0)
    model = build_model()
    opt = paddle.optimizer.AdamW(parameters=model.parameters(), learning_rate=3e-4)
    for step, (x, y) in enumerate(build_loader(rows, fault_at=fault_at)):
        if step >= steps:
            break
        label = paddle.to_tensor(y)
        loss = F.cross_entropy(model(paddle.to_tensor(x)), label.unsqueeze(-1))
        if not np.isfinite(float(loss)):
            print(json.dumps({"stopped_at": step}))
            return
        loss.backward()
        opt.step()
        opt.clear_grad()
    print(json.dumps({"stopped_at": None}))


def _hwm_mb() -> float:
    """This process's peak RSS since the last `_reset_hwm` (VmHWM), in MB."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:  # "5": VmHWM starts again from VmRSS
        f.write("5")


def phases(config: Path, bundle: Path | None) -> None:
    """The probe as the CLI runs it (run.run_command), in this process, its peak RSS per phase: VmHWM read
    and reset at each progress message that starts a new phase (exact, not sampled)."""
    import contextlib

    from rich.console import Console

    from nandoctor import app as run_module
    from nandoctor.engine import loop as loop_module

    phase = ["start (import, spec, model build)"]
    peaks: dict[str, float] = {}

    def enter(label: str) -> None:
        if label != phase[0]:
            peaks[phase[0]] = max(peaks.get(phase[0], 0.0), _hwm_mb())
            _reset_hwm()
            phase[0] = label

    def progress(done: int, total: int | None, what: str) -> None:
        enter("probe loop" if what == "probe step" else what)

    @contextlib.contextmanager
    def bar(_console: Any, _quiet: bool) -> Iterator[Any]:
        yield progress

    run = loop_module.ProbeLoop.run

    def marked(self: Any) -> Any:  # the time between the loop's end and the first replay: localisation
        try:
            return run(self)
        finally:
            enter("after the loop (localisation, findings)")

    loop_module.ProbeLoop.run = marked  # type: ignore[method-assign]
    run_module.progress_bar = bar  # type: ignore[assignment]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        run_module.run_command("probe", config, Console(quiet=True), json_path=Path(tmp) / "r.json",
                               bundle=bundle, quiet=True)
        enter("report and bundle written")
        enter("end")
        report = json.loads((Path(tmp) / "r.json").read_text(encoding="utf-8"))
    fault = report.get("first_fault") or {}
    print(f"probe in-process: {time.perf_counter() - t0:.1f} s, first fault at step {fault.get('step')}")
    for label, mb in peaks.items():
        print(f"  peak RSS {mb:7.0f} MB  {label}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=6400, help="samples a batch (x 4096 float32 features)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--fault-at", type=int, default=12)
    parser.add_argument("--bundle", action="store_true", help="the probe writes a bundle (--bundle)")
    parser.add_argument("--repeat", type=int, default=3, help="probe runs (the median and the worst are shown)")
    parser.add_argument("--phases", action="store_true", help="also the probe's peak RSS per phase")
    parser.add_argument("--plain", action="store_true", help="(internal) run the plain loop in this process")
    parser.add_argument("--phases-only", help="(internal) run the probe in this process on this config")
    args = parser.parse_args()
    if args.plain:
        plain(args.rows, args.steps, args.fault_at)
        return
    if args.phases_only:
        phases(Path(args.phases_only), Path(args.phases_only).parent / "bundle-phases" if args.bundle else None)
        return
    mb = args.rows * FEATURES * 4 / 2**20
    with tempfile.TemporaryDirectory() as tmp:
        config = write_config(Path(tmp), args.rows, args.steps, args.fault_at)
        report_path = Path(tmp) / "report.json"
        base = [sys.executable, str(HERE), "--rows", str(args.rows), "--steps", str(args.steps),
                "--fault-at", str(args.fault_at)]
        plain_mb, plain_s, plain_out = measure([*base, "--plain"])
        runs = []
        for i in range(args.repeat):  # the probe's peak moves with its read schedule (timed): several runs
            # a folder of its own each run: a second run's --force into the first's bundle exits 2 at once
            # (it takes the bundle's own code/ for files it did not write), and its 37 MB went into the median
            bundle = ["--bundle", str(Path(tmp) / f"bundle-{i}")] if args.bundle else []
            runs.append(measure([sys.executable, "-m", "nandoctor", "probe", str(config), "--json",
                                 str(report_path), "-q", *bundle]))
        report = json.loads(report_path.read_text(encoding="utf-8"))
        if args.phases:
            subprocess.run([*base, *(["--bundle"] if args.bundle else []), "--phases-only", str(config)],
                           check=True)
    fault = report.get("first_fault") or {}
    print(f"batches: {args.rows} x {FEATURES} float32 = {mb:.0f} MB each; a NaN in batch {args.fault_at}"
          f"{'; --bundle' if args.bundle else ''}")
    print(f"plain loop: peak RSS {plain_mb:.0f} MB, {plain_s:.1f} s, {plain_out.strip()}")
    peaks = sorted(mb for mb, _, _ in runs)
    probe_mb = peaks[len(peaks) // 2]
    each = ", ".join(f"{mb:.0f}" for mb, _, _ in runs)
    print(f"nandoctor probe: peak RSS {probe_mb:.0f} MB (median of {len(runs)}: {each}), {runs[0][1]:.1f} s, "
          f"first fault at step {fault.get('step')}")
    print(f"extra: {probe_mb - plain_mb:+.0f} MB = {(probe_mb - plain_mb) / mb:.1f} batches (worst run "
          f"{(peaks[-1] - plain_mb) / mb:.1f}); peak ratio probe / plain: {probe_mb / plain_mb:.2f}x "
          f"(worst {peaks[-1] / plain_mb:.2f}x)")
    for row in report.get("remedies", []):
        print(f"  {row['remedy']:<13} {row['outcome']:<15} from step {row.get('start_step')}")


if __name__ == "__main__":
    main()
