"""The floor under `nandoctor run`'s cost (issue 36): the least any watch that replays unread steps exactly
must add to the user's process, measured on a workload's plain script, beside what `run` adds.

`run` leaves most steps unread and, on a fault, replays them from what it kept. Whatever its bookkeeping,
each step it must pass through three seams (the model's forward, `loss.backward`, the optimizer's step)
and keep, until a later read, the step's inputs, its loss and the gradient that came back to the model's
outputs (what a replay of a loss written as functions needs). This script puts exactly that, and nothing
else, around the plain script (`--child`), and times it against the script alone, each process alone on
a core (`procs.run_alone`, CPU seconds):

    .venv/bin/python benchmarks/floor.py                   # fast_mlp, 20,000 steps, 3 pairs each
    .venv/bin/python benchmarks/floor.py cnn --steps 60 --runs 4

Printed: the seams alone, the seams with the smallest tape, `nandoctor run` with that tape in place of its
own bookkeeping (`--child bare`, under `run`: its seams, reads and snapshots as they are, but a quiet step
keeps the tape's tuple and nothing else; not a working watch, as its reads see no unread steps), and
`nandoctor run` itself. The gaps say what `run`'s machinery and what its bookkeeping cost above the floor
(benchmarks/README.md, "The floor under run").
"""

from __future__ import annotations

import argparse
import collections
import runpy
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

KEEP_STEPS = 512  # steps kept alive at once (run's ring keeps a few hundred on a 0.3 ms step)


def _child(mode: str, script: str, argv: list[str]) -> None:
    """Run the plain script with the floor's seams (`seams`), and its smallest tape (`tape`); or, under
    `nandoctor run`, with run's seams keeping that tape instead of run's bookkeeping (`bare`)."""
    sys.argv = [script, *argv]
    sys.path[:0] = [str(Path(script).resolve().parent), str(HERE / "workloads")]
    kept: collections.deque = collections.deque(maxlen=KEEP_STEPS)
    if mode == "bare":
        _bare_run(kept)
    else:
        _floor_seams(mode == "tape", kept)
    runpy.run_path(script, run_name="__main__")
    print(f"floor: {len(kept)} step(s) kept", file=sys.stderr)  # (what tests/test_benchmarks.py checks)


def _floor_seams(tape: bool, kept: collections.deque) -> None:
    """The three seams any watch needs, on the plain script's model and Paddle's classes; with `tape`, each
    step's inputs, detached loss and output gradient kept in `kept`."""
    import paddle
    import plain_loop

    last: dict[str, Any] = {}
    init = plain_loop.PlainTrainer.__init__

    def trainer_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        model = self.model
        forward = model.forward

        def seam(*inputs: Any, **kw: Any) -> Any:  # an instance seam on the model only, as `run` has
            out = forward(*inputs, **kw)
            if model.training:
                last["inputs"] = inputs
                if isinstance(out, paddle.Tensor) and not out.stop_gradient:
                    out.retain_grads()
                last["out"] = out
            return out

        model.forward = seam

    backward, step = paddle.Tensor.backward, paddle.optimizer.Optimizer.step

    def loss_backward(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = backward(self, *args, **kwargs)
        last["loss"] = self
        return out

    def optimizer_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        if tape:
            out = last.get("out")
            grad = out.grad if isinstance(out, paddle.Tensor) else None
            kept.append((last.get("inputs"), last["loss"].detach(), grad))
        return step(self, *args, **kwargs)

    plain_loop.PlainTrainer.__init__ = trainer_init
    paddle.Tensor.backward = loss_backward
    paddle.optimizer.Optimizer.step = optimizer_step


def _bare_run(kept: collections.deque) -> None:
    """`nandoctor run`'s session, with a quiet step's bookkeeping (the doctor's note, the replay tape, the
    update's close) replaced by the floor's tuple: what its seams, reads and snapshots cost without it."""
    from time import perf_counter

    from nandoctor.zero_change.runtime import Session

    before, after = Session.before_step, Session.after_step
    bare = {"step": False}  # the update under way is a bare quiet step: run's after_step is left out too

    def before_step(self: Any, optimizer: Any) -> bool:
        bare["step"] = False
        watch = None if self.busy else self._watch_of(optimizer)
        if watch is not None:
            doctor = watch.doctor
            if doctor.step < doctor._quiet_until and not doctor._checked and watch.checked != self.backwards:
                watch.checked = self.backwards
                kept.append((watch.inputs, self.last_loss.detach(), tuple(watch.grads.values()), perf_counter(),
                             optimizer.get_lr()))
                doctor.step += 1
                bare["step"] = True
                return True
        return before(self, optimizer)

    def after_step(self: Any, optimizer: Any) -> None:
        if not bare["step"]:
            after(self, optimizer)

    Session.before_step, Session.after_step = before_step, after_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", nargs="?", default="fast_mlp")
    parser.add_argument("--steps", type=int, default=None, help="default: the config's probe.steps")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    from harness import workloads

    scratch = Path(tempfile.mkdtemp(prefix="nandoctor-floor-"))
    w = workloads.load(args.workload, False, scratch)
    steps = str(args.steps or w.steps)
    py = sys.executable
    plain = [py, str(w.plain), str(w.config), "--steps", steps]
    run = [py, "-m", "nandoctor", "run", "--json", str(scratch / "run{run}.json"), "--"]
    sides = {
        "seams (forward, backward, step)": [py, __file__, "--child", "seams", *plain[1:]],
        "seams and the smallest tape": [py, __file__, "--child", "tape", *plain[1:]],
        "run keeping only that tape": [*run, py, __file__, "--child", "bare", *plain[1:]],
        "nandoctor run": [*run, *plain],
    }
    print(f"{args.workload}, {steps} steps, {args.runs} pair(s) each, each process alone on a core (CPU seconds)")
    try:
        for name, command in sides.items():
            _measure(name, command, plain, args.runs)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _measure(name: str, command: list[str], plain: list[str], runs: int) -> None:
    """`command` against the plain script, `runs` pairs alone on a core: the median ratio and each pair's."""
    from harness import procs
    from harness.table import median

    paired = procs.run_alone(command, plain, runs)
    failed = [r for r in paired.a + paired.b if r.returncode != 0]
    if failed:
        sys.exit(f"{name}: a run exited with {failed[0].returncode}: {failed[0].stderr_tail}")
    ratios = paired.ratios("cpu_seconds")
    print(f"  {name:34s} {median(ratios):.3f}x  (pairs {' '.join(f'{r:.3f}' for r in ratios)})", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        main()
