"""What scan and probe capture at a fault so a bundle can replay it: batch, model state, RNG state.

Captured only when a fault is found (a copy of one batch and one state dict), so a healthy run pays
nothing. Everything is copied to numpy at capture time: the user's loader may reuse its buffers and the
model keeps training (or is torn down) after the capture. The result goes into `Report.artifacts`,
which stays with the report (a large batch field in a temporary file, mapped back) and never enters the
JSON; `report/bundle.py` writes it to disk.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from nandoctor.tensors.convert import to_numpy

# A captured field this large waits for the bundle in a temporary file, not in memory (`_kept`)
SPILL_BYTES = 16 * 2**20


def batch_arrays(fields: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Each field as its own numpy copy; fields that are not arrays (strings, objects) are left out. A
    Paddle tensor's `numpy()` is already a copy of its own: copied once, not twice (a 100 MB batch)."""
    out: dict[str, np.ndarray] = {}
    for name, value in fields.items():
        array = to_numpy(value)
        if array is not None and array.dtype != object:
            out[str(name)] = _kept(array, copy=isinstance(value, np.ndarray))
    return out


def _kept(array: np.ndarray, *, copy: bool) -> np.ndarray:
    """The capture's own copy of a field. A large one is written to a temporary file at once and mapped back
    read-only (the file unlinked right away: its space goes with the mapping, whatever ends the process), so
    a 100 MB batch is not held in memory through the localisation and every replay until the bundle is
    written (issue 22: it was a second extra batch beside a replay's). With no room on disk, in memory."""
    if array.nbytes < SPILL_BYTES:
        return np.array(array, copy=True) if copy else array
    try:
        fd, path = tempfile.mkstemp(prefix="nandoctor-batch-", suffix=".npy")
        try:
            with os.fdopen(fd, "wb") as f:
                np.save(f, array, allow_pickle=False)  # written from the array itself: no copy in memory
            return np.load(path, mmap_mode="r")
        finally:
            os.unlink(path)
    except (OSError, ValueError):
        return np.array(array, copy=True) if copy else array


def model_state(model: Any) -> dict[str, np.ndarray]:
    """{name: array} of `model.state_dict()` (parameters and buffers, the names users know). `numpy()` is a
    copy of its own, one tensor at a time; a large one waits for the bundle on disk (`_kept`): a copy of the
    whole model held through every replay was the model's size beside the snapshots."""
    return {name: _kept(value.numpy(), copy=False) for name, value in model.state_dict().items()}


def rng_state() -> Any:
    """Paddle's generator states; None if this Paddle cannot give them (bundles store them via `rng_state_json`)."""
    try:
        import paddle

        return paddle.get_rng_state()
    except Exception:  # noqa: BLE001 - an RNG state is a nicety for dropout; never fail a run over it
        return None


# Set in `report.artifacts` (to False) when no bundle or report folder will be written (a probe without
# --bundle): then nothing is copied, which for a large model or large batches is a copy of each.
WANTED = "wanted"


def capture(report: Any, fields: Mapping[str, Any], *, step: int | None, batch_index: int | None,
            model: Any = None, rng: Any = None) -> None:
    """Store the fault's material in `report.artifacts`, once: the first fault wins."""
    if report.artifacts.get("batch") is not None or report.artifacts.get(WANTED) is False:
        return
    report.artifacts["batch"] = batch_arrays(fields)
    report.artifacts["batch_left_out"] = [str(name) for name in fields if str(name) not in report.artifacts["batch"]]
    report.artifacts["step"] = step
    report.artifacts["batch_index"] = batch_index
    if model is not None:
        try:
            report.artifacts["model_state"] = model_state(model)
        except Exception:  # noqa: BLE001 - a model whose state cannot be read still gets a bundle
            pass
    if rng is not None:
        report.artifacts["rng_state"] = rng


RNG_FORMAT = "paddle.GeneratorState/1"


def rng_state_json(states: Any) -> dict[str, Any] | None:
    """Paddle's generator states as plain JSON data (no pickle), or None when they do not reduce to numbers.

    A GeneratorState pickles through `__getstate__()`, a tuple of ints and a list of ints (device, seed,
    offset, the engine's text state); reproduce.py rebuilds it with `GeneratorState.__setstate__`.
    """
    try:
        out = [_plain(state.__getstate__()) for state in states]
    except (AttributeError, TypeError, ValueError):
        return None
    return {"format": RNG_FORMAT, "states": out}


def _plain(value: Any) -> Any:
    if isinstance(value, bool) or value is None:
        raise TypeError("not an RNG number")
    if isinstance(value, int):
        return value
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    raise TypeError(f"{type(value).__name__} in an RNG state")
