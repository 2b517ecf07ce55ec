"""The application layer's wiring: library log lines held back and counted, error messages printed verbatim."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from nandoctor.cli import app

MODEL = '''import logging

import numpy as np
import paddle


def build_model():
    logging.getLogger("someuserlib.modeling").warning("weights not initialised from a checkpoint")
    logging.getLogger("someuserlib").info("building a tiny model")
    return paddle.nn.Linear(4, 3)


def build_loader():
    rng = np.random.default_rng(0)
    for _ in range(3):
        logging.getLogger("someuserlib.data").warning("padding to 4")
        yield rng.normal(size=(8, 4)).astype("float32"), rng.integers(0, 3, size=(8,)).astype("int64")
'''
CONFIG = ('version: 1\nmodel: {entry: "net.py:build_model"}\n'
          'data: {entry: "net.py:build_loader", fields: [x, y], label: y}\nloss: {builtin: cross_entropy}\n')


def _cli(*args: object):
    return CliRunner(env={"COLUMNS": "100", "NO_COLOR": "1"}).invoke(app, [str(a) for a in args])


def test_library_log_lines_stay_off_the_terminal_and_are_counted_in_the_report(tmp_path: Path):
    (tmp_path / "net.py").write_text(MODEL, encoding="utf-8")
    (tmp_path / "config.yaml").write_text(CONFIG, encoding="utf-8")
    result = _cli("probe", tmp_path / "config.yaml", "--steps", "3", "--json", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    assert "padding to 4" not in result.output and "not initialised" not in result.output
    logs = json.loads((tmp_path / "r.json").read_text())["details"]["library_logs"]
    assert logs["count"] >= 4
    assert any("weights not initialised from a checkpoint" in line for line in logs["lines"])


def test_error_messages_keep_the_yaml_they_quote(tmp_path: Path):
    (tmp_path / "net.py").write_text(MODEL, encoding="utf-8")
    (tmp_path / "config.yaml").write_text(CONFIG.replace("fields: [x, y]", "fields: 3"), encoding="utf-8")
    result = _cli("scan", tmp_path / "config.yaml")
    assert result.exit_code == 2
    assert "such as [x, y], not 3" in result.output  # rich markup would have eaten "[x, y]"
