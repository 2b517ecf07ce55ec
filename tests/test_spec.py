"""Spec validation and entry loading: every way a new user's spec can be wrong gets one clear message.

Unit tests call `load_spec` / `load_entry`; CLI tests check the same mistakes end in exit status 2
with the message on stderr and no traceback.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nandoctor.cli import app
from nandoctor.errors import SpecError
from nandoctor.spec import load_spec
from nandoctor.workload.entrypoints import load_entry

GOOD = """\
version: 1
model: {entry: "models.py:build_model", args: {hidden: 4}}
data: {entry: "data.py:build_loader", fields: [x, y], label: y}
loss: {builtin: cross_entropy}
"""

MODELS = """\
def build_model(hidden=4):
    import paddle

    return paddle.nn.Sequential(paddle.nn.Linear(3, hidden), paddle.nn.ReLU(), paddle.nn.Linear(hidden, 2))
"""

DATA = """\
import numpy as np


def build_loader():
    rng = np.random.default_rng(0)
    return [(rng.normal(size=(4, 3)).astype("float32"), np.array([0, 1, 0, 1])) for _ in range(2)]
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A folder with a tiny model, a loader and a valid config.yaml next to them."""
    (tmp_path / "models.py").write_text(MODELS)
    (tmp_path / "data.py").write_text(DATA)
    (tmp_path / "config.yaml").write_text(GOOD)
    return tmp_path


def _spec_error(path: Path, text: str | None = None) -> str:
    if text is not None:
        path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    return str(info.value)


def _entry_error(project: Path, entry: str) -> str:
    with pytest.raises(SpecError) as info:
        load_entry(entry, project, "model.entry", project / "config.yaml")
    return str(info.value)


def test_good_spec_loads(project: Path):
    spec = load_spec(project / "config.yaml")
    assert spec.model.entry == "models.py:build_model" and spec.model.args == {"hidden": 4}
    assert spec.data.fields == ["x", "y"] and spec.data.label == "y"
    assert spec.loss is not None and spec.loss.builtin == "cross_entropy" and spec.step is None
    assert callable(load_entry(spec.model.entry, spec.base_dir, "model.entry", spec.path))


# --- the file itself ------------------------------------------------------------------------------------

def test_bad_yaml_names_line(project: Path):
    msg = _spec_error(project / "config.yaml", "version: 1\nmodel:\n  entry: [unclosed\ndata: {}\n")
    assert "not valid YAML" in msg and "config.yaml" in msg
    assert "line 3" in msg  # where the broken flow sequence began, not only where the parser gave up


def test_bad_indentation_names_line(project: Path):
    msg = _spec_error(project / "config.yaml", "version: 1\nmodel:\n entry: a\n  args: b\n")
    assert "line 4" in msg and "indentation" in msg


def test_empty_file(project: Path):
    assert "the file is empty" in _spec_error(project / "config.yaml", "")
    assert "the file is empty" in _spec_error(project / "config.yaml", "# only a comment\n")


def test_top_level_list(project: Path):
    assert "must be a mapping" in _spec_error(project / "config.yaml", "- model\n- data\n")


def test_missing_file_and_folder(project: Path):
    assert "no such file" in _spec_error(project / "nope.yaml")
    msg = _spec_error(project)
    assert "is a folder" in msg and "config.yaml" in msg


def test_python_file_passed_as_config(project: Path):
    msg = _spec_error(project / "models.py")
    assert "does not look like a nandoctor spec" in msg


def test_duplicate_key(project: Path):
    msg = _spec_error(project / "config.yaml", GOOD + "loss: {builtin: mse}\n")
    assert "'loss' is given twice" in msg and "line 5" in msg


# --- version and required blocks -----------------------------------------------------------------------

def test_missing_version(project: Path):
    msg = _spec_error(project / "config.yaml", GOOD.replace("version: 1\n", ""))
    assert "`version` is missing" in msg and "version: 1" in msg


@pytest.mark.parametrize("value", ["2", "'1'", "v1"])
def test_wrong_version(project: Path, value: str):
    msg = _spec_error(project / "config.yaml", GOOD.replace("version: 1", f"version: {value}"))
    assert "`version` is" in msg and "set `version: 1`" in msg


@pytest.mark.parametrize("block, hint", [("model", "models.py:build_model"), ("data", "data.py:build_loader"),
                                         ("loss", "builtin: cross_entropy")])
def test_missing_required_block(project: Path, block: str, hint: str):
    lines = [line for line in GOOD.splitlines() if not line.startswith(block + ":")]
    msg = _spec_error(project / "config.yaml", "\n".join(lines) + "\n")
    assert f"`{block}` is missing" in msg and hint in msg


def test_block_given_as_plain_string(project: Path):
    text = GOOD.replace("loss: {builtin: cross_entropy}", "loss: cross_entropy")
    msg = _spec_error(project / "config.yaml", text)
    assert "`loss` must be a mapping" in msg and "{builtin: cross_entropy}" in msg


# --- unknown keys ---------------------------------------------------------------------------------------

def test_unknown_nested_key_suggests(project: Path):
    msg = _spec_error(project / "config.yaml", GOOD.replace("label: y", "lable: y"))
    assert "`data.lable`" in msg and "did you mean 'label'" in msg


def test_unknown_top_level_key_suggests(project: Path):
    msg = _spec_error(project / "config.yaml", GOOD + "optimiser: {name: Adam}\n")
    assert "`optimiser`" in msg and "did you mean 'optimizer'" in msg and "at the top level" in msg


def test_loss_and_step_both(project: Path):
    msg = _spec_error(project / "config.yaml", GOOD + 'step: {entry: "train.py:step"}\n')
    assert "`loss` and `step` are both given" in msg and "keep exactly one" in msg


def test_unknown_builtin_loss_suggests(project: Path):
    msg = _spec_error(project / "config.yaml", GOOD.replace("cross_entropy", "crossentropy"))
    assert "`loss.builtin`" in msg and "did you mean 'cross_entropy'" in msg


# --- entry strings and loading ---------------------------------------------------------------------------

def test_entry_without_colon(project: Path):
    msg = _spec_error(project / "config.yaml", GOOD.replace('"models.py:build_model"', '"models.py"'))
    assert "`model.entry` is 'models.py'" in msg and '"file.py:function"' in msg


def test_entry_file_missing(project: Path):
    msg = _entry_error(project, "modles.py:build_model")
    assert "modles.py" in msg and "does not exist" in msg and "relative to the spec's folder" in msg


def test_entry_function_missing_suggests(project: Path):
    msg = _entry_error(project, "models.py:build_modle")
    assert "has no 'build_modle'" in msg and "Did you mean 'build_model'" in msg


def test_entry_module_missing(project: Path):
    msg = _entry_error(project, "no_such_module_xyz:build")
    assert "no module named 'no_such_module_xyz'" in msg


def test_entry_not_callable(project: Path):
    (project / "consts.py").write_text("SIZE = 3\n")
    assert "not something nandoctor can call" in _entry_error(project, "consts.py:SIZE")


def test_user_module_raising_on_import(project: Path):
    (project / "broken.py").write_text("import os\n\n\nraise RuntimeError('weights.bin not found')\n")
    msg = _entry_error(project, "broken.py:build_model")
    assert "broken.py:4" in msg and "RuntimeError" in msg and "weights.bin not found" in msg
    assert "Traceback" not in msg


def test_user_module_missing_dependency_names_the_line(project: Path):
    (project / "needs.py").write_text("x = 1\nimport not_installed_pkg_xyz\n")
    msg = _entry_error(project, "needs.py:build")
    assert "needs.py:2" in msg and "not_installed_pkg_xyz" in msg


def test_module_entry_missing_dependency_is_not_the_module_missing(project: Path):
    # "pkgx_models" exists; the package it imports, "pkgx", does not: name the user's line, not "no module".
    (project / "pkgx_models.py").write_text("import pkgx\n")
    msg = _entry_error(project, "pkgx_models:build")
    assert "importing 'pkgx_models' failed at pkgx_models.py:1" in msg and "No module named 'pkgx'" in msg


def test_user_module_syntax_error(project: Path):
    (project / "syntax.py").write_text("def build_model(:\n    pass\n")
    msg = _entry_error(project, "syntax.py:build_model")
    assert "syntax.py:1" in msg and "SyntaxError" in msg


# --- types --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra, key, words", [
    ("probe: {steps: -1}\n", "`probe.steps`", "whole number above 0"),
    ("probe: {steps: 10.5}\n", "`probe.steps`", "whole number above 0"),
    ("probe: {seed: -2}\n", "`probe.seed`", "whole number"),
    ("probe: {device: tpu}\n", "probe.device", "auto, cpu, gpu or gpu:N"),
    ("optimizer: {name: Adam, grad_clip: {global_norm: 1.0, value: 0.5}}\n", "`optimizer.grad_clip`",
     "exactly one of"),
    ("optimizer: {grad_clip: {global_norm: -1}}\n", "`optimizer.grad_clip.global_norm`", "above 0"),
    ("optimizer: {name: Adam, args: {learning_rate: '1e-4'}}\n", "`optimizer.args.learning_rate`", "in quotes"),
    ("optimizer: {name: Adam, args: {learning_rate: -0.1}}\n", "`optimizer.args.learning_rate`", "above 0"),
    ("optimizer: {args: {parameters: 1}}\n", "`optimizer.args.parameters`", "remove it"),
    ("amp: {enabled: 'yes please'}\n", "`amp.enabled`", "true or false"),
    ("amp: {dtype: fp16}\n", "`amp.dtype`", "float16, bfloat16"),
    ("checks: {num_classes: 0}\n", "`checks.num_classes`", "above 0"),
    ("checks: {value_range: [5, 1]}\n", "`checks.value_range`", "low <= high"),
])
def test_bad_types(project: Path, extra: str, key: str, words: str):
    msg = _spec_error(project / "config.yaml", GOOD + extra)
    assert key in msg and words in msg, msg


def test_numbers_in_exponent_form_are_numbers(project: Path):
    """YAML 1.1 (PyYAML) reads `1e-4` and `1.0e36` as text; a spec reads them as the numbers they are."""
    (project / "config.yaml").write_text(GOOD + "optimizer: {name: Adam, args: {learning_rate: 1e-4}}\n"
                                         "checks: {value_range: [-1.0e36, 1e5]}\n")
    spec = load_spec(project / "config.yaml")
    assert spec.optimizer.args["learning_rate"] == 1e-4
    assert spec.checks.value_range == (-1e36, 1e5)


def test_inputs_naming_unknown_field(project: Path):
    msg = _spec_error(project / "config.yaml", GOOD.replace("label: y", "label: y, inputs: [xx]"))
    assert "`data.inputs` names field 'xx'" in msg and "did you mean 'x'" in msg


def test_label_among_inputs(project: Path):
    msg = _spec_error(project / "config.yaml", GOOD.replace("label: y", "label: y, inputs: [x, y]"))
    assert "includes the label field 'y'" in msg


def test_args_not_a_mapping(project: Path):
    msg = _spec_error(project / "config.yaml", GOOD.replace("args: {hidden: 4}", "args: [4]"))
    assert "`model.args` must be a mapping of keyword arguments" in msg


# --- through the command line ---------------------------------------------------------------------------

def _cli(*args: str):
    return CliRunner(env={"COLUMNS": "100", "NO_COLOR": "1"}).invoke(app, list(args))


def _assert_usage_error(result, *words: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    for word in words:
        assert word in result.output, result.output


@pytest.mark.parametrize("command", ["scan", "probe"])
def test_cli_spec_errors_exit_2(project: Path, command: str):
    config = project / "config.yaml"
    config.write_text(GOOD.replace("label: y", "lable: y"))
    result = _cli(command, str(config))
    _assert_usage_error(result, "data.lable", "did you mean 'label'")
    assert "data.lable" in result.stderr  # the message goes to stderr, not stdout
    assert result.stdout == ""


def test_cli_missing_config_and_folder(project: Path):
    _assert_usage_error(_cli("scan", str(project / "missing.yaml")), "no such file")
    _assert_usage_error(_cli("probe", str(project)), "is a folder")


def test_cli_bad_yaml(project: Path):
    config = project / "config.yaml"
    config.write_text("version: 1\nmodel:\n  entry: [unclosed\n")
    _assert_usage_error(_cli("scan", str(config)), "not valid YAML", "line 3")


def test_cli_bad_command_line_values(project: Path):
    config = str(project / "config.yaml")
    _assert_usage_error(_cli("probe", config, "--steps", "0"), "--steps")
    _assert_usage_error(_cli("scan", config, "--batches", "-1"), "--batches")
    _assert_usage_error(_cli("probe", config, "--steps", "ten"), "--steps")
    _assert_usage_error(_cli("probe", config, "--device", "tpu"), "--device", "auto, cpu, gpu or gpu:N")


def test_cli_output_paths_checked_before_the_run(project: Path):
    config = str(project / "config.yaml")
    _assert_usage_error(_cli("scan", config, "--json", str(project / "no" / "dir" / "r.json")),
                        "does not exist")
    _assert_usage_error(_cli("scan", config, "--markdown", str(project)), "is a folder")


def test_cli_entry_errors_exit_2(project: Path):
    config = project / "config.yaml"
    (project / "broken.py").write_text(textwrap.dedent("""\
        import os

        raise ValueError("bad setting in broken.py")
        """))
    config.write_text(GOOD.replace("models.py:build_model", "broken.py:build_model"))
    result = _cli("scan", str(config))
    _assert_usage_error(result, "broken.py:3", "ValueError", "bad setting in broken.py")
    config.write_text(GOOD.replace("models.py:build_model", "models.py:build_modle"))
    _assert_usage_error(_cli("scan", str(config)), "Did you mean 'build_model'")
    config.write_text(GOOD.replace("models.py:build_model", "modles.py:build_model"))
    _assert_usage_error(_cli("scan", str(config)), "modles.py", "does not exist")
