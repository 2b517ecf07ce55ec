"""reproduce.py: re-run the failing step of this nandoctor bundle and print where it first goes NaN/Inf.

This file is copied verbatim into every bundle written by `nandoctor probe/scan --bundle DIR`. It needs
only paddle, numpy and pyyaml, plus the files next to it: spec.yaml, code/ (the model's own .py files),
state.npz (the parameters just before the failing step), batch.npz (the offending batch, one array per
field), rng_state.json (when saved), report.json (what nandoctor found, to compare against) and
op_guards.json (the probe's op guards, when the report has an op_guard remedy).

Only this file and code/ are code; read them before running a bundle someone else made. The data files
are read without pickle (`numpy.load(..., allow_pickle=False)` and JSON), so a planted pickle is refused,
never run.

    python reproduce.py                          # from any folder
    python reproduce.py --with-remedy op_guard   # the same step with a remedy from report.json applied

For a training fault it rebuilds the model from code/ with spec.yaml's arguments, loads the state and
the batch, restores the RNG state, and runs forward + loss + backward (and the optimizer step when the
fault was there, at the learning rate the run had at that step: spec.yaml's lr_scheduler set to the
rate in report.json's timeline) with Paddle's tensor checker on, which stops at the first operator that
outputs NaN or Inf. Forward hooks keep a stack of the layers being run, and gradient hooks on each layer's output
track which layer the backward pass is in, so the fault is printed as op, phase and layer. For a data
fault it re-checks the saved batch for NaN/Inf and prints the field and samples.

`--with-remedy NAME` replays the step with one of the report's remedies applied: `op_guard` (the epsilon
or clamp for the faulting op from op_guards.json, at the source line the report names, or as widely as
the probe's replay had to apply it: while that line's call runs, or everywhere), `source_clamp` (the output
of the layer that feeds the overflowing op clipped where it is made, at the probe's bound) or `drop_samples`
(the offending samples left out). Remedies that act over many steps (learning rate, warmup, clipping,
re-initialising) were verified by the probe from an earlier state this bundle does not hold; reproduce.py
says so, and says when the probe judged a remedy that leaves this step clean not to fix the run.

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
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
LOG_NAME = "reproduce.log"
RNG_FORMAT = "paddle.GeneratorState/1"
FAULT_KEYS = ("op", "phase", "layer")


class BundleError(Exception):
    """The bundle is missing a file or names code that cannot be loaded."""


USAGE = ("usage: python reproduce.py [--with-remedy NAME]   (NAME: op_guard, source_clamp or drop_samples, "
         "from report.json)")


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


# YAML 1.2's floats: PyYAML follows YAML 1.1, where `1e-4` and `1.0e36` (no dot, or no sign in the exponent)
# are text; nandoctor's spec reader and this file both read them as the numbers they are
_YAML12_FLOAT = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                            |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                            |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                            |[-+]?\.(?:inf|Inf|INF)
                            |\.(?:nan|NaN|NAN))$""", re.X)


def yaml12_floats(loader: type) -> type:
    """`loader` (a yaml.SafeLoader subclass) reading YAML 1.2's floats as floats; returned for chaining."""
    loader.add_implicit_resolver("tag:yaml.org,2002:float", _YAML12_FLOAT, list("-+0123456789."))
    return loader


class _SpecLoader(yaml.SafeLoader):
    """spec.yaml as nandoctor read it."""


yaml12_floats(_SpecLoader)


def main(argv: list[str] | None = None) -> int:
    remedy = parse_remedy(argv or [])
    warnings.filterwarnings("ignore", message=".*ccache.*")  # Paddle's import-time build-tool notice
    sys.dont_write_bytecode = True  # leave the bundle as it came: no __pycache__ under code/
    try:
        report = json.loads((HERE / "report.json").read_text(encoding="utf-8"))
        spec = yaml.load((HERE / "spec.yaml").read_text(encoding="utf-8"), Loader=_SpecLoader)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        print(f"reproduce.py: cannot read the bundle in {HERE}: {exc}", file=sys.stderr)
        return 2
    for name, value in (("report.json", report), ("spec.yaml", spec)):
        if not isinstance(value, dict):
            print(f"reproduce.py: {name} in {HERE} is not the mapping nandoctor wrote (it holds a "
                  f"{type(value).__name__}); restore it from the bundle nandoctor made.", file=sys.stderr)
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
    if not expected and not (HERE / "batch.npz").is_file():
        print(f"nothing to reproduce: nandoctor found no fault in this run (verdict {report.get('verdict')}); "
              "see report.md for its warnings.")
        return 0
    try:
        outcome = find_fault(report, spec, batch, expected)
    except BundleError as exc:
        print(f"reproduce.py: {exc}", file=sys.stderr)
        return 2
    return print_outcome(outcome, expected)


RAISES_ON_DATA = ("yes (the step raises on this batch; nandoctor traced the cause to the data, see "
                  "report.md)")


class Outcome(NamedTuple):
    """The fault this replay found (None: the step ran clean), and what to say of its match with the report
    when that is not the field-by-field comparison."""

    fault: dict[str, Any] | None
    match: str | None = None


def find_fault(report: dict[str, Any], spec: dict[str, Any], batch: dict[str, np.ndarray] | None,
               expected: dict[str, Any]) -> Outcome:
    """Look where the report found the fault: the parameters, the batch (a scan, or a data fault), or the
    training step."""
    phase = expected.get("phase")
    if phase == "params":
        return Outcome(check_state(expected))
    if report.get("command") == "scan" or phase == "data":
        return recheck_data(report, spec, batch, expected)
    return Outcome(replay_step(spec, batch, expected, step_lr(report, expected.get("step"))))


def recheck_data(report: dict[str, Any], spec: dict[str, Any], batch: dict[str, np.ndarray] | None,
                 expected: dict[str, Any]) -> Outcome:
    """The batch checked for NaN/Inf. A probe's data fault without one is a bad label or id that makes the
    step raise: the step is replayed, and its error matches the report."""
    found = check_data(batch, spec, expected)
    if found is None and report.get("command") == "probe":
        found = replay_step(spec, batch, expected, step_lr(report, expected.get("step")))
        if found is not None and found.get("error"):
            return Outcome(found, RAISES_ON_DATA)
    return Outcome(found)


def print_outcome(outcome: Outcome, expected: dict[str, Any]) -> int:
    """The fault found and whether it is the reported one; the exit status: 1 for a fault, 0 for none."""
    found = outcome.fault
    if found is None:
        print("no fault: the step ran without NaN/Inf here (a different Paddle version or device can differ; "
              "see environment.json).")
        return 0
    print("first fault: " + describe(found))
    if outcome.match is not None:
        print("matches the report: " + outcome.match)
    elif expected:
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


BUILTIN_LOSSES = ("cross_entropy", "mse", "l1", "bce_with_logits")  # nandoctor.spec.BUILTIN_LOSSES


def builtin_loss(name: str) -> Any:
    """The four builtin losses, as nandoctor.workload.build.builtin_loss computes them (inlined: nandoctor need
    not be installed; nandoctor's tests hold both equal on the same inputs)."""
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

    losses = {"cross_entropy": cross_entropy,
              "bce_with_logits": lambda o, y: F.binary_cross_entropy_with_logits(o, like(o, y)),
              "mse": lambda o, y: F.mse_loss(o, like(o, y)),
              "l1": lambda o, y: F.l1_loss(o, like(o, y))}
    if name not in losses:
        raise BundleError(f"spec.yaml names loss.builtin {name!r}; the builtin losses are "
                          f"{', '.join(BUILTIN_LOSSES)}.")
    return losses[name]


def build_optimizer(spec: dict[str, Any], model: Any) -> Any:
    """paddle.optimizer.<name>(parameters, grad_clip, **args), with the spec's LR scheduler as its rate."""
    import paddle

    opt = spec.get("optimizer") or {}
    clip = None
    for kind, cls in (("global_norm", paddle.nn.ClipGradByGlobalNorm), ("norm", paddle.nn.ClipGradByNorm),
                      ("value", paddle.nn.ClipGradByValue)):
        if kind in (opt.get("grad_clip") or {}):
            clip = cls(opt["grad_clip"][kind])
    cls = getattr(paddle.optimizer, opt.get("name", "Adam"))
    kwargs = dict(opt.get("args") or ({} if "optimizer" in spec else {"learning_rate": 1e-3}))
    scheduler = build_scheduler(spec)
    if scheduler is not None:  # the scheduler took `learning_rate` as its base rate
        kwargs["learning_rate"] = scheduler
    return cls(parameters=model.parameters(), grad_clip=clip, **kwargs)


def build_scheduler(spec: dict[str, Any]) -> Any:
    """`optimizer.lr_scheduler` as nandoctor.workload.schedulers.build_scheduler builds it: a class of
    paddle.optimizer.lr with `args` (and `optimizer.args.learning_rate` as its base rate when it takes
    one), or an `entry` returning one, or only a warmup to the constant rate; wrapped in LinearWarmup when
    `warmup` is set. None without a scheduler."""
    import paddle.optimizer.lr as lr

    opt = spec.get("optimizer") or {}
    sched = opt.get("lr_scheduler")
    if not sched:
        return None
    base_lr = (opt.get("args") or {}).get("learning_rate")
    args = dict(sched.get("args") or {})
    if sched.get("entry"):
        inner: Any = load_entry(sched["entry"])(**args)
        if not isinstance(inner, lr.LRScheduler):
            raise BundleError(f"optimizer.lr_scheduler.entry {sched['entry']!r} returned a {type(inner).__name__}, "
                              "not a paddle.optimizer.lr.LRScheduler.")
    elif sched.get("name"):
        cls = getattr(lr, str(sched["name"]), None)
        if not (isinstance(cls, type) and issubclass(cls, lr.LRScheduler)):
            raise BundleError(f"optimizer.lr_scheduler.name {sched['name']!r} is not a scheduler in this Paddle's "
                              "paddle.optimizer.lr.")
        code = getattr(cls.__init__, "__code__", None)
        if code is not None and "learning_rate" in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]:
            args["learning_rate"] = base_lr
        inner = cls(**args)
    else:  # only `warmup`: warm up to the optimizer's constant rate
        inner = float(base_lr) if base_lr is not None else 1.0e-3
    warmup = sched.get("warmup")
    if not warmup:
        return inner
    end_lr = float(inner) if isinstance(inner, float) else float(inner.base_lr)
    return lr.LinearWarmup(learning_rate=inner, warmup_steps=warmup["steps"],
                           start_lr=float(warmup.get("start_lr", 0.0)), end_lr=end_lr)


def step_lr(report: dict[str, Any], step: Any) -> float | None:
    """The learning rate the run had at `step`, from report.json's timeline (None when it is not there).
    The JSON writes a non-finite rate as the string "Infinity" or "NaN" (before: "inf", "nan")."""
    if not isinstance(step, int):
        return None
    for point in report.get("timeline") or []:
        if isinstance(point, dict) and point.get("step") == step:
            value = point.get("lr")
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
            if value in ("Infinity", "-Infinity", "NaN", "inf", "-inf", "nan"):  # the JSON's spelling, and before
                return float(value)
            return None
    return None


def set_lr(optimizer: Any, rate: float | None, step: Any) -> None:
    """Put the optimizer at the rate it had at the failing step (the scheduler's `last_lr`, which is what
    Paddle's optimizer reads), and say so; without a recorded rate, say what it starts from instead."""
    import paddle.optimizer.lr as lr

    sched = getattr(optimizer, "_learning_rate", None)
    sched = sched if isinstance(sched, lr.LRScheduler) else None
    what = f"{type(sched).__name__}, from report.json's timeline" if sched is not None else \
        "from report.json's timeline"
    if rate is None:
        print(f"note: report.json has no learning rate for step {step}; the optimizer steps at "
              f"{float(optimizer.get_lr()):g}, where its schedule starts")
        return
    if sched is not None:
        sched.last_lr = rate
    else:
        optimizer.set_lr(rate)
    print(f"learning rate at step {step}: {rate:g} ({what})")


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


def select_output(outputs: Any, selector: Any) -> Any:
    """`model.output`, as nandoctor.workload.outputs.select applies it: None keeps the output; `loss` is the model's
    own loss (the tensor itself, `["loss"]`, `[0]` of a tuple or `.loss`); an int is a position in a tuple
    or list; a string a key of a mapping or an attribute of an output object. What does not fit is a
    BundleError (nandoctor's tests hold this equal to nandoctor.workload.outputs on the same outputs)."""
    import paddle

    if selector is None:
        return outputs
    if selector == "loss":
        if isinstance(outputs, paddle.Tensor):
            return outputs
        if isinstance(outputs, Mapping):
            loss = outputs.get("loss")
        elif isinstance(outputs, (tuple, list)):
            loss = outputs[0] if outputs else None
        else:
            loss = getattr(outputs, "loss", None)
        if not isinstance(loss, paddle.Tensor):
            raise BundleError(f"model.output is `loss`, but the model returned a {type(outputs).__name__} without a "
                              "loss tensor.")
        return loss
    if isinstance(selector, int):
        if not isinstance(outputs, (tuple, list)) or not -len(outputs) <= selector < len(outputs):
            raise BundleError(f"model.output is {selector!r}, a position, but the model returned a "
                              f"{type(outputs).__name__} without it.")
        return outputs[selector]
    if isinstance(outputs, Mapping):
        if selector not in outputs:
            raise BundleError(f"model.output is {selector!r}, but the model returned a {type(outputs).__name__} "
                              f"with keys {list(outputs)}.")
        return outputs[selector]
    if isinstance(outputs, (tuple, list, paddle.Tensor)) or not hasattr(outputs, selector):
        raise BundleError(f"model.output is {selector!r}, but the model returned a {type(outputs).__name__}, "
                          f"which has no {selector!r}.")
    return getattr(outputs, selector)


def replay_step(spec: dict[str, Any], batch: dict[str, np.ndarray] | None, expected: dict[str, Any],
                rate: float | None = None, clamp: tuple[str, float] | None = None) -> dict[str, Any] | None:
    """The failing step from the saved state, batch and RNG; `rate` is the learning rate the run had at
    that step (the optimizer only steps when the fault was in its update); `clamp` clips a layer's output
    (the source_clamp remedy)."""
    import paddle

    if batch is None:
        raise BundleError("this bundle holds no batch.npz (the run captured no batch), so the step cannot be "
                          "replayed.")
    model, state = load_model(spec)
    fields = {name: paddle.to_tensor(array) for name, array in batch.items()}
    step = forward_and_loss_of(spec, model, fields)
    optimizer = None
    if expected.get("phase") == "optimizer":
        optimizer = build_optimizer(spec, model)
        set_lr(optimizer, rate, expected.get("step"))
    rng = load_rng()
    if rng is None:
        print("note: no rng_state.json in the bundle; a model with dropout may replay with other masks")
    clipped = clip_output(model, clamp) if clamp is not None else None
    tracker = Tracker(model)
    log = quiet_paddle()
    try:
        return checked_step(step, tracker, state, rng, optimizer)
    finally:
        tracker.remove()
        if clipped is not None:
            clipped.remove()
        restore_output(log)


def load_model(spec: dict[str, Any]) -> tuple[Any, dict[str, np.ndarray]]:
    """The model from code/ with spec.yaml's arguments, in training mode, at the state before the failing
    step (state.npz, also returned: pass 2 starts from it again) when the bundle holds one."""
    model_spec = spec.get("model") or {}
    model = load_entry(model_spec["entry"])(**(model_spec.get("args") or {}))
    state = load_state()
    if state:
        model.set_state_dict(state)
    else:
        print("note: no state.npz in the bundle; the replay starts from the model's fresh initialisation, "
              "not from the state before the failing step")
    model.train()
    return model, state


class UserStep(NamedTuple):
    """spec.yaml's `step` function, which runs the model and its loss itself: the layer stack tells which."""

    model: Any
    fields: dict[str, Any]
    step_fn: Any

    def forward_and_loss(self, tracker: Tracker) -> Any:
        tracker.phase = "step"
        loss = self.step_fn(self.model, self.fields)
        tracker.phase = "loss"
        return loss


class ModelThenLoss(NamedTuple):
    """The model on its input fields, the output model.output selects, and the loss: the loss function on
    that output (and the label when there is one), or the model's own loss when model.output is `loss`."""

    model: Any
    fields: dict[str, Any]
    inputs: Any  # data.inputs: field names in order, or {keyword argument: field}
    selector: Any  # model.output: a key, attribute or position; "loss": its own loss
    label_name: str | None
    builtin: str | None = None  # loss.builtin, when the loss is one
    loss_fn: Any = None  # None when the model's own loss is the loss

    def forward_and_loss(self, tracker: Tracker) -> Any:
        tracker.phase = "forward"
        if isinstance(self.inputs, dict):  # data.inputs as {keyword argument: field}
            outputs = self.model(**{arg: self.fields[name] for arg, name in self.inputs.items()})
        else:
            outputs = self.model(*[self.fields[k] for k in self.inputs])
        tracker.phase = "loss"
        outputs = select_output(outputs, self.selector)
        loss = outputs if self.selector == "loss" else self.loss_of(outputs)
        tracker.phase = "loss"
        return loss

    def loss_of(self, outputs: Any) -> Any:
        """The loss function on the selected output, with the label field when the data has one."""
        import paddle

        if self.builtin and not isinstance(outputs, paddle.Tensor):
            raise BundleError(f"loss.builtin {self.builtin} needs the model's output to be one Tensor, but the "
                              f"model returned a {type(outputs).__name__}; set model.output in spec.yaml.")
        label = self.fields.get(self.label_name) if self.label_name else None
        return self.loss_fn(outputs) if label is None else self.loss_fn(outputs, label)


def forward_and_loss_of(spec: dict[str, Any], model: Any, fields: dict[str, Any]) -> UserStep | ModelThenLoss:
    """How spec.yaml runs the step's forward pass and loss: its `step` function, or the model then the loss
    (the builtin or loss.entry, loaded here; none when model.output is the model's own loss)."""
    model_spec, data = spec.get("model") or {}, spec.get("data") or {}
    label_name = data.get("label") or ("label" if "label" in fields else None)
    inputs = data.get("inputs") or [k for k in fields if k != label_name]
    selector = model_spec.get("output")
    if spec.get("step"):
        return UserStep(model, fields, load_entry(spec["step"]["entry"]))
    if selector == "loss":
        return ModelThenLoss(model, fields, inputs, selector, label_name)
    loss_spec = spec.get("loss") or {}
    builtin = loss_spec.get("builtin")
    loss_fn = builtin_loss(builtin) if builtin else load_entry(loss_spec["entry"])
    return ModelThenLoss(model, fields, inputs, selector, label_name, builtin, loss_fn)


def checked_step(step: UserStep | ModelThenLoss, tracker: Tracker, state: dict[str, np.ndarray], rng: Any,
                 optimizer: Any) -> dict[str, Any] | None:
    """Pass 1, checker off: which phase first turns non-finite. The checker alone would also stop at an
    Inf that a where() or a mask throws away, which never reaches training. A non-finite forward or loss
    goes to pass 2 to name its op; a finite one has its backward pass (and update) checked."""
    import paddle

    set_rng(rng)
    try:
        loss = step.forward_and_loss(tracker)
    except BundleError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's code raised: that is the fault
        return fault_from(exc, tracker)
    bad_layer = tracker.nonfinite_layer
    if bad_layer is not None or not bool(paddle.isfinite(loss).all()):
        return forward_fault(step, tracker, state, rng, bad_layer)
    return backward_fault(loss, optimizer, tracker)


def forward_fault(step: UserStep | ModelThenLoss, tracker: Tracker, state: dict[str, np.ndarray], rng: Any,
                  bad_layer: str | None) -> dict[str, Any]:
    """Pass 2: the same forward and loss from the same state and RNG, checker on, names the op; without an
    op, the phase and layer pass 1 saw turn non-finite."""
    if state:
        step.model.set_state_dict(state)
    tracker.reset()
    with tensor_checker(rng):
        try:
            step.forward_and_loss(tracker)
        except Exception as exc:  # noqa: BLE001 - the checker's abort
            return fault_from(exc, tracker)
    return {"op": None, "phase": "forward" if bad_layer else "loss", "layer": bad_layer}


def backward_fault(loss: Any, optimizer: Any, tracker: Tracker) -> dict[str, Any] | None:
    """Forward and loss are finite: only the backward pass (and the update) run under the checker."""
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

OP_GUARDS = "op_guards.json"
OP_GUARDS_FORMAT = "nandoctor.op_guards/1"
RULE_KINDS = ("add", "clip", "nonzero")
SCOPES = ("line", "within", "any")
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def replay_with_remedy(report: dict[str, Any], spec: dict[str, Any], batch: dict[str, np.ndarray] | None,
                       expected: dict[str, Any], name: str) -> int:
    """The failing step again with the remedy `name` applied: exit 0 when it now runs clean, 1 when not."""
    row = replayable_remedy(report, name)
    if batch is None:
        raise BundleError("this bundle holds no batch.npz, so the step cannot be replayed.")
    rate = step_lr(report, expected.get("step"))
    if name == "drop_samples":
        found = replay_without_samples(row, spec, batch, expected, rate)
    elif name == "source_clamp":
        found = replay_with_source_clamp(row, spec, batch, expected, rate)
    else:
        found = replay_with_guard(report, row, spec, batch, expected, rate)
    if found is None:
        print("no fault: with this remedy the step runs without NaN/Inf.")
        if row.get("outcome") != "fixed":
            note = f": {row['note']}" if row.get("note") else ""
            print(f"note: nandoctor's replay over the following steps judged this remedy {row.get('outcome')}{note}; "
                  "one clean step does not show that it fixes the run.")
        return 0
    print("first fault: " + describe(found))
    print("the remedy does not stop the fault in this step.")
    return 1


def replayable_remedy(report: dict[str, Any], name: str) -> dict[str, Any]:
    """report.json's row for the remedy `name`, announced; a BundleError when the report has no such remedy
    or it is one that acts over many steps, which this bundle cannot replay."""
    rows = {r.get("remedy"): r for r in report.get("remedies") or [] if isinstance(r, dict)}
    row = rows.get(name)
    if row is None:
        raise BundleError(f"report.json has no remedy {name!r}; it has: {', '.join(map(str, rows)) or 'none'}.")
    print(f"remedy {name} ({row.get('outcome')} in nandoctor's replay): {row.get('change')}")
    if name not in REPLAYABLE:
        raise BundleError(f"{name} acts over many steps, from a state before the fault that this bundle does not "
                          f"hold; nandoctor replayed it in the probe (outcome {row.get('outcome')}, see report.md). "
                          f"reproduce.py replays {', '.join(REPLAYABLE)}.")
    return row


REPLAYABLE = ("op_guard", "source_clamp", "drop_samples")


def replay_with_source_clamp(row: dict[str, Any], spec: dict[str, Any], batch: dict[str, np.ndarray],
                             expected: dict[str, Any], rate: float | None) -> dict[str, Any] | None:
    """The source_clamp remedy: the step replayed with the named layer's output clipped where it is made,
    at the bound nandoctor's replay used, so every op it feeds sees the clipped value."""
    clamp = row.get("clamp")
    if not isinstance(clamp, dict) or not isinstance(clamp.get("layer"), str) \
            or not isinstance(clamp.get("max"), (int, float)):
        raise BundleError("report.json's source_clamp row names no layer and bound (`clamp`); it was written by "
                          "an older nandoctor: clip the layer's output as its `change` says.")
    print(f"clipping layer {clamp['layer']}'s output at {clamp['max']:g}, as nandoctor's replay did")
    return replay_step(spec, batch, expected, rate, clamp=(clamp["layer"], float(clamp["max"])))


def clip_output(model: Any, clamp: tuple[str, float]) -> Any:
    """A forward hook on layer `clamp[0]` that clips its output at `clamp[1]`; the hook's handle."""
    import paddle

    name, top = clamp
    layers = dict(model.named_sublayers())
    if name not in layers:
        raise BundleError(f"the model has no sublayer {name!r} (the source_clamp row's layer); its sublayers: "
                          f"{', '.join(list(layers)[:10]) or 'none'}.")

    def hook(_layer: Any, _inputs: Any, out: Any) -> Any:
        return paddle.clip(out, max=top) if isinstance(out, paddle.Tensor) else None

    return layers[name].register_forward_post_hook(hook)


def replay_without_samples(row: dict[str, Any], spec: dict[str, Any], batch: dict[str, np.ndarray],
                           expected: dict[str, Any], rate: float | None) -> dict[str, Any] | None:
    """The drop_samples remedy: the batch without the offending samples, re-checked (a data fault) or its
    step replayed."""
    samples = samples_to_drop(row, expected)
    n = len(next(iter(batch.values())))
    batch = {k: np.delete(v, samples, axis=0) if v.ndim and len(v) == n else v for k, v in batch.items()}
    print(f"left out sample(s) {samples} of the batch")
    if expected.get("phase") == "data":
        return check_data(batch, spec, {})
    return replay_step(spec, batch, expected, rate)


def samples_to_drop(row: dict[str, Any], expected: dict[str, Any]) -> list[int]:
    """The samples of the remedy's skip list (its first batch), or else the report's offending samples."""
    return sorted({i for b in (row.get("skip_list") or {}).get("batches", [])[:1] for i in b["samples"]}
                  or set(expected.get("sample_indices") or []))


def replay_with_guard(report: dict[str, Any], row: dict[str, Any], spec: dict[str, Any],
                      batch: dict[str, np.ndarray], expected: dict[str, Any], rate: float | None
                      ) -> dict[str, Any] | None:
    """The op_guard remedy: the step replayed with the probe's guard for the faulting op, at the scope and
    clamp the report's row names; says so when no call was guarded, since then the replay shows nothing."""
    table = load_guards()
    op = guard_op(table, expected.get("op"))
    if op is None:
        raise BundleError(f"no guard for op {expected.get('op')!r} in {OP_GUARDS}.")
    source = guard_source(report)
    scope = (row.get("guard") or {}).get("scope") or ("line" if source else "any")
    if scope not in SCOPES:
        raise BundleError(f"report.json's op_guard row has scope {scope!r}; expected one of {', '.join(SCOPES)}.")
    rule = guard_rule(table, op, row)
    at = f", clamped at {rule['hi']:g}" if row.get("threshold") is not None and rule.get("hi") is not None else ""
    print(f"guarding {op} ({scope_text(scope, source)}{at}), as nandoctor's replay did")
    with guard(rule, source, scope) as hits:
        found = replay_step(spec, batch, expected, rate)
    if not hits["calls"]:
        print(f"note: the guard was never applied: no {op} on a tensor was called {scope_text(scope, source)}, so "
              "this replay says nothing about the fix.")
    return found


def guard_rule(table: dict[str, Any], op: str, row: dict[str, Any]) -> dict[str, Any]:
    """The table's rule for `op`; an upper clamp at the row's threshold, the one the probe's threshold search
    verified (exp: 60, or tighter), when the rule is a clamp from above only."""
    rule = dict(table["guards"][op])
    limit = row.get("threshold")
    if limit is not None and rule.get("kind") == "clip" and rule.get("hi") is not None and rule.get("lo") is None:
        rule["hi"] = float(limit)
    return rule


def scope_text(scope: str, source: str | None) -> str:
    if scope == "any" or not source:
        return "on every call"
    return f"on calls made at {source}" if scope == "line" else f"on calls made while {source} runs"


def load_guards() -> dict[str, Any]:
    """op_guards.json, the probe's own guard table, checked entry by entry: reproduce.py applies exactly
    what it says and nothing a hand-edited file could slip in (only plain names, known rules, numbers)."""
    file = HERE / OP_GUARDS
    try:
        table = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BundleError(f"{OP_GUARDS} cannot be read ({exc}); the op_guard remedy needs it (a bundle written by "
                          "nandoctor with an op_guard remedy holds it).") from None
    problems = _guard_table_problems(table)
    if problems:
        raise BundleError(f"{OP_GUARDS} is not a guard table nandoctor wrote ({'; '.join(problems[:3])}); it was "
                          "not used.")
    return table


def _guard_table_problems(table: Any) -> list[str]:
    """What makes `table` other than a guard table nandoctor wrote: the table's own keys first, then each
    guard in the table's order; [] when it is one."""
    if not isinstance(table, dict) or table.get("format") != OP_GUARDS_FORMAT:
        return [f"format {table.get('format') if isinstance(table, dict) else None!r}, expected {OP_GUARDS_FORMAT!r}"]
    problems = []
    guards, aliases = table.get("guards"), table.get("aliases")
    if not isinstance(guards, dict) or not guards:
        return ["no guards"]
    if not isinstance(table.get("grad_suffix"), str) or not table["grad_suffix"]:
        problems.append("no grad_suffix")
    if not isinstance(aliases, dict) or not all(isinstance(k, str) and v in guards for k, v in aliases.items()):
        problems.append("aliases must map op names to guarded ops")
    for op, g in guards.items():
        problems += _guard_entry_problems(op, g)
    return problems


def _guard_entry_problems(op: str, g: Any) -> list[str]:
    """One guard's problems: the names it wraps, its rule kind, the argument it changes, its numbers."""
    if not isinstance(g, dict):
        return [f"{op}: not an object"]
    problems = []
    names = [*(g.get("functions") or []), *(g.get("methods") or [])]
    if not names or not all(isinstance(n, str) and NAME.match(n) for n in names):
        problems.append(f"{op}: functions/methods must be plain names")
    kind, arg = g.get("kind"), g.get("arg")
    if kind not in RULE_KINDS:
        problems.append(f"{op}: kind {kind!r}")
    if not isinstance(arg, int) or isinstance(arg, bool) or not 0 <= arg <= 1:
        problems.append(f"{op}: arg {arg!r}")
    return problems + _guard_bound_problems(op, kind, {k: g.get(k) for k in ("value", "lo", "hi")})


def _guard_bound_problems(op: str, kind: Any, numbers: dict[str, Any]) -> list[str]:
    """A guard's value/lo/hi: each absent or a finite number (never a bool), and the one its kind needs set."""
    if not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and abs(v) < float("inf"))
               for v in numbers.values()):
        return [f"{op}: value/lo/hi must be finite numbers"]
    if (kind in ("add", "nonzero") and numbers["value"] is None) or \
            (kind == "clip" and numbers["lo"] is None and numbers["hi"] is None):
        return [f"{op}: a {kind} rule without its bound"]
    return []


def guard_op(table: dict[str, Any], op: Any) -> str | None:
    """The guarded op for a reported one, as the probe's guard_for: `sqrt_grad` -> sqrt, aliases resolved."""
    if not isinstance(op, str) or not op:
        return None
    suffix = table["grad_suffix"]
    base = op[:-len(suffix)] if op.endswith(suffix) else op
    base = table["aliases"].get(base, base)
    return base if base in table["guards"] else None


def guard_source(report: dict[str, Any]) -> str | None:
    """The line that made the faulting op, which the probe's guard acted at: the first fault's source."""
    source = (report.get("details") or {}).get("source")
    if isinstance(source, str) and source:
        return source
    step = (report.get("first_fault") or {}).get("step")
    return next((f["evidence"]["source"] for f in report.get("findings") or []
                 if isinstance(f, dict) and (f.get("location") or {}).get("step") == step
                 and isinstance(f.get("evidence"), dict) and f["evidence"].get("source")), None)


def guarded_args(rule: dict[str, Any], args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The call's arguments with the rule applied; `args` itself when the rule does not apply to this call
    (nandoctor.engine.op_guards' rules, from op_guards.json)."""
    import paddle

    arg = rule["arg"]
    if len(args) <= arg or not isinstance(args[0], paddle.Tensor):
        return args
    x = args[arg]
    if rule["kind"] == "add":
        new = x + rule["value"]
    elif rule["kind"] == "clip":
        new = paddle.clip(x, min=rule["lo"], max=rule["hi"])
    elif rule["kind"] == "nonzero" and isinstance(x, paddle.Tensor):
        new = paddle.where(x.abs() < rule["value"], paddle.full_like(x, rule["value"]), x)
    else:
        return args
    return (*args[:arg], new, *args[arg + 1:])


@contextlib.contextmanager
def guard(rule: dict[str, Any], source: str | None, scope: str) -> Iterator[dict[str, int]]:
    """Wrap paddle.<function> and paddle.Tensor.<method> (the operators `x ** p`, `a / b` too) so that calls
    get the epsilon or clamp as nandoctor's op_guard remedy did: calls made at the report's source line
    (scope "line"), made while that line's call runs ("within"), or all ("any"); put back on exit. Yields
    {"calls": how many calls were guarded}."""
    import paddle

    head = (source or "").split(" in ", 1)[0]
    file, _, line = head.rpartition(":")
    where = (os.path.basename(file), int(line)) if line.isdigit() and scope != "any" else None
    hits = {"calls": 0}

    def at(frame: Any) -> bool:
        return where is not None and frame.f_lineno == where[1] and \
            os.path.basename(frame.f_code.co_filename) == where[0]

    def mine(frame: Any) -> bool:
        if where is None:
            return True
        if scope == "line":
            return at(frame)
        while frame is not None:
            if at(frame):
                return True
            frame = frame.f_back
        return False

    def wrap(fn: Any) -> Any:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if mine(sys._getframe(1)):
                new = guarded_args(rule, args)
                if new is not args:
                    hits["calls"] += 1
                    args = new
            return fn(*args, **kwargs)

        return guarded

    saved = []
    try:
        for owner, names in ((paddle, rule.get("functions") or []), (paddle.Tensor, rule.get("methods") or [])):
            for attr in names:
                if hasattr(owner, attr):
                    saved.append((owner, attr, getattr(owner, attr)))
                    setattr(owner, attr, wrap(getattr(owner, attr)))
        yield hits
    finally:
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
