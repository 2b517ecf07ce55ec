"""Transformer instability precursors (issue 35), sampled at fixed steps on the device, judged after the run.

Three quantities, measured in the forward of every 4th step (a constant, so a report never depends on how
fast the machine ran) of a model whose attention is seen:

- per attention layer, the largest attention logit (the softmax's input) and the attention entropy
  (Dehghani et al. 2023; Zhai et al. 2023): Paddle's softmax kernel (under whatever name the model calls it)
  over a [batch, heads, q, k] score tensor, and the fused attention kernels, are intercepted for the sampled
  step's forward only (`engine/attention_calls.py`), and the layer is the `Layer` whose code made the call;
- per output head (the model's last linear layer), the largest |log Z| = |logsumexp(logits)| of its output
  (Wortsman et al. 2023;
  PaLM's z-loss);
- the output RMS of each linear layer of the blocks that hold an attention layer (QKV, out-projection,
  FC1/FC2; Rybakov et al. 2024).

The first step a driver begins is sampled to find the layers, and the series start at the next multiple of 4,
whichever forward the driver saw first. The values stay on the device as one small vector per sampled step and
are read on the host every READ_EVERY sampled steps (fixed step numbers) and at the end. `findings()` turns
the series into warnings with thresholds that separate the healthy runs measured for issue 35 from the ones
that blew up (docs/how-it-works.md, "Precursors").
"""

from __future__ import annotations

import math
from typing import Any

from nandoctor.engine import attention_calls
from nandoctor.engine.precursor_rules import ATTN_ENT, ATTN_MAX, EARLY_STEPS, LOG_Z, RMS, judge
from nandoctor.findings import Code, Finding, Location, Phase, Severity
from nandoctor.tensors.convert import float_dtypes

EVERY_ATTENTION = 4  # sampled steps of a model whose attention is seen
# A model whose attention is not seen is sampled at its first step only: after it, only its head's log Z would be
# measured, and log Z's rule needs a sample within LOGZ_DOUBLING_STEPS of another, which one step in 64 (as it
# was sampled before) never gave: ~0.6% of a 0.3 ms step for no warning that could fire
READ_EVERY = 64  # sampled steps between host reads of the kept values
ENTROPY_ROWS = 4  # the attention entropy is the mean over the rows of the batch's first sequences
MAX_SAMPLES = 4096  # per quantity: beyond it the middle of the series is thinned (the early ones stay)
_ATTENTION_NAMES = ("attention", "attn")


class PrecursorMonitor:
    """Hooks and interceptions on sampled steps only: `begin(step)` before the forward, `end()` after it
    (idempotent; `close()` at the end, always). Never raises into the user's forward: a quantity that
    cannot be measured is left out."""

    def __init__(self, model: Any) -> None:
        import paddle

        self.model = model
        self._names = {id(layer): name for name, layer in model.named_sublayers()}
        self._names[id(model)] = type(model).__name__
        # the layer that called a softmax is the one whose code did: an nn.Softmax sublayer only applies it
        softmax_layers = {id(layer) for layer in model.sublayers() if isinstance(layer, paddle.nn.Softmax)}
        self._callers = {i: n for i, n in self._names.items() if i not in softmax_layers}
        self.alias_modules = attention_calls.alias_modules(model)  # where a fused kernel may be bound by name
        self.measured: dict[str, str] = {}  # attention layer -> how its logits were measured
        self._linears = [(name, layer) for name, layer in model.named_sublayers()
                         if isinstance(layer, paddle.nn.Linear)]
        self._looks_attention = [name for name, layer in model.named_sublayers()
                                 if isinstance(layer, paddle.nn.MultiHeadAttention)
                                 or any(w in type(layer).__name__.lower() for w in _ATTENTION_NAMES)]
        self.every: int | None = EVERY_ATTENTION  # until the first sample says whether attention is seen
        self.attention: list[str] = []  # layers seen computing attention, in order of first sight
        self._discovered = False
        self._tracked: list[tuple[str, Any]] = self._linears  # the first sample looks at every linear layer
        self._keys: dict[tuple[str, str], int] = {}
        self._key_list: list[tuple[str, str]] = []
        self._open = False
        self._step = 0
        # the first step a driver began: its sample finds the attention but stays out of the series, which starts
        # at the next multiple of EVERY_ATTENTION in every way in (`nandoctor run` begins step 0 after its forward)
        self._first: int | None = None
        self._idx: list[int] = []
        self._vals: list[Any] = []
        self._samples: list[tuple[int, list[int], Any]] = []
        self._handles: list[Any] = []
        self._intercepting = False
        self._forward_seen = False  # the model's forward ran during a sampled step (discovery needs one)
        self.broken: str | None = None  # nandoctor's own measurement failed: no more samples (never the user's)
        self.series: dict[tuple[str, str], list[tuple[int, float]]] = {}

    @classmethod
    def resumed(cls, like: PrecursorMonitor) -> PrecursorMonitor:
        """A fresh monitor of `like`'s model that samples `like`'s very steps and layers from wherever a replay
        starts (no discovery sample of its own): a remedy's replay is judged on the steps the run was."""
        m = cls(like.model)
        m._discovered, m.every, m._first = like._discovered, like.every, like._first
        m.attention, m.measured, m._tracked = list(like.attention), dict(like.measured), list(like._tracked)
        return m

    # ---- the schedule ----------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        every = self.every
        return self.broken is None and (not self._discovered or every is not None and step % every == 0)

    def next_due(self, step: int) -> int:
        """The first step from `step` on that is sampled (a driver's quiet window ends before it)."""
        every = self.every
        if self.broken is not None or every is None:
            return 2**62
        if not self._discovered:
            return step
        return -(-step // every) * every

    # ---- a sampled step -------------------------------------------------------------------------
    def begin(self, step: int) -> None:
        if self._first is None:
            self._first = step
        if self._open or not self.due(step):
            return
        self._open, self._step = True, step
        self._idx, self._vals = [], []
        try:
            # the head's hook, not one on the model: a hook registered during the model's own call (the watch's
            # seam opens the step inside its forward) would not run for that call, a sublayer's does
            head = self._linears[-1][1] if self._linears else None
            self._handles = [head.register_forward_post_hook(self._output_hook)] if head is not None else []
            self._handles += [layer.register_forward_post_hook(self._rms_hook(name)) for name, layer in self._tracked]
            if self.attention or not self._discovered:  # (the first sample saw no attention: no softmax is looked at)
                self._patch()
        except Exception:  # noqa: BLE001 - a model that takes no hooks: nothing is measured this step
            self._detach()

    def end(self) -> None:
        """The sampled step's forward is over: hooks off, its values kept (on the device) as one vector."""
        if not self._open:
            return
        self._open = False
        self._detach()
        if self._vals and self.broken is None and self._in_series(self._step):
            import paddle
            from paddle import _C_ops

            try:  # (no autograd to turn off: every value was made from detached tensors)
                vec = _C_ops.stack(self._vals, 0)
                if vec.dtype != paddle.float32:
                    vec = _C_ops.cast(vec, paddle.float32)
                self._samples.append((self._step, list(self._idx), vec))
            except Exception as exc:  # noqa: BLE001 - ours: see fail()
                self.fail(exc)
        self._idx, self._vals = [], []
        if not self._discovered and self._forward_seen:  # (`nandoctor run` opens its first step after its forward)
            self._discover()
        if len(self._samples) >= READ_EVERY:
            self.read()

    def _in_series(self, step: int) -> bool:
        """Whether a sample of `step` is kept: on the stride's grid, after the first step begun. The same steps
        whichever driver saw which forward first: the discovery sample (the first step's forward for the probe
        and the watch, step 1's for `nandoctor run`) only finds the layers."""
        return self._first is not None and step > self._first and step % EVERY_ATTENTION == 0

    def close(self) -> None:
        self.end()

    def _detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._intercepting:
            attention_calls.release(self)
        self._intercepting = False

    def _discover(self) -> None:
        """After the first sample: the stride (None, no more samples, when no attention is seen), and the linear
        layers worth tracking (those of the blocks that hold an attention layer)."""
        self._discovered = True
        self.every = EVERY_ATTENTION if self.attention else None
        parents = {name.rsplit(".", 1)[0] + "." if "." in name else "" for name in self.attention}
        self._tracked = [(n, layer) for n, layer in self._linears
                         if any(p and n.startswith(p) for p in parents)]

    def fail(self, exc: BaseException) -> None:
        """A measurement of ours raised inside the user's forward: swallowed there (it is not the user's error),
        and no step is sampled again."""
        if self.broken is None:
            self.broken = f"{type(exc).__name__}: {exc}"

    def _put(self, quantity: str, layer: str, value: Any) -> None:
        key = (quantity, layer)
        i = self._keys.get(key)
        if i is None:
            i = self._keys[key] = len(self._key_list)
            self._key_list.append(key)
        self._idx.append(i)
        self._vals.append(value.reshape([]) if value.shape else value)

    # ---- what is measured ---------------------------------------------------------------------
    def _output_hook(self, layer: Any, inputs: Any, outputs: Any) -> None:
        if not self._open or self.broken is not None:
            return None
        self._forward_seen = True
        try:
            t = _logits_of(outputs)
            if t is not None:
                import paddle
                from paddle import _C_ops

                x = t.detach()  # (detached: no autograd to turn off; the bare ops, ~5 us less a sampled step)
                if x.dtype != paddle.float32:
                    x = _C_ops.cast(x, paddle.float32)
                self._put(LOG_Z, self._linears[-1][0], _C_ops.max(_C_ops.abs(_C_ops.logsumexp(x, -1, False)), [],
                                                                  False))
        except Exception as exc:  # noqa: BLE001 - ours, not the user's: see fail()
            self.fail(exc)
        return None

    def _rms_hook(self, name: str) -> Any:
        def hook(layer: Any, inputs: Any, outputs: Any) -> None:
            self._forward_seen = True
            if self._open and self.broken is None and _is_float(outputs) and 0 not in outputs.shape:
                import paddle
                from paddle import _C_ops

                try:
                    with paddle.no_grad():  # one fused reduction (a square and a mean cost twice as much)
                        x = outputs.detach()
                        sq = _C_ops.squared_l2_norm(x if x.dtype == paddle.float32 else x.astype("float32"))
                        self._put(RMS, name, (sq / math.prod(x.shape)).sqrt())
                except Exception as exc:  # noqa: BLE001 - ours, not the user's: see fail()
                    self.fail(exc)
            return None

        return hook

    def _patch(self) -> None:
        self._intercepting = True
        attention_calls.intercept(self)

    def on_softmax(self, frame: Any, x: Any, axis: Any, out: Any) -> None:
        """A softmax ran during this monitor's sampled step: attention scores when a layer of the model made
        the call over a [batch, heads, q, k] tensor (or a 3-D one in a layer named like attention)."""
        self._forward_seen = True
        if self._open and self.broken is None and _is_float(x) and axis in (-1, len(x.shape) - 1):
            layer = _calling_layer(frame, self._callers)
            if layer is not None and _is_attention(x, layer):
                self._attention(layer, x, out, "the softmax's input")

    def on_kernel(self, frame: Any, kernel: Any, make_scores: Any) -> None:
        """A fused attention kernel ran: its logits made again from q and k (the kernel keeps them)."""
        layer = _calling_layer(frame, self._callers) if self._open and self.broken is None else None
        if layer is None:
            return
        try:
            scores = make_scores()
        except Exception:  # noqa: BLE001 - a layout this cannot read: left unmeasured
            return
        self._attention(layer, scores, attention_calls.softmax(scores), kernel.how)

    def _attention(self, layer: str, scores: Any, probs: Any, how: str) -> None:
        import paddle

        if layer not in self.attention:
            self.attention.append(layer)
            self.measured[layer] = how
        with paddle.no_grad():
            s = scores.detach()
            # the entropy of the first ENTROPY_ROWS sequences of the batch: a collapse shows in every one, and the
            # whole batch's cost ~1 ms a layer on a 4-layer d128 encoder (seq 64, batch 16) on a sampled step
            p = probs.detach()[:ENTROPY_ROWS].astype("float32")
            self._put(ATTN_MAX, layer, s.max().astype("float32"))
            self._put(ATTN_ENT, layer, -(p * paddle.log(p.clip(min=1e-30))).sum(axis=-1).mean())

    # ---- the host side -------------------------------------------------------------------------
    def read(self) -> None:
        """The kept samples' values, in one host sync, appended to the series."""
        samples, self._samples = self._samples, []
        if not samples:
            return
        import paddle

        with paddle.no_grad():
            flat = paddle.concat([v.reshape([-1]) for _, _, v in samples]).numpy().astype("float64")
        pos = 0
        for step, idx, _ in samples:
            values: dict[int, float] = {}
            for i, v in zip(idx, flat[pos:pos + len(idx)]):
                # a layer called twice in a step keeps its largest value (its smallest entropy)
                old = values.get(i)
                low = self._key_list[i][0] == ATTN_ENT
                values[i] = v if old is None else (min(old, v) if low else max(old, v))
            pos += len(idx)
            for i, v in values.items():
                series = self.series.setdefault(self._key_list[i], [])
                series.append((step, float(v)))
                if len(series) > MAX_SAMPLES:
                    _thin(series)

    def findings(self, fault_step: int | None, lrs: dict[int, float | None] | None = None) -> list[Finding]:
        """The warnings of the run up to the fault (the samples after it, which a driver that reads late may
        have taken, are left out); `lrs`: the learning rate by step, for the advice's numbers."""
        self.end()
        self.read()
        out = judge(self.series, fault_step, lrs or {}, self.every) if self.every is not None else []
        for f in out:
            if f.code == Code.ATTENTION_LOGIT_GROWTH:
                f.evidence["measured"] = self.measured.get(f.evidence["layer"])
        unseen = self.unseen()
        if unseen is not None:
            out.append(unseen)
        return out

    def unseen(self) -> Finding | None:
        """An info when the model has layers that look like attention but no attention was seen computed."""
        if self.attention or not self._looks_attention or not self._discovered:
            return None
        shown = ", ".join(self._looks_attention[:5])
        return Finding(
            Code.ATTENTION_UNSEEN, Severity.INFO,
            f"Layer(s) {shown} look like attention, but no softmax over attention scores was seen in their "
            "forward (Paddle's softmax under any name, scaled_dot_product_attention, flash_attention, "
            "flash_attn_unpadded, fused_multi_head_attention are): their attention logits and entropy were not "
            "watched (a hand-written softmax, or a fused kernel nandoctor does not know). The output head's log Z "
            "was still watched.",
            Location(phase=Phase.FORWARD, layer=self._looks_attention[0]),
            {"layers": self._looks_attention[:20]},
            ["To have them watched, compute the attention weights with Paddle's softmax "
             "(`paddle.nn.functional.softmax(scores, axis=-1)`) or `scaled_dot_product_attention` in the "
             "attention layer's forward."])


def _thin(series: list[tuple[int, float]]) -> None:
    """Every other sample of the older half dropped (the first EARLY_STEPS' samples stay): bounded memory."""
    first = series[0][0]
    head = [x for x in series if x[0] < first + EARLY_STEPS]
    rest = series[len(head):]
    half = len(rest) // 2
    series[:] = head + rest[:half][::2] + rest[half:]


def _is_float(t: Any) -> bool:
    import paddle

    return isinstance(t, paddle.Tensor) and t.dtype in float_dtypes()


def _logits_of(outputs: Any) -> Any:
    """The model's logits: the output tensor, or `logits` of a dict or an output object, or the first float
    tensor of a tuple; None unless it has a class axis (2+ dims, 2+ classes)."""
    t = outputs
    if isinstance(outputs, dict):
        t = outputs.get("logits")
    elif not _is_float(outputs) and hasattr(outputs, "logits"):
        t = outputs.logits
    elif isinstance(outputs, (tuple, list)):
        t = next((o for o in outputs if _is_float(o)), None)
    if not _is_float(t) or len(t.shape) < 2 or t.shape[-1] < 2 or 0 in t.shape:
        return None
    return t


def _calling_layer(frame: Any, names: dict[int, str]) -> str | None:
    """The model's layer whose code called the softmax: the nearest frame whose `self` is one of its layers
    (within a few frames: Paddle's softmax and its decorator, or a kernel's math path, sit between)."""
    for _ in range(8):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not None and id(owner) in names:
            return names[id(owner)]
        frame = frame.f_back
    return None


def _is_attention(x: Any, layer: str) -> bool:
    """Attention scores: a softmax over a [batch, heads, q, k] tensor, or over a 3-D one inside a layer named
    like attention (a classifier's or a head's softmax is neither)."""
    nd = len(x.shape)
    return nd == 4 or (nd == 3 and any(w in layer.lower() for w in _ATTENTION_NAMES))
