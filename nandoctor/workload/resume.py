"""Starting a probe from the user's checkpoint instead of step 0 (spec `resume`, or `probe --resume DIR`).

A NaN hours into training can only be probed where it happens: this loads the weights, the optimizer's
accumulators and the LR scheduler's state the user saved with `paddle.save`, and says where in the data the
run was (`step` batches trained). The loader is then advanced past those batches (workload.resume_at) and
the probe numbers its steps on from there, so a report names the same step the user's run failed at.

Every mismatch between the files and the model is a SpecError (exit 2) naming the file and the key: a
parameter the checkpoint has and the model does not, one the model has and the checkpoint lacks, a shape
that differs, an optimizer state for another optimizer or another model. Nothing is loaded half-way: a
resumed run that silently kept some initial weights would diagnose a run nobody trained.

The optimizer's state is keyed by Paddle's internal parameter names (`linear_3.w_0_moment1_0`), which
depend on how many layers the saving process had created before. They are translated through the model
file, whose tensors keep the internal name they had when saved (`StructuredToParameterName@@`), to the
structured name (`0.weight`) and on to this process's parameter.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nandoctor.errors import SpecError
from nandoctor.findings import Code, Finding, Location, Phase, Severity
from nandoctor.spec import ResumeSpec, Spec, check_resume_step
from nandoctor.spec.checks import did_you_mean

__all__ = ["apply_resume", "from_trainer_dir", "load_model_state", "resume_probe"]

# A PaddleNLP / PaddleFormers Trainer's checkpoint-N folder (trainer.py `_save_checkpoint`, utils/env.py)
TRAINER_STATE = "trainer_state.json"
TRAINER_WEIGHTS = ("model_state.pdparams", "model_state.pdparams.index.json", "model.safetensors",
                   "model.safetensors.index.json")
TRAINER_OPTIMIZER = "optimizer.pdopt"
TRAINER_SCHEDULER = "scheduler.pdparams"
TRAINER_RNG = "rng_state.pth"
_NAMES_KEY = "StructuredToParameterName@@"
_TRAILING_COUNTER = re.compile(r"_\d+$")


def from_trainer_dir(folder: Path, spec: Spec) -> ResumeSpec:
    """The files of a Trainer's `checkpoint-N` folder; `step` from trainer_state.json's global_step (optimizer
    steps, so times `optimizer.accumulate_steps` in the probe's batches)."""
    where = f"--resume {folder}"
    if not folder.is_dir():
        what = "is a file; pass the checkpoint-N folder that holds it" if folder.exists() else "does not exist"
        raise SpecError(f"{where}: the folder {what}. --resume takes a PaddleNLP or PaddleFormers Trainer "
                        f"checkpoint folder (checkpoint-N, with {TRAINER_STATE} and model_state.pdparams); for "
                        "files you saved yourself, use a `resume` block in the spec.")
    state_file = folder / TRAINER_STATE
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecError(f"{where}: {state_file} does not exist, so the step the checkpoint was taken at is "
                        "unknown. Pass a Trainer checkpoint-N folder (it holds trainer_state.json), or write a "
                        "`resume` block with `step:` in the spec.") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SpecError(f"{where}: {state_file} is not readable JSON ({exc}).") from None
    step = state.get("global_step") if isinstance(state, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise SpecError(f"{where}: {state_file} has no whole-number `global_step` (found {step!r}); it is the "
                        "optimizer step the Trainer saved this checkpoint at.")
    accumulate = spec.optimizer.accumulate_steps

    def fail(problem: str) -> None:
        raise SpecError(f"{where}: `global_step` in {state_file} {problem}.")

    batches = check_resume_step(step * accumulate, accumulate, fail)
    model = next((folder / n for n in TRAINER_WEIGHTS if (folder / n).is_file()), None)
    if model is None:
        raise SpecError(f"{where}: no model weights in the folder (looked for {', '.join(TRAINER_WEIGHTS)}). A "
                        "checkpoint saved with unified_checkpoint or by several ranks holds them in other files: "
                        "merge them into model_state.pdparams, or point a `resume` block at the file.")

    def optional(name: str) -> Path | None:
        return folder / name if (folder / name).is_file() else None

    return ResumeSpec(model=model, step=batches, optimizer=optional(TRAINER_OPTIMIZER),
                      lr_scheduler=optional(TRAINER_SCHEDULER), rng=optional(TRAINER_RNG), source=where,
                      trainer_state={"global_step": step, "epoch": state.get("epoch")})


def apply_resume(resume: ResumeSpec, model: Any, optimizer: Any) -> dict[str, Any]:
    """Load every state the checkpoint has into the model and optimizer, each file checked against them
    before it is loaded (a mismatch ends the run, exit 2); returns what the report's `details.resumed` says."""
    names = load_model_state(resume, model)
    info: dict[str, Any] = {"from": resume.source, "step": resume.step, "model": str(resume.model)}
    if resume.trainer_state is not None:
        info["trainer_global_step"] = resume.trainer_state["global_step"]
    opt_state: dict[str, Any] | None = None
    if resume.optimizer is not None:
        info["optimizer"] = str(resume.optimizer)
        opt_state = read_state(resume.optimizer, _key(resume, "optimizer"))  # read once: it is the largest file
        info["optimizer_state"] = _load_optimizer(resume, opt_state, model, optimizer, names)
    else:
        info["optimizer"] = None
        info["note"] = ("no optimizer state was given: the optimizer starts fresh (Adam's moments at zero), "
                        "which is not how the run went on")
    sched_note = _load_scheduler(resume, optimizer, (opt_state or {}).get("LR_Scheduler"))
    if resume.lr_scheduler is not None:
        info["lr_scheduler"] = str(resume.lr_scheduler)
    if sched_note:
        info["lr_scheduler_note"] = sched_note
    if resume.rng is not None:
        info["rng"] = _restore_rng(resume.rng)
    return info


# ---- the model ------------------------------------------------------------------------------------------
def read_state(file: Path, source: str) -> dict[str, Any]:
    """A state dict from `file`: paddle.save's format, safetensors, or a sharded index of either."""
    if file.name.endswith(".index.json"):
        try:
            index = json.loads(file.read_text(encoding="utf-8"))
            shards = sorted(set(index["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise SpecError(f"{source}: {file} is not a readable sharded-weights index (a JSON file with a "
                            f"`weight_map`): {type(exc).__name__}: {exc}.") from None
        state: dict[str, Any] = {}
        for shard in shards:
            state.update(read_state(file.parent / shard, source))
        return state
    if not file.is_file():
        raise SpecError(f"{source}: {file} does not exist.")
    try:
        if file.suffix == ".safetensors":
            from safetensors.numpy import load_file

            return dict(load_file(str(file)))
        import paddle

        loaded = paddle.load(str(file))
    except ImportError:
        raise SpecError(f"{source}: {file} is a safetensors file; install the `safetensors` package to read "
                        "it.") from None
    except Exception as exc:  # noqa: BLE001 - any failure to read the user's file is the file's problem
        raise SpecError(f"{source}: {file} could not be read with paddle.load ({type(exc).__name__}: "
                        f"{str(exc)[:200]}). Is it a file paddle.save wrote?") from None
    if not isinstance(loaded, dict):
        raise SpecError(f"{source}: {file} holds a {type(loaded).__name__}, not a state dict; save it with "
                        "paddle.save(model.state_dict(), path).")
    return loaded


def load_model_state(resume: ResumeSpec, model: Any) -> dict[str, str]:
    """Check the checkpoint's keys and shapes against the model, then load it. Returns the checkpoint's
    internal parameter names -> this process's (to translate the optimizer's state)."""
    source, file = _key(resume, "model"), resume.model
    state = read_state(file, source)
    state.pop(_NAMES_KEY, None)
    expected = model.state_dict()
    state = _unwrapped(state, expected)
    _check_flat(state, source, file)
    _check_model_keys(state, expected, model, source, file)
    _check_model_shapes(state, expected, source, file)
    names = {getattr(v, "name", None): k for k, v in state.items()}
    ours = dict(model.named_parameters())
    _set_model_state(model, state, expected)
    return {str(old): ours[k].name for old, k in names.items() if old and k in ours}


def _unwrapped(state: dict[str, Any], expected: dict[str, Any]) -> dict[str, Any]:
    """A DataParallel's or a wrapper's state dict with its prefix taken off, when no key matches as it is."""
    if state and not set(state) & set(expected):
        for prefix in ("_layers.", "model."):
            if all(k.startswith(prefix) for k in state):
                return {k[len(prefix):]: v for k, v in state.items()}
    return state


def _check_flat(state: dict[str, Any], source: str, file: Path) -> None:
    """A model state dict maps names to tensors: a dict inside is several things saved in one file."""
    nested = next((k for k, v in state.items() if isinstance(v, dict)), None)
    if nested is not None:
        raise SpecError(f"{source}: {file} holds a dict under '{nested}', not a model state dict (name -> "
                        f"tensor). If you saved several things in one file, save model.state_dict() on its own.")


def _check_model_keys(state: dict[str, Any], expected: dict[str, Any], model: Any, source: str,
                      file: Path) -> None:
    """Every key of the checkpoint is the model's, and every key of the model is in it (but those the model
    says it does not save): nothing is loaded half-way."""
    model_keys = list(expected)
    unexpected = [k for k in state if k not in expected]
    if unexpected:
        k = unexpected[0]
        raise SpecError(f"{source}: the key '{k}' in {file} is not a parameter or buffer of the model"
                        f"{did_you_mean(k, model_keys)}; {len(unexpected)} of its {len(state)} keys do not match "
                        f"(the model's look like {', '.join(model_keys[:3])}). Was it saved from another model "
                        "or with other model.args?")
    ignore = _ignorable(model)
    missing = [k for k in model_keys if k not in state and not any(p.search(k) for p in ignore)]
    if missing:
        k = missing[0]
        raise SpecError(f"{source}: {file} has no value for the model's '{k}' ({len(missing)} of the model's "
                        f"{len(model_keys)} keys are missing, e.g. {', '.join(missing[:3])}); a run resumed "
                        "from it would keep those at their initial values. Was it saved from another model "
                        "or with other model.args?")


def _check_model_shapes(state: dict[str, Any], expected: dict[str, Any], source: str, file: Path) -> None:
    """Each value has the shape of the model's tensor it is loaded into."""
    for k, value in state.items():
        have, want = _shape(value), [int(d) for d in expected[k].shape]
        if have != want:
            raise SpecError(f"{source}: the key '{k}' in {file} has shape {have}, but the model's '{k}' has "
                            f"shape {want}. Check model.args (sizes such as hidden or vocab_size) against the "
                            "run that saved the checkpoint.")


def _key(resume: ResumeSpec, what: str) -> str:
    """Where a file came from, for messages: `resume.model` in a spec, or `--resume DIR`."""
    return f"{resume.source}.{what}" if resume.source == "resume" else resume.source


def _set_model_state(model: Any, state: dict[str, Any], expected: dict[str, Any]) -> None:
    import paddle

    converted = {}
    for k, value in state.items():
        want = expected[k]
        t = value if isinstance(value, paddle.Tensor) else paddle.to_tensor(value)
        converted[k] = t.astype(want.dtype) if t.dtype != want.dtype else t
    model.set_state_dict(converted)


def _ignorable(model: Any) -> list[re.Pattern[str]]:
    """Keys a PaddleNLP model says it does not save (tied or derived weights)."""
    pats: list[re.Pattern[str]] = []
    for attr in ("_keys_to_ignore_on_save", "_keys_to_ignore_on_load_missing"):
        for p in getattr(model, attr, None) or []:
            try:
                pats.append(re.compile(p))
            except (re.error, TypeError):
                continue
    return pats


def _shape(value: Any) -> list[int]:
    return [int(d) for d in getattr(value, "shape", [])]


# ---- the optimizer --------------------------------------------------------------------------------------
def _load_optimizer(resume: ResumeSpec, loaded: dict[str, Any], model: Any, optimizer: Any,
                    names: dict[str, str]) -> dict[str, Any]:
    """The accumulators (Adam's moments, momentum...) created now and set from the checkpoint, every key
    placed or refused: Paddle would otherwise fill them lazily at the first step and assert there."""
    source, file = _key(resume, "optimizer"), resume.optimizer
    state = dict(loaded)
    state.pop("LR_Scheduler", None)  # loaded with the scheduler (_load_scheduler)
    master = state.pop("master_weights", None)
    params = [p for p in model.parameters() if not p.stop_gradient]
    _create_accumulators(optimizer, params, source, file)
    ours = _accumulators(optimizer)
    placed = _place_optimizer_state(state, ours, names, params, source, file)
    if placed.unmatched:
        raise _unmatched_error(resume, optimizer, state, ours, names, placed.unmatched)
    if master is not None and hasattr(optimizer, "_master_weights"):
        optimizer._master_weights = {names.get(k, k): v for k, v in dict(master).items()}
    # a parameter no gradient reached before the checkpoint has no state in it: it starts fresh, as it would have
    return {"keys_loaded": placed.count, "parameters_without_state": len({p for p, _ in ours} - placed.filled)}


@dataclass
class _Placed:
    """What placing the checkpoint's optimizer keys did: how many were set, the keys that matched no
    accumulator (refused together, after the rest), and the parameters that got a state."""

    count: int = 0
    unmatched: list[str] = field(default_factory=list)
    filled: set[str] = field(default_factory=set)


def _create_accumulators(optimizer: Any, params: list[Any], source: str, file: Path | None) -> None:
    """The optimizer's accumulators made now, for every trainable parameter, so each can be set."""
    import paddle

    block = paddle.static.default_main_program().global_block()
    try:
        optimizer._create_accumulators(block, params)
    except Exception as exc:  # noqa: BLE001 - an optimizer whose accumulators cannot be made ahead
        raise SpecError(f"{source}: the optimizer state in {file} cannot be loaded into "
                        f"{type(optimizer).__name__} ({type(exc).__name__}: {exc}).") from None


def _accumulators(optimizer: Any) -> dict[tuple[str, str], Any]:
    """Ours: (parameter name, accumulator) -> the tensor; the checkpoint's keys are translated to the same."""
    ours: dict[tuple[str, str], Any] = {}
    for acc, per in getattr(optimizer, "_accumulators", {}).items():
        for pname, var in per.items():
            ours[(pname, acc)] = var
    return ours


def _place_optimizer_state(state: dict[str, Any], ours: dict[tuple[str, str], Any], names: dict[str, str],
                           params: list[Any], source: str, file: Path | None) -> _Placed:
    """Set each key's value into the accumulator it names (a shape that differs ends the run); the keys
    that name none are collected, not set."""
    import paddle

    old_names = sorted(names, key=len, reverse=True)  # the longest prefix first: linear_1 before linear_10
    placed = _Placed()
    for key, value in state.items():
        found = _optimizer_target(key, old_names, names, params, ours)
        if found is None:
            placed.unmatched.append(key)
            continue
        pname, target = found
        have, want = _shape(value), [int(d) for d in target.shape]
        if have != want:
            raise SpecError(f"{source}: the key '{key}' in {file} has shape {have}, but this optimizer's state for "
                            f"that parameter has shape {want}.")
        unmatched_dtype = isinstance(value, paddle.Tensor) and value.dtype != target.dtype
        target.set_value(value.astype(target.dtype) if unmatched_dtype else value)
        placed.count += 1
        placed.filled.add(pname)
    return placed


def _optimizer_target(key: str, old_names: list[str], names: dict[str, str], params: list[Any],
                      ours: dict[tuple[str, str], Any]) -> tuple[str, Any] | None:
    """The parameter (this process's name) and the accumulator a checkpoint key belongs to
    (`linear_3.w_0_moment1_0`: linear_3.w_0's moment1), else None."""
    old = next((n for n in old_names if key.startswith(n + "_")), None)
    if old is None and not names:  # weights without their saved names (safetensors): names as they are
        old = next((p.name for p in params if key.startswith(p.name + "_")), None)
    if old is None:
        return None
    acc = _TRAILING_COUNTER.sub("", key[len(old) + 1:])
    pname = names.get(old, old)
    target = ours.get((pname, acc))
    return None if target is None else (pname, target)


def _unmatched_error(resume: ResumeSpec, optimizer: Any, state: dict[str, Any], ours: dict[tuple[str, str], Any],
                     names: dict[str, str], unmatched: list[str]) -> SpecError:
    """The refusal of an optimizer state whose keys match no accumulator of this optimizer and model."""
    source, file = _key(resume, "optimizer"), resume.optimizer
    k = unmatched[0]
    kinds = sorted({acc for _, acc in ours})
    return SpecError(f"{source}: the key '{k}' in {file} matches no state of this {type(optimizer).__name__} "
                     f"for the model's parameters ({len(unmatched)} of its {len(state)} keys do not; this "
                     f"optimizer keeps {', '.join(kinds) or 'no state'} per parameter). Was it saved with "
                     "another optimizer (optimizer.name) or for another model?" + ("" if names else (
                         f" The weights file {resume.model.name} keeps no internal parameter names (as "
                         "paddle.save's does) to translate the optimizer's keys with, so they must match this "
                         "process's names exactly; save the weights with paddle.save(model.state_dict(), ...)")))


def _load_scheduler(resume: ResumeSpec, optimizer: Any, in_optimizer_file: Any) -> str | None:
    """The scheduler's state from its own file (else from the optimizer file's LR_Scheduler entry)."""
    from nandoctor.workload.schedulers import lr_scheduler

    sched = lr_scheduler(optimizer)
    source = _key(resume, "lr_scheduler")
    state: Any = in_optimizer_file
    if resume.lr_scheduler is not None:
        state = read_state(resume.lr_scheduler, source)
    if state is None:
        return None
    if sched is None:
        return "the checkpoint has an LR scheduler state, but the spec has no optimizer.lr_scheduler: not loaded"
    if "last_epoch" not in state:
        keys = ", ".join(map(str, state))[:200]
        raise SpecError(f"{source}: the scheduler state has no 'last_epoch' (keys: {keys}); save it with "
                        "paddle.save(scheduler.state_dict(), path).")
    sched.set_state_dict(dict(state))
    return None


def _restore_rng(file: Path) -> str:
    """A Trainer's rng_state.pth (Python, NumPy, Paddle), as the Trainer restores it on resuming."""
    import random

    import numpy as np
    import paddle

    try:
        states = paddle.load(str(file), return_numpy=True)  # its NumPy state holds an array, not a tensor
        random.setstate(states["python"])
        np.random.set_state(states["numpy"])
        paddle.set_rng_state(states["cuda"])
    except Exception as exc:  # noqa: BLE001 - an RNG state from another device or version: go on unseeded
        return f"not restored ({type(exc).__name__}: {str(exc)[:120]}); the probe's seed is used"
    return f"restored from {file}"


def resume_probe(spec: Spec, model: Any, optimizer: Any, report: Any) -> int:
    """The probe's start: 0, or after loading the spec's checkpoint (exit 2 on a mismatch), its step, with
    `details.resumed` and a `run.resumed` info finding saying from what."""
    if spec.resume is None:
        return 0
    info = apply_resume(spec.resume, model, optimizer)
    report.details["resumed"] = info
    report.run["resumed_from_step"] = spec.resume.step
    loaded = ", ".join(f"{what} from {info[what]}" for what in ("model", "optimizer", "lr_scheduler") if info.get(what))
    report.findings.append(Finding(
        Code.RUN_RESUMED, Severity.INFO,
        f"The probe resumed from your checkpoint ({spec.resume.source}) after step {spec.resume.step}: {loaded}. "
        f"The {spec.resume.step} batches trained before it were skipped, not trained on; steps are numbered on "
        "from there." + (f" {info['note'][0].upper()}{info['note'][1:]}." if info.get("note") else ""),
        Location(step=spec.resume.step, phase=Phase.PARAMS), {k: v for k, v in info.items() if k != "from"}, []))
    return spec.resume.step
