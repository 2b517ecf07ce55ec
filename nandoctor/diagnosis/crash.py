"""The user's code raised during the probe: where (step, phase, layer, file:line) and, for Paddle errors
we know, what in the data caused it (a label beyond the classes, an id beyond an embedding table).

The raw exception always becomes a `user_code.error`; a known Paddle error adds the data finding that
says which batch and samples to fix, because "IndexError in cross_entropy.cc:65" is not actionable at
2 a.m. and "batch 3, sample 5 has label 5 but the model has 5 classes" is.
"""

from __future__ import annotations

import inspect
import re
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

from nandoctor.advice import advice_for
from nandoctor.findings import Code, Finding, Location, Phase, Severity
from nandoctor.tensors.convert import to_numpy
from nandoctor.tensors.sizes import batch_size
from nandoctor.workload.entrypoints import library_origin, user_origin

_LABEL_RE = re.compile(r"label value should less than|received label value as|Expected lbl < axis_dim", re.I)
_EMBED_RE = re.compile(r"OP\(embedding\)|Expected ids\[i\] < row_number|lookup_table", re.I)


@dataclass
class CrashContext:
    """What the loop knows when the user's code raises."""

    step: int
    batch_index: int | None
    epoch: int
    phase: Phase  # where the loop was: data, forward (model+loss), backward, optimizer
    what: str  # "the model's forward pass and loss", "data.entry ...", ...


_LOADING = {"__next__", "__getitem__", "__getitems__", "__iter__", "_next_data", "fetch"}


def _frames(exc: BaseException) -> Iterator[FrameType]:
    """The frames the exception passed through, outermost first."""
    tb = exc.__traceback__
    while tb is not None:
        yield tb.tb_frame
        tb = tb.tb_next


def in_data_loading(exc: BaseException) -> bool:
    """Whether the exception came out of making a batch: a generator, a dataset's `__getitem__`, an
    iterator's `__next__`, or Paddle's DataLoader (paddle/io)."""
    for frame in _frames(exc):
        code = frame.f_code
        path = code.co_filename.replace("\\", "/")
        if (code.co_flags & inspect.CO_GENERATOR or code.co_name in _LOADING or "/paddle/io/" in path
                or "/paddle/fluid/dataloader/" in path):
            return True
    return False


def in_backward(exc: BaseException) -> bool:
    """Whether the exception came out of a `Tensor.backward()` call (Paddle's own frame on the traceback)."""
    return any(frame.f_code.co_name == "backward" and "paddle" in frame.f_code.co_filename.replace("\\", "/")
               for frame in _frames(exc))


def label_in_traceback(exc: BaseException) -> Any:
    """The `label` tensor of the Paddle loss function the exception came out of (F.cross_entropy raises on
    an out-of-range label there), else None: a user's own loop may name its label anything, Paddle does not."""
    paddle = sys.modules.get("paddle")
    if paddle is None:
        return None
    found = None
    for frame in _frames(exc):
        value = frame.f_locals.get("label")
        if isinstance(value, paddle.Tensor) and "paddle" in frame.f_code.co_filename:
            found = value
    return found


def innermost_layer(exc: BaseException, layer_ids: dict[int, str]) -> str | None:
    """The dotted name of the deepest model sublayer whose method is on the traceback, via `self`."""
    found = None
    for frame in _frames(exc):
        obj = frame.f_locals.get("self")
        if obj is not None and id(obj) in layer_ids:
            found = layer_ids[id(obj)]
    return found


def crash_findings(exc: BaseException, ctx: CrashContext, base_dir: Path, model: Any, layer_ids: dict[int, str],
                   fields: dict[str, Any] | None, label_name: str | None,
                   label_bounds: tuple[float, float] | None) -> tuple[list[Finding], Location]:
    """The findings for one exception and the location that becomes first_fault."""
    layer = innermost_layer(exc, layer_ids) if model is not None else None
    phase = ctx.phase
    if phase == Phase.FORWARD and layer is None:
        phase = Phase.LOSS  # raised outside the model: the loss function or the user's step code
    layer = layer or None  # "" is the model itself: forward, but outside every named sublayer
    origin = user_origin(exc, base_dir)
    library = library_origin(exc, base_dir)  # the library line that raised, inside the user's
    loc = Location(step=ctx.step, phase=phase, layer=layer, batch_index=ctx.batch_index)
    findings: list[Finding] = []
    text = str(exc)
    if fields and batch_size(fields) == 0:  # Paddle's errors on an empty batch name nullptrs, not the batch
        loc = Location(step=ctx.step, phase=Phase.DATA, batch_index=ctx.batch_index)
        findings.append(Finding(
            Code.DATA_EMPTY, Severity.ERROR,
            f"Batch {ctx.batch_index} (step {ctx.step}, epoch {ctx.epoch}) holds no sample at all, and training "
            f"raised on it ({type(exc).__name__}). A loader that filters samples left it empty: skip empty "
            "batches in the loader (or its collate function), or check drop_last and the filter.",
            loc, {"epoch": ctx.epoch, "batch_size": 0}, advice_for(Code.DATA_EMPTY.value)))
    elif fields is not None and _LABEL_RE.search(text):
        translated = _label_range(exc, ctx, loc, fields, label_name, label_bounds)
        if translated is not None:
            findings.append(translated)
            loc = translated.location
    elif fields is not None and _EMBED_RE.search(text) and model is not None:
        translated = _embedding(exc, ctx, loc, fields, model, layer)
        if translated is not None:
            findings.append(translated)
            loc = translated.location
    where = f" at {origin}" if origin else ""
    if library:
        where += f" (raised inside library code at {library})" if origin else f" in library code at {library}"
    in_layer = f" inside layer {layer}" if layer else ""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-8))
    findings.append(Finding(
        Code.USER_CODE_ERROR, Severity.ERROR,
        f"{ctx.what[:1].upper()}{ctx.what[1:]} raised {type(exc).__name__}{where}{in_layer} at step {ctx.step}"
        f"{_batch_text(ctx)}: {first_line(text)}. Training stopped there; open "
        f"{origin or 'the traceback in the evidence'} and fix it.",
        Location(step=ctx.step, phase=phase, layer=layer, batch_index=ctx.batch_index),
        {"exception": type(exc).__name__, "error": text[:2000], "origin": origin, "library_origin": library,
         "what": ctx.what,
         "epoch": ctx.epoch, "traceback": tb.splitlines()[-40:]},
        advice_for(Code.USER_CODE_ERROR.value)))
    return findings, loc


def _batch_text(ctx: CrashContext) -> str:
    if ctx.batch_index is None:
        return ""
    return f" (batch {ctx.batch_index} of epoch {ctx.epoch})"


def first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else "(no message)"
    return line[:300].rstrip(". ")


def _label_range(exc: BaseException, ctx: CrashContext, loc: Location, fields: dict[str, Any],
                 label_name: str | None, bounds: tuple[float, float] | None) -> Finding | None:
    """cross_entropy's OutOfRange -> which samples hold which labels, against how many classes."""
    if label_name is None or label_name not in fields:
        return None
    labels = to_numpy(fields[label_name])
    if labels is None:
        return None
    flat = labels.reshape(labels.shape[0], -1) if labels.ndim > 0 else labels.reshape(1, 1)
    m = re.search(r"axis dimension is (\d+)|axis_dim_:(\d+)", str(exc))
    source = "the checks in the spec"
    if bounds is None and m:
        n = int(m.group(1) or m.group(2))
        bounds = (0, n - 1)
        source = f"the width of the model's output ({n})"
    if bounds is None:
        return None
    low, high = bounds
    bad = ((flat < low) | (flat > high)) & (flat != -100)
    rows = sorted(int(i) for i in np.where(bad.any(axis=1))[0])
    if not rows:
        return None
    values = sorted({int(v) for v in flat[bad].tolist()})[:10]
    loc = Location(step=ctx.step, phase=Phase.DATA, layer=None, batch_index=ctx.batch_index,
                   sample_indices=rows, field=label_name)
    return Finding(
        Code.DATA_LABEL_RANGE, Severity.ERROR,
        f"Batch {ctx.batch_index} (step {ctx.step}) has label(s) {values} in field '{label_name}' at sample(s) "
        f"{rows[:20]}, outside [{int(low)}, {int(high)}] ({source}); cross_entropy raised on them. Fix the label "
        f"mapping or size the model's head for {int(max(values)) + 1} classes.",
        loc, {"bad_labels": values, "bounds": [low, high], "bounds_from": source, "epoch": ctx.epoch},
        advice_for(Code.DATA_LABEL_RANGE.value))


def _embedding(exc: BaseException, ctx: CrashContext, loc: Location, fields: dict[str, Any], model: Any,
               layer: str | None) -> Finding | None:
    """An id beyond an nn.Embedding table: a position table means too long a sequence, else an id range."""
    import paddle

    target = None
    if layer is not None:
        sub = dict(model.named_sublayers()).get(layer)
        if isinstance(sub, paddle.nn.Embedding):
            target = (layer, sub)
    if target is None:
        return None
    name, emb = target
    rows_in_table = int(emb.weight.shape[0])
    m = re.search(r"ids\[i\]:(-?\d+)", str(exc)) or re.search(r"but got (-?\d+)", str(exc))
    got = int(m.group(1)) if m else None
    is_position = "pos" in name.lower()
    code = Code.DATA_SEQ_LEN if is_position else Code.DATA_RANGE
    samples, field = _rows_beyond(fields, rows_in_table) if not is_position else (None, None)
    if is_position:
        shapes = [_shape(v) for v in fields.values()]  # (shapes only: no copy of a tensor field, let alone three)
        lengths = [int(shape[1]) for shape in shapes if shape is not None and len(shape) >= 2]
        if lengths:
            held = f"sequences of length {max(lengths)}"
        else:  # the batch is not known here (a user's loop): the position id that raised says enough
            held = f"a sequence longer than {rows_in_table} (position id {got})" if got is not None else \
                f"a sequence longer than {rows_in_table}"
        message = (f"Batch {ctx.batch_index} (step {ctx.step}) holds {held}, but the position table {name} has "
                   f"{rows_in_table} rows; the embedding lookup raised. Truncate to {rows_in_table} tokens or "
                   f"enlarge {name}.")
    else:
        message = (f"Batch {ctx.batch_index} (step {ctx.step}) holds id {got} in field '{field}' at sample(s) "
                   f"{(samples or [])[:20]}, but embedding {name} has {rows_in_table} rows (ids 0..{rows_in_table - 1})"
                   "; the lookup raised. Fix the vocabulary/id mapping or enlarge the table.")
    loc = Location(step=ctx.step, phase=Phase.DATA, layer=name, batch_index=ctx.batch_index, sample_indices=samples,
                   field=field)
    return Finding(code, Severity.ERROR, message, loc,
                   {"table_rows": rows_in_table, "id": got, "epoch": ctx.epoch}, advice_for(code.value))


def _rows_beyond(fields: dict[str, Any], rows: int) -> tuple[list[int] | None, str | None]:
    """The first integer field holding ids >= rows (or < 0), and which samples hold them."""
    import paddle

    for key, value in fields.items():
        if isinstance(value, paddle.Tensor) and not paddle.is_integer(value):
            continue  # (an image batch is not copied to the host to learn that it holds no ids)
        arr = to_numpy(value)
        if arr is None or arr.dtype.kind not in "iu" or arr.ndim == 0:
            continue
        bad = ((arr >= rows) | (arr < 0)).reshape(arr.shape[0], -1).any(axis=1)
        if bad.any():
            return sorted(int(i) for i in np.where(bad)[0]), str(key)
    return None, None


def _shape(value: Any) -> tuple[int, ...] | None:
    """A field's shape, read without copying an array or tensor (a list is converted)."""
    shape = getattr(value, "shape", None)
    if shape is not None:
        return tuple(int(d) for d in shape)
    arr = to_numpy(value)
    return None if arr is None else arr.shape
