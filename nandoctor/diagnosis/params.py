"""The parameter checks: NaN/Inf in parameters and buffers, weights scaled far from their fan-in, zeros.

The scale rule has to stay quiet on every default Paddle initialisation, measured on Paddle 3.3.1:
Linear is XavierUniform (std sqrt(2/(in+out)), which for Linear(2, 8192) is 1/45 of sqrt(1/fan_in)),
Conv is KaimingNormal (sqrt(2/fan_in)), ConvTranspose is Xavier, LSTM/GRU/SimpleRNN are
Uniform(+-1/sqrt(hidden)) whatever their input size, Embedding is Xavier. So each weight gets a band
of acceptable stds built from every scheme that fits its layer (1/fan_in and 2/fan_in rules, Xavier,
the RNN rule), and is flagged only when it is more than 8x above the band's top or below 1/30 of its
bottom. Embeddings (and parameters named like position tables or tokens) are only flagged when far
above N(0, 1), a common and harmless choice for them. Layouts: Linear weight is [in, out]; Conv
weight is [out, in/groups, *kernel]; ConvTranspose weight is [in, out/groups, *kernel]; RNN weights
are [gates*hidden, in]. A parameter of an unknown layer gets the union of the plausible layouts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from nandoctor.advice import advice_for
from nandoctor.findings import Code, Finding, Location, Phase, Severity
from nandoctor.tensors.finite import nonfinite_rows

TOO_BIG = 8.0
TOO_SMALL = 1.0 / 30.0
EMBEDDING_MAX_STD = 8.0  # 8x N(0, 1)
MIN_NUMEL = 16  # a std over fewer entries says little
_EMBEDDING_HINTS = ("emb", "pos", "token", "cls")
MAX_ROWS = 100  # rows listed in evidence; the count is always exact


@dataclass
class NonfiniteParam:
    """Where one parameter or buffer holds NaN/Inf: counts, and the rows (indices along axis 0) holding them.

    Rows matter because a resumed checkpoint often has a few bad rows of an embedding table: only the
    inputs that read those rows (token ids, for an nn.Embedding) go NaN, not every step.
    """

    name: str
    shape: list[int]
    nan: int
    inf: int
    rows: list[int]  # the first MAX_ROWS of them
    n_rows: int
    wholly: bool  # every value is non-finite
    token_ids: bool  # the 2-D weight of an nn.Embedding: its rows are token ids

    def where(self) -> str:
        """'token id(s) 37 (1 of 64 rows)', 'row(s) 3, 5 (2 of 24)' or 'every value'."""
        if self.wholly:
            return "every value"
        total = self.shape[0] if self.shape else 1
        shown = ", ".join(str(r) for r in self.rows[:10]) + ("…" if self.n_rows > 10 else "")
        if self.token_ids:
            return f"token id(s) {shown} ({self.n_rows} of {total} rows)"
        return f"{'row(s)' if len(self.shape) > 1 else 'index(es)'} {shown} ({self.n_rows} of {total})"

    def evidence(self) -> dict[str, Any]:
        out: dict[str, Any] = {"nan": self.nan, "inf": self.inf, "shape": self.shape,
                               "rows": self.rows, "num_rows": self.n_rows, "wholly_nonfinite": self.wholly}
        if self.token_ids:
            out["token_ids"] = self.rows
        return out


def nonfinite_facts(name: str, arr: np.ndarray, layer: Any) -> NonfiniteParam:
    """Counts and rows of the NaN/Inf values in `arr` (a parameter or buffer owned by `layer`)."""
    import paddle.nn as nn

    bad = ~np.isfinite(arr)
    n_nan = int(np.isnan(arr).sum())
    rows = nonfinite_rows(arr)
    return NonfiniteParam(name=name, shape=[int(s) for s in arr.shape], nan=n_nan, inf=int(bad.sum()) - n_nan,
                          rows=rows[:MAX_ROWS], n_rows=len(rows), wholly=bool(bad.all()),
                          token_ids=isinstance(layer, nn.Embedding) and arr.ndim == 2)


def nonfinite_finding(name: str, arr: np.ndarray, layer_name: str | None, layer: Any, *, is_buffer: bool,
                      frozen: bool) -> Finding:
    """The scan's param.nonfinite finding, naming the bad rows (token ids for an embedding table)."""
    facts = nonfinite_facts(name, arr, layer)
    what = "Buffer" if is_buffer else "Parameter"
    if facts.wholly:
        effect = "every forward pass through it is NaN"
    elif facts.token_ids:
        effect = "only batches holding these ids read them, and those steps go NaN"
    else:
        effect = "every input that reads these entries gives NaN"
    frozen_text = (" It is frozen (stop_gradient), so training will not change it; if the model reads it, "
                   "the loss is NaN all the same." if frozen else "")
    return Finding(
        Code.PARAM_NONFINITE, Severity.ERROR,
        f"{what} '{name}' (shape {facts.shape}) holds {facts.nan} NaN and {facts.inf} Inf value(s) before "
        f"training, in {facts.where()}: {effect}.{frozen_text} Load an earlier checkpoint, or re-initialise "
        "those rows.",
        Location(phase=Phase.PARAMS, parameter=name, layer=layer_name or None),
        {**facts.evidence(), "numel": int(arr.size), "first_index": np.argwhere(~np.isfinite(arr))[0].tolist()
         if arr.ndim else [], "buffer": is_buffer, "frozen": frozen},
        advice_for(Code.PARAM_NONFINITE.value, **({} if facts.wholly else
                                                  {"name": name, "rows": facts.rows, "token_ids": facts.token_ids})))


def scan_params(model: Any) -> tuple[list[Finding], dict[str, Any]]:
    """Findings for the model's starting parameters and buffers, and a summary for `report.details`."""
    owners = _owners(model)
    findings: list[Finding] = []
    n_params = numel = 0
    for name, param in model.named_parameters():
        n_params += 1
        arr = np.asarray(param.numpy())
        numel += int(arr.size)
        layer_name, layer = owners.get(id(param), (None, None))
        findings += _check(name, arr, layer_name, layer, is_buffer=False, param=param)
    n_buffers = 0
    for name, buf in model.named_buffers():
        if buf is None or not hasattr(buf, "numpy"):
            continue
        n_buffers += 1
        findings += _check(name, np.asarray(buf.numpy()), None, None, is_buffer=True)
    return findings, {"parameters": n_params, "buffers": n_buffers, "numel": numel}


def init_scale_findings(model: Any) -> list[Finding]:
    """Only the weight-scale checks (param.init_scale), for the probe to run before training: a forward
    overflow that follows from the initial scale then carries its cause. The std is computed where the
    weight lives (no host copy of a large model); NaN/Inf and all-zero weights are left to other checks."""
    import paddle

    from nandoctor.tensors.grouped import per_tensor, std_rows

    weights = []
    for name, param in model.named_parameters():
        shape = [int(s) for s in param.shape]
        if param.dtype not in (paddle.float32, paddle.float16, paddle.bfloat16, paddle.float64) or \
                len([s for s in shape if s != 1]) < 2 or math.prod(shape) < MIN_NUMEL:
            continue
        weights.append((name, shape, param))
    if not weights:
        return []
    with paddle.no_grad():  # one host sync for every weight, and a few ops per shape (grouped.py)
        values = per_tensor([p.detach() for _, _, p in weights], std_rows)
    owners_ = _owners(model)
    out: list[Finding] = []
    for (name, shape, param), std in zip(weights, values):
        if not math.isfinite(std) or std == 0.0:
            continue
        layer_name, layer = owners_.get(id(param), (None, None))
        out += _scale_finding(name, shape, float(std), layer_name, layer)
    return out


def owners(model: Any) -> dict[int, tuple[str, Any]]:
    """id(parameter) -> (dotted layer name, layer) of the outermost layer that registers it."""
    return _owners(model)


def _owners(model: Any) -> dict[int, tuple[str, Any]]:
    """id(parameter) -> (dotted layer name, layer) of the outermost layer that registers it."""
    out: dict[int, tuple[str, Any]] = {}
    for lname, layer in model.named_sublayers(include_self=True):
        for _, p in layer.named_parameters(include_sublayers=False):
            out.setdefault(id(p), (lname, layer))
    return out


def _check(name: str, arr: np.ndarray, layer_name: str | None, layer: Any, is_buffer: bool,
           param: Any = None) -> list[Finding]:
    if arr.dtype.kind != "f":
        return []
    location = Location(phase=Phase.PARAMS, parameter=name, layer=layer_name or None)
    finite = np.isfinite(arr)
    if not finite.all():
        # Paddle keeps batch-norm running statistics as frozen parameters: they are state, not frozen weights
        stats = "BatchNorm" in type(layer).__name__ and name.rsplit(".", 1)[-1] in ("_mean", "_variance")
        return [nonfinite_finding(name, arr, layer_name, layer, is_buffer=is_buffer or stats,
                                  frozen=bool(getattr(param, "stop_gradient", False)) and not stats)]
    if is_buffer:
        return []
    shape = [int(s) for s in arr.shape if s != 1]
    if len(shape) < 2:
        return []
    if not arr.any():
        return [Finding(
            Code.PARAM_ZERO, Severity.WARNING,
            f"Weight '{name}' (shape {list(arr.shape)}) is all zeros: every unit of "
            f"{f'layer {layer_name}' if layer_name else 'its layer'} computes the same thing and gets the "
            "same gradient, so they never become different. Initialise it with Xavier or Kaiming (zeros are "
            "for biases, or a deliberate zero-init such as LoRA's B).",
            location, {"shape": list(arr.shape)}, advice_for(Code.PARAM_ZERO.value))]
    if arr.size < MIN_NUMEL:
        return []
    return _scale_finding(name, [int(s) for s in arr.shape], float(arr.astype(np.float64).std()), layer_name, layer)


def _scale_finding(name: str, shape: list[int], std: float, layer_name: str | None, layer: Any) -> list[Finding]:
    """param.init_scale when `std` is far outside the band of every default init for this weight."""
    location = Location(phase=Phase.PARAMS, parameter=name, layer=layer_name or None)
    kind, fan_in, band, quoted = expected_band(name, shape, layer)
    if kind == "embedding":
        if std <= EMBEDDING_MAX_STD:
            return []
        ratio = std / 1.0
    elif std > TOO_BIG * band[1]:
        ratio = std / band[1]
    elif std < TOO_SMALL * band[0]:
        ratio = std / band[0]
    else:
        return []
    layer_kind = type(layer).__name__ if layer is not None else "unknown layer"
    size = f"{ratio:.3g}x larger" if ratio > 1 else f"{1 / ratio:.3g}x smaller"
    fan_text = f", fan-in {fan_in}" if fan_in else ""
    consequence = ("activations grow by about that factor at this layer and can overflow" if ratio > 1 else
                   "signals and gradients shrink by about that factor at this layer and vanish")
    expected = 1.0 if kind == "embedding" else math.sqrt(quoted[0] * quoted[1])
    return [Finding(
        Code.PARAM_INIT_SCALE, Severity.WARNING,
        f"Weight '{name}' ({layer_kind}, shape {shape}{fan_text}) has std {std:.3g}, {size} than "
        f"its {'embedding scale' if kind == 'embedding' else 'fan-in'} needs (about {quoted[0]:.3g} to "
        f"{quoted[1]:.3g}): {consequence}. Re-initialise it (XavierUniform, or KaimingNormal before ReLU).",
        location,
        {"actual_std": std, "expected_std": list(quoted), "ratio": ratio, "fan_in": fan_in,
         "shape": shape, "layer_type": layer_kind},
        advice_for(Code.PARAM_INIT_SCALE.value, expected_std=expected))]


def expected_band(name: str, shape: list[int], layer: Any) -> tuple[str, int | None, tuple[float, float],
                                                                   tuple[float, float]]:
    """(kind, fan_in, acceptable std band, the band to quote to the user) for one weight.

    The acceptable band covers every default scheme for that layer type; the quoted one is the
    sqrt(1/fan_in)..sqrt(2/fan_in) the user can reason about (for a layout we know).
    """
    import paddle.nn as nn
    from paddle.nn.layer.rnn import RNNBase

    def rule(fan: int) -> list[float]:
        return [math.sqrt(1.0 / fan), math.sqrt(2.0 / fan)]

    def xavier(a: int, b: int) -> float:
        return math.sqrt(2.0 / (a + b))

    lname = name.lower()
    if isinstance(layer, nn.Embedding) or any(h in lname for h in _EMBEDDING_HINTS):
        return "embedding", None, (0.0, EMBEDDING_MAX_STD), (0.0, 1.0)
    rf = math.prod(shape[2:]) if len(shape) > 2 else 1
    cname = type(layer).__name__ if layer is not None else ""
    if isinstance(layer, nn.Linear) and len(shape) == 2:
        fan_in, cands = shape[0], rule(shape[0]) + [xavier(shape[0], shape[1])]
    elif cname.startswith("Conv") and "Transpose" not in cname and len(shape) >= 3:
        fan_in = shape[1] * rf
        cands = rule(fan_in) + [xavier(fan_in, shape[0] * rf)]
    elif cname.startswith("Conv") and len(shape) >= 3:  # transposed: [in, out/groups, *k]
        fan_in = shape[0] * rf
        cands = rule(fan_in) + rule(shape[1] * rf) + [xavier(fan_in, shape[1] * rf)]
    elif isinstance(layer, (RNNBase, nn.RNNCellBase)) and len(shape) == 2:
        fan_in = shape[1]
        hidden = int(getattr(layer, "hidden_size", shape[1]))
        cands = rule(fan_in) + [1.0 / math.sqrt(3.0 * hidden), xavier(shape[0], shape[1])]
    else:  # unknown layout: accept any reading of which dims are the inputs
        fan_in = None
        fans = {shape[0] * rf, shape[1] * rf, math.prod(shape[:-1]), math.prod(shape[1:]), shape[-1]}
        cands = [c for f in fans for c in rule(f)] + [xavier(shape[0] * rf, shape[1] * rf)]
    quoted = tuple(rule(fan_in)) if fan_in else (min(cands), max(cands))
    return "weight", fan_in, (min(cands), max(cands)), quoted  # type: ignore[return-value]
