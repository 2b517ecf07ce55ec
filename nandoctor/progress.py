"""The one way the core reports progress: a callback, so scan and probe never touch the terminal."""

from __future__ import annotations

from typing import Callable, Optional

# progress(done, total, description): `total` is None when the loader's length is unknown.
ProgressFn = Callable[[int, Optional[int], str], None]


def no_progress(done: int, total: int | None, description: str) -> None:
    """The default when nobody is watching (tests, library use)."""
