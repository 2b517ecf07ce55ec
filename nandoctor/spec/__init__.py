"""The YAML spec: read safely, validated key by key, turned into typed dataclasses.

Validation happens here, before any of the user's code is imported, so a typo costs a second, not a
model build. Every error names the file and the key path (`optimizer.grad_clip.global_norm`) and, for
an unknown key, the nearest valid one. Entry strings are checked for shape here; they are imported by
`entrypoints.py`. Reading the YAML is in spec_yaml.py, the per-key getters in spec_checks.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nandoctor.errors import SpecError
from nandoctor.spec.checks import Validator, did_you_mean, short

BUILTIN_LOSSES = ("cross_entropy", "mse", "l1", "bce_with_logits")
AMP_DTYPES = ("float16", "bfloat16")
AMP_LEVELS = ("O1", "O2")
SCHEDULER_BY = ("step", "epoch")
# `model.output: loss`: the model computes its own loss (from the labels it is given as an input).
OUTPUT_LOSS = "loss"
_DEVICE_RE = re.compile(r"^(auto|cpu|gpu(:\d+)?)$")


@dataclass
class EntrySpec:
    """A reference into the user's code, with the keyword arguments to call it with."""

    entry: str
    args: dict[str, Any] = field(default_factory=dict)
    key: str = ""  # the key path it came from, for messages ("model.entry")


@dataclass
class ModelSpec(EntrySpec):
    # `model.output`: which part of a tuple/dict/output object the loss gets (a key, attribute or index);
    # "loss": the model computes its own loss. None: the model's output as it is.
    output: str | int | None = None


@dataclass
class DataSpec(EntrySpec):
    fields: list[str] | None = None
    # positional: a list of field names; keyword: {argument name: field name}
    inputs: list[str] | dict[str, str] | None = None
    label: str | None = None


@dataclass
class LossSpec:
    builtin: str | None = None
    entry: str | None = None


@dataclass
class GradClipSpec:
    kind: str  # global_norm | norm | value
    value: float


@dataclass
class WarmupSpec:
    """`optimizer.lr_scheduler.warmup`: wraps the scheduler in paddle.optimizer.lr.LinearWarmup."""

    steps: int
    start_lr: float = 0.0


@dataclass
class SchedulerSpec:
    """`optimizer.lr_scheduler`: a class in paddle.optimizer.lr (`name` + `args`) or an `entry` returning one."""

    name: str | None = None
    entry: str | None = None
    args: dict[str, Any] = field(default_factory=dict)
    warmup: WarmupSpec | None = None
    by: str = "step"  # "step": scheduler.step() after every optimizer step; "epoch": after every epoch


@dataclass
class OptimizerSpec:
    name: str = "Adam"
    args: dict[str, Any] = field(default_factory=lambda: {"learning_rate": 1.0e-3})
    grad_clip: GradClipSpec | None = None
    given: bool = False  # False when the spec had no `optimizer` and the default is used
    lr_scheduler: SchedulerSpec | None = None
    accumulate_steps: int = 1  # one optimizer step every K batches

    @property
    def scheduler_by(self) -> str:
        """When the scheduler steps: "step" (after each optimizer step, also with no scheduler) or "epoch"."""
        return self.lr_scheduler.by if self.lr_scheduler is not None else "step"


@dataclass
class AmpSpec:
    enabled: bool = False
    dtype: str = "float16"
    level: str = "O1"
    init_loss_scaling: float = 65536.0


@dataclass
class ChecksSpec:
    num_classes: int | None = None
    label_range: tuple[float, float] | None = None
    max_seq_len: int | None = None
    value_range: tuple[float, float] | None = None

    def label_bounds(self) -> tuple[float, float] | None:
        """Inclusive [low, high] for labels, from `num_classes` or `label_range`."""
        if self.num_classes is not None:
            return (0, self.num_classes - 1)
        return self.label_range


@dataclass
class ProbeDefaults:
    steps: int = 200
    seed: int = 0
    device: str = "auto"


@dataclass
class ResumeSpec:
    """`resume` (or `probe --resume DIR`): the user's checkpoint, and after how many steps it was taken.

    `step` counts the probe's steps (batches), so with `optimizer.accumulate_steps: K` it is K times the
    optimizer steps. The files are read by resume.py once the model is built."""

    model: Path
    step: int
    optimizer: Path | None = None
    lr_scheduler: Path | None = None
    rng: Path | None = None  # a Trainer's rng_state.pth: Python, NumPy and Paddle RNG states
    source: str = "resume"  # the spec key or the option the files came from, for messages
    trainer_state: dict[str, Any] | None = None  # a Trainer folder's trainer_state.json (its global_step)

    @property
    def files(self) -> list[Path]:
        return [p for p in (self.model, self.optimizer, self.lr_scheduler, self.rng) if p is not None]


@dataclass
class Spec:
    path: Path
    model: ModelSpec
    data: DataSpec
    loss: LossSpec | None
    step: EntrySpec | None
    optimizer: OptimizerSpec
    amp: AmpSpec
    checks: ChecksSpec
    probe: ProbeDefaults
    raw: dict[str, Any]
    resume: ResumeSpec | None = None

    @property
    def base_dir(self) -> Path:
        """Relative entry paths resolve against the YAML's folder, which is importable at run time."""
        return self.path.parent

    @property
    def entries(self) -> list[str]:
        """Every entry string the spec names: the code a run imports (bundles copy it, outputs never overwrite it)."""
        out = [self.model.entry, self.data.entry]
        if self.loss is not None and self.loss.entry:
            out.append(self.loss.entry)
        if self.step is not None:
            out.append(self.step.entry)
        if self.optimizer.lr_scheduler is not None and self.optimizer.lr_scheduler.entry:
            out.append(self.optimizer.lr_scheduler.entry)
        return out


def load_spec(path: str | Path) -> Spec:
    """Read and validate a spec file; raise `SpecError` naming the file and key on any problem."""
    # here, not at the top: the in-loop watch imports this package for its types and never reads a file, and
    # PyYAML was ~13 ms of every watched script's start that did not import it itself
    from nandoctor.spec.yaml_file import not_yaml_hint, read_yaml

    path = Path(path)
    raw = read_yaml(path)
    try:
        return parse_spec(raw, path)
    except SpecError as err:
        if not isinstance(raw, dict) or "version" not in raw:
            raise SpecError(f"{err}{not_yaml_hint(path)}") from None
        raise


def parse_spec(raw: Any, path: Path) -> Spec:
    """Validate an already-parsed YAML document; `path` is used for messages and relative entries."""
    v = Validator(path)
    if raw is None:
        raise SpecError(f"{path}: the file is empty. A spec needs at least `version: 1`, `model`, `data` and `loss`.")
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: the top level must be a mapping of keys (version, model, data, ...), "
                        f"not a {type(raw).__name__}.")
    v.keys(raw, "")
    version = raw.get("version")
    if version is None:
        v.fail("version", "is missing; add `version: 1` at the top of the file")
    # `True == 1` and "1" would pass a plain comparison; the version is a whole number, written bare.
    if type(version) is not int or version != 1:
        shown = f"the text {version!r}" if isinstance(version, str) else repr(version)
        v.fail("version", f"is {shown}, but this nandoctor reads spec version 1; set `version: 1` "
               "(a bare number, no quotes)")

    model_raw = v.mapping(raw, "model", required=True)
    model_entry = _entry_block(v, raw, "model", required=True)
    model = ModelSpec(entry=model_entry.entry, args=model_entry.args, key=model_entry.key,
                      output=_model_output(model_raw, v))
    data_raw = v.mapping(raw, "data", required=True)
    data_entry = _entry_block(v, raw, "data", required=True)
    data = DataSpec(entry=data_entry.entry, args=data_entry.args, key="data.entry",
                    fields=v.str_list(data_raw, "data.fields"),
                    inputs=_data_inputs(data_raw, v),
                    label=v.opt_str(data_raw, "data.label"))
    input_fields = list(data.inputs.values()) if isinstance(data.inputs, dict) else (data.inputs or [])
    if data.fields is not None:
        if len(set(data.fields)) != len(data.fields):
            v.fail("data.fields", f"names a field twice ({data.fields}); each field needs its own name")
        for key, names in (("data.inputs", input_fields), ("data.label", [data.label] if data.label else [])):
            for name in names:
                if name not in data.fields:
                    v.fail(key, f"names field '{name}', which is not in data.fields {data.fields}"
                           + did_you_mean(name, data.fields))
    # A model that computes its own loss takes the labels as an input; any other gets them via the loss.
    if data.label and data.label in input_fields and model.output != OUTPUT_LOSS:
        v.fail("data.inputs", f"includes the label field '{data.label}'; the label goes to the loss, not the model "
               "(if your model computes its own loss from it, set `model.output: loss`)")

    loss, step = _loss_or_step(raw, v, model.output)
    optimizer = _optimizer(raw, v)
    amp = _amp(raw, v)
    checks = _checks(raw, v)
    probe = _probe(raw, v)
    resume = _resume(raw, v, path, optimizer.accumulate_steps)
    return Spec(path=path, model=model, data=data, loss=loss, step=step, optimizer=optimizer,
                amp=amp, checks=checks, probe=probe, raw=raw, resume=resume)


def _entry_block(v: Validator, raw: dict[str, Any], key: str, required: bool) -> EntrySpec:
    """`model` / `data`: an `entry` string and its `args`."""
    block = v.mapping(raw, key, required)
    assert block is not None
    v.keys(block, key)
    return EntrySpec(entry=v.entry_string(block, f"{key}.entry"), args=v.args(block, f"{key}.args"),
                     key=f"{key}.entry")


def _model_output(model_raw: dict[str, Any] | None, v: Validator) -> str | int | None:
    """`model.output`: a key/attribute name, an index into a tuple/list, or `loss`."""
    value = (model_raw or {}).get("output")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)) or (isinstance(value, str) and not value.strip()):
        v.fail("model.output", f"is {short(value)}; write the key or attribute of your model's output the loss "
               "needs (`logits`), its position in a returned tuple (`0`), or `loss` when the model returns "
               "its own loss")
    return value.strip() if isinstance(value, str) else value


def _data_inputs(data_raw: dict[str, Any] | None, v: Validator) -> list[str] | dict[str, str] | None:
    """`data.inputs`: fields passed positionally (a list) or by keyword ({argument: field})."""
    value = (data_raw or {}).get("inputs")
    if not isinstance(value, dict):
        return v.str_list(data_raw or {}, "data.inputs")
    if not value:
        v.fail("data.inputs", "is an empty mapping; map each keyword argument of your model's forward to a "
               "field, e.g. {input_ids: input_ids, attention_mask: mask}")
    for arg, name in value.items():
        if not isinstance(arg, str) or not arg.isidentifier():
            v.fail(f"data.inputs.{arg}", "is not a valid keyword argument name; the keys of the mapping are the "
                   "names of your model's forward arguments, e.g. {input_ids: ids}")
        if not isinstance(name, str) or not name:
            v.fail(f"data.inputs.{arg}", f"is {short(name)}; give the name of the batch field to pass as "
                   f"`{arg}=`, e.g. `{arg}: {arg}`")
    return dict(value)


def _loss_or_step(raw: dict[str, Any], v: Validator,
                  output: str | int | None = None) -> tuple[LossSpec | None, EntrySpec | None]:
    has_loss, has_step = raw.get("loss") is not None, raw.get("step") is not None
    if output is not None and has_step:
        v.fail("model.output", "applies to the `loss` path (nandoctor calls your model, then the loss); with "
               "`step`, your function picks what it needs from the model's output: remove `model.output`")
    if output == OUTPUT_LOSS:
        if has_loss:
            v.fail("loss", "is given, but `model.output: loss` says the model returns its own loss; remove the "
                   "`loss` block (or set `model.output` to the logits' key and keep `loss`)")
        return None, None
    if has_loss and has_step:
        v.fail("loss", "and `step` are both given; keep exactly one: `loss` (nandoctor calls your model, then "
               "the loss) or `step` (your function computes the loss from the model and the batch)")
    if not has_loss and not has_step:
        v.fail("loss", "is missing; add `loss: {builtin: cross_entropy}` (or mse, l1, bce_with_logits), "
               "`loss: {entry: \"losses.py:my_loss\"}`, a `step: {entry: ...}` block, or `model.output: loss` "
               "when your model returns its own loss")
    if has_step:
        step_raw = v.mapping(raw, "step", required=True)
        v.keys(step_raw, "step")
        return None, EntrySpec(entry=v.entry_string(step_raw, "step.entry"), key="step.entry")
    loss_raw = v.mapping(raw, "loss", required=True)
    v.keys(loss_raw, "loss")
    builtin, entry = loss_raw.get("builtin"), loss_raw.get("entry")
    if (builtin is None) == (entry is None):
        v.fail("loss", "needs exactly one of `builtin` (one of " + ", ".join(BUILTIN_LOSSES) + ") or `entry`")
    if builtin is not None:
        if builtin not in BUILTIN_LOSSES:
            v.fail("loss.builtin", f"is {builtin!r}; choose one of {', '.join(BUILTIN_LOSSES)}"
                   + did_you_mean(str(builtin), BUILTIN_LOSSES))
        return LossSpec(builtin=builtin), None
    return LossSpec(entry=v.entry_string(loss_raw, "loss.entry")), None


def _optimizer(raw: dict[str, Any], v: Validator) -> OptimizerSpec:
    opt_raw = v.mapping(raw, "optimizer", required=False)
    if opt_raw is None:
        return OptimizerSpec()
    v.keys(opt_raw, "optimizer")
    name = opt_raw.get("name", "Adam")
    if not isinstance(name, str) or not name.isidentifier():
        v.fail("optimizer.name", f"is {name!r}; give a class name from paddle.optimizer such as Adam, AdamW, SGD")
    args = v.args(opt_raw, "optimizer.args")
    for forbidden in ("parameters", "grad_clip"):
        if forbidden in args:
            v.fail(f"optimizer.args.{forbidden}", "is set by nandoctor"
                   + (" from optimizer.grad_clip" if forbidden == "grad_clip" else " from the model") + "; remove it")
    if "learning_rate" in args and not isinstance(args["learning_rate"], (int, float)):
        v.fail("optimizer.args.learning_rate", f"is {args['learning_rate']!r}; give a number such as 1.0e-4 "
               "(without quotes: in quotes it is text)")
    if "learning_rate" in args:
        v.positive_number(args["learning_rate"], "optimizer.args.learning_rate")
    clip = None
    clip_raw = v.mapping(opt_raw, "optimizer.grad_clip", required=False)
    if clip_raw is not None:
        v.keys(clip_raw, "optimizer.grad_clip")
        if len(clip_raw) != 1:
            v.fail("optimizer.grad_clip", "needs exactly one of global_norm, norm or value, e.g. {global_norm: 1.0}")
        kind, value = next(iter(clip_raw.items()))
        clip = GradClipSpec(kind=kind, value=v.positive_number(value, f"optimizer.grad_clip.{kind}"))
    accumulate = 1
    if opt_raw.get("accumulate_steps") is not None:
        accumulate = v.positive_int(opt_raw["accumulate_steps"], "optimizer.accumulate_steps")
    return OptimizerSpec(name=name, args=args, grad_clip=clip, given=True, lr_scheduler=_scheduler(opt_raw, v),
                         accumulate_steps=accumulate)


_SCHED_KEY = "optimizer.lr_scheduler"


def _scheduler(opt_raw: dict[str, Any], v: Validator) -> SchedulerSpec | None:
    """`optimizer.lr_scheduler`; the class name is checked against paddle.optimizer.lr when it is built."""
    key = _SCHED_KEY
    s_raw = v.mapping(opt_raw, key, required=False)
    if s_raw is None:
        return None
    v.keys(s_raw, key)
    name, entry = s_raw.get("name"), s_raw.get("entry")
    _check_scheduler_kind(s_raw, name, entry, v)
    sched = SchedulerSpec(name=name, args=v.args(s_raw, f"{key}.args"))
    if entry is not None:
        sched.entry = v.entry_string(s_raw, f"{key}.entry")
    _check_scheduler_args(sched.args, name, entry, v)
    if s_raw.get("by") is not None:
        sched.by = _scheduler_by(s_raw["by"], v)
    w_raw = v.mapping(s_raw, f"{key}.warmup", required=False)
    if w_raw is not None:
        sched.warmup = _warmup(w_raw, v)
    return sched


def _check_scheduler_kind(s_raw: dict[str, Any], name: Any, entry: Any, v: Validator) -> None:
    """Which scheduler: one of `name` (a paddle.optimizer.lr class) or `entry`, or a warmup alone."""
    key = _SCHED_KEY
    if name is not None and entry is not None:
        v.fail(key, "has both `name` and `entry`; keep one: `name` (a class in paddle.optimizer.lr) or `entry` "
               "(your function returning an LRScheduler)")
    if name is None and entry is None and s_raw.get("warmup") is None:
        v.fail(key, "needs `name` (a class in paddle.optimizer.lr such as CosineAnnealingDecay), `entry` "
               "(\"sched.py:build\", returning an LRScheduler) or just `warmup: {steps: 100}`")
    if name is not None and (not isinstance(name, str) or not name.isidentifier()):
        v.fail(f"{key}.name", f"is {short(name)}; give a class name from paddle.optimizer.lr such as "
               "CosineAnnealingDecay, StepDecay or LinearWarmup")


def _check_scheduler_args(args: dict[str, Any], name: Any, entry: Any, v: Validator) -> None:
    """`args` belong to a named or entry scheduler, and the base rate is set once, in optimizer.args."""
    key = _SCHED_KEY
    if name is None and entry is None and args:
        v.fail(f"{key}.args", "is given without `name` or `entry`; say which scheduler the arguments are for")
    if "learning_rate" in args and name is not None:
        v.fail(f"{key}.args.learning_rate", "is taken from `optimizer.args.learning_rate` (the scheduler's base "
               "rate); set it there and remove it here")


def _scheduler_by(by: Any, v: Validator) -> str:
    """`by`: when the scheduler steps, after every optimizer step or every epoch."""
    if by not in SCHEDULER_BY:
        v.fail(f"{_SCHED_KEY}.by", f"is {short(by)}; write `step` (scheduler.step() after every optimizer "
               "step) or `epoch` (after every pass over the data)")
    return by


def _warmup(w_raw: dict[str, Any], v: Validator) -> WarmupSpec:
    """`warmup`: a linear warmup over `steps` from `start_lr` (>= 0), wrapped around the scheduler."""
    key = f"{_SCHED_KEY}.warmup"
    v.keys(w_raw, key)
    if w_raw.get("steps") is None:
        v.fail(f"{key}.steps", "is missing; write e.g. `warmup: {steps: 100, start_lr: 0.0}`")
    steps = v.positive_int(w_raw["steps"], f"{key}.steps")
    start = w_raw.get("start_lr", 0.0)
    if not isinstance(start, (int, float)) or isinstance(start, bool) or start < 0:
        v.fail(f"{key}.start_lr", f"is {short(start)}; give a number >= 0 such as 0.0 or 1.0e-6")
    return WarmupSpec(steps=steps, start_lr=float(start))


def _amp(raw: dict[str, Any], v: Validator) -> AmpSpec:
    amp_raw = v.mapping(raw, "amp", required=False)
    if amp_raw is None:
        return AmpSpec()
    v.keys(amp_raw, "amp")
    amp = AmpSpec()
    if "enabled" in amp_raw:
        if not isinstance(amp_raw["enabled"], bool):
            v.fail("amp.enabled", f"is {amp_raw['enabled']!r}; write true or false")
        amp.enabled = amp_raw["enabled"]
    for key, allowed in (("dtype", AMP_DTYPES), ("level", AMP_LEVELS)):
        if key in amp_raw:
            if amp_raw[key] not in allowed:
                v.fail(f"amp.{key}", f"is {amp_raw[key]!r}; choose one of {', '.join(allowed)}")
            setattr(amp, key, amp_raw[key])
    if "init_loss_scaling" in amp_raw:
        amp.init_loss_scaling = v.positive_number(amp_raw["init_loss_scaling"], "amp.init_loss_scaling")
    return amp


def _checks(raw: dict[str, Any], v: Validator) -> ChecksSpec:
    c_raw = v.mapping(raw, "checks", required=False)
    if c_raw is None:
        return ChecksSpec()
    v.keys(c_raw, "checks")
    checks = ChecksSpec()
    if c_raw.get("num_classes") is not None:
        checks.num_classes = v.positive_int(c_raw["num_classes"], "checks.num_classes")
    if c_raw.get("label_range") is not None:
        if checks.num_classes is not None:
            v.fail("checks.label_range", "and checks.num_classes are both given; keep one")
        checks.label_range = v.interval(c_raw["label_range"], "checks.label_range")
    if c_raw.get("max_seq_len") is not None:
        checks.max_seq_len = v.positive_int(c_raw["max_seq_len"], "checks.max_seq_len")
    if c_raw.get("value_range") is not None:
        checks.value_range = v.interval(c_raw["value_range"], "checks.value_range")
    return checks


def _probe(raw: dict[str, Any], v: Validator) -> ProbeDefaults:
    p_raw = v.mapping(raw, "probe", required=False)
    if p_raw is None:
        return ProbeDefaults()
    v.keys(p_raw, "probe")
    probe = ProbeDefaults()
    if p_raw.get("steps") is not None:
        probe.steps = v.positive_int(p_raw["steps"], "probe.steps")
    if p_raw.get("seed") is not None:
        seed = p_raw["seed"]
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
            v.fail("probe.seed", f"is {seed!r}; give a whole number from 0 to 4294967295")
        probe.seed = seed
    if p_raw.get("device") is not None:
        probe.device = check_device(str(p_raw["device"]), f"{v.path}: probe.device")
    return probe


def _resume(raw: dict[str, Any], v: Validator, path: Path, accumulate: int) -> ResumeSpec | None:
    """`resume`: checkpoint files relative to the spec, checked to exist now (before the model is built)."""
    r_raw = v.mapping(raw, "resume", required=False)
    if r_raw is None:
        return None
    v.keys(r_raw, "resume")
    files: dict[str, Path | None] = {}
    for key in ("model", "optimizer", "lr_scheduler"):
        value = r_raw.get(key)
        if value is None:
            if key == "model":
                v.fail("resume.model", 'is missing; give the file your training saved with '
                       'paddle.save(model.state_dict(), ...), e.g. `model: "ckpt/model.pdparams"`')
            files[key] = None
            continue
        if not isinstance(value, str) or not value.strip():
            v.fail(f"resume.{key}", f"is {short(value)}; give a file path (relative to this YAML) in quotes")
        file = (path.parent / value.strip()).resolve() if not Path(value.strip()).is_absolute() else Path(value)
        if not file.is_file():
            what = "is a folder, not a file" if file.is_dir() else "does not exist"
            v.fail(f"resume.{key}", f"names {file}, which {what}; give the file paddle.save wrote (relative to "
                   "this YAML)" + (" (for a Trainer's checkpoint-N folder, use `nandoctor probe CONFIG --resume "
                                   "DIR` instead)" if file.is_dir() else ""))
        files[key] = file
    if r_raw.get("step") is None:
        v.fail("resume.step", "is missing; give the number of steps the checkpoint was taken after (e.g. 2000)")
    step = check_resume_step(r_raw["step"], accumulate, lambda problem: v.fail("resume.step", problem))
    model = files["model"]
    assert model is not None
    return ResumeSpec(model=model, step=step, optimizer=files["optimizer"], lr_scheduler=files["lr_scheduler"])


def check_resume_step(step: Any, accumulate: int, fail: Any) -> int:
    """A whole number >= 0, and a multiple of `optimizer.accumulate_steps` (a checkpoint is taken after an
    update: mid-accumulation, the gradients summed so far are not in it)."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        fail(f"is {short(step)}; give a whole number >= 0: the steps (batches) trained when the checkpoint was saved")
    if step % accumulate:
        fail(f"is {step}, which is not a multiple of optimizer.accumulate_steps ({accumulate}): steps count "
             f"batches, and a checkpoint is taken after an optimizer step, so give {accumulate} x the "
             "optimizer steps it was saved after")
    return int(step)


def check_device(device: str, where: str) -> str:
    """`auto`, `cpu`, `gpu` or `gpu:N`; anything else is a SpecError naming `where`."""
    if not _DEVICE_RE.match(device):
        raise SpecError(f"{where} is {device!r}; use auto, cpu, gpu or gpu:N (for example gpu:0).")
    return device
