"""Importing and calling the user's code: entry strings -> callables; exceptions -> the user's file and line.

Two kinds of failure, kept apart on purpose: an entry that cannot be *loaded* (file missing, import
error, no such function) is a `SpecError` (exit 2, nothing ran); an entry that raises when *called* is
a `UserCodeError`, which scan and probe turn into a `user_code.error` finding in a written report.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.util
import os
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

from nandoctor.errors import NandoctorError, SpecError, UserCodeError

_OUR_DIR = Path(__file__).resolve().parent.parent  # the nandoctor package


@contextlib.contextmanager
def user_import_path(base_dir: Path) -> Iterator[None]:
    """Make the spec's folder importable while the user's code runs (the contract), then undo it."""
    entry = str(base_dir.resolve())
    added = entry not in sys.path
    if added:
        sys.path.insert(0, entry)
    try:
        yield
    finally:
        if added and entry in sys.path:
            sys.path.remove(entry)


def load_entry(entry: str, base_dir: Path, key: str, spec_path: Path) -> Callable[..., Any]:
    """Resolve "file.py:func" (relative to `base_dir`) or "pkg.module:func" to a callable."""
    target, attr = entry.rsplit(":", 1)
    where = f"{spec_path}: `{key}` ({entry!r})"
    if target.endswith(".py") or "/" in target or "\\" in target:
        file = (base_dir / target).resolve()
        if not file.is_file():
            raise SpecError(f"{where} points at {file}, which does not exist. Entry paths are relative to the "
                            f"spec's folder ({base_dir}).")
        module = _import_file(file, where)
    else:
        module = _import_module(target, base_dir, where)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            import difflib

            close = difflib.get_close_matches(part, names, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise SpecError(f"{where}: {getattr(module, '__file__', target)} has no '{part}'.{hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise SpecError(f"{where}: '{attr}' is a {type(obj).__name__}, not something nandoctor can call.")
    return obj


def _import_file(file: Path, where: str) -> Any:
    # A stable, unique module name per file, so two specs' "models.py" never collide in sys.modules.
    name = f"nandoctor_user_{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise SpecError(f"{where}: {file} cannot be imported as Python.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    with user_import_path(file.parent):
        try:
            spec.loader.exec_module(module)
        except BaseException as exc:  # noqa: BLE001 - anything the user's import does is reported, not raised
            del sys.modules[name]
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise SpecError(f"{where}: importing {file} failed{_at(exc, file.parent)}: "
                            f"{type(exc).__name__}: {exc}. Fix that file; nandoctor ran none of your code yet."
                            ) from None
    return module


def _import_module(target: str, base_dir: Path, where: str) -> Any:
    with user_import_path(base_dir):
        try:
            return importlib.import_module(target)
        except ModuleNotFoundError as exc:
            # Only when the entry's own module (or a parent package) is missing; a missing dependency
            # inside the user's module is reported as an import failure with its file and line below.
            if exc.name and (target == exc.name or target.startswith(exc.name + ".")):
                raise SpecError(f"{where}: no module named '{exc.name}' (looked in {base_dir} and the installed "
                                "packages). For a file next to the spec write \"file.py:function\".") from None
            raise SpecError(f"{where}: importing '{target}' failed{_at(exc, base_dir)}: "
                            f"{type(exc).__name__}: {exc}.") from None
        except Exception as exc:  # noqa: BLE001
            raise SpecError(f"{where}: importing '{target}' failed{_at(exc, base_dir)}: "
                            f"{type(exc).__name__}: {exc}.") from None


def _at(exc: BaseException, base_dir: Path) -> str:
    origin = user_origin(exc, base_dir)
    return f" at {origin}" if origin else ""


def user_origin(exc: BaseException, base_dir: Path | None = None) -> str | None:
    """'models.py:42 in forward' for the innermost traceback frame in the user's code.

    The user's code is anything that is not nandoctor, not Paddle, not the standard library or
    site-packages; preferring files under `base_dir` when given. SyntaxErrors carry their own place.
    """
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{short_path(Path(exc.filename), base_dir)}:{exc.lineno}"
    frames = traceback.extract_tb(exc.__traceback__)
    base = base_dir.resolve() if base_dir else None
    best = None
    for frame in frames:
        file = Path(frame.filename)
        if is_user_file(file, base):
            best = frame
    if best is None:
        return None
    return f"{short_path(Path(best.filename), base_dir)}:{best.lineno} in {best.name}"


def is_user_file(file: Path, base: Path | None) -> bool:
    """Not nandoctor (its package or its console script), not an installed package, not the standard
    library, not anything else in the interpreter's own prefix (a venv's bin/ scripts); anything under
    `base` counts, but for installed packages there (a venv inside the project)."""
    text = str(file)
    if text.startswith("<"):
        return False
    try:
        resolved = file.resolve()
    except OSError:
        return False
    if _OUR_DIR in resolved.parents or resolved.name == "nandoctor":  # the package, the console script
        return False
    if base is not None and base in resolved.parents:
        # a venv inside the project holds installed packages, not the user's code
        return not _INSTALLED.intersection(resolved.relative_to(base).parts)
    if any(prefix in resolved.parents for prefix in _interpreter_dirs()):
        return False
    lowered = text.replace("\\", "/")
    return "site-packages" not in lowered and "/lib/python" not in lowered


_INSTALLED = frozenset({"site-packages", "dist-packages"})


@functools.lru_cache(maxsize=4096)
def is_user_path(file: str) -> bool:
    """`is_user_file` of a code object's file name, with no project folder, remembered: asked at every call of
    a watched model (`nandoctor run`'s call site) and at every call the checked pass's profile sees."""
    return is_user_file(Path(file), None)


def is_own_file(file: str) -> bool:
    """nandoctor's own package: on a stack, the boundary between the user's loop and a replay it runs."""
    return not file.startswith("<") and Path(file).resolve().is_relative_to(_OUR_DIR)


def is_library_file(file: str, base: Path | None) -> bool:
    """An installed library's code (a model zoo's layer, a criterion): not the user's, not nandoctor's, not
    Paddle's own (every op is made inside Paddle's wrappers: naming them says nothing) and not the standard
    library's."""
    if file.startswith("<") or is_user_file(Path(file), base) or is_own_file(file):
        return False
    lowered = file.replace("\\", "/")
    for mark in ("site-packages/", "dist-packages/"):
        if mark in lowered:
            top = lowered.rsplit(mark, 1)[1].split("/", 1)[0]
            return top not in _NOT_LIBRARIES
    return False


# Installed packages whose frames are the framework itself, not a library the user chose (and nandoctor's)
_NOT_LIBRARIES = frozenset({"paddle", "paddle_bfloat", "numpy", "nandoctor", "_pytest", "pytest", "pluggy"})


def library_site(file: str, line: int, func: str) -> str:
    """'nd_fakelib/layers.py:12 in forward': a library's file by its path inside the installed packages."""
    path = file.replace("\\", "/")
    for mark in ("site-packages/", "dist-packages/"):
        if mark in path:
            path = path.rsplit(mark, 1)[1]
            break
    return f"{path}:{line} in {func}"


def library_origin(exc: BaseException, base_dir: Path | None = None) -> str | None:
    """The innermost traceback frame in a library's code below the user's innermost frame (`user_origin`):
    the library line that raised, when the user's line only called into it."""
    base = base_dir.resolve() if base_dir else None
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        if is_user_file(Path(frame.filename), base):
            found = None  # only a library frame inside the user's innermost call counts
        elif is_library_file(frame.filename, base):
            found = library_site(frame.filename, frame.lineno or 0, frame.name)
    return found


@functools.lru_cache(maxsize=1)
def _interpreter_dirs() -> tuple[Path, ...]:
    """The interpreter's prefixes and its bin folder: what lives there was installed, not written by the
    user (the filesystem root is left out: it holds everything)."""
    dirs = {Path(sys.executable).parent}
    for prefix in (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix):
        if prefix:
            dirs.add(Path(prefix))
    resolved = set()
    for d in dirs:
        try:
            resolved.add(d.resolve())
        except OSError:
            continue
    return tuple(d for d in resolved if d.parent != d)


def short_path(file: Path, base_dir: Path | None) -> str:
    """`file` relative to `base_dir` when inside it, else as given with `..` resolved (`run/../train.py`)."""
    file = Path(os.path.normpath(file))
    if base_dir is not None:
        try:
            return str(file.resolve().relative_to(base_dir.resolve()))
        except ValueError:
            pass
    return str(file)


def call_user(what: str, fn: Callable[..., Any], /, *args: Any, base_dir: Path | None = None, **kwargs: Any) -> Any:
    """Call the user's code; anything it raises comes back as a UserCodeError saying what and where. The
    user's own keyword arguments (a spec's `model.args`) go in through `functools.partial`, so none of their
    names (`fn`, `what`, `base_dir`) can collide with this function's."""
    try:
        return fn(*args, **kwargs)
    except (KeyboardInterrupt, NandoctorError):  # nandoctor's own spec message from inside `fn`: not the user's
        raise
    except Exception as exc:  # noqa: BLE001 - the user's exception is the finding
        raise UserCodeError(what, exc, user_origin(exc, base_dir)) from exc


def entry_files(entry: str, base: Path) -> list[Path]:
    """'sub/models.py:build' -> that file; 'pkg.mod:f' -> pkg/__init__.py and pkg/mod.py under the folder."""
    target = entry.rsplit(":", 1)[0]
    if target.endswith(".py"):
        return [base / target]
    return module_files(target, base)


def module_files(dotted: str, root: Path) -> list[Path]:
    """The files under `root` that importing `dotted` runs: each package's __init__.py and the module."""
    out: list[Path] = []
    folder = root
    parts = [p for p in dotted.split(".") if p]
    for i, part in enumerate(parts):
        package = folder / part
        if (package / "__init__.py").is_file():
            out.append(package / "__init__.py")
            folder = package
        elif i == len(parts) - 1 and (folder / f"{part}.py").is_file():
            out.append(folder / f"{part}.py")
        else:
            break
    return out


def modules_imported_from(base: Path) -> list[Path]:
    """The `.py` files of loaded modules whose real path is under `base`, as imported (links kept).

    Installed packages and nandoctor itself are skipped by name before any path is resolved: after a
    Paddle import there are ~1,700 modules, and resolving them all costs a quarter of a second.
    """
    base = base.resolve()
    out: list[Path] = []
    for module in list(sys.modules.values()):
        name = getattr(module, "__file__", None)
        if not name or not name.endswith(".py") or "site-packages" in name or "dist-packages" in name:
            continue
        path = Path(name)
        if not path.is_absolute():
            continue
        real = path.resolve()
        if real.is_relative_to(base) and not real.is_relative_to(_OUR_DIR):
            out.append(path)
    return out
