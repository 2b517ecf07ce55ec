"""The checked pass of `nandoctor run`: the op and line of a fault in loss code no replay can reach.

`nandoctor run` can replay the model (its inputs and the gradient back to its outputs are recorded), but
not loss code written as functions in the user's script. When a fault began there, the watched process
runs the same command once more, up to the faulting step, with Paddle's tensor checker switched on at
that step only, right after the model's forward: the first loss-code op that makes NaN/Inf raises, and
its type and the user's line that called it (or, for a backward op, the line that created its forward op,
from the stack Paddle prints) are the answer. Everything before that step runs as in the first pass,
watched the same way so steps count the same; the RNG states the first pass had when Paddle was imported
are restored at the same point, so an unseeded script draws the same numbers. The cost is a second run of
the script up to the faulting step (docs/ways-in.md, "No code change": "What it costs").

The pass's stdout and stderr are discarded and its standard input is closed; its file writes go to a
private mirror folder (sandbox.py), and any file of the working folder that changed all the same is named
in the report; it writes one small JSON result and ends with `os._exit`, so the script's own atexit
handlers and output do not run twice.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

# The checked pass may take this many times as long as the first pass took to reach the fault, plus slack
_TIME_FACTOR = 3.0
_TIME_SLACK = 60.0


def rng_file(config: dict[str, Any]) -> Path:
    return Path(config["result"]).with_name("rng_at_import.pkl")


def save_rng(config: dict[str, Any]) -> None:
    """First pass, right after `import paddle`: the RNG states a checked pass restores at the same point."""
    import numpy as np
    import paddle

    try:
        rng_file(config).write_bytes(pickle.dumps((random.getstate(), np.random.get_state(), paddle.get_rng_state())))
    except Exception:  # noqa: BLE001 - without it the checked pass may just not reproduce: it says so
        pass


def restore_rng(path: str) -> None:
    """Checked pass, right after `import paddle`: the first pass's states (the file is nandoctor's own)."""
    import numpy as np
    import paddle

    try:
        py, npy, pd = pickle.loads(Path(path).read_bytes())  # noqa: S301 - written by our own first pass
    except Exception:  # noqa: BLE001
        return
    random.setstate(py)
    np.random.set_state(npy)
    paddle.set_rng_state(pd)


def run_checked_pass(config: dict[str, Any], step: int, model: Any, started: float) -> dict[str, Any]:
    """First pass, at a loss-code fault: run the command again with the checker on at `step`; its result
    ({"op", "source", "seconds"} or {"error"})."""
    argv = list(getattr(sys, "orig_argv", []) or [])
    if not argv:
        return {"error": "the command line of this Python process is not known (Python < 3.10)"}
    from nandoctor.engine.sandbox import changed_files, file_states

    with tempfile.TemporaryDirectory(prefix="nandoctor-recheck-") as tmp:
        result = Path(tmp) / "recheck.json"
        sub = {"result": str(result), "recheck_step": step, "rng": str(rng_file(config)),
               "model_class": f"{type(model).__module__}.{type(model).__qualname__}", "mirror": str(Path(tmp) / "m")}
        before = file_states(Path.cwd())
        env = dict(os.environ)
        env["NANDOCTOR_RUN"] = json.dumps(sub)
        env.pop("NANDOCTOR_RUN_ROOT_PID", None)  # the re-run command is a first process, not a child of ours
        limit = _TIME_FACTOR * (time.monotonic() - started) + _TIME_SLACK
        t0 = time.monotonic()
        try:
            subprocess.run(argv, env=env, cwd=os.getcwd(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=limit, check=False)
        except subprocess.TimeoutExpired:
            return {"error": f"the checked pass did not reach step {step} within {limit:.0f} s"}
        except OSError as exc:
            return {"error": f"the checked pass could not start: {exc}"}
        seconds = round(time.monotonic() - t0, 2)
        changed = changed_files(before, file_states(Path.cwd()))
        try:
            out = json.loads(result.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            out = {"error": "the checked pass ended without an answer (the script may stop early on a second run, "
                            "or read its input)"}
    out["seconds"] = seconds
    out["changed_files"] = changed
    return out


class CheckedPass:
    """The checked pass's side, inside the re-run script: checker on at the step, answer written, exit."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.result = Path(config["result"])
        self.step = int(config["recheck_step"])
        self.model_class = str(config.get("model_class") or "")
        self.armed = False
        self.base = Path.cwd()
        self.call: Any = None  # the model's call at the step, and the loss function it went to (loss_samples.py)
        self.bisecting = False  # the replays of the bisection run their backward as it is

    def is_model(self, layer: Any) -> bool:
        cls = type(layer)
        return f"{cls.__module__}.{cls.__qualname__}" == self.model_class

    def after_model(self, step: int, model: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """The model's forward at `step` returned: everything after it is the loss code, checked, and the
        first function of the user's that takes the output is caught (the loss, to bisect the batch with)."""
        if self.armed or step != self.step:
            return
        import paddle

        from nandoctor.engine.checker import enable_checker
        from nandoctor.zero_change.loss_samples import LossCall

        self.armed = True
        sys.excepthook = self._excepthook
        self.call = LossCall(model, args, kwargs, out)
        paddle.set_flags({"FLAGS_call_stack_level": 3})  # backward ops print the line of their forward op
        enable_checker()
        self.call.start()

    def backward(self, run: Any) -> Any:
        """`loss.backward()` of the checked step: an abort there names a backward op of the loss code."""
        if not self.armed or self.bisecting:
            return run()
        from nandoctor.engine.native import FRAME_RE, capture_native_output

        with capture_native_output() as native:
            try:
                return run()
            except Exception as exc:  # noqa: BLE001 - the checker's abort is what this pass is for
                failure = exc
        frames = [(file, int(line), func) for file, line, func in FRAME_RE.findall(native.text)]
        self.answer(failure, self._innermost(frames), "backward")
        return None

    def not_reproduced(self, why: str) -> None:
        self._write({"error": why})

    def answer(self, exc: BaseException, source: str | None, phase: str) -> None:
        """The checker's abort: its op, the user's line, and whether the loss code's forward (`loss`) or its
        backward (`backward`) made the first NaN/Inf."""
        from nandoctor.engine.checker import aborted_op

        op = aborted_op(exc)
        if op is None:
            self._write({"error": f"the checked step raised {type(exc).__name__}, not the tensor checker"})
            return
        self._write({"op": op, "source": source, "step": self.step, "phase": phase, "samples": self._samples()})

    def _samples(self) -> dict[str, Any]:
        """The faulting step's batch bisected through the model and the loss function (loss_samples.py)."""
        from nandoctor.zero_change.loss_samples import loss_samples

        if self.call is not None:
            self.call.stop()
        self.bisecting = True
        try:
            return loss_samples(self.call)
        except Exception as exc:  # noqa: BLE001 - nandoctor's own failure: no sample named, and it says so
            return {"samples": None, "why": "failed", "error": f"{type(exc).__name__}: {exc}"[:300]}

    def _excepthook(self, kind: type, exc: BaseException, tb: Any) -> None:
        self.answer(exc, self._innermost([(f.filename, f.lineno, f.name) for f in traceback.extract_tb(tb)]), "loss")

    def _innermost(self, frames: list[tuple[str, Any, str]]) -> str | None:
        """'loss.py:12 in bce' (relative to the working folder): the innermost frame of the user's own code.
        No folder counts as the user's by location alone: a venv inside the project is not their code."""
        from nandoctor.workload.entrypoints import is_user_file, short_path

        found = None
        for file, line, func in frames:
            path = Path(file)
            if is_user_file(path, None):  # (short_path resolves "run/../train.py")
                found = f"{short_path(path, self.base)}:{line} in {func}"
        return found

    def _write(self, data: dict[str, Any]) -> None:
        try:
            self.result.write_text(json.dumps(data), encoding="utf-8")
        finally:
            os._exit(0)
