"""nandoctor: finds where a PaddlePaddle training run first goes NaN or Inf, and says what to change.

`nandoctor.watch(model, optimizer, step_fn)` watches a training loop of your own (see README); the
import of Paddle waits until it is first used, so `import nandoctor` stays cheap for the CLI.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Doctor", "NonFiniteError", "__version__", "watch"]


def __getattr__(name: str) -> Any:
    if name in ("watch", "Doctor", "NonFiniteError"):
        from nandoctor import inloop

        return getattr(inloop, name)
    raise AttributeError(f"module 'nandoctor' has no attribute {name!r}")
