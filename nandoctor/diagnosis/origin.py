"""Where a forward non-finite value is born: the layer that made it, then the op and the line inside it.

Models carry intended non-finite values (attention masks of `-inf` built with `full`, `triu`, `where`,
added to scores, reduced by `max`), so "the first op that outputs an Inf" blames the mask. Instead:

1. One plain forward with pre/post hooks on every layer (and the model itself) classifies each call's
   inputs and output: NaN, a harmful Inf (one that is not mask-like: a tensor of only 0 and -inf), or
   clean. The layer that made the fault is the first call, in completion order (so the innermost), whose
   output has NaN while none of its inputs had; with no NaN anywhere (or a NaN made from a harmful Inf
   input), the first call that made a harmful Inf from clean inputs. None of them: the fault is in the loss.
2. A second forward runs Paddle's tensor checker in log mode only while that one call runs (or after the
   model's forward, for the loss), with a line tracer on the user's files, and keeps what it prints: the
   op is the first op whose output was non-finite, not counting a mask's Inf. That is the first NaN op,
   unless a harmful Inf came before it: an op that made +inf (an overflow; masks are -inf), or an op that
   makes Inf from finite values (`log(0)`, `x / 0`: `_INF_MAKERS`) while nothing in the span carried a
   mask (no mask-like tensor logged before it, none among the call's inputs). So `log(|x|.sum()) * x` on
   an all-zero row names `log`, as Paddle's own checker in abort mode does, and `multiply`, which turned
   the -inf into NaN, follows as the NaN op. With no NaN, the first Inf op that is not mask-like. The
   tracer maps the op's log line to the user's line that was running when it was printed (Paddle writes
   unbuffered, in order).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nandoctor.diagnosis.frames import creation_lines, live_stack
from nandoctor.engine.checker import disable_checker, enable_checker
from nandoctor.engine.native import capture_native_output
from nandoctor.workload.entrypoints import is_library_file, is_user_file, library_site, short_path

NAN, INF = "nan", "inf"
# Ops that turn finite inputs into an Inf of either sign (log(0) = -inf, -1 / 0 = -inf, 0 ** -1 = inf). A
# mask's -inf is written by full/where/masked_fill/triu and carried by add/max/subtract: none of these.
_INF_MAKERS = frozenset({"log", "log2", "log10", "log1p", "divide", "elementwise_div", "reciprocal", "pow",
                         "elementwise_pow", "rsqrt", "tan", "atanh", "lgamma", "digamma", "floor_divide"})
_LOG_RE = re.compile(r"op=([A-Za-z0-9_]+),[^\n]*?numel=(\d+), num_nan=(\d+), num_inf=(\d+), num_zero=(\d+), "
                     r"max=([^,]+), min=([^,]+)")


@dataclass
class LayerCall:
    name: str  # dotted sublayer name; "" for the model's own forward
    nth: int  # which call of that layer (a layer can run more than once per step)
    inputs: str | None  # NAN, INF or None (clean)
    output: str | None
    tensor: Any = None  # the output tensor (for its statistics)
    seek: str | None = None  # the kind of op to look for inside this call, when not its output's kind
    parent: str | None = None  # the enclosing call's name (None for the outermost)
    # its inputs held non-finite values of any kind, a mask's included (read only for a non-finite output)
    masked_inputs: bool = False


@dataclass
class Trace:
    loss: Any
    calls: list[LayerCall] = field(default_factory=list)

    def creator(self) -> LayerCall | None:
        """The innermost call that turned clean inputs into a NaN output (or, with no NaN, a harmful Inf).

        A NaN made from a harmful Inf input (a Linear over a row of log(0) = -inf) began with that Inf:
        then the call that made the Inf is named."""
        nan = next((c for c in self.calls if c.output == NAN and c.inputs != NAN), None)
        inf = next((c for c in self.calls if c.output == INF and c.inputs is None), None)
        if nan is not None and nan.inputs == INF and inf is None:
            # No layer call made that Inf: the code of an enclosing call did, between its sublayer calls
            # (`log(x)` in the model's own forward, then a Linear); the op to find in it is the Inf.
            outer = _clean_enclosing_call(self.calls, nan)
            if outer is not None:
                outer.seek = INF
                return outer
        if nan is not None and not (nan.inputs == INF and inf is not None):
            return nan
        return inf


def _clean_enclosing_call(calls: list[LayerCall], nan: LayerCall) -> LayerCall | None:
    """Walking out from `nan`'s call, the first enclosing call whose inputs were clean, or None when the walk
    reaches the outermost call (or one that did not complete) first. An enclosing call completes after
    `nan`'s, so it is looked for among the later calls."""
    later = calls[calls.index(nan) + 1:]
    outer, name = None, nan.parent
    while name is not None:
        outer = next((c for c in later if c.name == name), None)
        if outer is None or outer.inputs is None:
            break
        name = outer.parent
    return outer if outer is not None and outer.inputs is None else None


@dataclass
class OpLine:
    op: str
    numel: int
    nan: int
    inf: int
    zero: int
    max: str
    offset: int

    @property
    def positive_inf(self) -> bool:
        return self.max.strip() == "inf"

    @property
    def mask_like(self) -> bool:
        """Only zeros and -inf: an additive attention mask, not a fault."""
        return self.nan == 0 and self.max.strip() in ("0.000000e+00", "-inf") and self.zero + self.inf == self.numel


def kind(t: Any) -> str | None:
    """NAN, a harmful INF, or None for a finite or mask-like tensor (its non-finite values all -inf, the
    rest 0 or below -1e30, as finfo.min masks are)."""
    import paddle

    if bool(paddle.isfinite(t).all()):
        return None
    if bool(paddle.isnan(t).any()):
        return NAN
    maskish = (t == 0) | (t <= -1e30)
    return None if bool(maskish.all()) else INF


def all_finite(tensors: list[Any]) -> bool:
    if not tensors:
        return True
    import paddle

    return bool(paddle.stack([paddle.isfinite(t).all() for t in tensors]).all())


def worst(tensors: list[Any]) -> str | None:
    if all_finite(tensors):
        return None
    kinds = {kind(t) for t in tensors}
    return NAN if NAN in kinds else INF if INF in kinds else None


def pre_hook_with_kwargs(layer: Any, hook: Callable[[Any, Any, Any], None]) -> Any:
    """A forward pre-hook that also sees the call's keyword arguments (`self.head(hidden_states=h)`); a Paddle
    without `with_kwargs` (before 3.1) passes it none."""
    try:
        return layer.register_forward_pre_hook(hook, with_kwargs=True)
    except TypeError:
        return layer.register_forward_pre_hook(lambda mod, args: hook(mod, args, {}))


def post_hook_with_kwargs(layer: Any, hook: Callable[[Any, Any, Any, Any], None]) -> Any:
    try:
        return layer.register_forward_post_hook(hook, with_kwargs=True)
    except TypeError:
        return layer.register_forward_post_hook(lambda mod, args, out: hook(mod, args, {}, out))


def trace(layers: list[tuple[str, Any]], run: Callable[[], Any], tensors: Callable[[Any], list[Any]]) -> Trace:
    """A plain forward (no grad) with every call's inputs and output classified; `layers` includes ("", model)."""
    import paddle

    out = Trace(loss=None)
    counts: dict[str, int] = {}
    pending: dict[str, list[list[Any]]] = {}
    running: list[str] = []  # the calls in progress, outermost first
    suspects: set[str] = set()  # calls inside which a NaN was made from an Inf no sublayer produced
    hooks = []
    for name, layer in layers:
        # keyword arguments are inputs too: `self.head(x=h)` with a NaN h must not make head look like the
        # layer that turned clean inputs into NaN
        def pre(_layer: Any, inputs: Any, kwargs: Any, _n: str = name) -> None:
            pending.setdefault(_n, []).append(tensors(inputs) + tensors(kwargs))
            running.append(_n)

        def post(_layer: Any, _inputs: Any, _kwargs: Any, outputs: Any, _n: str = name) -> None:
            ins = pending[_n].pop() if pending.get(_n) else []
            while running and running[-1] != _n:  # a sublayer that raised left its name behind
                running.pop()
            if running:
                running.pop()
            ts = tensors(outputs)
            nth = counts.get(_n, 0)
            counts[_n] = nth + 1
            made = worst(ts)
            # inputs matter only for a non-finite output (or an enclosing call under suspicion): one host
            # sync per call on a clean forward
            ins_kind = worst(ins) if made or _n in suspects else None
            raw_in = bool(made) and ins_kind is None and not all_finite(ins)
            parent = running[-1] if running else None
            out.calls.append(LayerCall(_n, nth, ins_kind, made, ts[0] if ts else None, parent=parent,
                                       masked_inputs=raw_in or ins_kind is not None))
            if made == NAN and ins_kind == INF and parent is not None:
                suspects.add(parent)
            return None

        hooks.append(pre_hook_with_kwargs(layer, pre))
        hooks.append(post_hook_with_kwargs(layer, post))
    try:
        with paddle.no_grad():
            out.loss = run()
    finally:
        for h in hooks:
            h.remove()
    return out


_UNSET = object()


class _LineTracer:
    """Records (bytes printed so far, file:line, the user's?) at each line the user's code or a library's
    runs (Paddle's own and nandoctor's are not traced)."""

    def __init__(self, base_dir: Path | None, size: Callable[[], int]) -> None:
        self.base = base_dir.resolve() if base_dir else None
        self.base_dir = base_dir
        self.size = size
        self.events: list[tuple[int, str, bool]] = []
        self.fallback: str | None = None  # the user's line that called into the span
        self.fallback_library: str | None = None  # ... and the library line inside it that did
        self._user: dict[str, bool] = {}
        self._library: dict[str, bool] = {}
        self._previous: Any = _UNSET
        self._frames: list[Any] = []
        self.active = False

    def is_user(self, file: str) -> bool:
        if file not in self._user:
            self._user[file] = not file.startswith("<") and is_user_file(Path(file), self.base)
        return self._user[file]

    def is_library(self, file: str) -> bool:
        if file not in self._library:
            self._library[file] = not self.is_user(file) and is_library_file(file, self.base)
        return self._library[file]

    def where(self, frame: Any) -> str:
        code = frame.f_code
        if not self.is_user(code.co_filename):
            return library_site(code.co_filename, frame.f_lineno, code.co_name)
        return f"{short_path(Path(code.co_filename), self.base_dir)}:{frame.f_lineno} in {code.co_name}"

    def traced(self, file: str) -> bool:
        return self.is_user(file) or self.is_library(file)

    def __call__(self, frame: Any, event: str, _arg: Any) -> Any:
        if not self.active or not self.traced(frame.f_code.co_filename):
            return None
        if event == "line":
            self.events.append((self.size(), self.where(frame), self.is_user(frame.f_code.co_filename)))
        return self

    def start(self) -> None:
        if self._previous is _UNSET:
            self._previous = sys.gettrace()  # a debugger's or coverage's tracer comes back on stop()
        sys.settrace(self)
        self.active = True
        frame = sys._getframe(1)
        while frame is not None:  # the frames already running (the user's loss code) trace from here on
            if self.traced(frame.f_code.co_filename) and frame.f_trace is None:
                frame.f_trace = self
                self._frames.append(frame)
            frame = frame.f_back

    def stop(self) -> None:
        self.active = False
        for frame in self._frames:
            frame.f_trace = None
        self._frames.clear()
        if self._previous is not _UNSET:
            sys.settrace(self._previous)
            self._previous = _UNSET

    def line_at(self, offset: int) -> str | None:
        """The user's line running when Paddle printed at `offset`; else the user's line that called into
        the library code that did (an nn.MultiHeadAttention's softmax: the line calling the encoder)."""
        found = self.fallback
        for size, where, user in self.events:
            if size > offset:
                break
            if user:
                found = where
        return found

    def library_at(self, offset: int) -> str | None:
        """The library line running when Paddle printed at `offset`, when a library's code ran inside the
        user's line then (None when the user's own line made the op)."""
        found = self.fallback_library
        for size, where, user in self.events:
            if size > offset:
                break
            found = None if user else where
        return found


def scoped_ops(model: Any, layers: dict[str, Any], target: LayerCall | None, run: Callable[[], Any],
               base_dir: Path | None) -> tuple[list[OpLine], _LineTracer]:
    """The checker's log lines for the ops of one call (`target`), or of what runs after the model's
    forward (target None: the loss), with a line tracer over the same span."""
    import paddle

    seen: dict[str, int] = {}
    hooks = []
    state: dict[str, Any] = {}

    def on() -> None:
        # the user's line that called into this span (and the library line inside it that did): the
        # fallback when the op is made in library code
        tracer = state["tracer"]
        if tracer.fallback is None and tracer.fallback_library is None:
            tracer.fallback, tracer.fallback_library = creation_lines(live_stack(sys._getframe(1)), base_dir)
        rng = paddle.get_rng_state()
        enable_checker(log_only=True)
        paddle.set_rng_state(rng)  # the checker reseeds: the rest of the step must see the step's RNG
        state["tracer"].start()

    def off() -> None:
        state["tracer"].stop()
        disable_checker()

    name = target.name if target is not None else ""
    layer = layers[name] if name else model

    def pre(_layer: Any, _inputs: Any) -> None:
        if target is None:
            return
        nth = seen.get(name, 0)
        seen[name] = nth + 1
        if nth == target.nth:
            on()

    def post(_layer: Any, _inputs: Any, _outputs: Any) -> None:
        if target is None:
            on()  # the loss: checked from the end of the model's forward on
        elif seen.get(name, 0) - 1 == target.nth:
            off()
        return None

    hooks.append(layer.register_forward_pre_hook(pre))
    hooks.append(layer.register_forward_post_hook(post))
    try:
        with capture_native_output() as native:
            state["tracer"] = _LineTracer(base_dir, native.size)
            try:
                with paddle.no_grad():
                    run()
            except Exception:  # noqa: BLE001 - the user's code may raise on NaN; what was logged still counts
                pass
            finally:
                off()
    finally:
        for h in hooks:
            h.remove()
    return logged_ops(native.text), state["tracer"]


def logged_ops(text: str) -> list[OpLine]:
    """The checker's `[PRECISION]` lines in the order Paddle printed them."""
    return [OpLine(m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4)), int(m.group(5)), m.group(6),
                   m.start()) for m in _LOG_RE.finditer(text)]


def pick(lines: list[OpLine], level: str | None, masks: bool = True) -> OpLine | None:
    """The op whose non-finite output is the fault (see the module docstring). `masks`: the span's inputs may
    carry a mask's -inf, so an Inf-making op's -inf there may be a mask's, not a fault."""
    first_nan = next((i for i, ln in enumerate(lines) if ln.nan), None)
    if first_nan is not None and level != INF:
        before = lines[:first_nan]
        overflow = next((ln for ln in before if ln.positive_inf), None)
        if overflow is not None:
            return overflow
        if not masks and not any(ln.mask_like for ln in before):
            made = next((ln for ln in before if ln.inf and ln.op in _INF_MAKERS), None)
            if made is not None:
                return made
        return lines[first_nan]
    return next((ln for ln in lines if ln.inf and not ln.mask_like), None)


def first_nan_op(lines: list[OpLine]) -> str | None:
    return next((ln.op for ln in lines if ln.nan), None)
