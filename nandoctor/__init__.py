"""nandoctor: finds where a PaddlePaddle training run first goes NaN or Inf, and says what to change.

`nandoctor.watch(model, optimizer, step_fn)` watches a training loop of your own (see docs/ways-in.md); the
import of Paddle waits until it is first used, so `import nandoctor` stays cheap for the CLI.
"""

from __future__ import annotations

import warnings
from typing import Any

from nandoctor.version import __version__

# Paddle's import warns "No ccache found" (a build tool for C++ extensions) on every machine without one:
# noise in the user's terminal that asks nothing of them. Every process that runs nandoctor imports this
# package before Paddle (the CLI, and `nandoctor run`'s watched script through its sitecustomize), so the
# filter is set here; it matches that one message only.
warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)

__all__ = ["Doctor", "NonFiniteError", "__version__", "watch"]


def __getattr__(name: str) -> Any:
    if name in ("watch", "Doctor", "NonFiniteError"):
        from nandoctor import inloop

        return getattr(inloop, name)
    raise AttributeError(f"module 'nandoctor' has no attribute {name!r}")
