"""The user's own batch <-> the named fields the probe's checks and replays work on.

A user's loop hands `check()` whatever its loader yields: a tuple, a list, a dict or one tensor. The
watcher, the bundle and the sample bisection need named fields; a replay through the user's `step_fn`
needs the batch back in the user's own shape (a subset of it, for the bisection). Both directions are
here, so the names a report shows are the ones the user would write.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nandoctor.workload.batches import default_field_names


def to_fields(batch: Any, names: Sequence[str] | None = None) -> tuple[dict[str, Any], Callable[[dict], Any]]:
    """Named fields of `batch` and the function that rebuilds a batch of the same shape from fields."""
    if batch is None:
        return {}, lambda fields: None
    if isinstance(batch, Mapping):
        kind = type(batch)

        def rebuild_map(fields: dict[str, Any]) -> Any:
            try:
                return kind(fields)
            except TypeError:  # a mapping class that cannot be built from a dict: a plain dict will do
                return dict(fields)

        return dict(batch), rebuild_map
    if isinstance(batch, (tuple, list)):
        keys, rebuild_seq = _sequence_layout(type(batch), len(batch), names)
        return dict(zip(keys, batch)), rebuild_seq
    key = names[0] if names else "x"
    return {key: batch}, lambda fields: fields[key]


def _sequence_layout(seq: type, length: int, names: Sequence[str] | None
                     ) -> tuple[list[str], Callable[[dict], Any]]:
    """The field names of a tuple or list batch of this type and length, and its rebuild."""
    keys = list(names) if names is not None and len(names) == length else default_field_names(length)

    def rebuild_seq(fields: dict[str, Any]) -> Any:
        values = [fields[k] for k in keys]
        return seq(values) if seq in (tuple, list) else tuple(values)

    return keys, rebuild_seq


class FieldNamer:
    """`to_fields` for one watch, every step: a plain tuple or list batch's names and rebuild are decided
    once for its type and length (on a 0.3 ms step, building them anew was ~1% of the step), and the
    latest layout is tried first (a loader's batches keep theirs)."""

    def __init__(self, names: Sequence[str] | None) -> None:
        self.names = names
        self._layouts: dict[tuple[type, int], tuple[list[str], Callable[[dict], Any]]] = {}
        self._last: tuple[type, int, list[str], Callable[[dict], Any]] = (type(None), -1, [], lambda f: None)

    def __call__(self, batch: Any) -> tuple[dict[str, Any], Callable[[dict], Any]]:
        kind = type(batch)
        if kind is not tuple and kind is not list:
            return to_fields(batch, self.names)
        last_kind, last_len, keys, rebuild = self._last
        if kind is not last_kind or len(batch) != last_len:
            layout = self._layouts.get((kind, len(batch)))
            if layout is None:
                layout = self._layouts[(kind, len(batch))] = _sequence_layout(kind, len(batch), self.names)
            keys, rebuild = layout
            self._last = (kind, len(batch), keys, rebuild)
        return dict(zip(keys, batch)), rebuild
