"""Whatever the user's loader yields -> named fields, the model's inputs and the label.

Batches come as a single tensor, a tuple/list (named by `data.fields`) or a dict (its own keys); the
values as Paddle tensors or numpy arrays. Naming happens once here so that every finding can say
"batch 3, sample 7, field 'x'" in the user's own words.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nandoctor.errors import SpecError
from nandoctor.spec import DataSpec


def default_field_names(n: int) -> list[str]:
    """Names for an unnamed tuple batch: (x, label) for the common pair, x0..xN otherwise."""
    if n == 1:
        return ["x"]
    if n == 2:
        return ["x", "label"]
    return [f"x{i}" for i in range(n)]


@dataclass
class BatchLayout:
    """How to read a batch: resolved once from the spec and the first batch, then reused."""

    data: DataSpec
    where: str  # "config.yaml" for messages
    # tuple/list batch length -> its names, once a batch of that length passed the checks below (they depend
    # on the length alone): a 0.3 ms step pays for naming its batch, not for re-deciding it
    _named: dict[int, tuple[str, ...]] = field(default_factory=dict, init=False, repr=False, compare=False)

    def fields(self, batch: Any, batch_index: int) -> dict[str, Any]:
        """Name the parts of a batch; a mismatch with `data.fields` is a SpecError naming the batch."""
        kind = type(batch)
        if kind is tuple or kind is list:
            names = self._named.get(len(batch))
            if names is not None:
                return dict(zip(names, batch))
        out = self._fields(batch, batch_index)
        if (kind is tuple or kind is list) and len(out) == len(batch):  # (repeated names: never cached)
            self._named[len(batch)] = tuple(out)
        return out

    def _fields(self, batch: Any, batch_index: int) -> dict[str, Any]:
        if isinstance(batch, Mapping):
            out = dict(batch)
            if self.data.fields is not None:
                missing = [f for f in self.data.fields if f not in out]
                if missing:
                    raise SpecError(f"{self.where}: `data.fields` names {missing}, but batch {batch_index} is a "
                                    f"dict with keys {list(out)}. Dict batches keep their own keys: drop "
                                    "`data.fields` or use those keys.")
        elif isinstance(batch, (tuple, list)):
            names = self.data.fields or default_field_names(len(batch))
            if len(names) != len(batch):
                raise SpecError(f"{self.where}: `data.fields` names {len(names)} fields {names}, but batch "
                                f"{batch_index} from {self.data.entry} has {len(batch)} parts. List one name "
                                "per part, in order.")
            out = dict(zip(names, batch))
        else:
            names = self.data.fields or ["x"]
            if len(names) != 1:
                raise SpecError(f"{self.where}: `data.fields` names {names}, but batch {batch_index} is a single "
                                f"{type(batch).__name__}, not a tuple or dict.")
            out = {names[0]: batch}
        for key in [self.data.label, *self.input_fields()]:
            if key is not None and key not in out:
                which = "data.label" if key == self.data.label else "data.inputs"
                raise SpecError(f"{self.where}: `{which}` names field '{key}', but batch {batch_index} has "
                                f"fields {list(out)}.")
        return out

    def input_fields(self) -> list[str]:
        """The field names `data.inputs` gives (the values of a keyword mapping); [] when not given."""
        inputs = self.data.inputs
        if isinstance(inputs, dict):
            return list(inputs.values())
        return list(inputs or [])

    def model_call(self, fields: Mapping[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        """(positional, keyword) arguments for the model: keyword when `data.inputs` is a mapping."""
        if isinstance(self.data.inputs, dict):
            return [], {arg: fields[name] for arg, name in self.data.inputs.items()}
        return self.inputs(fields), {}

    def check_model_inputs(self, fields: Mapping[str, Any]) -> None:
        """A text or ragged field among the model's inputs is a SpecError naming it and `data.inputs`."""
        names = self.input_fields() if self.data.inputs is not None else self.input_names(fields)
        for name in names:
            why = not_a_tensor(fields.get(name))
            if why is None:
                continue
            if self.data.inputs is None:
                now = (f"`data.inputs` is not set, so every field but the label goes to the model: "
                       f"{self.input_names(fields)}; list the ones it takes, e.g. `inputs: "
                       f"[{', '.join(n for n in self.input_names(fields) if n != name) or 'input_ids'}]`")
            else:
                now = f"`data.inputs` passes it to the model ({self.data.inputs})"
            raise SpecError(f"{self.where}: field '{name}' holds {why}, which cannot be turned into a tensor for "
                            f"the model; {now}. Tokenize it in your collate_fn (ids as a padded array), or leave "
                            "it out of `data.inputs`.")

    def label_name(self, fields: Mapping[str, Any]) -> str | None:
        if self.data.label is not None:
            return self.data.label
        return "label" if "label" in fields else None

    def input_names(self, fields: Mapping[str, Any]) -> list[str]:
        if self.data.inputs is not None:
            return self.input_fields()
        label = self.label_name(fields)
        return [k for k in fields if k != label]

    def inputs(self, fields: Mapping[str, Any]) -> list[Any]:
        return [fields[k] for k in self.input_names(fields)]

    def label(self, fields: Mapping[str, Any]) -> Any:
        name = self.label_name(fields)
        return None if name is None else fields[name]


def not_a_tensor(value: Any) -> str | None:
    """Why a field cannot become a tensor (text, ragged lists), or None when it can."""
    if isinstance(value, (str, bytes)):
        return "text (a str)"
    if isinstance(value, np.ndarray):
        return f"text (a numpy array of dtype {value.dtype})" if value.dtype.kind in "OSU" else None
    if not isinstance(value, (list, tuple)):
        return None
    if any(isinstance(v, (str, bytes)) for v in value):
        return "text (a list of str)"
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError):
        return "a ragged list (rows of different lengths)"
    if arr.dtype.kind in "SU":
        return "text (a nested list of str)"
    if arr.dtype.kind == "O":
        return "a ragged list (rows of different lengths)"
    return None


def to_numpy(value: Any) -> np.ndarray | None:
    """A field as a numpy array (no copy for numpy); None for things that are not array-like."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "numpy") and callable(value.numpy):
        if str(getattr(value, "dtype", "")) == "paddle.bfloat16":  # its numpy() is raw uint16 bits
            value = value.astype("float32")
        return np.asarray(value.numpy())
    if isinstance(value, (int, float, bool, list, tuple)):
        try:
            return np.asarray(value)
        except (ValueError, TypeError):
            return None
    return None


# A batch is checked for NaN/Inf this many values at a time: the check's temporaries (boolean masks, a
# tensor's rows copied to the host) stay a few MB whatever the batch, not a copy of a 100 MB batch.
CHECK_CHUNK = 1 << 18


def row_chunks(value: Any) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, rows as a 2-D array) of an array or tensor with a first axis, a few MB at a time: a numpy
    array's rows are views, a tensor's are copied to the host one chunk at a time (never the whole tensor)."""
    shape = tuple(getattr(value, "shape", ()))
    n = int(shape[0])
    per_row = max(1, int(np.prod(shape[1:], dtype=np.int64)))
    step = max(1, CHECK_CHUNK // per_row)
    for start in range(0, n, step):
        part = value[start:start + step]
        if not isinstance(part, np.ndarray):
            # a tensor's slice is a view, and numpy() of a view copies the whole tensor (Paddle 3.3, 64 MB
            # for each 4 MB slice of a 4096 x 4096 gradient): a compact copy of the slice first
            clone = getattr(part, "clone", None)
            part = to_numpy(clone() if callable(clone) else part)
        yield start, part.reshape(part.shape[0], -1)


def _float_rows(value: Any) -> bool:
    """Whether `value` is an array or tensor of floats with a first axis (what the row checks read)."""
    if isinstance(value, np.ndarray):
        return value.dtype.kind in "fc" and value.ndim > 0 and value.size > 0
    shape = getattr(value, "shape", None)
    if shape is None or not hasattr(value, "numpy") or len(shape) == 0 or 0 in shape:
        return False
    from nandoctor.probe.monitors import float_dtypes

    return value.dtype in float_dtypes()


def _integer_tensor(value: Any) -> bool:
    """A tensor (not a numpy array) of integers or booleans: it cannot hold NaN/Inf."""
    if isinstance(value, np.ndarray) or not hasattr(value, "numpy"):
        return False
    dtype = str(getattr(value, "dtype", ""))
    return bool(dtype) and "float" not in dtype and "complex" not in dtype


def nonfinite_rows(value: Any) -> list[int]:
    """Positions along the first axis that hold a NaN or Inf (a batch's samples, a weight's rows); [0] for
    a non-finite scalar; [] for anything that is not array-like. Read a chunk of rows at a time."""
    if not _float_rows(value):  # a scalar, a list, a complex tensor: as numpy
        if _integer_tensor(value):
            return []  # (ids, labels, masks: no copy to learn they hold no NaN)
        value = to_numpy(value)
        if value is None or value.dtype.kind not in "fc" or value.size == 0:
            return []
        if value.ndim == 0:
            return [0] if not np.isfinite(value) else []
    out: list[int] = []
    for start, rows in row_chunks(value):
        bad = ~np.isfinite(rows).all(axis=1)
        out += (np.flatnonzero(bad) + start).tolist()
    return out


def nonfinite_count(value: Any) -> int:
    """How many NaN/Inf values an array or tensor holds, a chunk of rows at a time."""
    if len(getattr(value, "shape", ())) == 0 or not _float_rows(value):
        if _integer_tensor(value):
            return 0
        arr = to_numpy(value)
        return int((~np.isfinite(arr)).sum()) if arr is not None and arr.dtype.kind in "fc" else 0
    return sum(int((~np.isfinite(rows)).sum()) for _, rows in row_chunks(value))


def harmful_rows(value: Any) -> list[int]:
    """Like `nonfinite_rows`, but an additive attention mask's intended -inf does not count: in a field
    whose finite values are all 0 or <= -1e30 (the rule `probe.origin.kind` applies to a model's own
    masks), only NaN and +inf are harmful. A user's batch may carry such a mask on purpose. A chunk of
    rows at a time: a healthy chunk costs one finiteness test, and nothing the size of the batch is made."""
    if not _float_rows(value) or getattr(value.dtype, "kind", "f") == "c":  # (a tensor's dtype has no kind)
        return nonfinite_rows(value)
    nonfinite: list[int] = []  # rows with any NaN/Inf
    harmful: list[int] = []  # rows with a NaN or +inf
    mask_like = True  # every finite value so far is 0 or <= -1e30
    for start, rows in row_chunks(value):
        finite = np.isfinite(rows)
        if finite.all():
            if mask_like:
                mask_like = bool(((rows == 0) | (rows <= -1e30)).all())
            continue
        bad_rows = np.flatnonzero(~finite.all(axis=1))
        nonfinite += (bad_rows + start).tolist()
        sub = rows[bad_rows]  # only the rows holding a NaN/Inf: few, and small
        harmful += (bad_rows[(np.isnan(sub) | (sub == np.inf)).any(axis=1)] + start).tolist()
        if mask_like:
            with np.errstate(invalid="ignore"):
                mask_like = bool(((rows == 0) | (rows <= -1e30) | ~finite).all())
    return harmful if mask_like else nonfinite


def harmful_values(values: np.ndarray, finite: np.ndarray) -> np.ndarray:
    """Where float `values` (with `finite = np.isfinite(values)`) hold a harmful NaN/Inf: every non-finite
    value, but -inf only when the finite ones are not an additive mask's (all 0, or <= -1e30 as
    finfo.min-style fills are). (No copy of the finite values: boolean masks only.)"""
    bad = ~finite
    with np.errstate(invalid="ignore"):
        mask_like = bool(((values == 0) | (values <= -1e30) | bad).all())
    if mask_like:
        bad &= values != -np.inf
    return bad


def harmful_fields(fields: dict[str, Any] | None) -> dict[str, list[int]]:
    """Field -> the samples holding a harmful NaN/Inf (`harmful_rows`), for the fields that have any."""
    rows = {k: harmful_rows(v) for k, v in (fields or {}).items()}
    return {k: r for k, r in rows.items() if r}


def to_tensor(value: Any) -> Any:
    """Numpy arrays and Python numbers -> Paddle tensors on the current device; tensors pass through."""
    import paddle

    if isinstance(value, paddle.Tensor):
        return value
    if isinstance(value, np.ndarray) or isinstance(value, (int, float, list)):
        return paddle.to_tensor(value)
    return value


def batch_size(fields: Mapping[str, Any]) -> int | None:
    """The leading dimension shared by the array fields, or None when they disagree or have none."""
    sizes = set()
    for value in fields.values():
        shape = getattr(value, "shape", None)
        if shape is not None and len(shape) > 0:
            sizes.add(int(shape[0]))
    return sizes.pop() if len(sizes) == 1 else None


def take(value: Any, indices: list[int]) -> Any:
    """Rows `indices` of a field, keeping its type (tensor or array); other values pass through."""
    import paddle

    if isinstance(value, paddle.Tensor):
        return paddle.gather(value, paddle.to_tensor(indices, dtype="int64"), axis=0)
    if isinstance(value, np.ndarray):
        return value[indices]
    return value


def subset(fields: Mapping[str, Any], indices: list[int]) -> dict[str, Any]:
    """The same batch restricted to some samples; fields without a batch dimension are kept whole."""
    n = batch_size(fields)
    out = {}
    for k, v in fields.items():
        shape = getattr(v, "shape", None)
        out[k] = take(v, indices) if shape is not None and len(shape) > 0 and int(shape[0]) == n else v
    return out
