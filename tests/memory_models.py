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
