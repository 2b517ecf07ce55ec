"""What a bundle carries: only the code the spec runs (never secrets), and data that runs nothing when opened.

code/: the entry files and the local modules they import, inside the spec's folder; secrets next to the
spec, hidden folders, symlinks out of the folder and unimported files stay out. Data: a planted pickle in
a bundle file is refused by reproduce.py, never unpickled. RNG state: JSON that rebuilds Paddle's state.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nandoctor.findings import FirstFault, Phase, Report
from nandoctor.report.bundle import write_bundle
from nandoctor.report.bundle_code import is_secret_name
from nandoctor.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_configs"

MODEL = ("import paddle\nimport helpers\nfrom nets import blocks\nfrom . import nothing_here  # noqa\n"
         "try:\n    import secrets_local\nexcept ImportError:\n    pass\n"
         "import credentials\nimport outside_link\n\n\ndef build_model():\n"
         "    return paddle.nn.Linear(3, 2)\n")
DATA = ("import numpy as np\n\n\ndef build_loader():\n    for _ in range(2):\n"
        "        yield np.ones((4, 3), 'float32'), np.zeros((4,), 'int64')\n")
CONFIG = ('version: 1\nmodel: {entry: "model.py:build_model"}\n'
          'data: {entry: "data.py:build_loader", fields: [x, y], label: y}\nloss: {builtin: cross_entropy}\n')


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A spec folder with code the model imports, secrets beside it and a symlink out of it."""
    root = tmp_path / "proj"
    (root / "nets").mkdir(parents=True)
    (root / ".private").mkdir()
    (root / "model.py").write_text(MODEL)
    (root / "data.py").write_text(DATA)
    (root / "config.yaml").write_text(CONFIG)
    (root / "helpers.py").write_text("X = 1\n")
    (root / "nets" / "__init__.py").write_text("")
    (root / "nets" / "blocks.py").write_text("from .layers import L  # noqa\n")
    (root / "nets" / "layers.py").write_text("L = 1\n")
    (root / "unused.py").write_text("U = 1\n")
    (root / "secrets_local.py").write_text("TOKEN = 'hunter2'\n")
    (root / "credentials.py").write_text("PASSWORD = 'hunter2'\n")
    (root / ".env").write_text("API_KEY=hunter2\n")
    (root / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    (root / "server.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    (root / ".private" / "notes.py").write_text("SECRET = 1\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "outside_link.py").write_text("HOME_THING = 1\n")
    (root / "outside_link.py").symlink_to(elsewhere / "outside_link.py")
    return root / "config.yaml"


def test_code_holds_entries_and_their_local_imports_only(project: Path, tmp_path: Path):
    out = write_bundle(Report(command="probe"), load_spec(project), tmp_path / "b")
    copied = sorted(str(p.relative_to(out / "code")) for p in (out / "code").rglob("*") if p.is_file())
    assert copied == ["data.py", "helpers.py", "model.py", "nets/__init__.py", "nets/blocks.py", "nets/layers.py"]
    everything = b"".join(p.read_bytes() for p in out.rglob("*") if p.is_file())
    assert b"hunter2" not in everything and b"PRIVATE KEY" not in everything and b"HOME_THING" not in everything
    readme = (out / "README.txt").read_text()
    assert "Files in code/:\n- data.py\n- helpers.py\n- model.py\n" in readme
    assert "secrets_local.py not copied: its name looks like a secret" in readme
    assert "credentials.py not copied: its name looks like a secret" in readme
    assert "outside_link.py not copied: it lies outside the spec's folder" in readme
    assert "reproduce.py and everything in code/ are Python code" in readme


def test_modules_the_run_imported_come_along(project: Path, tmp_path: Path):
    """A dynamic import (importlib by name) the static scan cannot see, found in sys.modules."""
    root = project.parent
    (root / "plugin_mod.py").write_text("P = 1\n")
    sys.path.insert(0, str(root))
    try:
        __import__("plugin_mod")
        out = write_bundle(Report(command="probe"), load_spec(project), tmp_path / "b")
    finally:
        sys.path.remove(str(root))
        sys.modules.pop("plugin_mod", None)
    assert (out / "code" / "plugin_mod.py").read_text() == "P = 1\n"
    assert not (out / "code" / "unused.py").exists()


def test_no_code_leaves_code_out(project: Path, tmp_path: Path):
    out = write_bundle(Report(command="probe"), load_spec(project), tmp_path / "b", include_code=False)
    assert not (out / "code").exists()
    assert "code/: left out (--no-code)" in (out / "README.txt").read_text()


@pytest.mark.parametrize(("name", "secret"), [
    (".env", True), (".env.local", True), ("prod.env", True), ("server.pem", True), ("tls.key", True),
    ("id_rsa", True), ("id_ed25519.pub", True), (".netrc", True), ("credentials.json", True),
    ("aws_credentials.py", True), ("my_secret.py", True), ("cert.p12", True), ("hf_token.py", True),
    ("model.py", False), ("keyboard.py", False), ("data_loader.py", False)])
def test_secret_names(name: str, secret: bool):
    assert is_secret_name(name) is secret


# --- inert data files ------------------------------------------------------------------------------------


class _Exploit:
    """Unpickling this writes a marker file: proof that a loader ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _scan_bundle(tmp_path: Path) -> Path:
    from nandoctor.workload.build import build_workload

    spec = load_spec(SAMPLES / "nan_in_data" / "config.yaml")
    workload = build_workload(spec)
    fields = workload.layout.fields(list(workload.make_loader())[3], 3)
    report = Report(command="scan")
    report.first_fault = FirstFault(step=None, phase=Phase.DATA, batch_index=3, sample_indices=[5])
    report.artifacts = {"batch": fields}
    return write_bundle(report, spec, tmp_path / "b")


def _run(bundle: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, str(bundle / "reproduce.py")], cwd=cwd, capture_output=True,
                          text=True, env=env, timeout=300)


def test_bundle_data_files_hold_no_pickle(tmp_path: Path):
    out = _scan_bundle(tmp_path)
    assert not list(out.glob("*.pkl")) and not list(out.glob("*.pdparams"))
    with np.load(out / "batch.npz", allow_pickle=False) as data:  # raises if anything in it needs pickle
        assert {name: data[name].dtype.hasobject for name in data.files} == {"x": False, "y": False}


@pytest.mark.parametrize("plant", ["object_array_in_batch", "pickle_as_batch", "pickle_as_state"])
def test_reproduce_refuses_a_planted_pickle_and_never_runs_it(tmp_path: Path, plant: str):
    out = _scan_bundle(tmp_path)
    marker = tmp_path / "pwned"
    exploit = _Exploit(marker)
    if plant == "object_array_in_batch":
        np.savez(out / "batch.npz", x=np.array([exploit], dtype=object))  # numpy pickles object arrays
    elif plant == "pickle_as_batch":
        (out / "batch.npz").write_bytes(pickle.dumps({"x": exploit}))
    else:
        report = json.loads((out / "report.json").read_text())
        report["first_fault"]["phase"] = "params"  # reproduce.py then reads state.npz
        (out / "report.json").write_text(json.dumps(report))
        (out / "state.npz").write_bytes(pickle.dumps({"w": exploit}))
    # The file would run code if unpickled: prove the plant is live.
    if plant != "object_array_in_batch":
        target = out / ("batch.npz" if plant == "pickle_as_batch" else "state.npz")
        pickle.loads(target.read_bytes())
        assert marker.exists()
        marker.unlink()
    done = _run(out, tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "not a plain array archive" in done.stderr and "was not loaded" in done.stderr
    assert not marker.exists()


def test_rng_state_json_restores_paddles_generator(tmp_path: Path, capfd: pytest.CaptureFixture[str]):
    import paddle

    from nandoctor.engine.artifacts import rng_state_json

    paddle.seed(123)
    paddle.rand([5])
    state = paddle.get_rng_state()
    expected = paddle.rand([4]).numpy()
    data = rng_state_json(state)
    assert data is not None and json.loads(json.dumps(data)) == data
    (tmp_path / "rng_state.json").write_text(json.dumps(data))
    shutil.copyfile(ROOT / "nandoctor" / "standalone" / "reproduce.py", tmp_path / "reproduce.py")
    module = runpy.run_path(str(tmp_path / "reproduce.py"), run_name="bundle_reproduce")
    paddle.seed(999)
    module["set_rng"](module["load_rng"]())
    assert np.array_equal(paddle.rand([4]).numpy(), expected)


def test_installed_packages_inside_the_project_stay_out_silently(project: Path, tmp_path: Path):
    """A virtualenv next to the spec: its imported packages are not the user's code, and get no note each."""
    site = project.parent / "venv" / "lib" / "site-packages"
    site.mkdir(parents=True)
    (site / "some_pkg_xyz.py").write_text("Q = 1\n")
    sys.path.insert(0, str(site))
    try:
        __import__("some_pkg_xyz")
        out = write_bundle(Report(command="probe"), load_spec(project), tmp_path / "b")
    finally:
        sys.path.remove(str(site))
        sys.modules.pop("some_pkg_xyz", None)
    assert not list((out / "code").rglob("some_pkg_xyz.py"))
    assert "some_pkg_xyz" not in (out / "README.txt").read_text()


def test_a_module_linked_inside_the_folder_keeps_its_import_name(project: Path, tmp_path: Path):
    root = project.parent
    (root / "impl").mkdir()
    (root / "impl" / "real_helpers.py").write_text("R = 1\n")
    (root / "helpers.py").unlink()
    (root / "helpers.py").symlink_to(root / "impl" / "real_helpers.py")
    out = write_bundle(Report(command="probe"), load_spec(project), tmp_path / "b")
    assert (out / "code" / "helpers.py").read_text() == "R = 1\n"
    assert not (out / "code" / "helpers.py").is_symlink()


def test_no_code_flag_on_the_command_line(tmp_path: Path):
    from typer.testing import CliRunner

    from nandoctor.cli import app

    out = tmp_path / "bundle"
    result = CliRunner().invoke(app, ["scan", str(SAMPLES / "nan_in_data" / "config.yaml"), "--quiet",
                                      "--bundle", str(out), "--no-code"])
    assert result.exit_code == 1, result.output
    assert not (out / "code").exists()
    assert "code/: left out (--no-code)" in (out / "README.txt").read_text()


@pytest.mark.parametrize("name, text", [("report.json", "[1, 2]"), ("spec.yaml", "- just a list\n")])
def test_reproduce_says_which_bundle_file_is_not_a_mapping(tmp_path: Path, name: str, text: str,
                                                           capsys: pytest.CaptureFixture[str]):
    """A hand-edited or truncated bundle file gets one line that names it, exit 2, not a TypeError."""
    out = _scan_bundle(tmp_path)
    (out / name).write_text(text)
    spec = importlib.util.spec_from_file_location("_bundle_reproduce", out / "reproduce.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main([]) == 2
    err = capsys.readouterr().err
    assert f"{name} in {out}" in err and "is not the mapping nandoctor wrote" in err and "Traceback" not in err


def test_a_model_input_that_is_no_array_is_named_as_left_out_of_batch_npz(tmp_path: Path):
    """A graph object handed to the model (pgl's Graph under `run`) cannot go into batch.npz: the bundle's
    README names it, so a reader knows why reproduce.py lacks that input; the array fields are saved."""
    from nandoctor.engine.artifacts import capture
    from nandoctor.report.bundle_files import save_artifacts

    class Graph:  # a library's object with a numpy() of its own, which nandoctor must not call
        def numpy(self) -> None:
            raise AssertionError("called the object's own numpy()")

    report = Report(command="run")
    report.first_fault = FirstFault(step=3, phase=Phase.BACKWARD)
    capture(report, {"graph": Graph(), "x": np.ones((4, 2), np.float32)}, step=3, batch_index=None)
    (tmp_path / "b").mkdir()
    notes = save_artifacts(report, tmp_path / "b")
    assert any("not saved" in note and note.endswith(": graph") for note in notes), notes
    with np.load(tmp_path / "b" / "batch.npz", allow_pickle=False) as data:
        assert data.files == ["x"]
    report.artifacts = {}
    capture(report, {"graph": Graph()}, step=3, batch_index=None)  # nothing else: still named, no empty npz
    (tmp_path / "c").mkdir()
    assert any(note.endswith(": graph") for note in save_artifacts(report, tmp_path / "c"))
    assert not (tmp_path / "c" / "batch.npz").exists()
