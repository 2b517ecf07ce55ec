"""Where a model makes its queries and keys, for the qk-layernorm remedy (issue 35): the projections a replay
can normalise per head by forward hooks on their outputs, found from what the model really exposes.

An attention layer qualifies when it holds, as direct sublayers, `paddle.nn.Linear` projections named like
queries and keys (`q`, `q_proj`, `query`, ... as `paddle.nn.MultiHeadAttention` has them) or one fused
projection of 3 x d outputs (`qkv`, `c_attn`, `query_key_value`, ...) laid out [q | k | v], and names its
head count (`num_heads`, `heads`, ... or `head_dim`). Anything else is reported as not identifiable, with
the reason, and the remedy stays advice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nandoctor.engine.model_changes import QKProjection

_Q_NAMES = ("q", "q_proj", "query", "wq", "q_lin", "to_q")
_K_NAMES = ("k", "k_proj", "key", "wk", "k_lin", "to_k")
_FUSED_NAMES = ("qkv", "qkv_proj", "c_attn", "query_key_value", "in_proj", "wqkv", "to_qkv", "w_qkv")
_HEAD_ATTRS = ("num_heads", "n_head", "n_heads", "heads", "num_attention_heads", "nhead", "head_num",
               "num_head")


@dataclass
class QKSites:
    """The model's q/k projections (each attention layer's), and the attention layers asked about whose
    projections could not be identified (-> why)."""

    projections: list[QKProjection] = field(default_factory=list)
    layers: list[str] = field(default_factory=list)  # the attention layers whose projections were found
    fused: bool = False  # some were found in a fused qkv projection (its layout assumed [q | k | v])
    unknown: dict[str, str] = field(default_factory=dict)


def qk_sites(model: Any, wanted: list[str]) -> QKSites:
    """Every attention layer of `model` with identifiable q/k projections (the change a user makes goes in
    every block), and for each of `wanted` (the layers the report named) that is not among them, why."""
    found = QKSites()
    for name, layer in model.named_sublayers():
        projections = _projections(name, layer)
        if isinstance(projections, list):
            found.projections += projections
            found.layers.append(name)
            found.fused = found.fused or any(len(p.parts) == 2 for p in projections)
    for name in wanted:
        if not any(name == a or name.startswith(a + ".") for a in found.layers):
            found.unknown[name] = _why_not(model, name)
    return found


def attention_layer_of(model: Any, layer: str | None) -> str | None:
    """The attention layer (with identifiable q/k projections) that holds `layer`, or is it; None: none."""
    if not layer:
        return None
    layers = dict(model.named_sublayers())
    parts = layer.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        if name in layers and isinstance(_projections(name, layers[name]), list):
            return name
    return None


def _why_not(model: Any, name: str) -> str:
    layer = dict(model.named_sublayers()).get(name)
    if layer is None:
        return "no such sublayer"
    found = _projections(name, layer)
    return found if isinstance(found, str) else "no q/k projections found"


def _projections(name: str, layer: Any) -> list[QKProjection] | str | None:
    """The layer's q/k projections; a string saying why not when it has projections named like them but
    cannot be read; None when it is no attention layer at all."""
    import paddle

    linears = {n: sub for n, sub in layer.named_children() if isinstance(sub, paddle.nn.Linear)}
    q = next((n for n in _Q_NAMES if n in linears), None)
    k = next((n for n in _K_NAMES if n in linears), None)
    fused = next((n for n in _FUSED_NAMES if n in linears), None)
    if not (q and k) and not fused:
        return None
    heads = _heads(layer, linears[q] if q and k else linears[fused], fused=not (q and k))
    if isinstance(heads, str):
        return heads
    prefix = f"{name}." if name else ""
    if q and k:
        return [QKProjection(prefix + n, heads, ((0, _width(linears[n])),)) for n in (q, k)]
    d = _width(linears[fused]) // 3
    return [QKProjection(prefix + fused, heads, ((0, d), (d, 2 * d)))]


def _heads(layer: Any, proj: Any, fused: bool) -> int | str:
    """The attention's head count, from the layer's own attributes; a string saying why when it names none or
    one that does not divide the projection's width."""
    width = _width(proj) // (3 if fused else 1)
    if fused and _width(proj) % 3:
        return f"its fused projection has {_width(proj)} outputs, not 3 x d"
    heads = next((getattr(layer, a) for a in _HEAD_ATTRS if isinstance(getattr(layer, a, None), int)), None)
    head_dim = getattr(layer, "head_dim", None)
    if heads is None and isinstance(head_dim, int) and head_dim > 0:
        heads = width // head_dim
    if not isinstance(heads, int) or heads <= 0:
        return f"it names no head count ({', '.join(_HEAD_ATTRS[:4])} or head_dim)"
    if width % heads:
        return f"its {heads} heads do not divide the projection's {width} outputs"
    return heads


def _width(linear: Any) -> int:
    return int(linear.weight.shape[-1])  # paddle.nn.Linear's weight is [in, out]
