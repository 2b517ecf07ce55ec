"""The `--bundle DIR` folder: all a bug ticket needs to see, and re-run, the first fault without nandoctor.

Owns the target check made before a run (so a bad path costs nothing) and the write after it. The folder
is built under a temporary name next to DIR and renamed into place only when complete, so a crash or a
full disk never leaves half a bundle where a whole one was expected. Every bundle carries a manifest
(`.nandoctor-bundle.json`, each file written and its size): --force replaces a folder only when all it
holds is files of that manifest, so `--bundle . --force` can never delete a project, whatever
report.json it contains. A symlink is never a bundle target: nothing is replaced through it.

Contents: report.md, report.json, plots/, batch.npz, state.npz, rng_state.json (when saved),
environment.json, command.txt, spec.yaml, code/ (the files the spec names and the local modules they
import), reproduce.py, op_guards.json (with an op_guard remedy), README.txt. The data files load without
pickle, so opening them runs no code.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from pathlib import Path

from nandoctor.errors import OutputError
from nandoctor.findings import Report
from nandoctor.report.bundle_files import fill
from nandoctor.spec import Spec

MANIFEST = ".nandoctor-bundle.json"
MANIFEST_SCHEMA = "nandoctor.bundle/1"
# Files reproduce.py (or Python running it) may add to a bundle; --force may remove them with it.
DERIVED_FILES = ("reproduce.log",)


def check_bundle_target(path: Path, force: bool) -> None:
    """Refuse, before the run, a bundle folder that exists (without --force) or that cannot be created."""
    path = Path(path)
    if path.is_symlink():
        raise OutputError(f"cannot write the bundle to {path}: it is a symbolic link, and nandoctor writes "
                          "nothing through a link. Pick a new folder name, e.g. --bundle nan-bundle.")
    if path.exists():
        if not path.is_dir():
            raise OutputError(f"cannot write the bundle to {path}: it is a file, not a folder. Pick a new "
                              "folder name, e.g. --bundle nan-bundle.")
        if not force:
            raise OutputError(f"the bundle folder {path} already exists. Pass --force to replace it, or pick "
                              "another folder.")
        foreign = foreign_files(path)
        if foreign:  # --bundle . --force must never delete someone's project
            raise OutputError(f"{path} holds files nandoctor did not write for a bundle "
                              f"({_listing(foreign)}), so --force will not replace it. Pick another folder, "
                              "or move those files out.")
    anchor = _existing_ancestor(path.parent if str(path.parent) else Path("."))
    if not anchor.is_dir():
        raise OutputError(f"cannot create the bundle folder {path}: {anchor} is a file, not a folder. Pick a "
                          "path whose parent is a folder.")
    try:  # create, do not ask os.access: root, ACLs, read-only mounts and long names all answer here
        os.rmdir(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=anchor))
    except OSError as exc:
        raise OutputError(_write_failure(path, exc)) from None


def foreign_files(folder: Path) -> list[str]:
    """Paths in `folder` (relative, sorted) that its bundle manifest does not account for; [] = replaceable.

    An empty folder is replaceable. Otherwise the folder must hold a manifest, and every entry must be
    a regular file it lists with the size it lists (or a folder on the way to one, or a file
    reproduce.py derives). Symlinks are never accounted for: nothing is followed or deleted through one.
    A folder that is not a bundle is answered from its top level, never walked (think `--bundle ~`).
    """
    listed = _read_manifest(folder)
    if listed is None:
        return sorted(name + ("/" if (folder / name).is_dir() and not (folder / name).is_symlink() else "")
                      for name in os.listdir(folder))
    dirs = {str(p) for name in listed for p in Path(name).parents}
    foreign = []
    for rel, kind in _walk(folder, dirs):
        if kind == "dir":
            ok = rel in dirs or _derived(rel, is_dir=True)
        elif kind == "file":
            ok = (rel == MANIFEST or listed.get(rel) == (folder / rel).stat().st_size
                  or _derived(rel, is_dir=False))
        else:
            ok = False
        if not ok:
            foreign.append(rel + ("/" if kind == "dir" else ""))
    return sorted(foreign)


def _walk(folder: Path, enter: set[str] | None = None) -> list[tuple[str, str]]:
    """(relative path, 'dir' | 'file' | 'other') under `folder`, never entering a symlink; with `enter`,
    only the sub-folders named there (and code/__pycache__ folders) are entered."""
    out: list[tuple[str, str]] = []
    for root, dirnames, filenames in os.walk(folder, followlinks=False):
        for name in sorted(dirnames + filenames):
            full = Path(root) / name
            rel = str(full.relative_to(folder))
            if full.is_symlink():
                out.append((rel, "other"))
            elif full.is_dir():
                out.append((rel, "dir"))
            elif full.is_file():
                out.append((rel, "file"))
            else:
                out.append((rel, "other"))
        if enter is not None:
            dirnames[:] = [d for d in dirnames if not (Path(root) / d).is_symlink()
                           and (str((Path(root) / d).relative_to(folder)) in enter
                                or _derived(str((Path(root) / d).relative_to(folder)), is_dir=True))]
    return out


def _read_manifest(folder: Path) -> dict[str, int] | None:
    file = folder / MANIFEST
    if file.is_symlink() or not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    files = data.get("files") if isinstance(data, dict) and data.get("schema") == MANIFEST_SCHEMA else None
    if not isinstance(files, dict):
        return None
    return {str(k): v for k, v in files.items() if isinstance(v, int) and ".." not in Path(str(k)).parts}


def _derived(rel: str, *, is_dir: bool) -> bool:
    """reproduce.py's log, and the bytecode Python caches beside code/ when the bundle was replayed."""
    parts = Path(rel).parts
    if is_dir:
        return parts[0] == "code" and parts[-1] == "__pycache__"
    if rel in DERIVED_FILES:
        return True
    return parts[0] == "code" and len(parts) > 2 and parts[-2] == "__pycache__" and rel.endswith(".pyc")


def _listing(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _existing_ancestor(path: Path) -> Path:
    """The nearest folder (or file) on `path` that exists; missing parents are created at write time."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def write_bundle(report: Report, spec: Spec, path: Path, *, force: bool = False,
                 include_code: bool = True) -> Path:
    """Write the bundle for `report` to `path` atomically; returns the folder written.

    `include_code=False` (`--no-code`) leaves the user's code out: reproduce.py then needs it installed.
    """
    path = Path(path)
    check_bundle_target(path, force)  # again: the folder may have appeared during a long run
    tmp: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.parent))
        fill(report, spec, tmp, include_code=include_code)
        _write_manifest(tmp)
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700; a bundle is shared like any folder
        _move_into_place(tmp, path, force)
    except OSError as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise OutputError(_write_failure(path, exc)) from None
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_manifest(folder: Path) -> None:
    files = {rel: (folder / rel).stat().st_size for rel, kind in sorted(_walk(folder)) if kind == "file"}
    data = {"schema": MANIFEST_SCHEMA, "note": "files nandoctor wrote to this bundle; --force replaces the "
            "folder only while it holds nothing else", "files": files}
    (folder / MANIFEST).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _write_failure(path: Path, exc: OSError) -> str:
    """The real cause of a failed write, and what to do about it."""
    where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(path) else ""
    if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
        return (f"cannot write the bundle to {path}: {path} appeared while nandoctor was running (something "
                "else created it), and nandoctor replaces nothing it did not check. Nothing was left behind; "
                "pick another folder and run again.")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (f"cannot write the bundle to {path}: permission denied{where}. Nothing was left behind; pick "
                "a folder you can write to.")
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"cannot write the bundle to {path}: the disk (or your quota) is full{where}. Nothing was left "
                "behind; free some space or pick a folder on another disk.")
    if exc.errno == errno.ENAMETOOLONG:
        return f"cannot write the bundle to {path}: the name is too long for this file system. Pick a shorter one."
    if exc.errno == errno.EROFS:
        return f"cannot write the bundle to {path}: the file system is read-only. Pick another folder."
    return (f"cannot write the bundle to {path}: {exc.strerror or exc}{where}. Nothing was left behind; pick "
            "another folder and run again.")


def _move_into_place(tmp: Path, path: Path, force: bool) -> None:
    """Rename the finished folder to `path`; an old bundle (with --force) is moved aside, checked, removed."""
    old: Path | None = None
    if force and (path.exists() or path.is_symlink()):
        old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
        os.rmdir(old)
        os.rename(path, old)
        if old.is_symlink() or foreign_files(old):  # it changed since the check: put it back untouched
            os.rename(old, path)
            raise OSError(errno.EEXIST, "changed during the run", str(path))
    try:
        os.rename(tmp, path)
    except OSError:
        if old is not None:  # put the user's old bundle back rather than leave nothing
            os.rename(old, path)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
