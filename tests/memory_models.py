"""A workload whose loader tells the test which of its batches are still alive (tests/test_memory_bounded.py).

Imported by the spec as a module (`memory_models:...`), so the probe's loader and the test share one
`ALIVE` registry: every array the loader yields is registered there until it is garbage.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import numpy as np
from paddle import nn

ALIVE: dict[int, int] = {}  # id of a yielded x array -> its batch index, while it lives
# (phase, batch index, ids alive, the batch indices of those) each time a batch is made
DRAWS: list[tuple[str, int, frozenset[int], list[int]]] = []
PHASE = ["loop"]  # set by the test's progress callback: "loop" or "replays"


def build_model() -> nn.Layer:
    # Tanh, not ReLU: a CPU ReLU turns the NaN into 0 and the loss would stay finite
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))


def build_loader(batches: int = 12, fault_at: int = 5) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Fresh arrays each batch; sample 3 of batch `fault_at` holds a NaN (drop_samples fixes it)."""
    rng = np.random.default_rng(0)
    for i in range(batches):
        x = rng.normal(size=(16, 8)).astype(np.float32)
        if i == fault_at:
            x[3, 2] = np.nan
        weakref.finalize(x, ALIVE.pop, id(x), None)
        ALIVE[id(x)] = i
        DRAWS.append((PHASE[0], i, frozenset(ALIVE), sorted(ALIVE.values())))
        yield x, (x[:, 0] > 0).astype(np.int64)


def build_narrow_model(features: int = 8) -> nn.Layer:
    """A model whose activations on a whole batch of narrow rows are twice the batch (Linear 8 -> 16)."""
    return nn.Sequential(nn.Linear(features, 16), nn.Tanh(), nn.Linear(16, 2))


def build_narrow_loader(rows: int = 1 << 20, features: int = 8, batches: int = 6,
                        nan_at: int = 2) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Large batches of narrow rows (per-sample arrays are a large share of the batch), a fresh array each
    batch, made cheaply; one NaN in sample 5 of batch `nan_at` (the checks' slow path, and a batch to keep)."""
    rng = np.random.default_rng(0)
    for i in range(batches):
        x = np.empty((rows, features), dtype=np.float32)
        x[:] = np.float32(1.0 + i)
        x[:, 0] = rng.normal(size=rows)
        if i == nan_at:
            x[5, 3] = np.nan
        yield x, (x[:, 0] > 0).astype(np.int64)


def read_narrow_loader(**args: int) -> None:
    """The plain loop of the memory test: nandoctor's command line imported (as the scan's process has it),
    then the generator read once, as `for batch in loader: ...` does."""
    import paddle  # noqa: F401 - the scan's process has Paddle loaded: the same floor

    import nandoctor.cli  # noqa: F401

    for _ in build_narrow_loader(**args):
        pass
