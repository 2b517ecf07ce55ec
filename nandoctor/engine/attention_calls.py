"""Where the precursors find attention's logits (issue 35): one interception, while a monitor samples, of
Paddle's softmax kernel and of the fused attention kernels' Python entry points.

- `paddle._C_ops.softmax`, the kernel every dygraph softmax ends in, looked up on its module at each call:
  so `F.softmax` however the user's code names it (`from paddle.nn.functional import softmax` at the top of
  a file, an alias bound at import, `paddle.softmax`, `Tensor.softmax`, `nn.Softmax`) and the CPU math path
  of `scaled_dot_product_attention` and `flash_attention` are all seen, and nothing else is slowed.
- the fused kernels, which compute their softmax inside (on a GPU): their logits are made again from q and k
  on the sampled step only, in float32 on the device (`KERNELS`). They are patched where Paddle defines them
  and where the modules of the model's own classes bound them by name; a softmax the kernel's own Python
  computes meanwhile (its CPU fallback) is left to the kernel's measurement, not counted twice.

A monitor is anything with `on_softmax(frame, x, axis, out)`, `on_kernel(frame, kernel, make_scores)`,
`alias_modules` (the module dicts to patch by name) and `fail(exc)`; `engine/precursors.py` has the one.
"""

from __future__ import annotations

import importlib
import inspect
import math
import sys
from typing import Any, Callable

import numpy as np

MASKED = -1e30  # a masked logit: the softmax gives it ~0, and no max over the logits picks it
VARLEN_SEQUENCES = 4  # flash_attn_unpadded: the logits of the batch's first sequences only (one matmul each)

_OPEN: list[Any] = []  # the monitors with a sampled step open
_PATCHED: list[tuple[Any, str, Any]] = []  # (namespace, name, original): put back when the last one closes
_ORIGINAL_SOFTMAX: list[Any] = []
_inside_kernel = [0]  # > 0 while a fused kernel's wrapper runs: its own softmax is the kernel's measurement


def softmax(scores: Any) -> Any:
    """Paddle's own softmax over the last axis, never our wrapper (the probabilities of made-again logits)."""
    from paddle import _C_ops

    return (_ORIGINAL_SOFTMAX[0] if _ORIGINAL_SOFTMAX else _C_ops.softmax)(scores, -1)


def intercept(monitor: Any) -> None:
    """Install the interception for `monitor`'s sampled step (once for all the monitors open at a time)."""
    if not _OPEN:
        _patch_softmax()
        for kernel in KERNELS:
            _patch_kernel(kernel)
    _OPEN.append(monitor)
    _patch_aliases(monitor.alias_modules)


def release(monitor: Any) -> None:
    """`monitor`'s sampled step is over; the last one out puts every original back."""
    if monitor in _OPEN:
        _OPEN.remove(monitor)
    if _OPEN:
        return
    while _PATCHED:
        namespace, name, orig = _PATCHED.pop()
        _set(namespace, name, orig)
    _ORIGINAL_SOFTMAX.clear()


def _set(namespace: Any, name: str, value: Any) -> None:
    if isinstance(namespace, dict):
        namespace[name] = value
    else:
        setattr(namespace, name, value)


def _patch_softmax() -> None:
    from paddle import _C_ops

    orig = _C_ops.softmax
    _ORIGINAL_SOFTMAX[:] = [orig]

    def kernel_softmax(x: Any, axis: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(x, axis, *args, **kwargs)
        if not _inside_kernel[0]:
            frame = sys._getframe(1)
            for mon in list(_OPEN):
                try:
                    mon.on_softmax(frame, x, axis, out)
                except Exception as exc:  # noqa: BLE001 - ours, not the user's
                    mon.fail(exc)
        return out

    _C_ops.softmax = kernel_softmax
    _PATCHED.append((_C_ops, "softmax", orig))


# ---- the fused kernels ------------------------------------------------------------------------------------
class Kernel:
    """A fused attention entry point: where Paddle defines it, and how its logits are made from its arguments."""

    def __init__(self, module: str, name: str, scores: Callable[[dict[str, Any]], Any], how: str) -> None:
        self.module, self.name, self.scores, self.how = module, name, scores, how
        self.original: Any = None
        self.wrapper: Any = None
        self.holders: list[tuple[str, Any]] = []  # (name, module) of Paddle's modules that hand it out
        self.signature: inspect.Signature | None = None


def _patch_kernel(kernel: Kernel) -> None:
    """Wrap the kernel where Paddle hands it out; what that takes (its signature, the modules holding it) is
    worked out once for each function found there (~300 us for the four, then ~7 us a sampled step)."""
    module = sys.modules.get(kernel.module)
    orig = getattr(module, kernel.name, None) if module is not None else None
    if orig is None or orig is not kernel.original:
        try:
            module = importlib.import_module(kernel.module)
            orig = getattr(module, kernel.name)
            kernel.signature = inspect.signature(orig)
        except (ImportError, AttributeError, TypeError, ValueError):
            kernel.original = kernel.wrapper = None
            return  # a Paddle without it
        kernel.original, kernel.holders = orig, _modules_holding(orig, kernel.module)
    signature = kernel.signature

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        outer = not _inside_kernel[0]  # (sdpa may call flash_attention: the outer call is the model's)
        _inside_kernel[0] += 1
        try:
            out = orig(*args, **kwargs)
        finally:
            _inside_kernel[0] -= 1
        if not outer:
            return out
        frame = sys._getframe(1)
        for mon in list(_OPEN):
            try:
                mon.on_kernel(frame, kernel, lambda: _scores_of(kernel, signature, args, kwargs))
            except Exception as exc:  # noqa: BLE001 - ours, not the user's
                mon.fail(exc)
        return out

    kernel.wrapper = wrapper
    for name, mod in kernel.holders:
        if getattr(mod, name, None) is orig:
            setattr(mod, name, wrapper)
            _PATCHED.append((mod, name, orig))


def _modules_holding(orig: Any, home: str) -> list[tuple[str, Any]]:
    """Paddle's modules that hand the kernel out as an attribute (its own, and `paddle.nn.functional` for sdpa)."""
    out = []
    for path in (home, home.rsplit(".", 1)[0]):
        mod = sys.modules.get(path)
        if mod is not None:
            out += [(n, mod) for n, v in list(vars(mod).items()) if v is orig]
    return out


def _patch_aliases(namespaces: list[dict[str, Any]]) -> None:
    """The kernels bound by name in the model's own modules (`from ... import flash_attention`)."""
    wrappers = {id(k.original): k.wrapper for k in KERNELS if k.wrapper is not None}
    for namespace in namespaces:
        for name, value in list(namespace.items()):
            wrapper = wrappers.get(id(value))
            if wrapper is not None:
                namespace[name] = wrapper
                _PATCHED.append((namespace, name, value))


def alias_modules(model: Any) -> list[dict[str, Any]]:
    """The globals of the modules that define the model's layer classes, but Paddle's own (which name the
    kernels through their modules, already patched)."""
    seen: dict[str, dict[str, Any]] = {}
    for layer in [model, *model.sublayers()]:
        name = type(layer).__module__
        mod = sys.modules.get(name)
        if mod is not None and name not in seen and not name.startswith("paddle."):
            seen[name] = vars(mod)
    return list(seen.values())


def _scores_of(kernel: Kernel, signature: inspect.Signature, args: tuple, kwargs: dict) -> Any:
    import paddle

    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    with paddle.no_grad():
        return kernel.scores(bound.arguments)


def _f32(t: Any) -> Any:
    return t.detach().astype("float32")


def _heads_first(q: Any, k: Any) -> tuple[Any, Any]:
    """[batch, seq, heads, dim] -> [batch, heads, seq, dim], the key heads repeated for grouped queries."""
    q, k = _f32(q).transpose([0, 2, 1, 3]), _f32(k).transpose([0, 2, 1, 3])
    if k.shape[1] != q.shape[1] and k.shape[1] and q.shape[1] % k.shape[1] == 0:
        import paddle

        k = paddle.repeat_interleave(k, q.shape[1] // k.shape[1], axis=1)
    return q, k


def _logits(q: Any, k: Any, scale: Any) -> Any:
    import paddle

    return paddle.matmul(q, k, transpose_y=True) * (scale if scale else 1.0 / math.sqrt(q.shape[-1]))


def _masked(s: Any, mask: Any, causal: bool) -> Any:
    """The logits as the kernel's softmax sees them: a boolean mask's False and the causal future at MASKED."""
    import paddle

    if mask is not None:
        m = mask.detach()
        s = paddle.where(m, s, paddle.full_like(s, MASKED)) if m.dtype == paddle.bool else s + m.astype("float32")
    if causal:
        t, u = s.shape[-2], s.shape[-1]
        s = s + paddle.to_tensor(np.triu(np.full((t, u), MASKED, dtype="float32"), 1 + u - t))
    return s


def _sdpa(a: dict[str, Any]) -> Any:
    q, k = _heads_first(a["query"], a["key"])
    return _masked(_logits(q, k, a.get("scale")), a.get("attn_mask"), bool(a.get("is_causal")))


def _flash(a: dict[str, Any]) -> Any:
    q, k = _heads_first(a["query"], a["key"])
    return _masked(_logits(q, k, a.get("softmax_scale")), None, bool(a.get("causal")))


def _flash_unpadded(a: dict[str, Any]) -> Any:
    """[tokens, heads, dim] of sequences packed end to end: the first VARLEN_SEQUENCES, each padded to the
    longest with MASKED (a padded row's max is MASKED, never the largest)."""
    import paddle

    cq = [int(v) for v in a["cu_seqlens_q"].numpy()[:VARLEN_SEQUENCES + 1]]
    ck = [int(v) for v in a["cu_seqlens_k"].numpy()[:VARLEN_SEQUENCES + 1]]
    n = min(len(cq), len(ck)) - 1
    tq, tk = max(cq[i + 1] - cq[i] for i in range(n)), max(ck[i + 1] - ck[i] for i in range(n))
    out = paddle.full([n, a["query"].shape[1], tq, tk], MASKED, dtype="float32")
    for i in range(n):
        q = _f32(a["query"][cq[i]:cq[i + 1]]).transpose([1, 0, 2])
        k = _f32(a["key"][ck[i]:ck[i + 1]]).transpose([1, 0, 2])
        s = _masked(_logits(q, k, a.get("scale")), None, bool(a.get("causal")))
        out[i, :, :s.shape[-2], :s.shape[-1]] = s
    return out


def _fused_mha(a: dict[str, Any]) -> Any:
    """fused_multi_head_attention's q and k from its input and QKV weight (after its pre-LayerNorm)."""
    import paddle
    import paddle.nn.functional as F

    if a.get("cache_kv") is not None:
        raise ValueError("a cached decoding step: its keys are not all in the call")
    x = _f32(a["x"])
    if a.get("pre_layer_norm"):
        scale, bias = a.get("pre_ln_scale"), a.get("pre_ln_bias")
        x = F.layer_norm(x, x.shape[-1:], None if scale is None else _f32(scale),
                         None if bias is None else _f32(bias), a.get("pre_ln_epsilon", 1e-5))
    w, b = _f32(a["qkv_weight"]), a.get("qkv_bias")
    if a.get("transpose_qkv_wb"):  # [embed, 3 * embed] with num_heads
        heads = int(a["num_heads"])
        qkv = paddle.matmul(x, w) + (0 if b is None else _f32(b))
        qkv = qkv.reshape([x.shape[0], x.shape[1], 3, heads, -1]).transpose([2, 0, 3, 1, 4])
    else:  # [3, heads, head_dim, embed]
        qkv = paddle.einsum("bse,thde->tbhsd", x, w)
        if b is not None:
            qkv = qkv + _f32(b).unsqueeze(1).unsqueeze(3)
    return _masked(_logits(qkv[0], qkv[1], None), a.get("attn_mask"), False)


_MADE_AGAIN = "made again from q and k on sampled steps (float32, on the device)"
KERNELS = [
    Kernel("paddle.nn.functional.sdpa", "scaled_dot_product_attention", _sdpa,
           f"scaled_dot_product_attention's logits {_MADE_AGAIN}"),
    Kernel("paddle.nn.functional.flash_attention", "flash_attention", _flash,
           f"flash_attention's logits {_MADE_AGAIN}"),
    Kernel("paddle.nn.functional.flash_attention", "flash_attn_unpadded", _flash_unpadded,
           f"flash_attn_unpadded's logits {_MADE_AGAIN}, over the batch's first {VARLEN_SEQUENCES} sequences"),
    Kernel("paddle.incubate.nn.functional.fused_transformer", "fused_multi_head_attention", _fused_mha,
           f"fused_multi_head_attention's logits {_MADE_AGAIN} from its input and QKV weight"),
]
