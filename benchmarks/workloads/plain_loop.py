"""The plain Paddle training loop every `plain_<name>.py` runs: what a user's own script does, no nandoctor.

Each step: forward, loss, backward, optimizer step, clear_grad, and read the loss value (a host sync,
as every user loop that logs its loss does). Model, data and optimizer settings are read from the same
`config.yaml` nandoctor runs, so the two sides of a benchmark cannot drift apart. The seed is set the
way the probe sets it (paddle, numpy, random) before the model is built.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Callable

import numpy as np
import paddle
import yaml

# (config path) -> the model, data and optimizer settings the plain loop needs
Settings = dict[str, Any]


def read_settings(config: Path) -> Settings:
    raw = yaml.safe_load(config.read_text(encoding="utf-8"))
    opt = raw.get("optimizer") or {}
    return {"model": (raw["model"].get("args") or {}), "data": (raw["data"].get("args") or {}),
            "optimizer": opt.get("name", "Adam"),
            "optimizer_args": opt.get("args") or {"learning_rate": 1e-3}}


class PlainTrainer:
    """The plain loop one step at a time, so a benchmark can interleave its steps with another loop's."""

    def __init__(self, settings: Settings, build_model: Callable[..., Any],
                 build_loader: Callable[..., Iterable[Any]], loss_fn: Callable[[Any, Any], Any], seed: int) -> None:
        paddle.set_device("cpu")
        paddle.seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        self.model = build_model(**settings["model"])
        self.model.train()
        self.optimizer = getattr(paddle.optimizer, settings["optimizer"])(parameters=self.model.parameters(),
                                                                          **settings["optimizer_args"])
        self._new_epoch = lambda: iter(build_loader(**settings["data"]))
        self._batches = self._new_epoch()
        self.loss_fn = loss_fn

    def next_batch(self) -> tuple[Any, Any]:
        try:
            batch = next(self._batches)
        except StopIteration:  # a new epoch, as the probe does
            self._batches = self._new_epoch()
            batch = next(self._batches)
        x, y = (paddle.to_tensor(a) for a in batch)
        return x, y

    def step(self, after_backward: Callable[[Any, tuple[Any, Any]], None] | None = None) -> float:
        """Forward, loss, backward, optimizer step, clear_grad; the loss value read on the host.
        `after_backward(loss, (x, y))` runs where a user adds a check (the in-loop benchmark)."""
        x, y = self.next_batch()
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        if after_backward is not None:
            after_backward(loss, (x, y))
        self.optimizer.step()
        self.optimizer.clear_grad()
        return float(loss)


def train(settings: Settings, build_model: Callable[..., Any], build_loader: Callable[..., Iterable[Any]],
          loss_fn: Callable[[Any, Any], Any], steps: int, seed: int) -> dict[str, list[float]]:
    """Train `steps` steps; returns each step's loss, wall time and process CPU time (end to end)."""
    trainer = PlainTrainer(settings, build_model, build_loader, loss_fn, seed)
    losses: list[float] = []
    times: list[float] = []
    cpu_times: list[float] = []
    last, last_cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        losses.append(trainer.step())
        now, now_cpu = time.perf_counter(), time.process_time()
        times.append(now - last)
        cpu_times.append(now_cpu - last_cpu)
        last, last_cpu = now, now_cpu
    return {"loss": losses, "step_seconds": times, "step_cpu_seconds": cpu_times}


def main(here: str, build_model: Callable[..., Any], build_loader: Callable[..., Iterable[Any]],
         loss_fn: Callable[[Any, Any], Any]) -> None:
    """Command line of every plain script: [CONFIG] --steps N --seed S [--json PATH]."""
    parser = argparse.ArgumentParser(description="Train the workload with a plain Paddle loop.")
    parser.add_argument("config", nargs="?", default=str(Path(here).resolve().parent / "config.yaml"))
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the per-step losses and times here")
    args = parser.parse_args()
    settings = read_settings(Path(args.config))
    result = train(settings, build_model, build_loader, loss_fn, args.steps, args.seed)
    if args.json:
        Path(args.json).write_text(json.dumps(result), encoding="utf-8")
    print(f"trained {args.steps} steps, last loss {result['loss'][-1]:.4f}")
