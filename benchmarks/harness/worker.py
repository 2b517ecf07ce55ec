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
- `run`: the plain loop under `nandoctor run`'s seams (its sitecustomize's session, installed here) vs the
  same loop with Paddle's own methods put back around each of its steps, steps taken in turn.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

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


def rng_state() -> tuple[Any, Any, Any]:
    import random

    import numpy as np
    import paddle

    return paddle.get_rng_state(), np.random.get_state(), random.getstate()


def set_rng_state(state: tuple[Any, Any, Any]) -> None:
    import random

    import numpy as np
    import paddle

    paddle.set_rng_state(state[0])
    np.random.set_state(state[1])
    random.setstate(state[2])


class Interleaved:
    """One plain step after every step of another loop (the probe's, or a watched one), in one process.

    Whole runs of each side taken in turn were too noisy here: two runs of the very same plain loop
    differed by up to 1.37x (lstm, 30 steps each), as other tenants slow this machine for seconds at a
    time. Steps taken in turn see the same machine within ~100 ms. Each side keeps its own RNG state
    (swapped outside both timings), so each trains exactly as it would alone; `between()` times the other
    loop's step as the span since the previous plain step ended.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.rng = rng_state()  # the plain side's, as its build left it
        self.plain_loss: list[float] = []
        self.plain: list[tuple[float, float]] = []  # (wall, cpu) seconds of each plain step
        self.other: list[tuple[float, float]] = []  # the other loop's steps (by between(): from its second on)
        self._end: tuple[float, float] | None = None

    def between(self) -> None:
        wall, cpu = time.perf_counter(), time.process_time()
        if self._end is not None:
            self.other.append((wall - self._end[0], cpu - self._end[1]))
        self._plain_step()

    def pair(self, other_step: Callable[[], Any]) -> Any:
        """One step of the other loop, then one plain step, both timed by the same code around the call.

        For a loop the harness drives (row 7). `between()`'s span from one plain step's end to the next
        call also holds the harness's own work around the other step: the same plain loop on both sides
        measured 1.012-1.014x that way, 1.000-1.001x this way (fast_mlp, 6 runs of 3,000 steps)."""
        wall, cpu = time.perf_counter(), time.process_time()
        out = other_step()
        self.other.append((time.perf_counter() - wall, time.process_time() - cpu))
        self._plain_step()
        return out

    def _plain_step(self) -> None:
        theirs = rng_state()
        set_rng_state(self.rng)
        wall, cpu = time.perf_counter(), time.process_time()
        self.plain_loss.append(self.trainer.step())
        self.plain.append((time.perf_counter() - wall, time.process_time() - cpu))
        self.rng = rng_state()
        set_rng_state(theirs)
        self._end = time.perf_counter(), time.process_time()

    def on_progress(self, done: int, total: int | None, description: str) -> None:
        """As `run_probe`'s progress callback: a plain step after each probe step (not after a replay's)."""
        if description == "probe step":
            self.between()

    def ratios(self, warmup: int) -> tuple[float, float, float, float, float]:
        """(other ms, plain ms, wall ratio, cpu ratio) over the same steps, the first `warmup` left out, and
        the ms the other loop took over the plain one in those first steps (its start-up).

        The mean, not the median: a loop that samples per-layer stats every k-th step must pay for those
        steps here, and a median would hide them."""
        skipped = len(self.plain) - len(self.other)  # between() times no other step before the first plain one
        other, plain = self.other[warmup:], self.plain[warmup + skipped:]
        startup = sum(o - p for (o, _), (p, _) in zip(self.other[:warmup], self.plain[skipped:warmup + skipped]))
        ow, pw = statistics.fmean(w for w, _ in other), statistics.fmean(w for w, _ in plain)
        oc, pc = statistics.fmean(c for _, c in other), statistics.fmean(c for _, c in plain)
        return 1000 * ow, 1000 * pw, ow / pw, oc / pc, 1000 * startup


def mode_steps(args: argparse.Namespace) -> dict[str, Any]:
    """The probe's steps against plain steps taken in turn in the same process (`Interleaved`)."""
    from plain_loop import PlainTrainer, read_settings

    from nandoctor.probe import ProbeOptions, run_probe
    from nandoctor.spec import load_spec

    plain = load_plain(args.plain)
    settings = read_settings(args.config)
    spec = load_spec(args.config)
    out: dict[str, list[float]] = {"probe_ms": [], "plain_ms": [], "ratios": [], "cpu_ratios": [], "startup_ms": []}
    for _ in range(args.runs):
        gc.collect()
        steps = Interleaved(PlainTrainer(settings, plain.build_model, plain.build_loader, plain.loss_fn, 0))
        report = run_probe(spec, ProbeOptions(steps=args.steps, seed=0, device="cpu"), steps.on_progress)
        if [p.loss for p in report.timeline] != steps.plain_loss:
            return {"error": "the probe trained differently from the plain loop beside it"}
        for key, value in zip(("probe_ms", "plain_ms", "ratios", "cpu_ratios", "startup_ms"),
                              steps.ratios(args.warmup)):
            out[key].append(value)
    return out


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


class WatchedTrainer:
    """The plain loop with the in-loop API added as a user adds it: watch, then check after backward."""

    def __init__(self, trainer: Any) -> None:
        import nandoctor

        self.trainer = trainer
        # with step_fn and the batch, as docs/ways-in.md shows it: a fault is replayed, most steps' losses stay
        # on the device until a later read, and a many-tensor model's gradients are read one step in four
        # (inloop/history.py)
        self.watch = nandoctor.watch(trainer.model, trainer.optimizer, step_fn=self._step_fn, report_dir=None)
        self.doctor = self.watch.__enter__()

    def step(self) -> float:
        # `doctor.check(loss, (x, y))` itself as the callback: the one call a user adds (a wrapper of the
        # harness's own around it was ~0.3% of a 0.3 ms step); its answer is judged once, at the end
        return self.trainer.step(after_backward=self.doctor.check)

    def _step_fn(self, model: Any, batch: tuple[Any, Any]) -> Any:
        x, y = batch
        return self.trainer.loss_fn(model(x), y)

    @property
    def healthy(self) -> bool:
        """No check found a fault (every step's update went ahead)."""
        return self.doctor.fault is None

    def close(self) -> None:
        self.watch.__exit__(None, None, None)


def mode_inloop(args: argparse.Namespace) -> dict[str, Any]:
    """Watched steps against plain steps taken in turn in the same process, on two identical models."""
    from plain_loop import PlainTrainer, read_settings

    plain = load_plain(args.plain)
    settings = read_settings(args.config)

    def trainer() -> Any:
        return PlainTrainer(settings, plain.build_model, plain.build_loader, plain.loss_fn, 0)

    out: dict[str, list[float]] = {"inloop_ms": [], "plain_ms": [], "ratios": [], "cpu_ratios": [], "startup_ms": []}
    for _ in range(args.runs):
        gc.collect()
        watched = WatchedTrainer(trainer())
        steps = Interleaved(trainer())  # built from seed 0 again: the watched side starts from the same RNG
        losses = []
        try:
            for _ in range(args.steps):
                losses.append(steps.pair(watched.step))
        finally:
            watched.close()
        if not watched.healthy:
            return {"error": "the in-loop check found a fault on a healthy workload"}
        if losses != steps.plain_loss:
            return {"error": "the watched loop trained differently from the plain one"}
        for key, value in zip(("inloop_ms", "plain_ms", "ratios", "cpu_ratios", "startup_ms"),
                              steps.ratios(args.warmup)):
            out[key].append(value)
    return out


class Unwatched(Interleaved):
    """`Interleaved` whose plain steps run with Paddle's own methods, not `nandoctor run`'s seams (put back
    outside the step's timing): the plain side is the script alone, in the same process."""

    def __init__(self, trainer: Any, session: Any) -> None:
        super().__init__(trainer)
        self.session = session

    def _plain_step(self) -> None:
        with unpatched(self.session):
            super()._plain_step()


class unpatched:  # noqa: N801 - a context manager used as a function
    """Paddle's own `Layer.__call__`, `Tensor.backward` and optimizer steps while inside (the seams after)."""

    def __init__(self, session: Any) -> None:
        import paddle

        orig = session.orig
        self.slots = [(paddle.nn.Layer, "__call__", orig["call"]), (paddle.Tensor, "backward", orig["backward"]),
                      (paddle.optimizer.Optimizer, "step", orig["step"])]
        self.slots += [(cls, "step", own) for cls, own in orig.get("steps", {}).items()]

    def __enter__(self) -> None:
        self.seams = [(cls, name, cls.__dict__[name]) for cls, name, _ in self.slots]
        for cls, name, own in self.slots:
            setattr(cls, name, own)

    def __exit__(self, *exc: Any) -> None:
        for cls, name, seam in self.seams:
            setattr(cls, name, seam)


def mode_run(args: argparse.Namespace) -> dict[str, Any]:
    """`nandoctor run`'s steps against the same script's plain steps, in turn in one process: the session
    the run's sitecustomize installs, installed here, watches one trainer; the other steps with Paddle's own
    methods put back (`unpatched`). The seams' and the run's engine's cost per step, without the process
    start and end that row 9 also pays. One run a process (`--runs` is ignored; run.py starts one per pair): a
    second model in the same process is found the way a script's second model is, with hooks on the layers
    no watch has yet, and ran its steps ~1.5x slower than the first."""
    import atexit
    import os
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="nandoctor-bench-run-")
    atexit.register(shutil.rmtree, folder, True)  # first, so it runs after the session's own exit report
    from plain_loop import PlainTrainer, read_settings

    os.environ["NANDOCTOR_RUN"] = json.dumps({"result": str(Path(folder) / "report.json"), "report_dir": None,
                                              "keep_going": False})
    os.environ["NANDOCTOR_RANK_PROGRESS"] = folder
    from nandoctor.zero_change import runtime

    runtime.install()
    session = runtime.SESSION
    plain = load_plain(args.plain)
    settings = read_settings(args.config)

    def trainer() -> Any:
        return PlainTrainer(settings, plain.build_model, plain.build_loader, plain.loss_fn, 0)

    watched = trainer()
    with unpatched(session):
        steps = Unwatched(trainer(), session)  # built from seed 0 again: the same RNG as the watched side
    losses = [steps.pair(watched.step) for _ in range(args.steps)]
    if session.done or any(w.doctor is not None and w.doctor.fault is not None for w in session.watches):
        return {"error": "nandoctor run found a fault on a healthy workload"}
    if not session.watches:
        return {"error": "nandoctor run found no model in the plain loop"}
    if losses != steps.plain_loss:
        return {"error": "the loop under nandoctor run trained differently from the plain one"}
    keys = ("run_ms", "plain_ms", "ratios", "cpu_ratios", "startup_ms")
    return {key: [value] for key, value in zip(keys, steps.ratios(args.warmup))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["steps", "checker", "localize", "scan", "inloop", "run"])
    parser.add_argument("config", type=Path)
    parser.add_argument("plain", type=Path)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--checker-steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    modes = {"steps": mode_steps, "checker": mode_checker, "localize": mode_localize, "scan": mode_scan,
             "inloop": mode_inloop, "run": mode_run}
    result = modes[args.mode](args)
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
