"""Exit statuses that do not lie: internal errors (3), output paths checked by creating them and never
over the spec or its code, the unbounded scan, help texts and --version."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from test_watcher import write_spec
from typer.testing import CliRunner

from nandoctor import __version__
from nandoctor.cli import app
from nandoctor.engine.watcher import StepWatcher


def _cli(*args: str):
    return CliRunner(env={"COLUMNS": "100", "NO_COLOR": "1"}).invoke(app, [str(a) for a in args])


# --- internal errors: exit 3, one message, the traceback in a file, never user_code.error -----------------

def test_internal_error_exits_3_with_one_message_and_the_traceback_beside_the_json(tmp_path, monkeypatch):
    def broken(self, loss):
        raise ZeroDivisionError("a bug in nandoctor's bookkeeping")

    monkeypatch.setattr(StepWatcher, "after_backward", broken)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    result = _cli("probe", write_spec(tmp_path), "--steps", "3", "--json", out / "report.json", "-q")
    assert result.exit_code == 3, result.output
    text = " ".join(result.output.split())
    assert "internal error" in text and "nandoctor bug" in text and "ZeroDivisionError" in text
    assert "user_code.error" not in text and "raised" not in text.split("internal error")[0]
    [saved] = list(out.glob("nandoctor-internal-error-*.txt"))
    assert str(saved.name) in text
    body = saved.read_text(encoding="utf-8")
    assert "Traceback" in body and "bookkeeping" in body and "after_backward" not in text
    assert not (out / "report.json").exists()  # no report that could call the run healthy
    assert "Traceback" not in result.output


def test_internal_error_without_json_goes_to_the_current_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(StepWatcher, "after_update", lambda self, stepped=True: 1 / 0)
    monkeypatch.chdir(tmp_path)
    result = _cli("probe", write_spec(tmp_path), "--steps", "3", "-q")
    assert result.exit_code == 3
    assert len(list(tmp_path.glob("nandoctor-internal-error-*.txt"))) == 1


def test_all_frozen_model_is_not_an_optimizer_crash_on_the_command_line(tmp_path):
    result = _cli("probe", write_spec(tmp_path, model_args={"frozen": True}), "--json", tmp_path / "r.json", "-q")
    assert result.exit_code == 1, result.output
    data = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    assert [f["code"] for f in data["findings"]] == ["model.no_trainable"]
    assert "Optimizer" not in json.dumps(data["findings"])


# --- output paths -------------------------------------------------------------------------------------

def test_too_long_output_name_is_exit_2_before_the_run(tmp_path):
    result = _cli("probe", write_spec(tmp_path), "--json", tmp_path / ("x" * 300 + ".json"))
    assert result.exit_code == 2
    assert "name too long" in result.output.lower() and "Traceback" not in result.output


def test_output_check_leaves_no_file_behind_and_keeps_an_existing_one(tmp_path):
    from nandoctor.report.writer import check_writable_file

    fresh, old = tmp_path / "fresh.json", tmp_path / "old.json"
    old.write_text("keep me", encoding="utf-8")
    check_writable_file(fresh)
    check_writable_file(old)
    assert not fresh.exists() and old.read_text(encoding="utf-8") == "keep me"


def test_read_only_folder_is_refused(tmp_path):
    import os

    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK) and os.geteuid() == 0:
            # root writes anywhere: a read-only *filesystem* is what stops it; emulate by a file as parent
            target = tmp_path / "a-file" / "report.json"
            (tmp_path / "a-file").write_text("", encoding="utf-8")
        else:
            target = ro / "report.json"
        result = _cli("probe", write_spec(tmp_path), "--json", target)
        assert result.exit_code == 2 and "cannot write" in result.output
    finally:
        ro.chmod(0o700)


@pytest.mark.parametrize("which", ["spec", "entry"])
def test_report_never_overwrites_the_spec_or_its_code(tmp_path, which):
    import shutil

    models = tmp_path / "models.py"
    shutil.copy(Path(__file__).with_name("watcher_models.py"), models)
    spec = write_spec(tmp_path)
    text = spec.read_text(encoding="utf-8").replace(str(Path(__file__).with_name("watcher_models.py")), "models.py")
    spec.write_text(text, encoding="utf-8")
    target = spec if which == "spec" else models
    before = target.read_bytes()
    result = _cli("probe", spec, "--steps", "2", "--json", target)
    assert result.exit_code == 2, result.output
    assert "refusing to write" in result.output and ("the spec" if which == "spec" else "imports") in result.output
    assert target.read_bytes() == before


def test_report_never_overwrites_a_module_the_user_code_imports(tmp_path):
    (tmp_path / "trust_only_helpers.py").write_text("SCALE = 1.0\n", encoding="utf-8")
    models = tmp_path / "models.py"
    models.write_text("import trust_only_helpers  # noqa\nfrom watcher_models import *  # noqa\n", encoding="utf-8")
    spec = write_spec(tmp_path)
    text = spec.read_text(encoding="utf-8").replace(str(Path(__file__).with_name("watcher_models.py")), "models.py")
    spec.write_text(text, encoding="utf-8")
    result = _cli("probe", spec, "--steps", "2", "--markdown", tmp_path / "trust_only_helpers.py", "-q")
    assert result.exit_code == 2, result.output
    assert "a file the run imports" in result.output
    assert (tmp_path / "trust_only_helpers.py").read_text(encoding="utf-8") == "SCALE = 1.0\n"


# --- scan on an endless loader --------------------------------------------------------------------------

def test_scan_of_an_endless_loader_stops_at_the_default_bound_and_says_so(tmp_path):
    from nandoctor.scan import UNSIZED_BATCH_LIMIT

    result = _cli("scan", write_spec(tmp_path, data="endless_loader"), "--json", tmp_path / "r.json", "-q")
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    [f] = [f for f in data["findings"] if f["code"] == "data.unbounded"]
    assert f["severity"] == "info" and "--batches" in f["message"]
    assert f["evidence"]["batches_scanned"] == UNSIZED_BATCH_LIMIT == 1000
    bounded = _cli("scan", write_spec(tmp_path, data="endless_loader"), "--batches", "5", "--json",
                   tmp_path / "b.json", "-q")
    assert bounded.exit_code == 0
    assert "data.unbounded" not in (tmp_path / "b.json").read_text(encoding="utf-8")


# --- help texts ----------------------------------------------------------------------------------------

def test_every_command_has_help_a_real_usage_line_and_no_type_placeholders():
    commands = typer.main.get_command(app).commands
    assert set(commands) == {"scan", "probe", "run", "report", "env"}
    for name, command in commands.items():
        assert command.help and len(command.help) > 20, name
        result = _cli(name, "--help")
        assert result.exit_code == 0
        out = result.output
        assert "<bool>" not in out and "<path>" not in out and "<int" not in out and "{" not in out, out
        usage = next(line for line in out.splitlines() if "Usage:" in line)
        assert f" {name} [OPTIONS]" in usage  # the runner names the program "root"
        if name in ("scan", "probe"):
            assert usage.split()[-1] == "CONFIG"
    top = _cli("--help").output
    assert "<bool>" not in top and "--version" in top


def test_version():
    result = _cli("--version")
    assert result.exit_code == 0 and result.output.strip() == f"nandoctor {__version__}"


@pytest.mark.parametrize("command", ["scan", "probe"])
def test_sys_exit_in_the_users_code_is_a_finding_not_a_silent_exit(tmp_path, command):
    spec = write_spec(tmp_path, data="exiting_loader", data_args={"after": 1, "code": 0})
    result = _cli(command, spec, "--json", tmp_path / "r.json", "-q")
    assert result.exit_code == 1, result.output  # exit 0 from the loader must not pass for a healthy run
    data = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    [f] = [f for f in data["findings"] if f["code"] == "user_code.error"]
    assert "SystemExit" in f["message"] and data["verdict"] == "crashed"


def test_sys_exit_in_the_model_factory_is_a_finding(tmp_path):
    spec = write_spec(tmp_path)
    spec.write_text(spec.read_text(encoding="utf-8").replace(":classifier", ":exiting_model"), encoding="utf-8")
    result = _cli("probe", spec, "--json", tmp_path / "r.json", "-q")
    assert result.exit_code == 1, result.output
    data = json.loads((tmp_path / "r.json").read_text(encoding="utf-8"))
    assert [f["code"] for f in data["findings"]] == ["user_code.error"]
    assert "SystemExit" in data["findings"][0]["message"]


def test_more_ranks_than_the_machine_has_cores_are_refused_with_the_limit(tmp_path):
    import os

    cores = os.cpu_count() or 1
    result = _cli("probe", str(write_spec(tmp_path)), "--nproc", str(cores + 62), "--device", "cpu")
    assert result.exit_code == 2, result.output
    assert f"--nproc {cores + 62}" in result.output and f"has {cores} CPU cores" in result.output
    assert f"--nproc {cores} or fewer" in result.output.replace("\n", " ")
