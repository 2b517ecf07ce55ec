"""A plain Paddle training script for any sample config: the workload `nandoctor probe` trains, without nandoctor.

    python tests/parity/plain_train.py sample_configs/log_of_zero/config.yaml            # plain
    python tests/parity/plain_train.py sample_configs/log_of_zero/config.yaml --watch D  # nandoctor.watch

The parity suite (tests/test_parity.py) runs it under `nandoctor run` (plain mode: nandoctor is never
imported, so what `run` sees is an ordinary user script) and in `--watch` mode (the in-loop API), and
compares the first fault each names with the probe's on the same config. So it must train exactly as the
probe does, step for step, and it must know nothing of nandoctor's internals: it reads the YAML itself and
repeats the spec's contract (docs/spec.md) with plain Paddle calls. The order of work is the
probe's (nandoctor/probe/__init__.py, nandoctor/workload/build.py, nandoctor/engine/loop.py):

1. device cpu, then paddle.seed / np.random.seed / random.seed, before anything of the user's runs;
2. import the data entry's file, then the loss's (or step's), then the model's; call the model factory;
3. build the optimizer (scheduler, grad clip), model.train();
4. per step: the loader is made at the first step and again for each epoch; fields -> model(inputs) ->
   `model.output` -> loss(outputs, label) -> backward (of loss / K when accumulating K batches) ->
   optimizer.step -> clear_grad -> scheduler.step (`by: step`); `by: epoch` steps it at each epoch's end.

It runs on the CPU, as the suite's probe does (`--device cpu`); there the probe trains an `amp` config in
float32 (and reports amp.inactive), and so does this script. What it cannot reproduce faithfully
(ReduceOnPlateau, a scheduler without the base rate it needs, an unknown top-level key) is refused with a
message and exit status 2 rather than approximated: a parity test on a workload that differs from the
probe's would measure nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import math
import random
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import numpy as np
import paddle
import paddle.nn.functional as F
import yaml

OWN_LOSS = "loss"  # `model.output: loss`: the model computes its own loss


class Refused(SystemExit):
    """A spec feature this script does not reproduce: exit status 2 and the reason on stderr."""

    def __init__(self, config: Path, why: str) -> None:
        print(f"plain_train.py: {config}: {why}", file=sys.stderr)
        super().__init__(2)


# ---- the user's code, imported as the probe imports it --------------------------------------------------
_modules: dict[Path, Any] = {}


def load_entry(entry: str, base: Path) -> Callable[..., Any]:
    """ "file.py:callable" (relative to the YAML's folder) or "pkg.module:callable"; each file imported once."""
    target, attr = entry.rsplit(":", 1)
    if target.endswith(".py") or "/" in target:
        file = (base / target).resolve()
        if file not in _modules:
            spec = importlib.util.spec_from_file_location(f"plain_train_user_{len(_modules)}_{file.stem}", file)
            assert spec is not None and spec.loader is not None, file
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            _modules[file] = module
        obj: Any = _modules[file]
    else:
        obj = importlib.import_module(target)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


# ---- batches: fields, model inputs, label ---------------------------------------------------------------
def default_names(n: int) -> list[str]:
    return ["x"] if n == 1 else ["x", "label"] if n == 2 else [f"x{i}" for i in range(n)]


def name_fields(batch: Any, data: Mapping[str, Any]) -> dict[str, Any]:
    """Tuple/list batches named by `data.fields` (or the default names); dict batches keep their keys."""
    if isinstance(batch, Mapping):
        return dict(batch)
    if isinstance(batch, (tuple, list)):
        names = data.get("fields") or default_names(len(batch))
        if len(names) != len(batch):
            raise ValueError(f"data.fields {names} does not fit a batch of {len(batch)} parts")
        return dict(zip(names, batch))
    return {(data.get("fields") or ["x"])[0]: batch}


def label_name(fields: Mapping[str, Any], data: Mapping[str, Any]) -> str | None:
    if data.get("label") is not None:
        return data["label"]
    return "label" if "label" in fields else None


def to_tensor(value: Any) -> Any:
    if isinstance(value, (np.ndarray, int, float, list)):
        return paddle.to_tensor(value)
    return value


def model_call(model: Any, fields: Mapping[str, Any], data: Mapping[str, Any]) -> Any:
    """model(*inputs) for a list (default: every field but the label), model(**inputs) for a mapping."""
    inputs = data.get("inputs")
    if isinstance(inputs, Mapping):
        return model(**{arg: to_tensor(fields[name]) for arg, name in inputs.items()})
    if inputs is None:
        label = label_name(fields, data)
        inputs = [k for k in fields if k != label]
    return model(*[to_tensor(fields[k]) for k in inputs])


def select_output(outputs: Any, selector: Any) -> Any:
    """`model.output`: None = as returned; `loss` = the model's own loss; a key, attribute or position."""
    if selector is None:
        return outputs
    if selector == OWN_LOSS:
        if isinstance(outputs, paddle.Tensor):
            return outputs
        if isinstance(outputs, Mapping):
            return outputs["loss"]
        if isinstance(outputs, (tuple, list)):
            return outputs[0]
        return outputs.loss
    if isinstance(selector, int):
        return outputs[selector]
    return outputs[selector] if isinstance(outputs, Mapping) else getattr(outputs, selector)


# ---- losses ---------------------------------------------------------------------------------------------
def cross_entropy(outputs: Any, label: Any) -> Any:
    if label.dtype not in (paddle.int64, paddle.int32):
        label = label.astype("int64")
    if len(label.shape) == len(outputs.shape) - 1:
        label = label.unsqueeze(-1)
    return F.cross_entropy(outputs, label)


def bce_with_logits(outputs: Any, label: Any) -> Any:
    return F.binary_cross_entropy_with_logits(outputs, label.astype(outputs.dtype).reshape(outputs.shape))


def mse(outputs: Any, label: Any) -> Any:
    return F.mse_loss(outputs, label.astype(outputs.dtype).reshape(outputs.shape))


def l1(outputs: Any, label: Any) -> Any:
    return F.l1_loss(outputs, label.astype(outputs.dtype).reshape(outputs.shape))


BUILTIN = {"cross_entropy": cross_entropy, "bce_with_logits": bce_with_logits, "mse": mse, "l1": l1}


def step_inputs(fields: Mapping[str, Any]) -> dict[str, Any]:
    """A `step` function's batch: numeric numpy arrays as tensors, anything else as it is."""
    return {k: paddle.to_tensor(v) if isinstance(v, np.ndarray) and v.dtype.kind in "biuf" else v
            for k, v in fields.items()}


def loss_of(raw: Mapping[str, Any], base: Path) -> Callable[[Any, dict[str, Any]], Any]:
    """(model, fields) -> scalar loss, from `step.entry`, `model.output: loss`, `loss.builtin` or `loss.entry`."""
    data = raw["data"]
    selector = raw["model"].get("output")
    if raw.get("step"):
        step_fn = load_entry(raw["step"]["entry"], base)
        return lambda model, fields: step_fn(model, step_inputs(fields))
    if selector == OWN_LOSS:
        return lambda model, fields: select_output(model_call(model, fields, data), OWN_LOSS)
    spec = raw["loss"]
    fn = BUILTIN[spec["builtin"]] if spec.get("builtin") else load_entry(spec["entry"], base)

    def compute(model: Any, fields: dict[str, Any]) -> Any:
        outputs = select_output(model_call(model, fields, data), selector)
        name = label_name(fields, data)
        return fn(outputs) if name is None else fn(outputs, to_tensor(fields[name]))

    return compute


# ---- optimizer ------------------------------------------------------------------------------------------
def build_optimizer(raw: Mapping[str, Any], model: Any, config: Path, base: Path) -> tuple[Any, Any, str, int]:
    """(optimizer, scheduler or None, when the scheduler steps, accumulate_steps)."""
    opt = raw.get("optimizer") or {}
    args = dict(opt.get("args") or ({"learning_rate": 1.0e-3} if not opt else {}))
    clip = None
    if opt.get("grad_clip"):
        [(kind, value)] = opt["grad_clip"].items()
        clip = {"global_norm": paddle.nn.ClipGradByGlobalNorm, "norm": paddle.nn.ClipGradByNorm,
                "value": paddle.nn.ClipGradByValue}[kind](value)
    sched_spec = opt.get("lr_scheduler")
    scheduler = None
    if sched_spec:
        scheduler = build_scheduler(sched_spec, args.get("learning_rate"), config, base)
        args["learning_rate"] = scheduler
    cls = getattr(paddle.optimizer, opt.get("name", "Adam"))
    optimizer = cls(parameters=model.parameters(), grad_clip=clip, **args)
    by = (sched_spec or {}).get("by") or "step"
    return optimizer, scheduler if isinstance(scheduler, paddle.optimizer.lr.LRScheduler) else None, by, int(
        opt.get("accumulate_steps") or 1)


def build_scheduler(spec: Mapping[str, Any], base_lr: Any, config: Path, base: Path) -> Any:
    lr = paddle.optimizer.lr
    if spec.get("entry"):
        inner: Any = load_entry(spec["entry"], base)(**(spec.get("args") or {}))
    elif spec.get("name"):
        if spec["name"] == "ReduceOnPlateau":
            raise Refused(config, "ReduceOnPlateau needs a metric; the probe refuses it too")
        cls = getattr(lr, spec["name"])
        kwargs = dict(spec.get("args") or {})
        if "learning_rate" in inspect.signature(cls).parameters:  # the optimizer's rate is its base rate
            if base_lr is None:
                raise Refused(config, f"lr_scheduler {spec['name']} needs optimizer.args.learning_rate")
            kwargs["learning_rate"] = base_lr
        inner = cls(**kwargs)
    else:  # only `warmup`: warm up to the optimizer's constant rate
        inner = float(base_lr) if base_lr is not None else 1.0e-3
    warmup = spec.get("warmup")
    if not warmup:
        return inner
    end_lr = float(inner) if isinstance(inner, float) else float(inner.base_lr)
    return lr.LinearWarmup(learning_rate=inner, warmup_steps=warmup["steps"],
                           start_lr=float(warmup.get("start_lr", 0.0)), end_lr=end_lr)


# ---- training -------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path, help="a sample config YAML")
    parser.add_argument("--watch", metavar="DIR", help="train under nandoctor.watch, its report written to DIR")
    parser.add_argument("--steps", type=int, help="override probe.steps")
    opts = parser.parse_args(argv)

    config = opts.config.resolve()
    raw = yaml.safe_load(config.read_text(encoding="utf-8"))
    base = config.parent
    known = {"version", "model", "data", "loss", "step", "optimizer", "amp", "checks", "probe"}
    if set(raw) - known:
        raise Refused(config, f"unknown top-level keys {sorted(set(raw) - known)}")
    # The probe runs on the CPU here (--device cpu), where it trains AMP configs in float32 and reports
    # amp.inactive; so does this script. On a GPU the probe would autocast: that is not reproduced.
    paddle.set_device("cpu")
    probe = raw.get("probe") or {}
    steps = opts.steps if opts.steps is not None else int(probe.get("steps", 200))
    seed = int(probe.get("seed", 0))
    paddle.seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)

    sys.path.insert(0, str(base))  # the spec's contract: its folder is importable while the user's code runs
    data = raw["data"]
    make_loader = load_entry(data["entry"], base)
    compute_loss = loss_of(raw, base)
    model = load_entry(raw["model"]["entry"], base)(**(raw["model"].get("args") or {}))
    optimizer, scheduler, by, accumulate = build_optimizer(raw, model, config, base)
    model.train()

    def step_fn(model: Any, batch: Any) -> Any:  # the forward and loss of one step, from the batch as it came
        return compute_loss(model, name_fields(batch, data))

    if opts.watch:  # as docs/ways-in.md shows it: a `with` block, whose exit also reports an exception of the loop
        import nandoctor

        names = data.get("fields")
        with nandoctor.watch(model, optimizer, step_fn=step_fn, report_dir=opts.watch, fields=names) as doctor:
            train(model, optimizer, scheduler, by, accumulate, steps, make_loader, data, step_fn, doctor)
        return 1 if doctor.report is not None and doctor.report.exit_code else 0
    finite = train(model, optimizer, scheduler, by, accumulate, steps, make_loader, data, step_fn, None)
    print("training finished" if finite else "training finished (non-finite losses)")
    return 0


def train(model: Any, optimizer: Any, scheduler: Any, by: str, accumulate: int, steps: int,
          make_loader: Callable[..., Any], data: Mapping[str, Any], step_fn: Callable[[Any, Any], Any],
          doctor: Any) -> bool:
    """The probe's loop (nandoctor/engine/loop.py) without its checks; False when a loss was not finite."""
    finite = True
    step, batch_index, it = 0, 0, None
    while step < steps:
        if it is None:
            it = iter(make_loader(**(data.get("args") or {})))
        try:
            batch = next(it)
        except StopIteration:
            if batch_index == 0:  # an empty loader: nothing to train on
                break
            if scheduler is not None and by == "epoch":
                scheduler.step()
            batch_index, it = 0, None
            continue
        loss = step_fn(model, batch)
        (loss / accumulate if accumulate > 1 else loss).backward()
        if doctor is not None and not doctor.check(loss, batch):
            break
        value = float(loss)
        finite = finite and math.isfinite(value)
        print(f"step {step} loss {value:.6g}", flush=True)
        if (step + 1) % accumulate == 0:
            if type(optimizer).__name__ == "LBFGS":  # its step re-evaluates the batch through a closure

                def closure(batch: Any = batch) -> Any:
                    optimizer.clear_grad()
                    again = step_fn(model, batch)
                    again.backward()
                    return again

                optimizer.step(closure)
            else:
                optimizer.step()
            optimizer.clear_grad()
            if scheduler is not None and by == "step":
                scheduler.step()
        step += 1
        batch_index += 1
    return finite


if __name__ == "__main__":
    sys.exit(main())
