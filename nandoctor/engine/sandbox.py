"""Keep the user's files as their training wrote them while nandoctor re-runs the user's code.

Replays run the user's code again: the probe's and the watch's replays of a failing step, the rollback
and remedy replays, and `nandoctor run`'s checked pass, which re-runs the whole script up to the fault. A
step or a script saves checkpoints, appends to logs, writes metrics: done again, that would overwrite what
the real run wrote. While they run, every write through Python is redirected into a private mirror
folder: `open` and `io.open` in a writing mode, `os.open` with a writing flag, and `os.remove`,
`os.unlink`, `os.rename`, `os.replace`, `os.mkdir`, `os.makedirs`, `os.rmdir` act on the mirror (a read
sees the mirror's copy once the replay wrote one). Not covered: writes through a file the user's code
opened before the replay (a logging FileHandler) and C code's own file I/O; `file_states` before and after
shows what changed anyway, and the report names it.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_SKIP_DIRS = {".git", "__pycache__", ".venv", "venv", "node_modules", ".mypy_cache", ".pytest_cache", ".ruff_cache"}
_SCAN_LIMIT = 20000


@contextlib.contextmanager
def redirected(folder: Path | None = None) -> Iterator[list[str]]:
    """Python-level writes go to a private mirror for the block, which is removed afterwards; yields the
    list that gets the files of `folder` (the user's code's folder) that changed all the same."""
    before = file_states(folder) if folder is not None else None
    changed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="nandoctor-replay-") as tmp:
        undo = redirect_writes(Path(tmp) / "mirror", exempt=Path(tmp))
        try:
            yield changed
        finally:
            undo()
    if before is not None and folder is not None:
        changed += changed_files(before, file_states(folder))


def redirect_writes(mirror: Path, exempt: Path) -> Callable[[], None]:
    """From now on in this process, Python-level writes go to `mirror` instead of the user's files
    (writes under `exempt`, nandoctor's own folder for the pass's answer, go where they are meant to).
    Returns the function that puts the real ones back."""
    # the originals: what the replacements call, and what `undo` puts back
    real = {name: getattr(os, name) for name in ("open", "remove", "unlink", "rename", "replace", "mkdir",
                                                 "makedirs", "rmdir")}
    real_open, real_io_open = builtins.open, io.open
    own = str(exempt.resolve())

    def make_dirs(path: str) -> None:
        """os.makedirs with the real os.mkdir (os.makedirs looks up os.mkdir, which is replaced below)."""
        missing = []
        while path and not os.path.isdir(path):
            missing.append(path)
            path = os.path.dirname(path)
        for folder in reversed(missing):
            try:
                real["mkdir"](folder)
            except FileExistsError:
                pass

    def mirrored(path: Any) -> str | None:
        """The mirror's path for a user's path, None for what is not a path (a file descriptor)."""
        if isinstance(path, int):
            return None
        full = os.path.abspath(os.fsdecode(path))
        if full.startswith((own + os.sep, "/dev/", "/proc/")):
            return full  # nandoctor's own folder (the mirror is inside it), devices
        return os.path.join(str(mirror), full.lstrip(os.sep))

    def prepare(path: Any, keep: bool) -> str | None:
        target = mirrored(path)
        if target is None:
            return None
        make_dirs(os.path.dirname(target))
        original = os.path.abspath(os.fsdecode(path))
        if keep and not os.path.exists(target) and os.path.isfile(original):
            shutil.copyfile(original, target)  # an append or an update starts from the user's content
        return target

    def read_path(path: Any) -> Any:
        target = mirrored(path)
        return target if target is not None and os.path.exists(target) else path

    def sandboxed_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, int):
            return real_open(file, mode, *args, **kwargs)
        if any(c in mode for c in "wax+"):
            target = prepare(file, keep=any(c in mode for c in "a+"))
            return real_open(target, mode, *args, **kwargs)
        return real_open(read_path(file), mode, *args, **kwargs)

    def sandboxed_os_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if kwargs.get("dir_fd") is None and flags & _WRITE_FLAGS:
            return real["open"](prepare(path, keep=not flags & os.O_TRUNC), flags, *args, **kwargs)
        if kwargs.get("dir_fd") is None:
            path = read_path(path)
        return real["open"](path, flags, *args, **kwargs)

    def remove(path: Any, *args: Any, **kwargs: Any) -> None:
        target = mirrored(path)
        if kwargs.get("dir_fd") is None and target is not None and os.path.lexists(target):
            real["remove"](target)
        # the user's own file stays: the pass only pretends it is gone

    def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("src_dir_fd") is not None or kwargs.get("dst_dir_fd") is not None:
            return
        source = mirrored(src)
        if source is None:
            return
        if not os.path.exists(source):
            prepare(src, keep=True)
        if os.path.exists(source):
            real["replace"](source, prepare(dst, keep=False))

    def mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        target = mirrored(path)
        if target is not None and kwargs.get("dir_fd") is None:
            make_dirs(target)

    def makedirs(path: Any, mode: int = 0o777, exist_ok: bool = False) -> None:
        mkdir(path)

    def rmdir(path: Any, *args: Any, **kwargs: Any) -> None:
        return None

    builtins.open = sandboxed_open
    io.open = sandboxed_open
    os.open = sandboxed_os_open
    os.remove = os.unlink = remove
    os.rename = os.replace = rename
    os.mkdir = mkdir
    os.makedirs = makedirs
    os.rmdir = rmdir

    def undo() -> None:
        builtins.open, io.open = real_open, real_io_open
        for name, fn in real.items():
            setattr(os, name, fn)

    return undo


def file_states(folder: Path) -> dict[str, tuple[int, int]]:
    """{relative path: (mtime_ns, size)} of the files under `folder` (caches and virtualenvs left out; at
    most 20,000 files: a larger tree is compared on its first 20,000)."""
    out: dict[str, tuple[int, int]] = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for name in filenames:
            path = os.path.join(dirpath, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            out[os.path.relpath(path, folder)] = (st.st_mtime_ns, st.st_size)
            if len(out) >= _SCAN_LIMIT:
                return out
    return out


def changed_files(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> list[str]:
    """Files created, changed or removed between two `file_states`."""
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
