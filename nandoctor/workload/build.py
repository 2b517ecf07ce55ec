"""The user's training workload built from a spec: model, loader, loss function and optimizer.

Loading an entry point is a SpecError (exit 2); calling one that raises is a UserCodeError that scan
and probe turn into a finding. Nothing here trains or checks anything.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from nandoctor.errors import SpecError
from nandoctor.spec import OUTPUT_LOSS, Spec
from nandoctor.tensors.convert import to_tensor
from nandoctor.workload import outputs as model_outputs
from nandoctor.workload.batches import BatchLayout
from nandoctor.workload.entrypoints import call_user, load_entry, user_import_path
from nandoctor.workload.loader import guard_loader, skip_batches
from nandoctor.workload.plan import StepPlan
from nandoctor.workload.schedulers import build_scheduler
from nandoctor.workload.schedulers import lr_scheduler as lr_scheduler


@dataclass
class Workload:
    spec: Spec
    model: Any
    layout: BatchLayout
    make_loader: Callable[[], Iterable[Any]]
    # (model, fields) -> scalar loss; wraps either `loss` (model then loss) or `step`
    compute_loss: Callable[[Any, dict[str, Any]], Any]
    uses_step: bool

    def call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return call_user(what, fn, *args, base_dir=self.spec.base_dir, **kwargs)

    @property
    def plan(self) -> StepPlan:
        """How batches become updates (accumulation, scheduler, AMP's loss scale): what the step engine reads."""
        opt, amp = self.spec.optimizer, self.spec.amp
        return StepPlan(accumulate=opt.accumulate_steps, scheduler_by=opt.scheduler_by,
                        amp_scale=float(amp.init_loss_scaling) if amp.enabled else None)

    def on_device(self, device: str) -> Workload:
        """This workload as it trains on `device`: its forward and loss under `paddle.amp.auto_cast` when the
        spec turns AMP on and the device has the kernels (not on CPU), for the loop and every replay alike."""
        amp = self.spec.amp
        if not amp.enabled or device == "cpu":
            return self
        import dataclasses

        import paddle

        inner = self.compute_loss

        def compute(model: Any, fields: dict[str, Any]) -> Any:
            with paddle.amp.auto_cast(level=amp.level, dtype=amp.dtype):
                return inner(model, fields)

        return dataclasses.replace(self, compute_loss=compute)

    def resume_at(self, step: int, before_epoch: Callable[[int], None]) -> tuple[int, int, Any]:
        """(epoch, batch index, iterator) of a run resumed after `step` batches: the trained batches are
        skipped, counting across epochs, never trained on (nor loaded, where the loader's batch sampler
        allows). `before_epoch(e)` is called before epoch e's batches are drawn, as the probe loop does
        (the snapshot ring keeps the RNG a shuffle draws from)."""
        loader = self.make_loader()
        try:
            per_epoch = len(loader)  # type: ignore[arg-type]
        except TypeError:  # a generator or an IterableDataset: count by iterating
            per_epoch = None
        if per_epoch is not None:
            epoch, batch_index = divmod(step, per_epoch) if per_epoch else (0, 0)
            before_epoch(epoch)
            return epoch, batch_index, skip_batches(loader, batch_index)
        epoch, left = 0, step
        while True:
            before_epoch(epoch)
            it = iter(loader)
            dropped = sum(1 for _ in itertools.islice(it, left))
            if dropped == left or dropped == 0:  # there, or an empty loader (the probe reports that)
                return epoch, dropped, it
            epoch, left, loader = epoch + 1, left - dropped, self.make_loader()



def build_model(spec: Spec) -> Any:
    """Import and call `model.entry`; the result must be a paddle.nn.Layer."""
    import paddle

    factory = load_entry(spec.model.entry, spec.base_dir, "model.entry", spec.path)
    check_args(factory, spec.model.args, "model.args", spec.model.entry, spec.path)
    with user_import_path(spec.base_dir):
        model = call_user(f"model.entry {spec.model.entry}", functools.partial(factory, **spec.model.args),
                          base_dir=spec.base_dir)
    if not isinstance(model, paddle.nn.Layer):
        raise SpecError(f"{spec.path}: `model.entry` ({spec.model.entry}) returned a {type(model).__name__}; it must "
                        "return a paddle.nn.Layer (your model instance).")
    return model


def loader_factory(spec: Spec) -> Callable[[], Iterable[Any]]:
    """A function that makes a fresh iterable of batches each call (a new epoch)."""
    factory = load_entry(spec.data.entry, spec.base_dir, "data.entry", spec.path)
    check_args(factory, spec.data.args, "data.args", spec.data.entry, spec.path)

    def make() -> Iterable[Any]:
        with user_import_path(spec.base_dir):
            loader = call_user(f"data.entry {spec.data.entry}", functools.partial(factory, **spec.data.args),
                               base_dir=spec.base_dir)
        if isinstance(loader, (str, bytes)) or not hasattr(loader, "__iter__"):
            raise SpecError(f"{spec.path}: `data.entry` ({spec.data.entry}) returned a {type(loader).__name__}; it "
                            "must return an iterable of batches (a paddle.io.DataLoader, a list, a generator).")
        return guard_loader(loader, spec.base_dir)  # a worker's crash surfaces as the user's exception

    return make


def check_args(factory: Callable[..., Any], args: dict[str, Any], key: str, entry: str, spec_path: Path) -> None:
    """A key in `model.args`/`data.args` the factory does not take is a spec mistake, caught before any run."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # some builtins and C extensions have no signature: let the call decide
        return
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return
    names = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for name in args:
        if name not in names:
            import difflib  # on a typo only: 2.8 ms at every start otherwise

            close = difflib.get_close_matches(name, names, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            takes = f"it takes: {', '.join(names)}" if names else "it takes no arguments"
            raise SpecError(f"{spec_path}: `{key}.{name}` is not an argument of {entry} ({takes}).{hint} Fix "
                            f"the name in `{key}` or add the parameter to the function.")


def model_forward(spec: Spec, layout: BatchLayout, model: Any, fields: dict[str, Any]) -> Any:
    """Call the model on a batch: `data.inputs` positionally or by keyword, numpy turned into tensors."""
    layout.check_model_inputs(fields)
    args, kwargs = layout.model_call(fields)
    return model(*[to_tensor(x) for x in args], **{k: to_tensor(v) for k, v in kwargs.items()})


def loss_function(spec: Spec, layout: BatchLayout) -> tuple[Callable[[Any, dict[str, Any]], Any], bool]:
    """(model, fields) -> loss, from `loss.builtin`, `loss.entry`, `step.entry` or the model's own loss."""
    if spec.step is not None:
        step_fn = load_entry(spec.step.entry, spec.base_dir, "step.entry", spec.path)
        return _step_compute(spec, step_fn), True
    selector = spec.model.output
    if selector == OUTPUT_LOSS:
        def own(model: Any, fields: dict[str, Any]) -> Any:
            return model_outputs.own_loss(model_forward(spec, layout, model, fields), spec.path)

        return own, False
    assert spec.loss is not None
    builtin = spec.loss.builtin
    if builtin is not None:
        loss_fn = builtin_loss(builtin)
    else:
        assert spec.loss.entry is not None
        loss_fn = load_entry(spec.loss.entry, spec.base_dir, "loss.entry", spec.path)

    def compute(model: Any, fields: dict[str, Any]) -> Any:
        outputs = model_outputs.select(model_forward(spec, layout, model, fields), selector, spec.path)
        if builtin is not None:  # before Paddle or nandoctor trips over a dict/tuple/output object
            outputs = model_outputs.for_builtin(outputs, builtin, spec.path)
        label = layout.label(fields)
        return loss_fn(outputs) if label is None else loss_fn(outputs, to_tensor(label))

    return _specialised(spec, layout, loss_fn, compute) or compute, False


# numpy labels `paddle.to_tensor` always converts (no text, objects, unsigned wider than a byte, long double)
_PLAIN_LABELS = frozenset(np.dtype(t) for t in ("int64", "int32", "int16", "int8", "uint8", "bool", "float64",
                                                 "float32", "float16"))


def _specialised(spec: Spec, layout: BatchLayout, loss_fn: Callable[..., Any],
                 generic: Callable[[Any, dict[str, Any]], Any]) -> Callable[[Any, dict[str, Any]], Any] | None:
    """`generic` (the `loss` path) with what the spec fixes decided once (the input fields, by position or
    keyword, the label's name, the output's selector), for a 0.3 ms step whose per-step Python shows. A
    model input that is neither a plain numpy array of numbers nor a Tensor sends the step to `generic`
    before the model is called, so the checks, conversions and messages stay `generic`'s. None without
    `data.inputs` (the inputs are then every field but the label, batch by batch)."""
    import paddle

    inputs = layout.data.inputs
    if inputs is None:
        return None
    label_name, selector = layout.data.label, spec.model.output
    tensor, array, to = paddle.Tensor, np.ndarray, paddle.to_tensor
    # (keyword or None for positional, field) for each model input, in the order the model gets them
    slots = tuple(inputs.items()) if isinstance(inputs, dict) else tuple((None, name) for name in inputs)
    builtin = spec.loss.builtin if spec.loss is not None else None

    def compute(model: Any, fields: dict[str, Any]) -> Any:
        # a numeric numpy label becomes a tensor before the forward, as a plain loop converts its batch (after
        # it, the conversion measured ~1.5 us slower on fast_mlp); it cannot raise, so nothing else changes
        label = fields.get("label") if label_name is None else fields.get(label_name, fields)
        early = to(label) if type(label) is array and label.dtype in _PLAIN_LABELS else None
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for arg, name in slots:  # `check_model_inputs` passes these, and `to_tensor` converts them so
            value = fields[name]
            kind = type(value)
            if kind is array and value.dtype.kind not in "OSU":
                value = to(value)
            elif kind is not tensor:
                return generic(model, fields)
            if arg is None:
                args.append(value)
            else:
                kwargs[arg] = value
        outputs = model(*args, **kwargs)
        if selector is not None:
            outputs = model_outputs.select(outputs, selector, spec.path)
        if builtin is not None and not isinstance(outputs, tensor):  # `for_builtin`'s message
            model_outputs.for_builtin(outputs, builtin, spec.path)
        if early is not None:
            return loss_fn(outputs, early)
        if label is fields:  # no such field: the KeyError `generic` raises here
            label = fields[label_name]
        kind = type(label)
        if kind is array:
            return loss_fn(outputs, to(label))
        if kind is tensor:
            return loss_fn(outputs, label)
        return loss_fn(outputs) if label is None else loss_fn(outputs, to_tensor(label))

    return compute


def step_fields(fields: dict[str, Any]) -> dict[str, Any]:
    """The batch as a `step` function gets it: numeric numpy arrays as tensors, as the `loss` path passes them.

    Text, object arrays and Python lists are left as they are: a step may tokenize or index with them.
    """
    return {k: to_tensor(v) if isinstance(v, np.ndarray) and v.dtype.kind in "biuf" else v
            for k, v in fields.items()}


def _step_compute(spec: Spec, step_fn: Callable[..., Any]) -> Callable[[Any, dict[str, Any]], Any]:
    """`step.entry` with tensor fields; on the first call, a step that ran backward() itself is refused."""
    first = [True]

    def compute(model: Any, fields: dict[str, Any]) -> Any:
        check, first[0] = first[0], False
        params = [p for p in model.parameters() if not p.stop_gradient] if check else []
        had_grads = any(p.grad is not None for p in params)
        loss = step_fn(model, step_fields(fields))
        if check and not had_grads and any(p.grad is not None for p in params):
            raise SpecError(f"{spec.path}: `step.entry` ({spec.step.entry if spec.step else ''}) computed gradients "
                            "itself: the model's parameters had gradients when it returned. step.entry must return "
                            "the loss; nandoctor calls backward() (and the optimizer). Remove the backward() call "
                            "(and any optimizer.step()) from that function.")
        return loss

    return compute


def builtin_loss(name: str) -> Callable[..., Any]:
    import paddle
    import paddle.nn.functional as F

    integer = (paddle.int64, paddle.int32)  # read once: these run every step

    def cross_entropy(outputs: Any, label: Any) -> Any:
        if label.dtype not in integer:
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

    return {"cross_entropy": cross_entropy, "bce_with_logits": bce_with_logits, "mse": mse, "l1": l1}[name]


def build_optimizer(spec: Spec, model: Any) -> Any:
    """`paddle.optimizer.<name>(parameters=..., grad_clip=..., **args)`; a bad name or arg is a SpecError.

    With `optimizer.lr_scheduler`, the scheduler is the optimizer's `learning_rate` (get it back with
    `lr_scheduler(optimizer)`; the probe loop steps it).
    """
    import paddle

    opt = spec.optimizer
    names = [n for n in dir(paddle.optimizer) if n[0].isupper() and n not in ("Optimizer",)]
    cls = getattr(paddle.optimizer, opt.name, None)
    if cls is None or not isinstance(cls, type):
        import difflib  # on a typo only: 2.8 ms at every start otherwise

        close = difflib.get_close_matches(opt.name, names, n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise SpecError(f"{spec.path}: `optimizer.name` is {opt.name!r}, which is not a class in paddle.optimizer."
                        f"{hint} Choose one of: {', '.join(sorted(names))}.")
    clip = None
    if opt.grad_clip is not None:
        clip_cls = {"global_norm": paddle.nn.ClipGradByGlobalNorm, "norm": paddle.nn.ClipGradByNorm,
                    "value": paddle.nn.ClipGradByValue}[opt.grad_clip.kind]
        clip = clip_cls(opt.grad_clip.value)
    kwargs = dict(opt.args)
    scheduler = build_scheduler(spec)
    if scheduler is not None:  # the scheduler took `learning_rate` as its base rate
        kwargs["learning_rate"] = scheduler
    try:
        return cls(parameters=model.parameters(), grad_clip=clip, **kwargs)
    except TypeError as exc:
        shown = {k: v for k, v in kwargs.items() if k != "learning_rate" or scheduler is None}
        raise SpecError(f"{spec.path}: `optimizer.args` {shown} do not fit paddle.optimizer.{opt.name}: {exc}."
                        ) from None


def build_workload(spec: Spec) -> Workload:
    """Everything but the optimizer (scan needs no optimizer); entry points are loaded before any is run."""
    layout = BatchLayout(spec.data, str(spec.path))
    make_loader = loader_factory(spec)
    compute_loss, uses_step = loss_function(spec, layout)
    model = build_model(spec)
    return Workload(spec=spec, model=model, layout=layout, make_loader=make_loader, compute_loss=compute_loss,
                    uses_step=uses_step)


def scan_outputs(spec: Spec, layout: BatchLayout, model: Any, fields: dict[str, Any]) -> Any:
    """The model's output as scan reads it for the class count: `model.output` applied, None when unknown.

    A model that returns its own loss, or an output `model.output` does not fit, gives None (no guess
    about the number of classes); the probe reports a selector that does not fit.
    """
    try:  # text or ragged inputs: no guess; the data scan reports them (data.not_tensor) when the model gets them
        layout.check_model_inputs(fields)
    except SpecError:
        return None
    outputs = model_forward(spec, layout, model, fields)
    selector = spec.model.output
    if selector is None:
        return outputs
    if selector == OUTPUT_LOSS:
        return None
    try:
        return model_outputs.pick(outputs, selector, spec.path)
    except SpecError:
        return None
