"""The user's own batch <-> the named fields the probe's checks and replays work on.

A user's loop hands `check()` whatever its loader yields: a tuple, a list, a dict or one tensor. The
watcher, the bundle and the sample bisection need named fields; a replay through the user's `step_fn`
needs the batch back in the user's own shape (a subset of it, for the bisection). Both directions are
here, so the names a report shows are the ones the user would write.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from nandoctor.batches import default_field_names


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
        keys = list(names) if names is not None and len(names) == len(batch) else default_field_names(len(batch))
        seq = type(batch)

        def rebuild_seq(fields: dict[str, Any]) -> Any:
            values = [fields[k] for k in keys]
            return seq(values) if seq in (tuple, list) else tuple(values)

        return dict(zip(keys, batch)), rebuild_seq
    key = names[0] if names else "x"
    return {key: batch}, lambda fields: fields[key]
