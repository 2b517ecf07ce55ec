"""Packaging and the edges of the command line (issue 21, "Packaging" and `--json -`): without Paddle every
command says how to install it (exit 2); a path the file system refuses is exit 2 naming it; the
internal-error message says where to report; the sdist and the wheel ship what the package reads; `--json -` gives
standard output to the JSON alone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from test_watcher import write_spec
from typer.testing import CliRunner

from nandoctor.cli import app
from nandoctor.engine.watcher import StepWatcher

ROOT = Path(__file__).resolve().parent.parent
# A sitecustomize that makes `import paddle` fail as on a machine without it (find_spec raises, as a
# meta-path finder may; a real absence makes it return None: errors.paddle_installed takes both).
HIDE_PADDLE = '''
import sys

class _NoPaddle:
    def find_spec(self, name, path=None, target=None):
        if name == "paddle" or name.startswith("paddle."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, _NoPaddle())
'''


def _cli(*args: object):
    return CliRunner(env={"COLUMNS": "100", "NO_COLOR": "1"}).invoke(app, [str(a) for a in args])


def _nandoctor(*args: object, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nandoctor", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


def _flat(text: str) -> str:
    return " ".join(text.split())


# --- without Paddle -----------------------------------------------------------------------------------

def test_every_command_without_paddle_says_how_to_install_it(tmp_path):
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE_PADDLE, encoding="utf-8")
    env = {"PYTHONPATH": os.pathsep.join([str(hide), str(ROOT)])}
    spec = write_spec(tmp_path)
    check = _nandoctor("-c", "pass", cwd=tmp_path, env=env)  # the hiding works in this Python
    assert subprocess.run([sys.executable, "-c", "import paddle"], env={**os.environ, **env},
                          capture_output=True).returncode != 0, check.stderr
    for args in (["scan", spec], ["probe", spec, "--steps", "2"], ["probe", spec, "--nproc", "2"], ["env"],
                 ["run", "--", sys.executable, "-c", "pass"]):
        done = _nandoctor(*args, cwd=tmp_path, env=env)
        text = _flat(done.stdout + done.stderr)
        assert done.returncode == 2, (args, text)
        assert 'pip install "nandoctor[cpu]"' in text and "paddlepaddle-gpu" in text, (args, text)
        assert "internal error" not in text and "Traceback" not in text, (args, text)
    assert not list(tmp_path.glob("nandoctor-internal-error-*"))


def test_report_rerenders_without_paddle(tmp_path):
    """`nandoctor report` needs no Paddle: a saved report is shown on any machine."""
    from report_samples import probe_nan_report

    from nandoctor.report import json as json_report

    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(HIDE_PADDLE, encoding="utf-8")
    saved = tmp_path / "r.json"
    saved.write_text(json_report.render(probe_nan_report()), encoding="utf-8")
    done = _nandoctor("report", saved, cwd=tmp_path, env={"PYTHONPATH": str(hide)})
    assert done.returncode == 1, done.stderr
    assert "head.distance" in done.stdout


# --- paths the file system refuses ----------------------------------------------------------------------

LONG = "x" * 300  # one name longer than any file system's 255 bytes


@pytest.mark.parametrize("option, value", [("--json", LONG + ".json"), ("--markdown", LONG + ".md"),
                                           ("--bundle", LONG), ("--json", f"{LONG}/report.json"),
                                           ("--bundle", f"{LONG}/bundle")])
@pytest.mark.parametrize("command", ["scan", "probe"])
def test_too_long_output_path_is_exit_2_naming_it(tmp_path, command, option, value):
    target = tmp_path / value
    result = _cli(command, write_spec(tmp_path), option, target, "-q")
    text = _flat(result.output)
    assert result.exit_code == 2, text
    assert str(target) in text and "too long" in text.lower(), text
    assert "internal error" not in text and not list(tmp_path.glob("nandoctor-internal-error-*"))


def test_too_long_spec_path_is_exit_2_naming_it(tmp_path):
    spec = tmp_path / (LONG + ".yaml")
    for command in ("scan", "probe"):
        result = _cli(command, spec)
        text = _flat(result.output)
        assert result.exit_code == 2, text
        assert str(spec) in text and "too long" in text.lower() and "internal error" not in text


@pytest.mark.parametrize("option, value", [("--json", LONG + ".json"), ("--markdown", LONG + ".md"),
                                           ("--bundle", LONG)])
def test_too_long_path_of_nandoctor_run_is_exit_2_naming_it(tmp_path, option, value):
    target = tmp_path / value
    result = _cli("run", option, target, "--", sys.executable, "-c", "pass")
    text = _flat(result.output)
    assert result.exit_code == 2, text
    assert str(target) in text and "too long" in text.lower() and "internal error" not in text


def test_too_long_markdown_of_nandoctor_report_is_exit_2(tmp_path):
    from report_samples import probe_nan_report

    from nandoctor.report import json as json_report

    saved = tmp_path / "r.json"
    saved.write_text(json_report.render(probe_nan_report()), encoding="utf-8")
    target = tmp_path / (LONG + ".md")
    result = _cli("report", saved, "--markdown", target)
    text = _flat(result.output)
    assert result.exit_code == 2 and str(target) in text and "too long" in text.lower(), text


def test_too_long_report_path_of_nandoctor_report_is_exit_2(tmp_path):
    target = tmp_path / (LONG + ".json")
    result = _cli("report", target)
    text = _flat(result.output)
    assert result.exit_code == 2 and str(target) in text and "too long" in text.lower(), text


def test_an_oserror_on_a_path_of_ours_is_still_a_bug(tmp_path, monkeypatch):
    """Only the user's paths are the user's: an OSError elsewhere stays exit 3."""
    def broken(self, loss):
        raise OSError(36, "File name too long", str(tmp_path / "ours" / "internal.bin"))

    monkeypatch.setattr(StepWatcher, "after_backward", broken)
    monkeypatch.chdir(tmp_path)
    result = _cli("probe", write_spec(tmp_path), "--steps", "2", "-q", "--json", tmp_path / "r.json")
    assert result.exit_code == 3, result.output


# --- the internal-error message -------------------------------------------------------------------------

def test_internal_error_says_where_the_traceback_is_and_asks_for_it_in_a_report(tmp_path, monkeypatch):
    """nandoctor has no public home yet: the message names no URL, it asks for the saved file."""
    monkeypatch.setattr(StepWatcher, "after_backward", lambda self, loss: 1 / 0)
    monkeypatch.chdir(tmp_path)
    result = _cli("probe", write_spec(tmp_path), "--steps", "2", "-q")
    text = _flat(result.output)
    assert result.exit_code == 3, text
    [saved] = tmp_path.glob("nandoctor-internal-error-*.txt")
    assert "ZeroDivisionError" in saved.read_text(encoding="utf-8")
    assert f"The traceback is saved in {saved.resolve()}." in text, text
    assert ("Please report this bug to nandoctor's maintainers with the title \"nandoctor bug: ZeroDivisionError\" "
            "and attach that file.") in text, text
    assert "http" not in text and "example." not in text and "pip show" not in text, text


def _with_project_urls(monkeypatch, *urls: str) -> None:
    """nandoctor's installed metadata as if pyproject.toml had these [project.urls] ("Label, URL")."""
    import email.message

    real = metadata.metadata

    def fake(name):
        if name != "nandoctor":
            return real(name)
        meta = email.message.Message()
        meta["Name"] = "nandoctor"
        for url in urls:
            meta["Project-URL"] = url
        return meta

    monkeypatch.setattr(metadata, "metadata", fake)


def test_internal_error_names_the_issue_tracker_once_the_metadata_has_one(tmp_path, monkeypatch):
    from nandoctor.errors import internal_error_message

    saved = tmp_path / "nandoctor-internal-error-1.txt"
    _with_project_urls(monkeypatch, "Homepage, https://home.invalid/", "Issues, https://home.invalid/issues")
    text = internal_error_message(ZeroDivisionError("x"), saved)
    assert ("Please report this bug at https://home.invalid/issues with the title \"nandoctor bug: "
            "ZeroDivisionError\" and attach that file.") in text, text
    _with_project_urls(monkeypatch, "Homepage, https://home.invalid/")  # a home page is no tracker
    assert "to nandoctor's maintainers" in internal_error_message(ZeroDivisionError("x"), saved)


def test_internal_error_without_a_saved_file_asks_for_the_printed_traceback(monkeypatch):
    from nandoctor.errors import internal_error_message

    _with_project_urls(monkeypatch)
    text = internal_error_message(ZeroDivisionError("x"), None)
    assert "The traceback could not be saved to a file, so it follows." in text
    assert text.endswith("to nandoctor's maintainers with the title \"nandoctor bug: ZeroDivisionError\" and copy "
                         "the traceback below into the report."), text


# --- what the sdist and the wheel ship ------------------------------------------------------------------

# Left out of the copy that is built: what a checkout gathers that is not the project's.
NOT_SOURCE = (".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.pyc", ".pytest_cache", ".ruff_cache",
              "nandoctor-report*", "nandoctor-internal-error-*")


@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> dict[str, Path]:
    """The sdist and the wheel as `python -m build` makes them (the wheel built from the unpacked sdist, so a
    file the sdist lacks is missing from the wheel too), with this venv's setuptools: no isolated build
    environment, so nothing is downloaded (`make dist-check` builds in isolation and installs the result)."""
    tmp = tmp_path_factory.mktemp("dists")
    source = tmp / "src"  # built from a copy: setuptools writes *.egg-info beside the sources
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    done = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp / "dist"), str(source)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [sdist] = (tmp / "dist").glob("nandoctor-*.tar.gz")
    [wheel] = (tmp / "dist").glob("nandoctor-*-py3-none-any.whl")
    return {"sdist": sdist, "wheel": wheel, "source": source}


def _wheel_files(wheel: Path) -> dict[str, bytes]:
    import zipfile

    with zipfile.ZipFile(wheel) as zf:
        return {name: zf.read(name) for name in zf.namelist()}


def _sdist_files(sdist: Path) -> dict[str, bytes]:
    import tarfile

    with tarfile.open(sdist) as tf:
        top = sdist.name[:-len(".tar.gz")] + "/"
        return {m.name[len(top):]: tf.extractfile(m).read() for m in tf.getmembers() if m.isfile()}


# The package's files that are not Python modules: each one is read at run time.
PACKAGE_DATA = ("nandoctor/py.typed", "nandoctor/report/schemas/nandoctor.report-1.schema.json",
                "nandoctor/zero_change/site/sitecustomize.py")  # sitecustomize: `nandoctor run`'s seams


def test_the_wheel_ships_every_module_the_package_data_and_the_entry_point(dists):
    files = _wheel_files(dists["wheel"])
    modules = {p.relative_to(dists["source"]).as_posix() for p in (dists["source"] / "nandoctor").rglob("*.py")}
    assert modules <= set(files), sorted(modules - set(files))
    for name in PACKAGE_DATA:
        assert name in files, name
    [entry_points] = [v for k, v in files.items() if k.endswith(".dist-info/entry_points.txt")]
    assert "nandoctor = nandoctor.__main__:main" in entry_points.decode()  # (plain `run` lines skip typer)
    assert not [k for k in files if k.startswith(("tests/", "sample_configs/", "benchmarks/", "examples/"))]
    [meta] = [v.decode() for k, v in files.items() if k.endswith(".dist-info/METADATA")]
    assert "Classifier: Typing :: Typed" in meta and "Requires-Dist: paddlepaddle>=3.0; extra == \"cpu\"" in meta


def test_the_sdist_ships_the_licence_the_readme_and_the_package_data(dists):
    files = _sdist_files(dists["sdist"])
    for name in ("LICENSE", "README.md", "pyproject.toml", "PKG-INFO", *PACKAGE_DATA):
        assert name in files, name
    assert files["LICENSE"] == (ROOT / "LICENSE").read_bytes()


def test_the_sdist_ships_whole_folders_its_tests_read(dists):
    """Its tests run from an unpacked sdist: with them, their helpers, golden files and the folders they read."""
    files, source = set(_sdist_files(dists["sdist"])), dists["source"]
    for folder in ("tests", "sample_configs", "examples", "benchmarks"):
        wanted = {p.relative_to(source).as_posix() for p in (source / folder).rglob("*") if p.is_file()}
        assert wanted and wanted <= files, (folder, sorted(wanted - files)[:10])
    assert "tests/conftest.py" in files and "Makefile" in files
    assert not [f for f in files if "__pycache__" in f or f.endswith(".pyc")]


def _metadata(dists) -> dict[str, str]:
    """The wheel's METADATA and the sdist's PKG-INFO, the text pip and an index show."""
    [wheel_meta] = [v.decode() for k, v in _wheel_files(dists["wheel"]).items() if k.endswith(".dist-info/METADATA")]
    return {"wheel": wheel_meta, "sdist": _sdist_files(dists["sdist"])["PKG-INFO"].decode()}


def test_both_name_the_apache_licence_and_the_wheel_ships_its_text(dists):
    license_text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text  # the full text, not a one-line notice
    for which, meta in _metadata(dists).items():
        headers = meta.split("\n\n", 1)[0]
        assert "License-Expression: Apache-2.0" in headers and "License-File: LICENSE" in headers, which
        assert "Not yet chosen" not in headers and "rights reserved" not in headers, which
    files = _wheel_files(dists["wheel"])
    [shipped] = [v for k, v in files.items() if k.endswith(".dist-info/licenses/LICENSE")]
    assert shipped.decode() == license_text


def test_no_placeholder_url_ships(dists):
    """No example.org home, tracker or schema $id: not in the metadata, not in any file of either."""
    shipped = {**_wheel_files(dists["wheel"]), **{f"sdist:{k}": v for k, v in _sdist_files(dists["sdist"]).items()}}
    for name, data in shipped.items():
        if name != "sdist:tests/test_packaging.py":  # this file names what it looks for
            assert b"example.org" not in data and b"example.com" not in data, name


# --- `--json -` -----------------------------------------------------------------------------------------

def test_json_dash_writes_the_json_alone_to_standard_output(tmp_path):
    spec = write_spec(tmp_path)
    for args in (["probe", spec, "--steps", "3"], ["scan", spec]):
        done = _nandoctor(*args, "--json", "-", cwd=tmp_path)
        data = json.loads(done.stdout)  # nothing else on stdout: `... --json - | python -m json.tool` works
        assert data["schema"] == "nandoctor.report/1" and data["command"] == args[0]
        assert done.returncode == 0, done.stderr
        assert "healthy" in done.stderr  # the report for people went to standard error
        assert not (tmp_path / "-").exists()


def test_json_dash_of_nandoctor_run_keeps_the_scripts_output_off_standard_output(tmp_path):
    done = _nandoctor("run", "--json", "-", "--", sys.executable, str(ROOT / "examples" / "unmodified_loop.py"),
                      cwd=tmp_path, env={"PYTHONPATH": str(ROOT)})
    data = json.loads(done.stdout)
    assert done.returncode == 1, done.stderr
    assert data["verdict"] == "nan_found" and data["first_fault"]["op"]
    assert "step 0 loss" in done.stderr  # the script's own prints, moved to standard error
    assert not (tmp_path / "-").exists()
