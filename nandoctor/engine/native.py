"""Paddle's C++ side writes to the process's file descriptors, not to sys.stdout: capture it there.

During a replay under the tensor checker Paddle prints a `[PRECISION] [ERROR]` line and, for a backward
op, the Python stack where the forward op was created. The core must not print, and that stack is worth
keeping: its innermost frame in the user's own code is the source line that created the offending op
(diagnosis/frames.py `creation_lines` reads it).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Iterator

FRAME_RE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')  # a frame of a printed Python stack


class NativeOutput:
    """What the C++ side printed while captured; filled when the `with` block ends."""

    text: str = ""

    def size(self) -> int:
        """Bytes captured so far (Paddle writes unbuffered, so this orders its lines against Python's)."""
        return 0


@contextlib.contextmanager
def capture_native_output() -> Iterator[NativeOutput]:
    """Send fds 1 and 2 to a temporary file for the block, then put them back; never loses the originals."""
    out = NativeOutput()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    saved: list[tuple[int, int]] = []
    with tempfile.TemporaryFile(mode="w+b") as sink:
        try:
            for fd in (1, 2):
                try:
                    saved.append((fd, os.dup(fd)))
                    os.dup2(sink.fileno(), fd)
                except OSError:  # no such fd (embedded interpreters): nothing to capture there
                    continue
            out.size = lambda: os.fstat(sink.fileno()).st_size  # type: ignore[method-assign]
            yield out
        finally:
            for fd, copy in saved:
                os.dup2(copy, fd)
                os.close(copy)
            sink.seek(0)
            out.text = sink.read().decode("utf-8", errors="replace")
