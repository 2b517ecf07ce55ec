"""The benchmark workloads and their two settings: full (realistic) and quick (tiny, for the test).

A workload is a folder under `benchmarks/workloads/` holding `config.yaml` (what nandoctor runs), a
`model.py` and a `plain_<name>.py` that trains the same thing as a plain Paddle loop. The quick setting
writes shrunken copies of the configs into a scratch folder (entries made absolute, so they still point
at the same model code), which keeps the code under test identical and only the sizes different.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1] / "workloads"

# Tiny sizes for --quick: every row still runs end to end, in seconds.
QUICK: dict[str, dict[str, dict[str, Any]]] = {
    "transformer": {"model": {"vocab": 100, "d_model": 16, "heads": 2, "layers": 1, "seq_len": 8},
                    "data": {"batches": 40, "batch_size": 4, "seq_len": 8, "vocab": 100}},
    "cnn": {"model": {"channels": 4}, "data": {"batches": 40, "batch_size": 4}},
    "lstm": {"model": {"hidden": 8}, "data": {"batches": 40, "batch_size": 4, "seq_len": 6}},
    "deep_mlp": {"model": {"depth": 8}, "data": {"batches": 40, "batch_size": 8}},
    "narrow_mlp": {"model": {"depth": 8}, "data": {"batches": 40, "batch_size": 8}},
    "wide_batch": {"model": {"features": 64, "depth": 4}, "data": {"batches": 40, "batch_size": 8, "features": 64}},
    "fast_mlp": {"data": {"batches": 40}},
    "scan_data": {"data": {"samples": 4000}},
}
# The fault of config_fault.yaml (step 50) moved early enough for the quick run.
QUICK_FAULT = {"empty_sample_at": [5, 1]}


@dataclass
class Workload:
    name: str
    config: Path  # the config nandoctor runs (the committed one, or a quick copy)
    plain: Path  # plain_<name>.py
    describe: str  # a short description of the setting for the table
    steps: int  # row 1's whole-process steps: the config's `probe.steps` (60; 600 narrow_mlp, 200 wide_batch,
    # 20,000 fast_mlp)
    step_steps: int | None = None  # row 2's steps per run, where the default is too short to be steady
    step_warmup: int | None = None  # rows 2 and 7: steps left out before the steady state, where not the default

    @property
    def settings(self) -> dict[str, Any]:
        return yaml.safe_load(self.config.read_text(encoding="utf-8"))


def _describe(name: str, raw: dict[str, Any]) -> str:
    m, d = raw["model"].get("args") or {}, raw["data"].get("args") or {}
    if name == "transformer":
        return f"{m['layers']}L d{m['d_model']} seq{m['seq_len']} b{d['batch_size']}"
    if name == "cnn":
        return f"3 conv c{m['channels']} 32x32 b{d['batch_size']}"
    if name == "lstm":
        return f"2L h{m['hidden']} seq{d['seq_len']} b{d['batch_size']}"
    if name == "deep_mlp":
        return f"{m['depth']} blocks, {4 * m['depth'] + 3} sublayers b{d['batch_size']}"
    if name == "narrow_mlp":
        return f"{m['depth']} Linear+Tanh, {2 * m['depth'] + 1} sublayers w{m['width']} b{d['batch_size']}"
    if name == "wide_batch":
        mb = d["batch_size"] * m["features"] * 4 / 2**20
        return (f"Linear {m['features']}->{m['width']} + {m['depth']} Linear, {2 * m['depth'] + 4} tensors, "
                f"b{d['batch_size']} ({mb:.0f} MB)")
    if name == "fast_mlp":
        return f"Linear {m['features']}->{m['width']}->{m['classes']}, b{d['batch_size']} (~0.3 ms a step)"
    if name == "scan_data":
        return f"{d['samples'] // 1000}k x {d['features']} f32 b{d['batch_size']}"
    return name


def _quick_copy(src: Path, name: str, scratch: Path, extra_data: dict[str, Any] | None = None) -> Path:
    raw = yaml.safe_load(src.read_text(encoding="utf-8"))
    out = copy.deepcopy(raw)
    for block in ("model", "data"):
        entry_file, attr = out[block]["entry"].split(":")
        out[block]["entry"] = f"{(src.parent / entry_file).resolve()}:{attr}"
        out[block].setdefault("args", {}).update(QUICK.get(name, {}).get(block, {}))
    if extra_data:
        out["data"]["args"].update(extra_data)
    dest = scratch / f"{name}_{src.stem}.yaml"
    dest.write_text(yaml.safe_dump(out, sort_keys=False), encoding="utf-8")
    return dest


def load(name: str, quick: bool, scratch: Path, *, fault: bool = False) -> Workload:
    """The workload `name` in the chosen setting; `fault` picks config_fault.yaml (transformer only)."""
    folder = ROOT / name
    src = folder / ("config_fault.yaml" if fault else "config.yaml")
    config = _quick_copy(src, name, scratch, QUICK_FAULT if fault else None) if quick else src
    raw = yaml.safe_load(config.read_text(encoding="utf-8"))
    return Workload(name, config, folder / f"plain_{name}.py", _describe(name, raw),
                    int((raw.get("probe") or {}).get("steps", 60)), STEP_STEPS.get(name),
                    None if quick else STEP_WARMUP.get(name))


TRAINING = ("transformer", "cnn", "lstm", "deep_mlp", "narrow_mlp", "wide_batch", "fast_mlp")
# The long-run rows (8): report sizes and memory of this workload's row-1 runs (20,000 steps in full)
LONG_RUN = "fast_mlp"
# Row 2 runs 30 steps a run; the cheap narrow_mlp step gets more, so that a probe sampling per-layer
# stats every k-th step pays for several of them in the mean (100 steps are still only ~3 s a run).
STEP_STEPS = {"narrow_mlp": 100, "fast_mlp": 2000}
# The steady state of a run long enough to have one starts after the first READ_ALL_STEPS (64), which the
# watcher reads in full by design (the early gradient-norm level): a start-up of ~30 ms a run, 1% of the
# mean of a 2000-step fast_mlp run, that row 1 pays in whole-process time and rows 2 and 7 show in their notes.
STEP_WARMUP = {"fast_mlp": 100}
