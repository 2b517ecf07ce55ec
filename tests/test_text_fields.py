"""Text and ragged-list fields: a finding in scan and a spec message in probe naming the field, never a traceback."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nandoctor.cli import app

DATA = """\
import numpy as np


def build_loader(kind="text"):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(3):
        x = rng.normal(size=(4, 3)).astype("float32")
        y = np.array([0, 1, 0, 1])
        extra = ["a cat", "dog", "the mat", "rug"] if kind == "text" else [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]]
        out.append({"x": x, "extra": extra, "label": y})
    return out
"""

MODEL = """\
import paddle


def build_model():
    paddle.seed(0)
    return paddle.nn.Linear(3, 2)
"""

STEP = """\
import paddle


def step(model, batch):
    assert isinstance(batch["extra"], list)  # the step gets the text as it is, to tokenize itself
    return paddle.nn.functional.cross_entropy(model(batch["x"]), batch["label"].unsqueeze(-1))
"""


def _project(tmp_path: Path, kind: str, data_extra: str = "", loss: str = "loss: {builtin: cross_entropy}") -> Path:
    (tmp_path / "data.py").write_text(DATA)
    (tmp_path / "model.py").write_text(MODEL)
    (tmp_path / "train.py").write_text(STEP)
    config = tmp_path / "config.yaml"
    config.write_text(textwrap.dedent(f"""\
        version: 1
        model: {{entry: "model.py:build_model"}}
        data: {{entry: "data.py:build_loader", args: {{kind: {kind}}}{data_extra}}}
        {loss}
        """))
    return config


def _cli(*args: str):
    return CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"}).invoke(app, list(args))


@pytest.mark.parametrize("kind, holds", [("text", "text (a list of str)"),
                                         ("ragged", "a ragged list (rows of different lengths)")])
def test_scan_reports_a_text_or_ragged_model_input(tmp_path: Path, kind: str, holds: str):
    out = tmp_path / "scan.json"
    result = _cli("scan", str(_project(tmp_path, kind)), "--json", str(out))
    assert result.exit_code == 1
    report = json.loads(out.read_text())
    (finding,) = [f for f in report["findings"] if f["code"] == "data.not_tensor"]
    assert finding["severity"] == "error" and finding["location"]["field"] == "extra"
    assert f"Field 'extra' holds {holds}" in finding["message"] and "`data.inputs`" in finding["message"]
    assert "Traceback" not in result.output


@pytest.mark.parametrize("kind", ["text", "ragged"])
def test_probe_names_the_field_and_data_inputs(tmp_path: Path, kind: str):
    result = _cli("probe", str(_project(tmp_path, kind)), "--steps", "2")
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "field 'extra' holds" in text and "`data.inputs` is not set" in text and "collate_fn" in text
    assert "Traceback" not in result.output


def test_left_out_of_inputs_or_given_to_a_step_is_fine(tmp_path: Path):
    out = tmp_path / "scan.json"
    config = _project(tmp_path, "ragged", data_extra=", inputs: [x]")
    assert _cli("scan", str(config), "--json", str(out)).exit_code == 0
    fields = json.loads(out.read_text())["details"]["fields"]
    assert fields["extra"]["dtype"] == "ragged list" and fields["extra"]["role"] == "other"
    assert _cli("probe", str(config), "--steps", "2").exit_code == 0
    config = _project(tmp_path, "text", loss='step: {entry: "train.py:step"}')
    assert _cli("scan", str(config), "--json", str(out)).exit_code == 0
    assert not json.loads(out.read_text())["findings"]
    assert _cli("probe", str(config), "--steps", "2").exit_code == 0
