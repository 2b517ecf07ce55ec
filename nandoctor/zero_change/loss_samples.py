"""The samples of a loss-code fault under `nandoctor run`, from the checked pass (recheck.py).

The first pass cannot call the user's loss code again: it sees only the model's outputs and the gradient
that came back to them, and a NaN row there is not proof that the sample is a cause (a loss that mixes the
rows spreads one sample's NaN to others). The checked pass re-runs the script to the faulting step, where
the loss code runs once more: the calls of functions of the user's code that receive the model's output (or
one of its tensors) are caught with their arguments (`LossCall`). The first of them whose replay on the whole
batch, through the model, faults again is the loss function (a helper that only picks the output, called
first, does not). The batch is then bisected as the probe bisects it (diagnosis/samples.py), each part
replayed through the model and that function: a sample is named only when it faults alone and the rest of
the batch without it does not.

When the loss is not such a function (written inline in the loop, or given only a tensor derived from the
output), or no replay on the whole batch faults, no sample is named, and the reason says why.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

from nandoctor.tensors.sizes import leading_dim
from nandoctor.workload.entrypoints import is_user_path
from nandoctor.zero_change.capture import ROW

_WHOLE = -1  # the loss function took the model's whole output (else the position of the tensor it took)
_MAX_CANDIDATES = 8


class Candidate:
    """A function of the user's called with the model's output: the loss, if its replay faults."""

    def __init__(self, fn: Any, arguments: dict[str, Any], outputs: dict[str, int]) -> None:
        # outputs: the arguments that are the model's output or one of its tensors (`outputs.logits`): name ->
        # _WHOLE or the tensor's position among the output's leaves; a part's own output goes there
        self.fn, self.arguments, self.outputs = fn, arguments, outputs

    def where(self) -> str:
        from nandoctor.workload.entrypoints import short_path

        code = self.fn.__code__
        return f"{short_path(Path(code.co_filename), Path.cwd())}:{code.co_firstlineno} in {code.co_name}"


class LossCall:
    """The model's call at the faulting step and the user's function its output went to (the loss)."""

    def __init__(self, model: Any, args: tuple, kwargs: dict, out: Any) -> None:
        import paddle

        self.model, self.args, self.kwargs, self.out = model, tuple(args), dict(kwargs or {}), out
        self.rng = paddle.get_rng_state()
        self.candidates: list[Candidate] = []
        self._leaves = [out] + list(_leaves(out))

    def start(self) -> None:
        sys.setprofile(self._profile)

    def stop(self) -> None:
        sys.setprofile(None)

    def _profile(self, frame: Any, event: str, _arg: Any) -> None:
        """A Python call of the user's code that takes the model's output (or one of its tensors)."""
        if event != "call" or not is_user_path(frame.f_code.co_filename):
            return
        code = frame.f_code
        names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
        values = frame.f_locals
        outputs = {n: i - 1 for n in names for i, leaf in enumerate(self._leaves) if values.get(n) is leaf}
        if not outputs or code.co_posonlyargcount or any(c.fn.__code__ is code for c in self.candidates):
            return
        fn = _function_of(frame)
        if fn is not None:
            self.candidates.append(Candidate(fn, {n: values[n] for n in names}, outputs))
        if len(self.candidates) >= _MAX_CANDIDATES:
            self.stop()


def _function_of(frame: Any) -> Any:
    """The function object running in `frame` (a module's function, a method, or a closure)."""
    code = frame.f_code
    found = frame.f_globals.get(code.co_name)
    if getattr(found, "__code__", None) is code:
        return found
    owner = frame.f_locals.get("self")
    method = getattr(type(owner), code.co_name, None) if owner is not None else None
    if getattr(method, "__code__", None) is code:
        return method
    return next((f for f in gc.get_referrers(code) if getattr(f, "__code__", None) is code), None)


class _Replay:
    """What diagnosis/samples.find_samples replays: the model on part of the batch, then the loss function on
    its output and the matching rows of the loss function's other batch-sized arguments."""

    def __init__(self, call: LossCall, fn: Candidate) -> None:
        self.call, self.fn = call, fn
        self.params = [(n, p) for n, p in call.model.named_parameters() if not p.stop_gradient]
        self.const: dict[str, Any] = {}

    def fields(self) -> dict[str, Any] | None:
        """The batch as fields: the model's inputs and the loss function's arguments that have a row per
        sample, and the sample positions; the other arguments stay whole (`const`)."""
        import paddle

        from nandoctor.tensors.sizes import batch_size

        c = self.call
        every: dict[str, Any] = {f"input{i}": a for i, a in enumerate(c.args)}
        every.update({f"kw:{k}": v for k, v in c.kwargs.items()})
        n = batch_size({k: v for k, v in every.items() if isinstance(v, paddle.Tensor)})
        if n is None:
            return None
        every.update({f"arg:{k}": v for k, v in self.fn.arguments.items() if k not in self.fn.outputs})
        fields = {k: v for k, v in every.items() if leading_dim(v) == n}
        self.const = {k: v for k, v in every.items() if k not in fields}
        fields[ROW] = paddle.arange(n, dtype="int64")
        return fields

    def reset_rng(self) -> None:
        import paddle

        paddle.set_rng_state(self.call.rng)

    def loss(self, fields: dict[str, Any]) -> Any:
        c, f = self.call, self.fn

        def value(key: str) -> Any:
            return fields[key] if key in fields else self.const[key]

        out = c.model(*[value(f"input{i}") for i in range(len(c.args))], **{k: value(f"kw:{k}") for k in c.kwargs})
        parts = _leaves(out)

        def argument(name: str) -> Any:
            if name not in f.outputs:
                return value(f"arg:{name}")
            i = f.outputs[name]
            return out if i == _WHOLE else parts[i]

        return f.fn(**{k: argument(k) for k in f.arguments})

    def clear(self) -> None:
        for _, p in self.params:
            p.clear_gradient(False)


def _leaves(out: Any) -> list[Any]:
    from nandoctor.tensors.convert import leaves

    return list(leaves(out))



def loss_samples(call: LossCall | None) -> dict[str, Any]:
    """{"samples", "scope", "reason", "notes", "function"} from the bisection through the first caught
    function whose replay of the whole batch faults, or {"samples": None, "why": ...} when none can be
    replayed on part of the batch."""
    from nandoctor.diagnosis.samples import find_samples
    from nandoctor.engine.checker import disable_checker

    if call is None or not call.candidates:
        return {"samples": None, "why": "inline"}
    disable_checker()
    why = "no_batch"
    for candidate in call.candidates:
        replay = _Replay(call, candidate)
        fields = replay.fields()
        if fields is None:
            continue
        if not _faults(replay, fields, list(range(int(fields[ROW].shape[0])))):
            why = "not_reproduced"
            continue
        bis = find_samples(replay, fields, "backward")
        return {"samples": bis.samples, "scope": bis.scope, "reason": bis.reason, "notes": list(bis.notes),
                "function": candidate.where()}
    return {"samples": None, "why": why, "function": ", ".join(c.where() for c in call.candidates)}


def _faults(replay: _Replay, fields: dict[str, Any], rows: list[int]) -> bool:
    """Whether the replay of these rows makes a NaN/Inf loss or parameter gradient (the whole batch must)."""
    import paddle

    from nandoctor.tensors.sizes import subset

    replay.reset_rng()
    try:
        loss = replay.loss(subset(fields, rows))
        if not bool(paddle.isfinite(loss.detach()).all()):
            return True
        loss.backward()
        return any(p.grad is not None and not bool(paddle.isfinite(p.grad).all()) for _, p in replay.params)
    except Exception:  # noqa: BLE001 - a function that is not the loss (it returns no tensor) reproduces nothing
        return False
    finally:
        replay.clear()
