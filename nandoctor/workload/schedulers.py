"""`optimizer.lr_scheduler` -> a paddle.optimizer.lr.LRScheduler, handed to the optimizer as its learning rate.

The class name is checked here, against the installed Paddle (not a list frozen into the spec parser),
so every scheduler Paddle ships works and a typo gets the nearest real name. `optimizer.args.learning_rate`
is the scheduler's base rate, as in Paddle's own examples.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any

from nandoctor.errors import SpecError
from nandoctor.workload.entrypoints import call_user, load_entry, user_import_path

if TYPE_CHECKING:
    from nandoctor.spec import SchedulerSpec, Spec

_KEY = "optimizer.lr_scheduler"


def scheduler_classes() -> dict[str, type]:
    """Every concrete LRScheduler class in paddle.optimizer.lr, by name."""
    import paddle.optimizer.lr as lr

    return {n: c for n, c in vars(lr).items()
            if isinstance(c, type) and issubclass(c, lr.LRScheduler) and c is not lr.LRScheduler}


def build_scheduler(spec: Spec) -> Any | None:
    """The scheduler the spec asks for (wrapped in LinearWarmup when `warmup` is set), or None."""
    sched = spec.optimizer.lr_scheduler
    if sched is None:
        return None
    base_lr = spec.optimizer.args.get("learning_rate")
    if sched.entry is not None:
        inner: Any = _from_entry(spec, sched)
    elif sched.name is not None:
        inner = _from_name(spec, sched, base_lr)
    else:  # only `warmup`: warm up to the optimizer's constant rate
        inner = float(base_lr) if base_lr is not None else 1.0e-3
    if sched.warmup is None:
        return inner
    import paddle.optimizer.lr as lr

    end_lr = float(inner) if isinstance(inner, float) else float(inner.base_lr)
    return _construct(spec, lr.LinearWarmup, f"{_KEY}.warmup", learning_rate=inner,
                      warmup_steps=sched.warmup.steps, start_lr=sched.warmup.start_lr, end_lr=end_lr)


def _from_entry(spec: Spec, sched: SchedulerSpec) -> Any:
    import paddle.optimizer.lr as lr

    assert sched.entry is not None
    fn = load_entry(sched.entry, spec.base_dir, f"{_KEY}.entry", spec.path)
    with user_import_path(spec.base_dir):
        made = call_user(f"{_KEY}.entry {sched.entry}", functools.partial(fn, **sched.args), base_dir=spec.base_dir)
    if not isinstance(made, lr.LRScheduler):
        raise SpecError(f"{spec.path}: `{_KEY}.entry` ({sched.entry}) returned a {type(made).__name__}; it must "
                        "return a paddle.optimizer.lr.LRScheduler (e.g. paddle.optimizer.lr.StepDecay(...)).")
    return made


def _from_name(spec: Spec, sched: SchedulerSpec, base_lr: Any) -> Any:
    classes = scheduler_classes()
    assert sched.name is not None
    cls = classes.get(sched.name)
    if cls is None:
        import difflib  # on a typo only: 2.8 ms at every start otherwise

        close = difflib.get_close_matches(sched.name, list(classes), n=1)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        raise SpecError(f"{spec.path}: `{_KEY}.name` is {sched.name!r}, which is not a scheduler in "
                        f"paddle.optimizer.lr.{hint} Choose one of: {', '.join(sorted(classes))}.")
    if sched.name == "ReduceOnPlateau":  # steps on a metric, not on a step count: nothing here could step it
        raise SpecError(f"{spec.path}: `{_KEY}.name` is ReduceOnPlateau, which lowers the rate only when a metric "
                        "you pass it stops improving; a probe run has no such metric, so the rate would never "
                        "change. Remove `optimizer.lr_scheduler` for the probe (the rate it starts with is "
                        "`optimizer.args.learning_rate`).")
    params = inspect.signature(cls).parameters
    kwargs = dict(sched.args)
    if "learning_rate" in params:
        if base_lr is None:
            raise SpecError(f"{spec.path}: `{_KEY}` ({sched.name}) needs a base learning rate: set "
                            "`optimizer.args.learning_rate` (e.g. 1.0e-3); the scheduler starts from it.")
        kwargs["learning_rate"] = base_lr
    elif base_lr is not None and spec.optimizer.given:
        required = [n for n, p in params.items() if p.default is inspect.Parameter.empty
                    and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        raise SpecError(f"{spec.path}: `optimizer.args.learning_rate` is set, but paddle.optimizer.lr.{sched.name} "
                        f"takes no base learning rate (its rates come from its own arguments: "
                        f"{', '.join(required) or 'see its docs'}). Remove `optimizer.args.learning_rate` and set "
                        + ", ".join(f"`{_KEY}.args.{n}`" for n in required) + ".")
    return _construct(spec, cls, f"{_KEY}.args", **kwargs)


def _construct(spec: Spec, cls: type, key: str, **kwargs: Any) -> Any:
    """cls(**kwargs); an argument Paddle refuses is a SpecError naming the key and the accepted arguments."""
    try:
        return cls(**kwargs)
    except (TypeError, ValueError, AssertionError) as exc:
        accepted = [n for n in inspect.signature(cls).parameters if n not in ("self", "verbose", "last_epoch")]
        shown = {k: v for k, v in kwargs.items() if not hasattr(v, "step")}
        raise SpecError(f"{spec.path}: `{key}` {shown} do not fit paddle.optimizer.lr.{cls.__name__} ({exc}). It "
                        f"takes: {', '.join(accepted)}.") from None


def lr_scheduler(optimizer: Any) -> Any | None:
    """The optimizer's LRScheduler (the one `build_optimizer` passed as its learning rate), or None."""
    import paddle.optimizer.lr as lr

    rate = getattr(optimizer, "_learning_rate", None)
    return rate if isinstance(rate, lr.LRScheduler) else None
