"""`--bundle DIR`: contents, reproduce.py as a subprocess, re-rendering, refusal, --force, bad paths, Ctrl-C.

A probe-style bundle is built from the `sqrt_at_zero` sample with the report filled in by hand (the
batch, state and first fault the probe would capture), so these tests check the bundle and reproduce.py
on their own; the end-to-end probe test runs when `nandoctor.probe` can run.
"""

from __future__ import annotations

import json
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from nandoctor.cli import app
from nandoctor.findings import Code, Finding, FirstFault, Phase, Report, Severity, TimelinePoint
from nandoctor.report.bundle import check_bundle_target, write_bundle
from nandoctor.report.plots import make_plots
from nandoctor.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_configs"
PYTHON = sys.executable


def _cli(*args: str):
    return CliRunner(env={"COLUMNS": "100", "NO_COLOR": "1"}).invoke(app, list(args))


def _reproduce(bundle: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    """reproduce.py as a user runs it: a fresh interpreter, from another folder, nandoctor not imported."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([PYTHON, str(bundle / "reproduce.py")], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=300)


def _reproduce_here(bundle: Path, capfd: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """The same script run in this process (no second Paddle import): for the many-case tests."""
    capfd.readouterr()
    code = runpy.run_path(str(bundle / "reproduce.py"), run_name="bundle_reproduce")["main"]()
    return code, capfd.readouterr().out


def _first_fault_line(stdout: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith("first fault: ")]
    assert lines, f"reproduce.py printed no 'first fault:' line:\n{stdout}"
    return lines[0]


# --- a probe-style bundle for sqrt_at_zero, filled in by hand ----------------------------------------


def _sqrt_report() -> tuple[Report, object]:
    import paddle

    from nandoctor.workload.build import build_workload

    spec = load_spec(SAMPLES / "sqrt_at_zero" / "config.yaml")
    workload = build_workload(spec)
    batches = list(workload.make_loader())
    fields = workload.layout.fields(batches[6], 6)
    report = Report(command="probe", run={"command_line": "nandoctor probe config.yaml --bundle out"})
    report.first_fault = FirstFault(step=6, phase=Phase.BACKWARD, layer="head.distance", op="sqrt_grad",
                                    batch_index=6, sample_indices=[3])
    report.findings.append(Finding(Code.GRAD_NONFINITE, Severity.ERROR, "gradient went NaN",
                                   report.first_fault.as_location()))
    report.timeline = [TimelinePoint(step=i, loss=1.0 / (i + 1), grad_norm=0.5 + i) for i in range(6)]
    report.timeline.append(TimelinePoint(step=6, loss=0.1, grad_norm=float("nan")))
    layers = [name for name, _ in workload.model.named_sublayers()]
    values = [[1.0 + i + j for i in range(7)] for j in range(len(layers))]
    report.details["activation_max"] = {"layers": layers, "steps": list(range(7)), "values": values}
    report.details["clip"] = 3.0
    report.environment = {"paddle": paddle.__version__, "device": "cpu"}
    report.artifacts = {"batch": fields, "model_state": {k: v.numpy() for k, v in
                                                         workload.model.state_dict().items()},
                        "rng_state": paddle.get_rng_state(), "step": 6}
    return report, spec


@pytest.fixture(scope="module")
def sqrt_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    report, spec = _sqrt_report()
    out = tmp_path_factory.mktemp("probe") / "bundle"
    assert write_bundle(report, spec, out) == out
    return out


def test_probe_bundle_holds_every_file(sqrt_bundle: Path):
    for name in ("report.md", "report.json", "batch.npz", "state.npz", "rng_state.json", ".nandoctor-bundle.json",
                 "environment.json", "command.txt", "spec.yaml", "reproduce.py", "code/model.py", "code/data.py",
                 "plots/loss_and_grad_norm.png", "plots/activation_heatmap.png"):
        assert (sqrt_bundle / name).is_file(), name
    data = json.loads((sqrt_bundle / "report.json").read_text())
    assert data["schema"] == "nandoctor.report/1"
    assert data["first_fault"]["op"] == "sqrt_grad"
    assert "artifacts" not in data
    assert (sqrt_bundle / "command.txt").read_text().strip() == "nandoctor probe config.yaml --bundle out"
    assert (sqrt_bundle / "spec.yaml").read_bytes() == (SAMPLES / "sqrt_at_zero" / "config.yaml").read_bytes()
    assert json.loads((sqrt_bundle / "environment.json").read_text())["device"] == "cpu"
    # No temporary folder is left next to the bundle.
    assert sorted(p.name for p in sqrt_bundle.parent.iterdir()) == ["bundle"]


def test_batch_is_saved_losslessly_with_field_names(sqrt_bundle: Path):
    report, _ = _sqrt_report()
    with np.load(sqrt_bundle / "batch.npz") as saved:
        assert saved.files == ["a", "b", "target"]
        for name, original in report.artifacts["batch"].items():
            assert saved[name].dtype == original.dtype
            assert np.array_equal(saved[name], original)
        assert np.array_equal(saved["a"][3], saved["b"][3])  # the duplicate pair is there


def test_state_loads_without_pickle_and_fits_the_model(sqrt_bundle: Path):
    from nandoctor.workload.build import build_workload

    report, spec = _sqrt_report()
    with np.load(sqrt_bundle / "state.npz", allow_pickle=False) as saved:
        state = {name: saved[name] for name in saved.files}
    assert set(state) == set(report.artifacts["model_state"])
    for name, value in report.artifacts["model_state"].items():
        assert np.array_equal(state[name], value), name
    model = build_workload(spec).model
    model.set_state_dict(state)
    assert all(np.array_equal(v.numpy(), state[k]) for k, v in model.state_dict().items())


def test_markdown_links_plots_that_exist(sqrt_bundle: Path):
    markdown = (sqrt_bundle / "report.md").read_text()
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown)
    assert sorted(links) == ["plots/activation_heatmap.png", "plots/loss_and_grad_norm.png"]
    for link in links:
        assert (sqrt_bundle / link).is_file(), link
        assert (sqrt_bundle / link).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_reproduce_prints_the_reported_first_fault(sqrt_bundle: Path, tmp_path: Path):
    """...and keeps Paddle's checker log in the bundle (reproduce.log), leaving $TMPDIR and code/ clean."""
    private_tmp = tmp_path / "tmpdir"
    private_tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"TMPDIR": str(private_tmp)}
    result = subprocess.run([PYTHON, str(sqrt_bundle / "reproduce.py")], cwd=tmp_path, capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert _first_fault_line(result.stdout) == "first fault: op=sqrt_grad phase=backward layer=head.distance"
    assert "matches the report: yes" in result.stdout
    log = sqrt_bundle / "reproduce.log"
    assert f"checker log (the Python stack where each op was created): {log}" in result.stdout
    assert "sqrt_grad" in log.read_text(errors="replace")
    assert list(private_tmp.iterdir()) == []
    assert not (sqrt_bundle / "code" / "__pycache__").exists()


# Each of these faults comes from the data, so the sample's fresh model at the bad batch shows it too.
FRESH_STATE_FAULTS = {
    # forward finite (where() drops the log's -inf); the first NaN that reaches training is log_grad's
    "masked_where_grad": (7, "first fault: op=log_grad phase=backward layer=features.logfeat"),
    "div_by_zero_layer": (9, "first fault: op=divide phase=forward layer=pool"),
    "empty_mask_mean": (4, "first fault: op=divide phase=loss layer=-"),
    "neg_fractional_pow": (5, "first fault: op=pow phase=forward layer=features.compress"),
}


@pytest.mark.parametrize("sample", sorted(FRESH_STATE_FAULTS))
def test_reproduce_names_phase_op_and_layer(sample: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]):
    from nandoctor.workload.build import build_workload

    batch_index, expected = FRESH_STATE_FAULTS[sample]
    spec = load_spec(SAMPLES / sample / "config.yaml")
    workload = build_workload(spec)
    fields = workload.layout.fields(list(workload.make_loader())[batch_index], batch_index)
    report = Report(command="probe")
    report.artifacts = {"batch": fields, "model_state": {k: v.numpy() for k, v in
                                                         workload.model.state_dict().items()}}
    write_bundle(report, spec, tmp_path / "b")
    code, out = _reproduce_here(tmp_path / "b", capfd)
    assert code == 1, out
    assert _first_fault_line(out) == expected


def test_reproduce_exits_0_when_the_step_is_clean(tmp_path: Path, capfd: pytest.CaptureFixture[str]):
    """The same bundle with the duplicate pair made distinct: nothing to reproduce, exit 0."""
    report, spec = _sqrt_report()
    batch = {k: np.array(v) for k, v in report.artifacts["batch"].items()}
    batch["b"][3] += 1.0
    report.artifacts["batch"] = batch
    write_bundle(report, spec, tmp_path / "clean")
    code, out = _reproduce_here(tmp_path / "clean", capfd)
    assert code == 0, out
    assert "no fault" in out


def test_reproduce_needs_no_nandoctor(sqrt_bundle: Path):
    source = (sqrt_bundle / "reproduce.py").read_text()
    imports = re.findall(r"^\s*(?:from|import) ([\w.]+)", source, flags=re.M)
    allowed = {"__future__", "collections", "contextlib", "importlib", "json", "os", "re", "sys",
               "warnings", "pathlib", "typing", "numpy", "yaml", "paddle"}  # no pickle, no tempfile
    assert {name.split(".")[0] for name in imports} <= allowed


def test_rerender_bundle_report(sqrt_bundle: Path, tmp_path: Path):
    result = _cli("report", str(sqrt_bundle / "report.json"))
    assert result.exit_code == 1, result.output
    assert "sqrt_grad" in result.output and "head.distance" in result.output
    out = tmp_path / "again.md"
    result = _cli("report", str(sqrt_bundle / "report.json"), "--markdown", str(out))
    assert result.exit_code == 1, result.output
    in_bundle = (sqrt_bundle / "report.md").read_text()
    again = out.read_text()
    # the plots are linked from where each Markdown file is: so the links work wherever it was written
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", again)
    assert images and all((out.parent / link).resolve().is_file() for link in images)
    same = re.sub(r"!\[([^\]]*)\]\([^)]+\)", r"![\1]()", again)
    assert re.sub(r"!\[([^\]]*)\]\([^)]+\)", r"![\1]()", in_bundle).startswith(same)  # adds "In this bundle"
    assert "\n## In this bundle\n\n- `reproduce.py`" in in_bundle and "## In this bundle" not in again


# --- plots on their own -------------------------------------------------------------------------------


@pytest.mark.parametrize("details", [
    {},
    {"activation_max": {"layers": [], "steps": [], "values": []}},
    {"activation_max": {"layers": ["a"], "steps": [0, 1], "values": [[1.0]]}},  # ragged: skipped
    {"activation_max": "not a table", "grad_norms": None, "clip": "none"},
])
def test_plots_skip_missing_or_broken_details(tmp_path: Path, details: dict):
    report = Report(command="probe", details=details)
    assert make_plots(report, tmp_path / "plots") == {}


def test_heatmap_tolerates_nan_and_marks_fp16(tmp_path: Path):
    report = Report(command="probe", timeline=[TimelinePoint(step=0, loss="nan", grad_norm="inf")])
    report.details["activation_max"] = {"layers": ["x", "y"], "steps": [0, 1],
                                        "values": [[1.0, 1.0e5], ["nan", "inf"]]}
    report.details["grad_norms"] = {"parameters": ["w"], "steps": [0, 1], "values": [[0.0, 2.0]]}
    written = make_plots(report, tmp_path)
    assert list(written.values()) == ["activation_heatmap.png"]  # no finite loss: no loss plot
    assert (tmp_path / "activation_heatmap.png").stat().st_size > 1000


# --- scan bundles and the target checks, through the CLI -----------------------------------------------


NAN_DATA = SAMPLES / "nan_in_data" / "config.yaml"


def test_scan_bundle_holds_the_bad_batch_and_reproduce_finds_it(tmp_path: Path):
    out = tmp_path / "scan-bundle"
    result = _cli("scan", str(NAN_DATA), "--bundle", str(out), "--quiet")
    assert result.exit_code == 1, result.output
    assert f"Bundle written to {out}" in result.output.replace("\n", "")
    with np.load(out / "batch.npz") as saved:
        assert set(saved.files) == {"x", "y"}
        assert np.isnan(saved["x"][5, 7]) and np.isfinite(np.delete(saved["x"], 5, axis=0)).all()
    assert not (out / "state.npz").exists()
    assert sorted(p.name for p in (out / "code").iterdir()) == ["data.py", "model.py"]
    done = _reproduce(out, tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert _first_fault_line(done.stdout) == "first fault: phase=data field=x batch=3 samples=5"


def test_existing_bundle_is_refused_before_the_run_and_kept(tmp_path: Path):
    out = tmp_path / "b"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    result = _cli("scan", str(NAN_DATA), "--bundle", str(out), "--json", str(tmp_path / "r.json"))
    assert result.exit_code == 2
    assert "already exists" in result.output and "--force" in result.output
    assert (out / "mine.txt").read_text() == "keep me"
    assert not (tmp_path / "r.json").exists()  # refused before the run: nothing was written


def test_unwritable_bundle_path_exits_2(tmp_path: Path):
    (tmp_path / "somefile.txt").write_text("x")
    result = _cli("scan", str(NAN_DATA), "--bundle", str(tmp_path / "somefile.txt" / "bundle"))
    assert result.exit_code == 2
    assert "is a file, not a folder" in result.output


def test_bundle_path_that_is_a_file_exits_2(tmp_path: Path):
    (tmp_path / "taken").write_text("x")
    with pytest.raises(Exception, match="it is a file"):
        check_bundle_target(tmp_path / "taken", force=True)


def test_missing_parents_are_created(tmp_path: Path):
    out = tmp_path / "new" / "deeper" / "b"
    result = _cli("scan", str(NAN_DATA), "--bundle", str(out), "--quiet")
    assert result.exit_code == 1, result.output
    assert (out / "report.md").is_file()


# --- Ctrl-C: a partial report, still written ----------------------------------------------------------

INTERRUPT_FILES = {
    "model.py": ("import paddle\n\n\ndef build_model():\n    paddle.seed(0)\n"
                 "    nn = paddle.nn\n"
                 "    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))\n"),
    "data.py": ("import numpy as np\n\n\ndef build_loader(stop_at=3, nan_at=1):\n"
                "    rng = np.random.default_rng(0)\n    for i in range(10):\n"
                "        if i == stop_at:\n            raise KeyboardInterrupt\n"
                "        x = rng.normal(size=(4, 3)).astype('float32')\n"
                "        if i == nan_at:\n            x[2, 1] = float('nan')\n"
                "        yield x, np.array([0, 1, 0, 1], dtype='int64')\n"),
    "config.yaml": ("version: 1\nmodel: {entry: \"model.py:build_model\"}\n"
                    "data: {entry: \"data.py:build_loader\", args: {stop_at: 3, nan_at: 1}, fields: [x, y], "
                    "label: y}\nloss: {builtin: cross_entropy}\n"
                    "optimizer: {name: SGD, args: {learning_rate: 0.1}}\n"
                    "probe: {steps: 8, device: cpu}\n"),
}


@pytest.fixture
def interrupted_project(tmp_path: Path) -> Path:
    for name, text in INTERRUPT_FILES.items():
        (tmp_path / name).write_text(text)
    return tmp_path / "config.yaml"


def _check_partial_outputs(tmp_path: Path, out: Path) -> dict:
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["partial"] is True
    assert json.loads((out / "report.json").read_text())["partial"] is True
    assert "Partial report" in (tmp_path / "r.md").read_text()
    assert "Partial report" in (out / "report.md").read_text()
    return data


def test_interrupted_scan_still_writes_json_markdown_and_bundle(interrupted_project: Path, tmp_path: Path):
    out = tmp_path / "b"
    result = _cli("scan", str(interrupted_project), "--json", str(tmp_path / "r.json"), "--markdown",
                  str(tmp_path / "r.md"), "--bundle", str(out), "--quiet")
    assert result.exit_code == 130, result.output  # Ctrl-C: 130 (contract), the NaN of batch 1 still reported
    data = _check_partial_outputs(tmp_path, out)
    assert data["verdict"] == "nan_found"  # an error found before the interrupt keeps its verdict
    assert data["first_fault"]["batch_index"] == 1
    with np.load(out / "batch.npz") as saved:
        assert np.isnan(saved["x"][2, 1])


def _probe_runs() -> bool:
    try:
        from nandoctor.probe import run_probe  # noqa: F401
    except ImportError:
        return False
    return True


needs_probe = pytest.mark.skipif(not _probe_runs(), reason="nandoctor.probe is not in this tree yet")


@needs_probe
def test_interrupted_probe_still_writes_json_markdown_and_bundle(interrupted_project: Path, tmp_path: Path):
    """Ctrl-C at batch 3 of a healthy run: the three steps before it are reported, marked partial."""
    interrupted_project.write_text(interrupted_project.read_text().replace("nan_at: 1", "nan_at: 99"))
    out = tmp_path / "b"
    result = _cli("probe", str(interrupted_project), "--json", str(tmp_path / "r.json"), "--markdown",
                  str(tmp_path / "r.md"), "--bundle", str(out), "--quiet")
    assert result.exit_code == 130, result.output  # Ctrl-C: 130 (contract), never 0 for a run cut short
    data = _check_partial_outputs(tmp_path, out)
    assert data["verdict"] == "interrupted"
    assert [p["step"] for p in data["timeline"]] == [0, 1, 2]
    assert "run.interrupted" in {f["code"] for f in data["findings"]}


@needs_probe
def test_probe_bundle_end_to_end_reproduces_the_reported_fault(tmp_path: Path):
    out = tmp_path / "b"
    result = _cli("probe", str(SAMPLES / "sqrt_at_zero" / "config.yaml"), "--bundle", str(out), "--quiet")
    assert result.exit_code == 1, result.output
    fault = json.loads((out / "report.json").read_text())["first_fault"]
    for name in ("batch.npz", "state.npz", "rng_state.json", "reproduce.py"):
        assert (out / name).is_file(), name
    done = _reproduce(out, tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert _first_fault_line(done.stdout) == (f"first fault: op={fault['op']} phase={fault['phase']} "
                                              f"layer={fault['layer']}")
    assert fault["op"] == "sqrt_grad" and fault["layer"] == "head.distance"


@needs_probe
def test_reproduce_calls_a_keyword_model_and_takes_its_own_loss(tmp_path: Path, capfd: pytest.CaptureFixture[str]):
    """data.inputs as a mapping and model.output: loss (no loss block) replay as the probe ran them."""
    out = tmp_path / "b"
    config = SAMPLES / "kwargs_structured_outputs" / "empty_text.yaml"
    result = _cli("probe", str(config), "--steps", "12", "--bundle", str(out), "--quiet")
    assert result.exit_code == 1, result.output
    code, stdout = _reproduce_here(out, capfd)
    assert code == 1, stdout
    assert _first_fault_line(stdout) == "first fault: op=divide phase=forward layer=pool"


def test_code_copy_follows_entries_and_skips_big_files(tmp_path: Path):
    """A package named by a module entry, a sub-folder file entry and what they import; not a 2 MB file,
    not files nothing imports (behaviour change: the spec folder's other .py files no longer come along)."""
    (tmp_path / "nets").mkdir()
    (tmp_path / "nets" / "__init__.py").write_text("")
    (tmp_path / "nets" / "models.py").write_text("import helpers\nfrom table import T\n" + INTERRUPT_FILES["model.py"])
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "data.py").write_text(INTERRUPT_FILES["data.py"])
    (tmp_path / "sub" / "unrelated.py").write_text("")
    (tmp_path / "other.py").write_text("")
    (tmp_path / "helpers.py").write_text("")
    (tmp_path / "table.py").write_text("# data in disguise\n" * 120_000 + "T = 0\n")
    config = tmp_path / "config.yaml"
    config.write_text(INTERRUPT_FILES["config.yaml"].replace("model.py:build_model", "nets.models:build_model")
                      .replace("data.py:build_loader", "sub/data.py:build_loader").replace("stop_at: 3", "stop_at: 9"))
    out = tmp_path / "out" / "b"
    result = _cli("scan", str(config), "--bundle", str(out), "--quiet")
    assert result.exit_code == 130, result.output  # the loader raises KeyboardInterrupt at batch 9: Ctrl-C
    copied = sorted(str(p.relative_to(out / "code")) for p in (out / "code").rglob("*.py"))
    assert copied == ["helpers.py", "nets/__init__.py", "nets/models.py", "sub/data.py"]
    readme = (out / "README.txt").read_text()
    assert "code/table.py not copied" in readme
    assert "Files in code/:\n- helpers.py\n- nets/__init__.py\n- nets/models.py\n- sub/data.py\n" in readme


def test_bundle_of_a_healthy_run_has_nothing_to_reproduce(tmp_path: Path):
    spec = load_spec(SAMPLES / "sqrt_at_zero" / "config.yaml")
    report = Report(command="probe", timeline=[TimelinePoint(step=0, loss=1.0, grad_norm=1.0)])
    write_bundle(report, spec, tmp_path / "b")
    assert not (tmp_path / "b" / "batch.npz").exists()
    assert "the run found no fault (verdict healthy)" in (tmp_path / "b" / "README.txt").read_text()
    result = _reproduce(tmp_path / "b", tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "nothing to reproduce" in result.stdout


STEP_FILES = {
    "model.py": ("import paddle\n\n\nclass Log(paddle.nn.Layer):\n    def forward(self, x):\n"
                 "        return paddle.log(x)\n\n\nclass Net(paddle.nn.Layer):\n    def __init__(self):\n"
                 "        super().__init__()\n        self.lin = paddle.nn.Linear(3, 2)\n        self.log = Log()\n\n"
                 "    def forward(self, x):\n        return self.log(paddle.abs(self.lin(x)) + x[:, :2])\n\n\n"
                 "def build_model():\n    paddle.seed(0)\n    return Net()\n"),
    "train.py": ("import paddle\n\n\ndef step(model, batch):\n    out = model(batch['x'])\n"
                 "    return paddle.log(out.mean() * batch['scale'].mean())\n"),
}


@pytest.mark.parametrize(("x", "scale", "expected"), [
    (-1.0e4, 1.0, "first fault: op=log phase=forward layer=log"),  # log of a negative number in the layer
    (1.0, 0.0, "first fault: op=log phase=loss layer=-"),  # log(0) in the user's step, after the model
])
def test_reproduce_with_a_step_function(tmp_path: Path, x: float, scale: float, expected: str,
                                        capfd: pytest.CaptureFixture[str]):
    for name, text in STEP_FILES.items():
        (tmp_path / name).write_text(text)
    config = tmp_path / "config.yaml"
    config.write_text('version: 1\nmodel: {entry: "model.py:build_model"}\n'
                      'data: {entry: "model.py:build_model"}\nstep: {entry: "train.py:step"}\n')
    report = Report(command="probe")
    report.artifacts = {"batch": {"x": np.full((4, 3), x, dtype="float32"),
                                  "scale": np.full((4,), scale, dtype="float32")}}
    write_bundle(report, load_spec(config), tmp_path / "b")
    code, out = _reproduce_here(tmp_path / "b", capfd)
    assert code == 1, out
    assert _first_fault_line(out) == expected


def test_ctrl_c_inside_the_model_during_scan_still_writes_a_partial_report(interrupted_project: Path,
                                                                            tmp_path: Path):
    """Ctrl-C lands wherever the time goes; here in the model call scan makes to infer num_classes."""
    model = interrupted_project.parent / "model.py"
    model.write_text(model.read_text() + "\n\nclass Stop(paddle.nn.Layer):\n    def forward(self, x):\n"
                     "        raise KeyboardInterrupt\n\n\ndef build_stop():\n    return Stop()\n")
    interrupted_project.write_text(interrupted_project.read_text().replace("model.py:build_model",
                                                                           "model.py:build_stop"))
    out = tmp_path / "b"
    result = _cli("scan", str(interrupted_project), "--json", str(tmp_path / "r.json"), "--markdown",
                  str(tmp_path / "r.md"), "--bundle", str(out), "--quiet")
    assert result.exit_code == 130, result.output  # Ctrl-C: 130 (contract), the partial report written
    _check_partial_outputs(tmp_path, out)


def test_reproduce_of_a_batch_with_a_mask_names_the_nan_field_not_the_mask(tmp_path: Path,
                                                                          capfd: pytest.CaptureFixture[str]):
    """The bundle's own re-check judges a batch as the probe does: a causal mask's -inf is not a fault."""
    models = ROOT / "tests" / "probe_models.py"
    spec = tmp_path / "config.yaml"
    spec.write_text(
        "version: 1\n"
        f"model: {{entry: '{models}:masked_attention'}}\n"
        f"data: {{entry: '{models}:mask_loader', args: {{nan_batch: 3, nan_row: 2}}, inputs: [x, mask], "
        "label: label}\n"
        "loss: {builtin: cross_entropy}\n"
        "optimizer: {name: Adam, args: {learning_rate: 0.01}}\n", encoding="utf-8")
    out = tmp_path / "b"
    result = _cli("probe", str(spec), "--steps", "6", "--bundle", str(out), "--quiet")
    assert result.exit_code == 1, result.output
    code, stdout = _reproduce_here(out, capfd)
    assert code == 1, stdout
    assert _first_fault_line(stdout) == "first fault: phase=data field=x batch=3 samples=2"
