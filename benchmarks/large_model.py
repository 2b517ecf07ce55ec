"""Peak memory of `nandoctor probe` against a plain Paddle loop on a large model with a fault (the
large-model figures of docs/how-it-works.md; not a `make bench` row: one pair takes minutes and gigabytes).

The workload: an MLP of `--layers` Linear(H, H) layers and a linear head (H = `--hidden`; 2 x 4096 is 34M
parameters, 6 x 4096 is 101M), trained with Adam on a regression whose input features grow 10x every two
batches (a sensor whose scale drifts): the gradient norm climbs from the first steps and the squared error
overflows float32 at step ~34. So the report has a grad.explosion warning before the fault, and the
learning-rate, clipping and warmup remedies need a snapshot from before the growth (warmup: the first).

    .venv/bin/python benchmarks/large_model.py                  # 34M parameters
    .venv/bin/python benchmarks/large_model.py --layers 6       # 101M parameters
    .venv/bin/python benchmarks/large_model.py --phases         # ... and the probe's peak RSS in each phase

Each side runs in its own process; peak RSS is the process's `ru_maxrss` from `wait4` (the same figure
`/usr/bin/time -v` prints). The plain loop is seeded as the probe seeds and stops at the first
non-finite loss, as the probe's loop does; the two must stop at the same step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve()
STEPS = 60


def build_model(hidden: int = 4096, layers: int = 2) -> Any:
    import paddle
    from paddle import nn

    paddle.seed(0)
    return nn.Sequential(*[nn.Linear(hidden, hidden) for _ in range(layers)], nn.Linear(hidden, 1))


def build_loader(hidden: int = 4096, batches: int = STEPS, batch_size: int = 32) -> Iterator[tuple[Any, Any]]:
    """Fresh arrays each batch (as a real loader makes them), the features' scale growing 10x every 2 batches."""
    rng = np.random.default_rng(0)
    w = (rng.normal(size=hidden) / np.sqrt(hidden)).astype("float32")
    for i in range(batches):
        x = (rng.normal(size=(batch_size, hidden)) * 10.0 ** (i / 2)).astype("float32")
        yield x, (x @ w).reshape(-1, 1).astype("float32")


def write_config(folder: Path, hidden: int, layers: int, steps: int) -> Path:
    config = folder / "config.yaml"
    config.write_text(
        "version: 1\n"
        f'model: {{entry: "{HERE}:build_model", args: {{hidden: {hidden}, layers: {layers}}}}}\n'
        f'data: {{entry: "{HERE}:build_loader", args: {{hidden: {hidden}, batches: {steps}}}, '
        "fields: [x, y], label: y}\n"
        "loss: {builtin: mse}\n"
        "optimizer: {name: Adam, args: {learning_rate: 1.0e-3}}\n"
        f"probe: {{steps: {steps}, seed: 0, device: cpu}}\n", encoding="utf-8")
    return config


def plain(hidden: int, layers: int, steps: int) -> None:
    """The user's loop: forward, loss, backward, step, clear_grad, the loss read every step."""
    import random

    import paddle

    paddle.set_device("cpu")
    paddle.seed(0)
    np.random.seed(0)
    random.seed(0)
    model = build_model(hidden, layers)
    opt = paddle.optimizer.Adam(parameters=model.parameters(), learning_rate=1e-3)
    for step, (x, y) in enumerate(build_loader(hidden, steps)):
        loss = paddle.nn.functional.mse_loss(model(paddle.to_tensor(x)), paddle.to_tensor(y))
        value = float(loss)
        if not np.isfinite(value):
            print(json.dumps({"stopped_at": step}))
            return
        loss.backward()
        opt.step()
        opt.clear_grad()
    print(json.dumps({"stopped_at": None}))


def measure(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, float, str]:
    """(peak RSS in MB, wall seconds, stdout) of one child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert proc.stdout is not None
    out = proc.stdout.read().decode()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_maxrss / 1024, time.perf_counter() - t0, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--phases", action="store_true",
                        help="also the probe's peak RSS per phase (loop, localisation, each replay; big_batches.py)")
    parser.add_argument("--bundle", action="store_true",
                        help="the probe writes a bundle (--bundle: the batch and model state captured at the fault)")
    parser.add_argument("--plain", action="store_true", help="(internal) run the plain loop in this process")
    args = parser.parse_args()
    if args.plain:
        plain(args.hidden, args.layers, args.steps)
        return
    params = args.layers * (args.hidden + 1) * args.hidden + args.hidden + 1
    with tempfile.TemporaryDirectory() as tmp:
        config = write_config(Path(tmp), args.hidden, args.layers, args.steps)
        report_path = Path(tmp) / "report.json"
        base = [sys.executable, str(HERE), "--hidden", str(args.hidden), "--layers", str(args.layers),
                "--steps", str(args.steps)]
        plain_mb, plain_s, plain_out = measure([*base, "--plain"])
        bundle = ["--bundle", str(Path(tmp) / "bundle")] if args.bundle else []
        probe_mb, probe_s, _ = measure([sys.executable, "-m", "nandoctor", "probe", str(config), "--json",
                                        str(report_path), "-q", *bundle])
        report = json.loads(report_path.read_text(encoding="utf-8"))
        if args.phases:  # in a process of its own: its peaks are not this one's
            subprocess.run([sys.executable, str(HERE.parent / "big_batches.py"), "--phases-only", str(config)],
                           check=True)
    fault = report.get("first_fault") or {}
    details = report.get("details", {})  # the ring's figures depend on the clock: under details.timings
    snaps = {**details.get("snapshots", {}), **details.get("timings", {}).get("snapshots", {})}
    print(f"model: {params / 1e6:.1f}M parameters ({args.layers} x Linear({args.hidden}, {args.hidden}) + head), Adam")
    print(f"plain loop: peak RSS {plain_mb:.0f} MB, {plain_s:.1f} s, {plain_out.strip()}")
    print(f"nandoctor probe: peak RSS {probe_mb:.0f} MB, {probe_s:.1f} s, first fault at step {fault.get('step')}")
    print(f"peak ratio probe / plain: {probe_mb / plain_mb:.2f}x{' (--bundle)' if args.bundle else ''}")
    print(f"snapshots: kept before steps {snaps.get('kept_steps')}, of them on disk {snaps.get('disk_steps')}, "
          f"every {snaps.get('every')} steps, {snaps.get('seconds')} s; note: {snaps.get('note')}")
    for row in report.get("remedies", []):
        print(f"  {row['remedy']:<13} {row['outcome']:<15} from step {row.get('start_step')}  {row.get('note') or ''}")


if __name__ == "__main__":
    main()
