"""Changes to the model's own computation that a remedy replay makes through forward hooks, never by editing
the user's code: a z-loss on an output head and qk-layernorm on the query and key projections (issue 35).

- z-loss (PaLM; Wortsman et al. 2023): the head's output is captured on each forward, and the step's loss
  becomes loss + coef * mean(logsumexp(head output, -1)^2), which pulls log Z back towards 0.
- qk-layernorm (Dehghani et al. 2023; Wortsman et al. 2023): the output of each projection that makes the
  queries or keys is normalised per head (a layer norm over head_dim without a learned scale), so the
  attention logits q k^T / sqrt(d) stay within +/- sqrt(head_dim) whatever the weights grow to.

Both are context managers: the hooks are removed on exit, whatever happens inside.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


class ChangeNotMade(Exception):
    """The model does not take the change as described (a layer gone, an output of another shape): nandoctor's
    description of the model was wrong, never the user's error."""


@dataclass(frozen=True)
class QKProjection:
    """A linear layer whose output holds queries and/or keys: its name, the attention's head count, and the
    column ranges of its output's last axis to normalise per head (q alone for `q_proj`; q and k, the first
    two thirds, for a fused qkv)."""

    layer: str
    heads: int
    parts: tuple[tuple[int, int], ...]

    @property
    def head_dim(self) -> int:
        lo, hi = self.parts[0]
        return (hi - lo) // self.heads


@dataclass
class ZLossTerm:
    """The head's outputs of the running step's forward, turned into the z-loss term once the loss is made."""

    head: str
    coef: float
    outputs: list[Any] = field(default_factory=list)

    def take(self) -> Any:
        """coef * mean(logsumexp(logits, -1)^2) over this step's head outputs (averaged over the calls of a head
        run more than once); the captured outputs let go."""
        import paddle

        outs, self.outputs = self.outputs, []
        if not outs:
            raise ChangeNotMade(f"layer {self.head} did not run in the step's forward: no head output to add a "
                                "z-loss on")
        terms = [paddle.logsumexp(o.astype("float32"), axis=-1).square().mean() for o in outs]
        return self.coef * (terms[0] if len(terms) == 1 else paddle.add_n(terms) / len(terms))


@dataclass
class InModel:
    """The model changes of one replay, switched on from `from_step` (the steps before it replay the run as it
    was): `begin(step)` before each forward, `loss(loss)` the loss to backpropagate."""

    z: ZLossTerm | None
    on: list[bool]  # shared with the qk-norm hooks
    qk_hits: list[int]
    from_step: int | None = None

    def begin(self, step: int) -> None:
        self.on[0] = self.from_step is None or step >= self.from_step
        if self.z is not None:
            self.z.outputs = []

    def loss(self, loss: Any) -> Any:
        """The step's loss with the z-loss term added while the change is on (the head's outputs let go either
        way: a step's forward is not held into the next)."""
        if self.z is None:
            return loss
        if not self.on[0]:
            self.z.outputs = []
            return loss
        return loss + self.z.take().astype(loss.dtype)


@contextlib.contextmanager
def changed_model(model: Any, z_loss: tuple[str, float] | None, qk: tuple[QKProjection, ...],
                  from_step: int | None = None) -> Iterator[InModel]:
    """Within the block, the z-loss and qk-layernorm hooks on the model (none when neither is asked for)."""
    on = [from_step is None]
    with z_loss_on(model, z_loss) as term, qk_normed(model, qk, on) as hits:
        yield InModel(term, on, hits, from_step)


@contextlib.contextmanager
def z_loss_on(model: Any, head: tuple[str, float] | None) -> Iterator[ZLossTerm | None]:
    """Within the block, layer `head[0]`'s output is kept on every forward; `take()` gives the z-loss term at
    coefficient `head[1]`. None when no z-loss is asked for."""
    if head is None:
        yield None
        return
    import paddle

    name, coef = head
    layer = _sublayer(model, name)
    term = ZLossTerm(name, float(coef))

    def keep(_layer: Any, _inputs: Any, out: Any) -> None:
        if isinstance(out, paddle.Tensor):
            term.outputs.append(out)
        return None

    handle = layer.register_forward_post_hook(keep)
    try:
        yield term
    finally:
        handle.remove()


@contextlib.contextmanager
def qk_normed(model: Any, projections: tuple[QKProjection, ...], on: list[bool] | None = None) -> Iterator[list[int]]:
    """Within the block, each projection's q/k columns are normalised per head on every forward while `on[0]`
    (always, without `on`); yields a one-item list counting the forwards changed (a hook never run says the
    change was never made)."""
    if not projections:
        yield [0]
        return
    hits = [0]
    handles = []
    on = on if on is not None else [True]
    try:
        for proj in projections:
            handles.append(_sublayer(model, proj.layer).register_forward_post_hook(_normalise(proj, hits, on)))
        yield hits
    finally:
        for h in handles:
            h.remove()


def _normalise(proj: QKProjection, hits: list[int], on: list[bool]) -> Any:
    """The forward post-hook that returns the projection's output with its q/k parts layer-normed per head."""
    import paddle
    import paddle.nn.functional as F

    hd = proj.head_dim

    def hook(_layer: Any, _inputs: Any, out: Any) -> Any:
        if not on[0]:
            return None
        if not isinstance(out, paddle.Tensor):
            raise ChangeNotMade(f"layer {proj.layer} returned {type(out).__name__}, not a tensor to normalise")
        width = int(out.shape[-1])
        if proj.parts[-1][1] > width:
            raise ChangeNotMade(f"layer {proj.layer}'s output has {width} columns, fewer than the q/k parts "
                                f"{list(proj.parts)}")
        pieces, at = [], 0
        for lo, hi in proj.parts:
            if lo > at:
                pieces.append(out[..., at:lo])
            part = out[..., lo:hi]
            shape = [*part.shape[:-1], proj.heads, hd]
            pieces.append(F.layer_norm(part.reshape(shape), hd).reshape(part.shape))
            at = hi
        if at < width:
            pieces.append(out[..., at:])
        hits[0] += 1
        return pieces[0] if len(pieces) == 1 else paddle.concat(pieces, axis=-1)

    return hook


def _sublayer(model: Any, name: str) -> Any:
    layer = dict(model.named_sublayers()).get(name)
    if layer is None:
        raise ChangeNotMade(f"the model has no sublayer {name!r}")
    return layer
