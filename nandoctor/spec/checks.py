"""The spec's key-by-key checks: the allowed keys at each level and typed getters with messages.

Split from spec.py (which owns the dataclasses and the parse order). Every message names the file and
the key path, and never echoes a huge value back.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from nandoctor.errors import SpecError

GRAD_CLIP_KINDS = ("global_norm", "norm", "value")
# "path/to/file.py:callable" or "pkg.module:callable" (callable may be dotted: "Cls.build")
_ENTRY_RE = re.compile(r"^(?P<target>[^:]+):(?P<attr>[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*)$")

# The allowed keys at each level; the single source for "unknown key" checks and suggestions.
_SCHEMA: dict[str, tuple[str, ...]] = {
    "": ("version", "model", "data", "loss", "step", "optimizer", "amp", "checks", "probe", "resume"),
    "model": ("entry", "args", "output"),
    "data": ("entry", "args", "fields", "inputs", "label"),
    "loss": ("builtin", "entry"),
    "step": ("entry",),
    "optimizer": ("name", "args", "grad_clip", "lr_scheduler", "accumulate_steps"),
    "optimizer.grad_clip": GRAD_CLIP_KINDS,
    "optimizer.lr_scheduler": ("name", "entry", "args", "warmup", "by"),
    "optimizer.lr_scheduler.warmup": ("steps", "start_lr"),
    "amp": ("enabled", "dtype", "level", "init_loss_scaling"),
    "checks": ("num_classes", "label_range", "max_seq_len", "value_range"),
    "probe": ("steps", "seed", "device"),
    "resume": ("model", "optimizer", "lr_scheduler", "step"),
}


def short(value: Any, limit: int = 80) -> str:
    """repr() cut to `limit` characters: a message must never echo a huge value back."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def did_you_mean(word: str, choices: Any) -> str:
    import difflib  # on a typo only: 2.8 ms at every start otherwise

    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


class Validator:
    """Small typed getters that raise SpecError with the file and key path in every message."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, key: str, problem: str) -> None:
        raise SpecError(f"{self.path}: `{key}` {problem}.")

    def keys(self, mapping: dict[str, Any], where: str) -> None:
        allowed = _SCHEMA[where]
        for key in mapping:
            if key not in allowed:
                full = f"{where}.{key}" if where else str(key)
                hint = did_you_mean(str(key), allowed)
                level = f"under `{where}`" if where else "at the top level"
                self.fail(full, f"is not a key nandoctor knows{hint}; allowed {level}: {', '.join(allowed)}")

    def mapping(self, parent: dict[str, Any], key: str, required: bool) -> dict[str, Any] | None:
        name = key.rsplit(".", 1)[-1]
        value = parent.get(name)
        if value is None:
            if required:
                self.fail(key, "is missing" + _EXAMPLES.get(key, ""))
            return None
        if not isinstance(value, dict):
            self.fail(key, f"must be a mapping of keys, not {type(value).__name__} {short(value)}"
                      + _EXAMPLES.get(key, ""))
        return value

    def entry_string(self, block: dict[str, Any], key: str) -> str:
        value = block.get(key.rsplit(".", 1)[-1])
        if value is None:
            self.fail(key, 'is missing; give "file.py:function" (relative to this YAML) or "package.module:function"')
        if not isinstance(value, str) or not _ENTRY_RE.match(value.strip()):
            self.fail(key, f'is {short(value)}; write it as "file.py:function" (relative to this YAML) or '
                      '"package.module:function", with one colon before the name to call')
        return value.strip()

    def args(self, block: dict[str, Any], key: str) -> dict[str, Any]:
        value = block.get(key.rsplit(".", 1)[-1])
        if value is None:
            return {}
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            self.fail(key, f"must be a mapping of keyword arguments such as {{hidden: 128}}, not {short(value)}")
        return dict(value)

    def str_list(self, block: dict[str, Any], key: str) -> list[str] | None:
        value = block.get(key.rsplit(".", 1)[-1])
        if value is None:
            return None
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not value or not all(isinstance(x, str) and x for x in value):
            self.fail(key, f"must be a list of field names such as [x, y], not {short(value)}")
        return list(value)

    def opt_str(self, block: dict[str, Any], key: str) -> str | None:
        value = block.get(key.rsplit(".", 1)[-1])
        if value is not None and not isinstance(value, str):
            self.fail(key, f"must be a field name, not {short(value)}")
        return value

    def positive_int(self, value: Any, key: str) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            self.fail(key, f"is {short(value)}; give a whole number above 0")
        return value

    def positive_number(self, value: Any, key: str) -> float:
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            self.fail(key, f"is {short(value)}; give a number above 0, such as 1.0e-4 or 1e-4")
        return float(value)

    def interval(self, value: Any, key: str) -> tuple[float, float]:
        ok = (isinstance(value, list) and len(value) == 2
              and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value))
        if not ok or value[0] > value[1]:
            self.fail(key, f"is {short(value)}; give [low, high] with low <= high, e.g. [-1.0e4, 1.0e4]")
        return (value[0], value[1])


_EXAMPLES = {
    "model": '; add e.g. `model: {entry: "models.py:build_model", args: {hidden: 128}}`',
    "data": '; add e.g. `data: {entry: "data.py:build_loader", fields: [x, y], label: y}`',
    "step": '; add e.g. `step: {entry: "train.py:compute_loss"}`',
    "loss": "; write e.g. `loss: {builtin: cross_entropy}` or `loss: {entry: \"losses.py:my_loss\"}`",
    "optimizer": "; write e.g. `optimizer: {name: AdamW, args: {learning_rate: 1.0e-4}}`",
    "optimizer.grad_clip": "; write e.g. `grad_clip: {global_norm: 1.0}`",
    "optimizer.lr_scheduler": "; write e.g. `lr_scheduler: {name: CosineAnnealingDecay, args: {T_max: 1000}}`",
    "optimizer.lr_scheduler.warmup": "; write e.g. `warmup: {steps: 100, start_lr: 0.0}`",
    "amp": "; write e.g. `amp: {enabled: true, dtype: float16}`",
    "checks": "; write e.g. `checks: {num_classes: 10}`",
    "probe": "; write e.g. `probe: {steps: 200, seed: 0, device: auto}`",
    "resume": '; write e.g. `resume: {model: "ckpt/model.pdparams", optimizer: "ckpt/opt.pdopt", step: 2000}`',
}
