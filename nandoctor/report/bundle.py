"""The `--bundle DIR` folder: all a bug ticket needs to see, and re-run, the first fault without nandoctor.

Owns the target check made before a run (so a bad path costs nothing) and the write after it. The folder
is built under a temporary name next to DIR and renamed into place only when complete, so a crash or a
full disk never leaves half a bundle where a whole one was expected; with --force the old folder is
removed only after the new one is complete.

Contents: report.md, report.json, plots/, batch.npz, state.pdparams, rng_state.pkl (when saved),
environment.json, command.txt, spec.yaml, code/ (the spec folder's .py files), reproduce.py, README.txt.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from nandoctor.errors import OutputError
from nandoctor.findings import SCHEMA, Report
from nandoctor.spec import Spec

MAX_CODE_FILE = 1_000_000  # bytes; bigger .py files are data in disguise, not code a maintainer reads
REPRODUCE_SOURCE = Path(__file__).with_name("reproduce_script.py")


def check_bundle_target(path: Path, force: bool) -> None:
    """Refuse, before the run, a bundle folder that exists (without --force) or that cannot be created."""
    path = Path(path)
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            raise OutputError(f"cannot write the bundle to {path}: it is a file, not a folder. Pick a new "
                              "folder name, e.g. --bundle nan-bundle.")
        if not force:
            raise OutputError(f"the bundle folder {path} already exists. Pass --force to replace it, or pick "
                              "another folder.")
        if not _is_bundle(path):  # --bundle . --force must never delete someone's project
            raise OutputError(f"{path} exists and is not a nandoctor bundle (it has files but no report.json "
                              "from nandoctor), so --force will not replace it. Pick another folder.")
    anchor = _existing_ancestor(path.parent if str(path.parent) else Path("."))
    if not anchor.is_dir():
        raise OutputError(f"cannot create the bundle folder {path}: {anchor} is a file, not a folder. Pick a "
                          "path whose parent is a folder.")
    if not os.access(anchor, os.W_OK | os.X_OK):
        raise OutputError(f"cannot create the bundle folder {path}: the folder {anchor} is not writable. "
                          "Pick a folder you can write to.")


def _is_bundle(path: Path) -> bool:
    """An empty folder, or one holding a nandoctor report.json: the only folders --force may replace."""
    if not any(path.iterdir()):
        return True
    try:
        data = json.loads((path / "report.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("schema") == SCHEMA


def _existing_ancestor(path: Path) -> Path:
    """The nearest folder (or file) on `path` that exists; missing parents are created at write time."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def write_bundle(report: Report, spec: Spec, path: Path, *, force: bool = False) -> Path:
    """Write the bundle for `report` to `path` atomically; returns the folder written."""
    path = Path(path)
    check_bundle_target(path, force)  # again: the folder may have appeared during a long run
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.parent))
    try:
        _fill(report, spec, tmp)
        _move_into_place(tmp, path, force)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputError(f"cannot write the bundle to {path}: {exc.strerror or exc}. Nothing was left "
                          "behind; free space or pick another folder and run again.") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _move_into_place(tmp: Path, path: Path, force: bool) -> None:
    """Rename the finished folder to `path`; an old one (with --force) is moved aside first, then removed."""
    old: Path | None = None
    if path.exists() and force:
        old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
        os.rmdir(old)
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except OSError:
        if old is not None:  # put the user's old bundle back rather than leave nothing
            os.rename(old, path)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _fill(report: Report, spec: Spec, folder: Path) -> None:
    from nandoctor.report import json as json_report
    from nandoctor.report import markdown as markdown_report
    from nandoctor.report.plots import make_plots

    notes: list[str] = []
    plots = make_plots(report, folder / "plots")
    if plots:
        report.details["plots"] = {title: f"plots/{name}" for title, name in plots.items()}
    else:
        report.details.pop("plots", None)
        shutil.rmtree(folder / "plots", ignore_errors=True)
    notes += _save_artifacts(report, folder)
    _write(folder / "report.json", json_report.render(report))
    _write(folder / "report.md", markdown_report.render(report))
    environment = report.to_dict()["environment"]  # the JSON-safe form (numpy values, NaN as text)
    _write(folder / "environment.json", json.dumps(environment, indent=2, sort_keys=True) + "\n")
    _write(folder / "command.txt", str(report.run.get("command_line") or f"nandoctor {report.command} "
                                       f"{spec.path}") + "\n")
    shutil.copyfile(spec.path, folder / "spec.yaml")
    notes += _copy_code(spec, folder / "code")
    shutil.copyfile(REPRODUCE_SOURCE, folder / "reproduce.py")
    _write(folder / "README.txt", _readme(report, notes, folder))
    with (folder / "report.md").open("a", encoding="utf-8") as md:
        md.write("\n## In this bundle\n\n" + "\n".join(
            f"- `{name}`: {what}" for name, what in _contents(folder)) + "\n")


def _save_artifacts(report: Report, folder: Path) -> list[str]:
    """batch.npz, state.pdparams, rng_state.pkl from report.artifacts; returns notes on what is missing."""
    notes: list[str] = []
    art = report.artifacts or {}
    if not art and report.first_fault is None:
        return [f"no batch, model state or replay: the run found no fault (verdict {report.verdict.value})"]
    batch = art.get("batch")
    if isinstance(batch, dict) and batch:
        arrays, skipped = {}, []
        for name, value in batch.items():
            array = _as_array(value)
            if array is None or array.dtype == object:
                skipped.append(str(name))
            else:
                arrays[str(name)] = array
        if arrays:
            np.savez(folder / "batch.npz", **arrays)  # uncompressed: bit-exact and quick to open
        if skipped:
            notes.append(f"batch fields not saved (not numeric arrays): {', '.join(skipped)}")
    else:
        notes.append("no offending batch was captured (the run found no fault, or found it outside the data)")
    state = art.get("model_state")
    if isinstance(state, dict) and state:
        import paddle

        arrays = {str(k): a for k, v in state.items() if (a := _as_array(v)) is not None}
        paddle.save(arrays, str(folder / "state.pdparams"))  # model.set_state_dict(paddle.load(...)) reads it
    elif report.command == "probe":
        notes.append("no model state was captured, so reproduce.py starts from the model's fresh "
                     "initialisation")
    rng = art.get("rng_state")
    if rng is not None:
        try:
            (folder / "rng_state.pkl").write_bytes(pickle.dumps(rng))
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            notes.append(f"the RNG state could not be saved ({exc}); dropout masks in the replay may differ")
    elif report.command == "probe":
        notes.append("no RNG state was captured; a model with dropout may replay with other masks")
    return notes


def _as_array(value: Any) -> np.ndarray | None:
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "numpy") and callable(value.numpy):
        return np.asarray(value.numpy())
    try:
        return np.asarray(value)
    except (TypeError, ValueError):
        return None


def _copy_code(spec: Spec, dest: Path) -> list[str]:
    """The spec folder's own .py files (not sub-folders), plus entry files in sub-folders it names."""
    dest.mkdir()
    notes: list[str] = []
    base = spec.base_dir.resolve()
    files = sorted(p for p in base.glob("*.py") if p.is_file())
    for entry in _entry_files(spec):
        if entry not in files:
            files.append(entry)
    for file in files:
        rel = file.relative_to(base)
        size = file.stat().st_size
        if size > MAX_CODE_FILE:
            notes.append(f"code/{rel} not copied: {size:,} bytes is over the 1 MB limit")
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, dest / rel)
    return notes


def _entry_files(spec: Spec) -> list[Path]:
    """Files under the spec folder that model/data/loss/step entries name ("sub/models.py:build", "pkg.mod:f")."""
    base = spec.base_dir.resolve()
    entries = [spec.model.entry, spec.data.entry]
    if spec.loss is not None and spec.loss.entry:
        entries.append(spec.loss.entry)
    if spec.step is not None:
        entries.append(spec.step.entry)
    out = []
    for entry in entries:
        target = entry.rsplit(":", 1)[0]
        if not target.endswith(".py"):
            # "pkg.module:func" with pkg a package folder next to the spec: the whole package comes along
            package = base / target.split(".")[0]
            if (package / "__init__.py").is_file():
                out += sorted(p.resolve() for p in package.rglob("*.py") if "__pycache__" not in p.parts)
            continue
        file = (base / target).resolve()
        if file.is_file() and file.is_relative_to(base):
            out.append(file)
    return out


CONTENTS = (
    ("reproduce.py", "re-runs the failing step with Paddle's tensor checker and prints the first fault "
                     "(`python reproduce.py`; needs paddle, numpy, pyyaml; exit 1 when it reproduces, 0 when not)"),
    ("report.md", "this report"),
    ("report.json", "the same, machine-readable (`nandoctor report report.json` re-renders it)"),
    ("batch.npz", "the offending batch, one array per field (`numpy.load`)"),
    ("state.pdparams", "the model's parameters and buffers just before the failing step (`paddle.load`)"),
    ("rng_state.pkl", "Paddle's RNG state before the step, so dropout masks match in the replay"),
    ("spec.yaml", "the nandoctor spec as given"),
    ("code", "the user's .py files the spec points at"),
    ("command.txt", "the command that produced this report"),
    ("environment.json", "versions of nandoctor, Paddle, Python and the device"),
    ("plots", "loss and gradient norm per step; per-layer activation maxima"),
)


def _contents(folder: Path) -> list[tuple[str, str]]:
    """The CONTENTS entries that exist in this bundle (a scan bundle has no state, say)."""
    return [(name, what) for name, what in CONTENTS if (folder / name).exists() or name == "report.md"]


def _readme(report: Report, notes: list[str], folder: Path) -> str:
    ff = report.first_fault
    lines = [f"nandoctor {report.command} bundle: verdict {report.verdict.value}"
             + (" (partial: the run was interrupted)" if report.partial else ""), ""]
    if ff is not None:
        lines += ["First fault: " + ff.as_location().describe(), ""]
    lines += [f"{name + ('/' if (folder / name).is_dir() else ''):<17} {what.replace('`', '')}"
              for name, what in _contents(folder)]
    if notes:
        lines += ["", "Not included:"] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")
