"""Which of the user's files go into a bundle's `code/`: the ones the spec names and the local modules they import.

A bundle is attached to tickets, so it must never carry more than the model's code. Starting from the
entry files, the copy follows imports (a static scan of each file, plus the modules the run actually
imported from the spec's folder) and keeps a file only when it is a `.py` file inside the spec's folder
once symlinks are resolved, on no hidden path, not named like a secret (even when imported), and under
the size caps. Everything left out is listed in the README, with the reason.
"""

from __future__ import annotations

import ast
import fnmatch
import os
import shutil
from pathlib import Path

from nandoctor.spec import Spec
from nandoctor.workload.entrypoints import entry_files, module_files, modules_imported_from

MAX_CODE_FILE = 1_000_000  # bytes; bigger .py files are data in disguise, not code a maintainer reads
MAX_CODE_TOTAL = 5_000_000  # bytes for all of code/
# Names that hold keys, tokens or passwords; never copied, whatever imports them.
SECRET_PATTERNS = (".env", ".env.*", "*.env", "*.pem", "*.key", "id_rsa*", "id_dsa*", "id_ecdsa*", "id_ed25519*",
                   ".netrc", "_netrc", ".pypirc", "credentials*", "*credential*", "*secret*", "*.p12", "*.pfx",
                   "*.jks", "*.keystore", "*token*", "*password*", "*passwd*", ".htpasswd", "*.kdbx")
_OWN_DIR = Path(__file__).resolve().parent.parent  # the nandoctor package


def is_secret_name(name: str) -> bool:
    lowered = name.lower()
    return any(fnmatch.fnmatch(lowered, pattern) for pattern in SECRET_PATTERNS)


def copy_code(spec: Spec, dest: Path) -> tuple[list[str], list[str]]:
    """Copy the selected files to `dest`; returns (relative paths copied, notes on what was left out)."""
    dest.mkdir()
    base = spec.base_dir.resolve()
    files, notes = select_code(spec, base)
    copied: list[str] = []
    total = 0
    for file, rel in files:
        size = file.stat().st_size
        if size > MAX_CODE_FILE:
            notes.append(f"code/{rel} not copied: {size:,} bytes is over the {MAX_CODE_FILE // 1_000_000} MB "
                         "limit per file")
            continue
        if total + size > MAX_CODE_TOTAL:
            notes.append(f"code/{rel} not copied: code/ would pass {MAX_CODE_TOTAL // 1_000_000} MB")
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, dest / rel)
        copied.append(str(rel))
        total += size
    if not copied:  # an empty folder the manifest cannot list would make --force refuse this bundle
        dest.rmdir()
    return copied, notes


def select_code(spec: Spec, base: Path) -> tuple[list[tuple[Path, Path]], list[str]]:
    """The entry files, the local modules they import (transitively) and those the run imported.

    Returns (real file, path in code/): a module reached through a link inside the folder keeps the
    name it is imported by.
    """
    notes: list[str] = []
    queue = [f for entry in spec.entries for f in entry_files(entry, base)]
    queue += _imported_during_run(base)
    seen: set[Path] = set()
    kept: list[tuple[Path, Path]] = []
    while queue:
        candidate = queue.pop(0)
        try:
            file = candidate.resolve()
        except OSError:
            continue
        if file in seen:
            continue
        seen.add(file)
        reason = _refusal(candidate, file, base)
        if reason is not None:
            if reason:
                notes.append(reason)
            continue
        kept.append((file, _import_name(candidate, file, base)))
        queue += _imports_of(file, base)
    return sorted(kept, key=lambda pair: pair[1]), notes


def _import_name(candidate: Path, file: Path, base: Path) -> Path:
    """`candidate` relative to the folder as written (a link's own name), else the real file's place."""
    lexical = Path(os.path.normpath(candidate.absolute()))
    if lexical.is_relative_to(base):
        rel = lexical.relative_to(base)
        if not any(part.startswith(".") or is_secret_name(part) for part in rel.parts):
            return rel
    return file.relative_to(base)


def _refusal(candidate: Path, file: Path, base: Path) -> str | None:
    """Why `file` stays out of code/ ("" to leave it out without a note), or None when it may be copied."""
    if not file.is_relative_to(base):
        return f"{candidate.name} not copied: it lies outside the spec's folder (a symlink out of it?)"
    rel = file.relative_to(base)
    if file.is_relative_to(_OWN_DIR) or {"site-packages", "dist-packages"} & set(rel.parts):
        return ""  # nandoctor itself, or installed packages in a virtualenv inside the project: silently out
    if any(part.startswith(".") for part in rel.parts):
        return f"{rel} not copied: hidden files and folders are never copied"
    if any(is_secret_name(part) for part in rel.parts):
        return f"{rel} not copied: its name looks like a secret (keys, tokens, credentials)"
    if file.suffix != ".py" or not file.is_file() or "__pycache__" in rel.parts:
        return f"{rel} not copied: only Python source files are copied"
    return None





def _imports_of(file: Path, base: Path) -> list[Path]:
    """Local files that `file` imports, found statically (`import a.b`, `from . import c`, `from a import b`)."""
    try:
        tree = ast.parse(file.read_bytes(), filename=str(file))
    except (SyntaxError, ValueError, OSError):
        return []
    out: list[Path] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out += module_files(alias.name, base)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                root = file.parent
                for _ in range(node.level - 1):
                    root = root.parent
                prefix = node.module or ""
            else:
                root, prefix = base, node.module or ""
            found = module_files(prefix, root) if prefix else []
            out += found
            # `from pkg import mod` imports pkg/mod.py when mod is a submodule
            sub_root = root.joinpath(*prefix.split(".")) if prefix else root
            for alias in node.names:
                out += [f for f in (sub_root / f"{alias.name}.py", sub_root / alias.name / "__init__.py")
                        if f.is_file()]
    return out


def _imported_during_run(base: Path) -> list[Path]:
    """Files of modules already imported from the spec's folder (a dynamic import the scan cannot see)."""
    out: list[Path] = []
    for path in modules_imported_from(base):
        if any(p.startswith(".") for p in path.resolve().relative_to(base).parts):
            continue  # ~/.local and other hidden folders: never the user's code (and no note each)
        out.append(path)
    return out
