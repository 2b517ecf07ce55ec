"""The watch's seam on the model's forward: a `forward` set on the model instance, not a forward pre-hook.

Paddle's `Layer.__call__` goes straight to `self.forward` only for a layer without hooks; one pre-hook
sends every call of the model down `_dygraph_call_func` (its hook loops, a `name_struct` context), ~6 us
a call: 1.5% of a tiny MLP's 0.4 ms step, for a seam that needs to run one line per step. `forward` set on
the instance is what `Layer.__call__` calls on either path (after any pre-hooks of the user's), so the
doctor sees each training call of the model with its inputs, and the model keeps Paddle's short path.

`paddle.jit.to_static(layer)` sets `layer.forward` in the same way: a forward the user set before the
watch is called through and put back at the end; one set after it is left alone (ours, under it, then
only calls through). A deep copy of the watched model (an EMA or teacher copy) gets its own forward, not
the watched model's seam.
"""

from __future__ import annotations

import copy
import functools
import types
from collections.abc import Callable
from typing import Any


class ForwardSeam:
    """`before(layer, inputs)` on every call of `layer`'s forward until `remove()` (the hook-handle API).
    With `after`, a pre- and post-hook pair at the cost of one call: `before(layer, inputs, kwargs)` and
    `after(layer, inputs, output)` (`nandoctor run`'s record of the model's calls)."""

    def __init__(self, layer: Any, before: Callable[..., None],
                 after: Callable[[Any, tuple, Any], None] | None = None) -> None:
        self.layer = layer
        self._previous = vars(layer).get("forward")  # an instance forward set before the watch (to_static's)
        self.forward = (_Forward(layer, layer.forward, before, self._previous) if after is None
                        else _Around(layer, layer.forward, before, self._previous, after))
        layer.forward = self.forward

    def remove(self) -> None:
        """The model's forward as it was before the watch (unless something replaced ours since)."""
        layer = self.layer
        if vars(layer).get("forward") is not self.forward:
            return
        if self._previous is not None:
            layer.forward = self._previous
        else:
            del layer.forward


class _Forward:
    """The instance's forward while watched. A class, not a closure: `copy.deepcopy` copies a function as
    itself, so a deep copy of the model would call the watched model's forward; this one is asked."""

    def __init__(self, layer: Any, inner: Any, before: Callable[[Any, tuple], None], previous: Any) -> None:
        # the model's own signature for whoever inspects it (`nandoctor run` names the inputs by it); first, as
        # it copies the attributes of an `inner` that is itself a seam's forward (`nandoctor run` puts its own
        # over the doctor's), which would otherwise replace these
        functools.update_wrapper(self, inner)
        self._layer, self._inner, self._before, self._previous = layer, inner, before, previous

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        self._before(self._layer, inputs)
        return self._inner(*inputs, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """A deep copy of the watched model gets its own forward (copy.deepcopy puts the new model in
        `memo` before it copies the model's attributes), unwatched; never a call into the watched one."""
        if self._previous is not None:
            return copy.deepcopy(self._previous, memo)
        new = memo.get(id(self._layer))
        if new is None:  # the forward copied on its own, not as part of its model: the model's, unwatched
            return self._inner
        return types.MethodType(type(new).forward, new)


class _Around(_Forward):
    """`_Forward` with the keyword inputs given to `before` and the output to `after`."""

    def __init__(self, layer: Any, inner: Any, before: Callable[..., None], previous: Any,
                 after: Callable[[Any, tuple, Any], None]) -> None:
        super().__init__(layer, inner, before, previous)
        self._after = after

    def __call__(self, *inputs: Any, **kwargs: Any) -> Any:
        self._before(self._layer, inputs, kwargs)
        out = self._inner(*inputs, **kwargs)
        self._after(self._layer, inputs, out)
        return out
