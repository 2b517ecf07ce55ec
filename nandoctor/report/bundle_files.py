"""What goes into a bundle folder: reports, plots, inert data files, the spec, code/, reproduce.py, README.

Data files are written in formats that cannot run code when opened: arrays as `.npz` (read back with
`allow_pickle=False`) and JSON. No pickle anywhere, so opening someone else's bundle is as safe as
opening an image; only `reproduce.py` and `code/` are code, and the README says so.

reproduce.py runs without nandoctor, so what it must agree on with the probe and can hold as data goes
in as data: `op_guards.json` is the probe's own guard table (nandoctor.engine.op_guards.bundle_table), so
`reproduce.py --with-remedy op_guard` applies the guard the probe verified, never a copy of it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from nandoctor.engine.artifacts import rng_state_json
from nandoctor.findings import Report
from nandoctor.report.bundle_code import copy_code
from nandoctor.report.common import project_dir, public_paths
from nandoctor.spec import Spec
from nandoctor.tensors.convert import array_like, to_numpy

REPRODUCE_SOURCE = Path(__file__).resolve().parent.parent / "standalone" / "reproduce.py"
OP_GUARDS = "op_guards.json"  # the name reproduce_script.py reads


def fill(report: Report, spec: Spec, folder: Path, *, include_code: bool = True) -> None:
    """Write every bundle file into `folder` (a fresh temporary folder)."""
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
    notes += save_artifacts(report, folder)
    _write(folder / "report.json", json_report.render(report))
    _write(folder / "report.md", markdown_report.render(report))
    project = project_dir(report)
    environment = public_paths(report.to_dict()["environment"], project)  # JSON-safe, no home path
    _write(folder / "environment.json", json.dumps(environment, indent=2, sort_keys=True) + "\n")
    command = report.run.get("command_line") or f"nandoctor {report.command} {spec.path.name}"
    _write(folder / "command.txt", public_paths(str(command), project) + "\n")
    shutil.copyfile(spec.path, folder / "spec.yaml")
    if include_code:
        copied, code_notes = copy_code(spec, folder / "code")
        notes += code_notes
    else:
        copied = []
        notes.append("code/: left out (--no-code); reproduce.py needs the model's code importable to replay")
    shutil.copyfile(REPRODUCE_SOURCE, folder / "reproduce.py")
    if any(row.get("remedy") == "op_guard" for row in report.remedies or []):
        from nandoctor.engine.op_guards import bundle_table

        _write(folder / OP_GUARDS, json.dumps(bundle_table(), indent=2, sort_keys=True) + "\n")
    _write(folder / "README.txt", _readme(report, notes, folder, copied))
    with (folder / "report.md").open("a", encoding="utf-8") as md:
        md.write("\n## In this bundle\n\n" + "\n".join(
            f"- `{name}`: {what}" for name, what in _contents(folder)) + "\n")


def save_artifacts(report: Report, folder: Path) -> list[str]:
    """batch.npz, state.npz, rng_state.json from report.artifacts; returns notes on what is missing."""
    notes: list[str] = []
    art = report.artifacts or {}
    if not art and report.first_fault is None:
        return [f"no batch, model state or replay: the run found no fault (verdict {report.verdict.value})"]
    notes += _save_batch(folder, art)
    state = art.get("model_state")
    if isinstance(state, dict) and state:
        arrays, skipped = _numeric(state)
        np.savez(folder / "state.npz", **arrays)  # model.set_state_dict(dict(np.load(...))) reads it
        if skipped:
            notes.append(f"model state entries not saved (not numeric arrays): {', '.join(skipped)}")
    elif report.command == "probe":
        notes.append("no model state was captured, so reproduce.py starts from the model's fresh "
                     "initialisation")
    rng = art.get("rng_state")
    if rng is not None:
        data = rng_state_json(rng)
        if data is None:
            notes.append("the RNG state could not be saved as data; dropout masks in the replay may differ")
        else:
            _write(folder / "rng_state.json", json.dumps(data) + "\n")
    elif report.command == "probe":
        notes.append("no RNG state was captured; a model with dropout may replay with other masks")
    return notes


def _save_batch(folder: Path, art: dict[str, Any]) -> list[str]:
    """batch.npz, and a note naming the fields it could not hold (a graph object given to the model is not
    an array): a reader of the bundle should not have to guess why reproduce.py lacks an input."""
    batch = art.get("batch")
    left_out = list(art.get("batch_left_out") or [])
    if not (isinstance(batch, dict) and batch) and not left_out:
        return ["no offending batch was captured (the run found no fault, or found it outside the data)"]
    arrays, skipped = _numeric(batch if isinstance(batch, dict) else {})
    if arrays:
        np.savez(folder / "batch.npz", **arrays)  # uncompressed: bit-exact and quick to open
    skipped += [name for name in left_out if name not in skipped]
    if not skipped:
        return []
    return [f"batch fields not saved (not numeric arrays, e.g. a graph or another library's object; "
            f"reproduce.py cannot feed them back): {', '.join(skipped)}"]


def _numeric(values: dict[str, Any]) -> tuple[dict[str, np.ndarray], list[str]]:
    """Arrays that save without pickle (no object dtype), and the names of those that would need it."""
    arrays, skipped = {}, []
    for name, value in values.items():
        array = _as_array(value)
        if array is None or array.dtype.hasobject:
            skipped.append(str(name))
        else:
            arrays[str(name)] = array
    return arrays, skipped


def _as_array(value: Any) -> np.ndarray | None:
    if array_like(value):
        return to_numpy(value)
    if hasattr(value, "numpy"):  # an object of the user's with a numpy() of its own: not ours to call
        return None
    try:
        return np.asarray(value)
    except (TypeError, ValueError):
        return None


CONTENTS = (
    ("reproduce.py", "re-runs the failing step with Paddle's tensor checker and prints the first fault "
                     "(`python reproduce.py`; needs paddle, numpy, pyyaml; exit 1 when it reproduces, 0 when not). "
                     "It is code: read it before running a bundle from someone else"),
    ("report.md", "this report"),
    ("report.json", "the same, machine-readable (`nandoctor report report.json` re-renders it)"),
    ("batch.npz", "the offending batch, one array per field (`numpy.load(..., allow_pickle=False)`)"),
    ("state.npz", "the model's parameters and buffers just before the failing step, one array per name "
                  "(`numpy.load(..., allow_pickle=False)`)"),
    ("rng_state.json", "Paddle's RNG state before the step, as plain numbers, so dropout masks match in the replay"),
    (OP_GUARDS, "the probe's op guards (functions wrapped, epsilon or clamp), which `python reproduce.py "
                "--with-remedy op_guard` applies"),
    ("spec.yaml", "the nandoctor spec as given"),
    ("code", "the user's code: the files the spec names and the local modules they import (code runs when "
             "imported: read it before running a bundle from someone else)"),
    ("command.txt", "the command that produced this report"),
    ("environment.json", "versions of nandoctor, Paddle, Python and the device"),
    ("plots", "loss and gradient norm per step; per-layer activation maxima"),
)


def _contents(folder: Path) -> list[tuple[str, str]]:
    """The CONTENTS entries that exist in this bundle (a scan bundle has no state, say)."""
    return [(name, what) for name, what in CONTENTS if (folder / name).exists() or name == "report.md"]


def _readme(report: Report, notes: list[str], folder: Path, copied: list[str]) -> str:
    ff = report.first_fault
    lines = [f"nandoctor {report.command} bundle: verdict {report.verdict.value}"
             + (" (partial: the run was interrupted)" if report.partial else ""), ""]
    if ff is not None:
        lines += ["First fault: " + ff.as_location().describe(), ""]
    lines += ["Safety: reproduce.py and everything in code/ are Python code that runs when you run "
              "reproduce.py. Read them before running a bundle someone else made. The data files (*.npz, "
              "*.json) hold only numbers and text: they load without pickle and run nothing.", ""]
    lines += [f"{name + ('/' if (folder / name).is_dir() else ''):<17} {what.replace('`', '')}"
              for name, what in _contents(folder)]
    if copied:
        lines += ["", "Files in code/:"] + [f"- {name}" for name in copied]
    if notes:
        lines += ["", "Not included:"] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")
