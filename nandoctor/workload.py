"""The user's training workload built from a spec: model, loader, loss function and optimizer.

Loading an entry point is a SpecError (exit 2); calling one that raises is a UserCodeError that scan
and probe turn into a finding. Nothing here trains or checks anything.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable

from nandoctor.batches import BatchLayout, to_tensor
from nandoctor.entrypoints import call_user, load_entry, user_import_path
from nandoctor.errors import SpecError
from nandoctor.spec import Spec


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


def build_model(spec: Spec) -> Any:
    """Import and call `model.entry`; the result must be a paddle.nn.Layer."""
    import paddle

    factory = load_entry(spec.model.entry, spec.base_dir, "model.entry", spec.path)
    with user_import_path(spec.base_dir):
        model = call_user(f"model.entry {spec.model.entry}", factory, base_dir=spec.base_dir, **spec.model.args)
    if not isinstance(model, paddle.nn.Layer):
        raise SpecError(f"{spec.path}: `model.entry` ({spec.model.entry}) returned a {type(model).__name__}; it must "
                        "return a paddle.nn.Layer (your model instance).")
    return model


def loader_factory(spec: Spec) -> Callable[[], Iterable[Any]]:
    """A function that makes a fresh iterable of batches each call (a new epoch)."""
    factory = load_entry(spec.data.entry, spec.base_dir, "data.entry", spec.path)

    def make() -> Iterable[Any]:
        with user_import_path(spec.base_dir):
            loader = call_user(f"data.entry {spec.data.entry}", factory, base_dir=spec.base_dir, **spec.data.args)
        if isinstance(loader, (str, bytes)) or not hasattr(loader, "__iter__"):
            raise SpecError(f"{spec.path}: `data.entry` ({spec.data.entry}) returned a {type(loader).__name__}; it "
                            "must return an iterable of batches (a paddle.io.DataLoader, a list, a generator).")
        return loader

    return make


def loss_function(spec: Spec, layout: BatchLayout) -> tuple[Callable[[Any, dict[str, Any]], Any], bool]:
    """(model, fields) -> loss, from `loss.builtin`, `loss.entry` or `step.entry`; and whether it is a step."""
    if spec.step is not None:
        step_fn = load_entry(spec.step.entry, spec.base_dir, "step.entry", spec.path)
        return (lambda model, fields: step_fn(model, fields)), True
    assert spec.loss is not None
    if spec.loss.builtin is not None:
        loss_fn = builtin_loss(spec.loss.builtin)
    else:
        assert spec.loss.entry is not None
        loss_fn = load_entry(spec.loss.entry, spec.base_dir, "loss.entry", spec.path)

    def compute(model: Any, fields: dict[str, Any]) -> Any:
        outputs = model(*[to_tensor(x) for x in layout.inputs(fields)])
        label = layout.label(fields)
        return loss_fn(outputs) if label is None else loss_fn(outputs, to_tensor(label))

    return compute, False


def builtin_loss(name: str) -> Callable[..., Any]:
    import paddle.nn.functional as F

    def cross_entropy(outputs: Any, label: Any) -> Any:
        if label.dtype not in (_paddle().int64, _paddle().int32):
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


def _paddle() -> Any:
    import paddle

    return paddle


def build_optimizer(spec: Spec, model: Any) -> Any:
    """`paddle.optimizer.<name>(parameters=..., grad_clip=..., **args)`; a bad name or arg is a SpecError."""
    import paddle

    opt = spec.optimizer
    names = [n for n in dir(paddle.optimizer) if n[0].isupper() and n not in ("Optimizer",)]
    cls = getattr(paddle.optimizer, opt.name, None)
    if cls is None or not isinstance(cls, type):
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
    try:
        return cls(parameters=model.parameters(), grad_clip=clip, **kwargs)
    except TypeError as exc:
        raise SpecError(f"{spec.path}: `optimizer.args` {kwargs} do not fit paddle.optimizer.{opt.name}: {exc}."
                        ) from None


def build_workload(spec: Spec) -> Workload:
    """Everything but the optimizer (scan needs no optimizer); entry points are loaded before any is run."""
    layout = BatchLayout(spec.data, str(spec.path))
    make_loader = loader_factory(spec)
    compute_loss, uses_step = loss_function(spec, layout)
    model = build_model(spec)
    return Workload(spec=spec, model=model, layout=layout, make_loader=make_loader, compute_loss=compute_loss,
                    uses_step=uses_step)
