"""The seams `nandoctor run` puts on Paddle's classes, and the import hook that waits for Paddle.

`patch_paddle(session)` wraps `Layer.__call__`, `Tensor.backward`, `Optimizer.step` (and every
subclass's own `step`) and `Optimizer.minimize`, each a thin call into the `Session` of runtime.py.
`AfterImport` runs the patching right after `import paddle` finished, so a process that never imports
Paddle (the launcher's helpers, pip) pays only the sitecustomize's few light modules (~10 ms; numpy and the
model's watch come with Paddle: tests/test_run_start.py).
"""

from __future__ import annotations

import sys
from typing import Any


def patch_paddle(session: Any) -> None:
    """Put the seams on Paddle's classes (called once Paddle is imported)."""
    import paddle
    layer_call = paddle.nn.Layer.__call__
    backward = paddle.Tensor.backward
    step = paddle.optimizer.Optimizer.step
    session.orig = {"call": layer_call, "backward": backward, "step": step}

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807 - the method it replaces
        return session.layer_call(self, args, kwargs)

    def tensor_backward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if session.recheck is None:  # (every step: no closure made for the checked pass's watch)
            out = backward(self, *args, **kwargs)
        else:
            out = session.run_backward(lambda: backward(self, *args, **kwargs))
        session.backward(self)
        return out

    def optimizer_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not session.before_step(self):
            self.clear_grad()  # --keep-going: the update of the faulty step is not applied either
            return None
        out = step(self, *args, **kwargs)
        session.after_step(self)
        return out

    minimize = paddle.optimizer.Optimizer.minimize

    def optimizer_minimize(self: Any, *args: Any, **kwargs: Any) -> Any:  # paddle.Model.fit's route
        if not session.before_step(self):
            return None  # hapi clears the gradients itself right after
        out = minimize(self, *args, **kwargs)
        session.after_step(self)
        return out

    session.orig["patched_call"] = __call__  # (put back in a forked child, which looks for its own model)
    paddle.nn.Layer.__call__ = __call__
    session.patched = True
    paddle.Tensor.backward = tensor_backward
    paddle.optimizer.Optimizer.step = optimizer_step
    paddle.optimizer.Optimizer.minimize = optimizer_minimize
    _patch_subclass_steps(session, step)


def _patch_subclass_steps(session: Any, base: Any) -> None:
    """Optimizers that define their own `step` (Adam, AdamW, ...) get the same wrapper around theirs."""
    import paddle

    seen = set()
    stack = list(paddle.optimizer.Optimizer.__subclasses__())
    while stack:
        cls = stack.pop()
        if cls in seen:
            continue
        seen.add(cls)
        stack += cls.__subclasses__()
        own = cls.__dict__.get("step")
        if own is not None and own is not base:
            session.orig.setdefault("steps", {})[cls] = own  # (the benchmark's plain side steps with these)
            cls.step = _wrap_step(session, own)


def _wrap_step(session: Any, own: Any) -> Any:
    def optimizer_step(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not session.before_step(self):
            self.clear_grad()
            return None
        out = own(self, *args, **kwargs)
        session.after_step(self)
        return out

    return optimizer_step


class AfterImport:
    """A meta-path finder that runs `then()` right after module `name` has been executed."""

    def __init__(self, name: str, then: Any) -> None:
        self.name = name
        self.then = then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module
        then = self.then

        def run(module: Any) -> None:
            exec_module(module)
            then()

        loader.exec_module = run  # type: ignore[method-assign]
        return spec
