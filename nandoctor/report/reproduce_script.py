"""reproduce.py: re-run the failing step of this nandoctor bundle and print where it first goes NaN/Inf.

This file is copied verbatim into every bundle written by `nandoctor probe/scan --bundle DIR`. It needs
only paddle, numpy and pyyaml, plus the files next to it: spec.yaml, code/ (the model's own .py files),
state.npz (the parameters just before the failing step), batch.npz (the offending batch, one array per
field), rng_state.json (when saved) and report.json (what nandoctor found, to compare against).

Only this file and code/ are code; read them before running a bundle someone else made. The data files
are read without pickle (`numpy.load(..., allow_pickle=False)` and JSON), so a planted pickle is refused,
never run.

    python reproduce.py                          # from any folder
    python reproduce.py --with-remedy op_guard   # the same step with a remedy from report.json applied

For a training fault it rebuilds the model from code/ with spec.yaml's arguments, loads the state and
the batch, restores the RNG state, and runs forward + loss + backward (and the optimizer step when the
fault was there) with Paddle's tensor checker on, which stops at the first operator that outputs NaN
or Inf. Forward hooks keep a stack of the layers being run, and gradient hooks on each layer's output
track which layer the backward pass is in, so the fault is printed as op, phase and layer. For a data
fault it re-checks the saved batch for NaN/Inf and prints the field and samples.

`--with-remedy NAME` replays the step with one of the report's remedies applied: `op_guard` (the epsilon
or clamp for the faulting op, at the source line the report names) or `drop_samples` (the offending
samples left out). Remedies that act over many steps (learning rate, warmup, clipping, re-initialising)
were verified by the probe from an earlier state this bundle does not hold; reproduce.py says so.

Paddle's checker log goes to reproduce.log in this folder. Exit status: 1 when a fault reproduced, 0
when the step ran clean, 2 when the bundle cannot be replayed.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
LOG_NAME = "reproduce.log"
RNG_FORMAT = "paddle.GeneratorState/1"
FAULT_KEYS = ("op", "phase", "layer")


class BundleError(Exception):
    """The bundle is missing a file or names code that cannot be loaded."""


USAGE = "usage: python reproduce.py [--with-remedy NAME]   (NAME: op_guard or drop_samples, from report.json)"


def parse_remedy(argv: list[str]) -> str | None:
    """`--with-remedy NAME` (or `=NAME`); anything else is a usage error (SystemExit 2)."""
    if not argv:
        return None
    if len(argv) == 1 and argv[0].startswith("--with-remedy="):
        return argv[0].split("=", 1)[1]
    if len(argv) == 2 and argv[0] == "--with-remedy":
        return argv[1]
    print(USAGE, file=sys.stderr if argv[0] not in ("-h", "--help") else sys.stdout)
    raise SystemExit(0 if argv[0] in ("-h", "--help") else 2)


def main(argv: list[str] | None = None) -> int:
    remedy = parse_remedy(argv or [])
    warnings.filterwarnings("ignore", message=".*ccache.*")  # Paddle's import-time build-tool notice
    sys.dont_write_bytecode = True  # leave the bundle as it came: no __pycache__ under code/
    try:
        report = json.loads((HERE / "report.json").read_text(encoding="utf-8"))
        spec = yaml.safe_load((HERE / "spec.yaml").read_text(encoding="utf-8"))
    except (OSError, ValueError, yaml.YAMLError) as exc:
        print(f"reproduce.py: cannot read the bundle in {HERE}: {exc}", file=sys.stderr)
        return 2
    expected = report.get("first_fault") or {}
    if expected:
        print("nandoctor reported: " + describe(expected))
    try:
        batch = load_batch()
        if remedy:
            return replay_with_remedy(report, spec, batch, expected, remedy)
    except BundleError as exc:
        print(f"reproduce.py: {exc}", file=sys.stderr)
        return 2
    phase = expected.get("phase")
    if not expected and not (HERE / "batch.npz").is_file():
        print(f"nothing to reproduce: nandoctor found no fault in this run (verdict {report.get('verdict')}); "
              "see report.md for its warnings.")
        return 0
    try:
        if phase == "params":
            found = check_state(expected)
        elif report.get("command") == "scan" or phase == "data":
            found = check_data(batch, spec, expected)
            if found is None and report.get("command") == "probe":
                # No NaN/Inf in the batch: a bad label or id that makes the step raise. Replay the step.
                found = replay_step(spec, batch, expected)
                if found is not None and found.get("error"):
                    print("first fault: " + describe(found))
                    print("matches the report: yes (the step raises on this batch; nandoctor traced the cause "
                          "to the data, see report.md)")
                    return 1
        else:
            found = replay_step(spec, batch, expected)
    except BundleError as exc:
        print(f"reproduce.py: {exc}", file=sys.stderr)
        return 2
    if found is None:
        print("no fault: the step ran without NaN/Inf here (a different Paddle version or device can differ; "
              "see environment.json).")
        return 0
    print("first fault: " + describe(found))
    if expected:
        same = all(found.get(k) == expected.get(k) for k in FAULT_KEYS if expected.get(k) is not None)
        print("matches the report: " + ("yes" if same else "no (see the report above)"))
    return 1


def describe(fault: dict[str, Any]) -> str:
    """'op=sqrt_grad phase=backward layer=head.distance' plus whatever else is known."""
    training = fault.get("phase") not in ("data", "params")  # op and layer mean nothing for a data fault
    parts = [f"{k}={fault.get(k) if fault.get(k) is not None else '-'}" for k in FAULT_KEYS
             if training or k == "phase"]
    for key in ("parameter", "field", "batch_index", "sample_indices", "error"):
        if fault.get(key) not in (None, []):
            value = fault[key]
            parts.append(f"{key.replace('batch_index', 'batch').replace('sample_indices', 'samples')}="
                         f"{','.join(map(str, value)) if isinstance(value, list) else value}")
    return " ".join(parts)


# --- the data ----------------------------------------------------------------------------------------


def load_batch() -> dict[str, np.ndarray] | None:
    """The saved batch, fields in the loader's order; None when the bundle has none."""
    file = HERE / "batch.npz"
    if not file.is_file():
        return None
    return load_arrays(file)


def load_arrays(file: Path) -> dict[str, np.ndarray]:
    """An .npz of plain arrays. Never unpickles: an object array or a pickle in disguise is refused."""
    try:
        data = np.load(file, allow_pickle=False)
        if not hasattr(data, "files"):
            raise ValueError("a single array, not an .npz archive of arrays")
        with data:
            return {name: data[name] for name in data.files}
    except (OSError, ValueError, EOFError) as exc:
        raise BundleError(f"{file.name} is not a plain array archive ({exc}); it was not loaded. A bundle "
                          "from nandoctor never holds pickled data: treat this bundle with care.") from None


def check_data(batch: dict[str, np.ndarray] | None, spec: dict[str, Any], expected: dict[str, Any]
               ) -> dict[str, Any] | None:
    """The first field (in loader order) holding a harmful NaN/Inf, and the samples that hold it. As in
    the probe, an additive mask's -inf (a field whose finite values are all 0 or <= -1e30) is not one."""
    if batch is None:
        raise BundleError("this bundle holds no batch.npz, so there is no data to re-check.")
    for name, array in batch.items():
        if not np.issubdtype(array.dtype, np.floating) and not np.issubdtype(array.dtype, np.complexfloating):
            continue
        bad = ~np.isfinite(array)
        values = array[~bad]
        if np.issubdtype(array.dtype, np.floating) and ((values == 0) | (values <= -1e30)).all():
            bad &= array != -np.inf
        if bad.any():
            samples = np.nonzero(bad.reshape(len(array), -1).any(axis=1))[0].tolist() if array.ndim else []
            return {"op": None, "phase": "data", "layer": None, "field": name,
                    "batch_index": expected.get("batch_index"), "sample_indices": samples}
    return None


def check_state(expected: dict[str, Any]) -> dict[str, Any] | None:
    """A parameter that is already NaN/Inf before training (phase params)."""
    for name, array in load_state().items():
        if np.issubdtype(array.dtype, np.floating) and not np.isfinite(array).all():
            return {"op": None, "phase": "params", "layer": None, "parameter": name}
    return None


def load_state() -> dict[str, np.ndarray]:
    """{parameter or buffer name: array} from state.npz (`model.set_state_dict` takes it); {} when absent."""
    file = HERE / "state.npz"
    if not file.is_file():
        return {}
    return load_arrays(file)


# --- the user's code ---------------------------------------------------------------------------------


def load_entry(entry: str) -> Any:
    """'model.py:build_model' from code/ (or 'pkg.module:func' from code/ or the installed packages)."""
    target, _, attr = entry.rpartition(":")
    code = HERE / "code"
    if str(code) not in sys.path:
        sys.path.insert(0, str(code))
    try:
        if target.endswith(".py"):
            file = code / target
            if not file.is_file():
                raise BundleError(f"{entry!r}: {file} is not in the bundle (was it outside the spec's "
                                  "folder, or the bundle written with --no-code?).")
            module_spec = importlib.util.spec_from_file_location(f"bundle_{file.stem}", file)
            assert module_spec is not None and module_spec.loader is not None
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_spec.name] = module
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ImportError as exc:
        raise BundleError(f"cannot import {entry!r}: {exc}. Install the package it needs.") from None
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def builtin_loss(name: str) -> Any:
    """The four builtin losses, as nandoctor computes them (inlined: nandoctor need not be installed)."""
    import paddle
    import paddle.nn.functional as F

    def cross_entropy(outputs: Any, label: Any) -> Any:
        if label.dtype not in (paddle.int64, paddle.int32):
            label = label.astype("int64")
        if len(label.shape) == len(outputs.shape) - 1:
            label = label.unsqueeze(-1)
        return F.cross_entropy(outputs, label)

    def like(outputs: Any, label: Any) -> Any:
        return label.astype(outputs.dtype).reshape(outputs.shape)

    return {"cross_entropy": cross_entropy,
            "bce_with_logits": lambda o, y: F.binary_cross_entropy_with_logits(o, like(o, y)),
            "mse": lambda o, y: F.mse_loss(o, like(o, y)),
            "l1": lambda o, y: F.l1_loss(o, like(o, y))}[name]


def build_optimizer(spec: dict[str, Any], model: Any) -> Any:
    import paddle

    opt = spec.get("optimizer") or {}
    clip = None
    for kind, cls in (("global_norm", paddle.nn.ClipGradByGlobalNorm), ("norm", paddle.nn.ClipGradByNorm),
                      ("value", paddle.nn.ClipGradByValue)):
        if kind in (opt.get("grad_clip") or {}):
            clip = cls(opt["grad_clip"][kind])
    cls = getattr(paddle.optimizer, opt.get("name", "Adam"))
    return cls(parameters=model.parameters(), grad_clip=clip, **(opt.get("args") or {"learning_rate": 1e-3}))


# --- the replay --------------------------------------------------------------------------------------


class Tracker:
    """Which layer runs: a stack in forward; in backward, the last layer whose output gradient arrived."""

    def __init__(self, model: Any) -> None:
        self.phase = "forward"
        self.stack: list[str] = []
        self.entered = 0  # layers entered so far: a `step` function that fails outside them is in its loss
        self.backward_layer: str | None = None
        self.nonfinite_layer: str | None = None  # the first layer whose forward output was NaN/Inf
        self.claimed: dict[int, Any] = {}  # id -> tensor (kept alive so ids are not reused)
        self.handles = []
        for name, layer in model.named_sublayers():
            self.handles.append(layer.register_forward_pre_hook(self._enter(name)))
            self.handles.append(layer.register_forward_post_hook(self._leave(name)))

    def _enter(self, name: str) -> Any:
        def hook(layer: Any, inputs: Any) -> None:
            self.stack.append(name)
            self.entered += 1

        return hook

    def _leave(self, name: str) -> Any:
        def hook(layer: Any, inputs: Any, outputs: Any) -> None:
            if self.stack and self.stack[-1] == name:
                self.stack.pop()
            for out in outputs if isinstance(outputs, (tuple, list)) else [outputs]:
                if self.nonfinite_layer is None and _nonfinite(out):
                    self.nonfinite_layer = name  # post-hooks run innermost first: the layer that made it
                # The innermost layer that returned a tensor owns it (Head returning distance(...) as is).
                if hasattr(out, "register_hook") and not out.stop_gradient and id(out) not in self.claimed:
                    self.claimed[id(out)] = out
                    out.register_hook(self._grad_arrived(name))

        return hook

    def _grad_arrived(self, name: str) -> Any:
        def hook(grad: Any) -> None:
            self.backward_layer = name  # the ops that run next are this layer's backward

        return hook

    def reset(self) -> None:
        self.phase, self.stack, self.entered, self.backward_layer = "forward", [], 0, None

    def layer(self) -> str | None:
        if self.phase == "forward":
            return self.stack[-1] if self.stack else None
        if self.phase == "backward":
            return self.backward_layer
        return None

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _nonfinite(tensor: Any) -> bool:
    import paddle

    if not isinstance(tensor, paddle.Tensor) or not tensor.is_floating_point() or tensor.size == 0:
        return False
    return not bool(paddle.isfinite(tensor).all())


def pick_output(outputs: Any, selector: Any) -> Any:
    """`model.output`: a position in a tuple, a key of a dict, or an attribute of an output object."""
    if isinstance(selector, int) or isinstance(outputs, dict):
        return outputs[selector]
    return getattr(outputs, selector)


def replay_step(spec: dict[str, Any], batch: dict[str, np.ndarray] | None, expected: dict[str, Any]
                ) -> dict[str, Any] | None:
    import paddle

    if batch is None:
        raise BundleError("this bundle holds no batch.npz (the run captured no batch), so the step cannot be "
                          "replayed.")
    model_spec, data = spec.get("model") or {}, spec.get("data") or {}
    model = load_entry(model_spec["entry"])(**(model_spec.get("args") or {}))
    state = load_state()
    if state:
        model.set_state_dict(state)
    else:
        print("note: no state.npz in the bundle; the replay starts from the model's fresh initialisation, "
              "not from the state before the failing step")
    model.train()
    fields = {name: paddle.to_tensor(array) for name, array in batch.items()}
    label_name = data.get("label") or ("label" if "label" in fields else None)
    inputs = data.get("inputs") or [k for k in fields if k != label_name]
    selector = model_spec.get("output")  # model.output: a key, attribute or position; "loss": its own loss
    if spec.get("step"):
        step_fn = load_entry(spec["step"]["entry"])
    elif selector != "loss":
        loss_spec = spec.get("loss") or {}
        builtin = loss_spec.get("builtin")
        loss_fn = builtin_loss(builtin) if builtin else load_entry(loss_spec["entry"])
    optimizer = build_optimizer(spec, model) if expected.get("phase") == "optimizer" else None

    def forward_and_loss() -> Any:
        if spec.get("step"):
            tracker.phase = "step"  # the user's step runs model and loss: the layer stack tells which
            loss = step_fn(model, fields)
        else:
            tracker.phase = "forward"
            if isinstance(inputs, dict):  # data.inputs as {keyword argument: field}
                outputs = model(**{arg: fields[name] for arg, name in inputs.items()})
            else:
                outputs = model(*[fields[k] for k in inputs])
            tracker.phase = "loss"
            if selector is not None:
                outputs = pick_output(outputs, selector)
            if selector == "loss":
                loss = outputs
            else:
                label = fields.get(label_name) if label_name else None
                loss = loss_fn(outputs) if label is None else loss_fn(outputs, label)
        tracker.phase = "loss"
        return loss

    rng = load_rng()
    if rng is None:
        print("note: no rng_state.json in the bundle; a model with dropout may replay with other masks")
    tracker = Tracker(model)
    log = quiet_paddle()
    try:
        # Pass 1, checker off: which phase first turns non-finite. The checker alone would also stop at
        # an Inf that a where() or a mask throws away, which never reaches training.
        set_rng(rng)
        try:
            loss = forward_and_loss()
        except Exception as exc:  # noqa: BLE001 - the user's code raised: that is the fault
            return fault_from(exc, tracker)
        bad_layer = tracker.nonfinite_layer
        if bad_layer is not None or not bool(paddle.isfinite(loss).all()):
            # Pass 2: the same forward and loss from the same state and RNG, checker on, names the op.
            if state:
                model.set_state_dict(state)
            tracker.reset()
            with tensor_checker(rng):
                try:
                    forward_and_loss()
                except Exception as exc:  # noqa: BLE001 - the checker's abort
                    return fault_from(exc, tracker)
            return {"op": None, "phase": "forward" if bad_layer else "loss", "layer": bad_layer}
        # Forward and loss are finite: only the backward pass (and the update) run under the checker.
        with tensor_checker(None):
            try:
                tracker.phase = "backward"
                loss.backward()
                if optimizer is not None:
                    tracker.phase = "optimizer"
                    optimizer.step()
            except Exception as exc:  # noqa: BLE001 - the checker's abort, or the user's code raising
                return fault_from(exc, tracker)
        return None
    finally:
        tracker.remove()
        restore_output(log)


def load_rng() -> Any:
    """Paddle's generator states rebuilt from rng_state.json (plain numbers); None when absent."""
    file = HERE / "rng_state.json"
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        if data.get("format") != RNG_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {RNG_FORMAT!r}")
        from paddle.base.libpaddle import GeneratorState

        states = []
        for numbers in data["states"]:
            state = GeneratorState.__new__(GeneratorState)
            state.__setstate__(tuple(numbers))
            states.append(state)
        return states
    except (OSError, ValueError, KeyError, TypeError, AttributeError, ImportError) as exc:
        print(f"note: rng_state.json cannot be used ({exc}); a model with dropout may replay with other masks")
        return None


def set_rng(rng: Any) -> None:
    import paddle

    if rng is not None:
        paddle.set_rng_state(rng)


@contextlib.contextmanager
def tensor_checker(rng: Any) -> Iterator[None]:
    """Paddle's tensor checker, aborting at the first op that outputs NaN/Inf; off again afterwards."""
    import paddle
    from paddle.amp.debugging import DebugMode, TensorCheckerConfig

    paddle.amp.debugging.enable_tensor_checker(
        TensorCheckerConfig(enable=True, debug_mode=DebugMode.CHECK_NAN_INF_AND_ABORT))
    set_rng(rng)  # enabling the checker reseeds Paddle, so the saved state goes back after it
    try:
        yield
    finally:
        paddle.amp.debugging.disable_tensor_checker()


def quiet_paddle() -> tuple[str, int, int]:
    """Send Paddle's checker log (a Python stack per op, thousands of lines) to reproduce.log, not the terminal.

    The log stays in the bundle folder (replaced on each run); a read-only bundle discards it.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    path = str(HERE / LOG_NAME)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    except OSError:
        path = os.devnull
        fd = os.open(path, os.O_WRONLY)
    saved = (os.dup(1), os.dup(2))
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return path, saved[0], saved[1]


def restore_output(log: tuple[str, int, int]) -> None:
    path, out, err = log
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.close(out)
    os.close(err)
    if path == os.devnull:
        print(f"Paddle's checker log was discarded: {HERE} is not writable")
    else:
        print(f"Paddle's checker log (the Python stack where each op was created): {path}")


def fault_from(exc: Exception, tracker: Tracker) -> dict[str, Any]:
    message = str(exc)
    op = re.search(r"op=([\w.]+)", message)
    phase = tracker.phase
    if phase == "step":
        phase = "forward" if tracker.stack or not tracker.entered else "loss"
    layer = tracker.stack[-1] if phase == "forward" and tracker.stack else tracker.layer()
    found: dict[str, Any] = {"op": op.group(1) if op else None, "phase": phase, "layer": layer}
    if not (op and "NAN OR INF" in message.upper()):
        found["error"] = f"{type(exc).__name__}: {message.strip().splitlines()[-1][:300] if message else ''}"
    return found


# --- a remedy from the report ------------------------------------------------------------------------

GUARDED = {"sqrt": ("sqrt",), "rsqrt": ("rsqrt",), "log": ("log",), "exp": ("exp",), "pow": ("pow", "__pow__"),
           "divide": ("divide", "__truediv__", "__div__"), "acos": ("acos",)}


def replay_with_remedy(report: dict[str, Any], spec: dict[str, Any], batch: dict[str, np.ndarray] | None,
                       expected: dict[str, Any], name: str) -> int:
    """The failing step again with the remedy `name` applied: exit 0 when it now runs clean, 1 when not."""
    rows = {r.get("remedy"): r for r in report.get("remedies") or []}
    row = rows.get(name)
    if row is None:
        raise BundleError(f"report.json has no remedy {name!r}; it has: {', '.join(rows) or 'none'}.")
    print(f"remedy {name} ({row.get('outcome')} in nandoctor's replay): {row.get('change')}")
    if name not in ("op_guard", "drop_samples"):
        raise BundleError(f"{name} acts over many steps, from a state before the fault that this bundle does not "
                          f"hold; nandoctor replayed it in the probe (outcome {row.get('outcome')}, see report.md). "
                          "reproduce.py replays op_guard and drop_samples.")
    if batch is None:
        raise BundleError("this bundle holds no batch.npz, so the step cannot be replayed.")
    if name == "drop_samples":
        samples = sorted({i for b in (row.get("skip_list") or {}).get("batches", [])[:1] for i in b["samples"]}
                         or set(expected.get("sample_indices") or []))
        n = len(next(iter(batch.values())))
        batch = {k: np.delete(v, samples, axis=0) if v.ndim and len(v) == n else v for k, v in batch.items()}
        print(f"left out sample(s) {samples} of the batch")
        if expected.get("phase") == "data":
            found = check_data(batch, spec, {})
        else:
            found = replay_step(spec, batch, expected)
    else:
        op = (expected.get("op") or "").removesuffix("_grad")
        if op not in GUARDED:
            raise BundleError(f"no guard for op {expected.get('op')!r}.")
        source = next((f.get("evidence", {}).get("source") for f in report.get("findings", [])
                       if f.get("evidence", {}).get("source")), None)
        with guard(op, source):
            found = replay_step(spec, batch, expected)
    if found is None:
        print("no fault: with this remedy the step runs without NaN/Inf.")
        return 0
    print("first fault: " + describe(found))
    print("the remedy does not stop the fault in this step.")
    return 1


@contextlib.contextmanager
def guard(op: str, source: str | None) -> Iterator[None]:
    """Wrap paddle.<op> (and the Tensor method or operator) so that calls from the report's source line
    get an epsilon or clamp, as nandoctor's op_guard remedy did; put back on exit."""
    import paddle

    head = (source or "").split(" in ", 1)[0]
    file, _, line = head.rpartition(":")
    where = (os.path.basename(file), int(line)) if line.isdigit() else None

    def safe(args: tuple[Any, ...]) -> tuple[Any, ...]:
        if not args or not isinstance(args[0], paddle.Tensor):
            return args
        x, rest = args[0], args[1:]
        if op in ("sqrt", "rsqrt"):
            return (x + 1e-12, *rest)
        if op in ("log", "pow"):
            return (paddle.clip(x, min=1e-12), *rest)
        if op == "exp":
            return (paddle.clip(x, max=60.0), *rest)
        if op == "acos":
            return (paddle.clip(x, -1 + 1e-7, 1 - 1e-7), *rest)
        if op == "divide" and rest and isinstance(rest[0], paddle.Tensor):
            den = rest[0]
            return (x, paddle.where(den.abs() < 1e-12, paddle.full_like(den, 1e-12), den), *rest[1:])
        return args

    def wrap(fn: Any) -> Any:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            frame = sys._getframe(1)
            if where is None or (frame.f_lineno == where[1] and os.path.basename(frame.f_code.co_filename) == where[0]):
                args = safe(args)
            return fn(*args, **kwargs)

        return guarded

    saved = []
    for owner, names in ((paddle, GUARDED[op]), (paddle.Tensor, GUARDED[op])):
        for attr in names:
            if hasattr(owner, attr) and not (owner is paddle and attr.startswith("__")):
                saved.append((owner, attr, getattr(owner, attr)))
                setattr(owner, attr, wrap(getattr(owner, attr)))
    try:
        yield
    finally:
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
