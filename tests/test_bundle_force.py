"""`--bundle DIR --force` replaces only a folder of the bundle's own files; a failed write names its real cause.

The manifest (`.nandoctor-bundle.json`) lists every file a bundle wrote, with its size; these tests check
that --force replaces an earlier bundle (even one reproduce.py has run in) and refuses every folder that
holds anything else, through the CLI (exit 2, nothing touched), including symlinks and `--bundle .`.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nandoctor.cli import app
from nandoctor.errors import OutputError
from nandoctor.findings import Report
from nandoctor.report import bundle as bundle_module
from nandoctor.report.bundle import MANIFEST, foreign_files, write_bundle
from nandoctor.spec import load_spec

ROOT = Path(__file__).resolve().parent.parent
NAN_DATA = ROOT / "sample_configs" / "nan_in_data" / "config.yaml"


def _cli(*args: str):
    return CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"}).invoke(app, list(args))


def _snapshot(folder: Path) -> dict[str, bytes | str]:
    """Every entry under `folder` (links as their target text), to show nothing changed."""
    out: dict[str, bytes | str] = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = Path(root) / name
            rel = str(path.relative_to(folder))
            out[rel] = ("link:" + os.readlink(path)) if path.is_symlink() else (
                "dir" if path.is_dir() else path.read_bytes())
    return out


@pytest.fixture
def earlier(tmp_path: Path) -> Path:
    """A real earlier bundle (a probe report with no fault: quick to write)."""
    out = tmp_path / "b"
    write_bundle(Report(command="probe"), load_spec(NAN_DATA), out)
    return out


def _scan_force(out: Path, *extra: str):
    return _cli("scan", str(NAN_DATA), "--bundle", str(out), "--force", "--quiet", *extra)


def test_manifest_lists_every_file_with_its_size(earlier: Path):
    data = json.loads((earlier / MANIFEST).read_text())
    files = {str(p.relative_to(earlier)): p.stat().st_size for p in earlier.rglob("*")
             if p.is_file() and p.name != MANIFEST}
    assert data["files"] == files
    assert {"report.json", "report.md", "reproduce.py", "README.txt", "code/model.py"} <= set(files)
    assert foreign_files(earlier) == []


def test_force_replaces_an_earlier_bundle_even_after_reproduce_ran(earlier: Path, tmp_path: Path):
    (earlier / "reproduce.log").write_text("checker log")  # what reproduce.py leaves
    (earlier / "code" / "__pycache__").mkdir()
    (earlier / "code" / "__pycache__" / "model.cpython-312.pyc").write_bytes(b"\0")
    result = _scan_force(earlier)
    assert result.exit_code == 1, result.output
    assert json.loads((earlier / "report.json").read_text())["command"] == "scan"
    assert not (earlier / "reproduce.log").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]  # no .partial / .old folder left behind


def test_a_bundle_with_no_code_to_copy_has_no_code_folder_and_can_be_replaced(tmp_path: Path):
    """The spec's code outside its folder (absolute entries): nothing is copied, so no empty code/ folder
    that the manifest cannot list and that made --force refuse nandoctor's own bundle."""
    text = NAN_DATA.read_text().replace('"model.py:', f'"{NAN_DATA.parent / "model.py"}:').replace(
        '"data.py:', f'"{NAN_DATA.parent / "data.py"}:')
    config = tmp_path / "elsewhere" / "config.yaml"
    config.parent.mkdir()
    config.write_text(text)
    out = tmp_path / "b"
    first = _cli("scan", str(config), "--bundle", str(out), "--quiet")
    assert first.exit_code == 1, first.output
    assert not (out / "code").exists() and foreign_files(out) == []
    again = _cli("scan", str(config), "--bundle", str(out), "--force", "--quiet")
    assert again.exit_code == 1, again.output


@pytest.mark.parametrize("plant", ["top", "nested", "edited", "empty_dir"])
def test_force_refuses_a_bundle_that_holds_anything_else(earlier: Path, plant: str):
    if plant == "top":
        (earlier / "notes.txt").write_text("mine")
    elif plant == "nested":
        (earlier / "code" / "secret_work.py").write_text("mine")
    elif plant == "edited":
        (earlier / "report.md").write_text("my own notes on this bug, longer than before " * 50)
    else:
        (earlier / "results").mkdir()
    before = _snapshot(earlier)
    result = _scan_force(earlier)
    assert result.exit_code == 2, result.output
    named = {"top": "notes.txt", "nested": "code/secret_work.py", "edited": "report.md", "empty_dir": "results/"}
    assert "nandoctor did not write" in result.output and named[plant] in result.output
    assert _snapshot(earlier) == before


def test_force_refuses_a_folder_with_only_a_hand_written_report_json(tmp_path: Path):
    """The old rule (a report.json with nandoctor's schema) let a copied report.json open a project to --force."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "report.json").write_text(json.dumps({"schema": "nandoctor.report/1"}))
    (folder / "train.py").write_text("precious")
    result = _scan_force(folder)
    assert result.exit_code == 2
    assert "report.json" in result.output and "train.py" in result.output
    assert (folder / "train.py").read_text() == "precious"


def test_force_refuses_a_forged_manifest_that_does_not_list_the_files(earlier: Path):
    (earlier / "thesis.tex").write_text("years of work")
    manifest = json.loads((earlier / MANIFEST).read_text())
    manifest["files"]["../outside.txt"] = 3  # a path out of the folder is never taken on trust
    (earlier / MANIFEST).write_text(json.dumps(manifest))
    result = _scan_force(earlier)
    assert result.exit_code == 2
    assert (earlier / "thesis.tex").read_text() == "years of work"


def test_bundle_dot_in_a_project_is_refused_with_and_without_force(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch):
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("precious")
    (project / "report.json").write_text(json.dumps({"schema": "nandoctor.report/1"}))
    monkeypatch.chdir(project)
    before = _snapshot(project)
    for flags in (["--force"], []):
        result = _cli("scan", str(NAN_DATA), "--bundle", ".", "--quiet", *flags)
        assert result.exit_code == 2, result.output
    assert _snapshot(project) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["project"]


@pytest.mark.parametrize("target", ["earlier_bundle", "project", "dangling"])
def test_a_symlinked_target_is_refused_and_nothing_is_written_through_it(earlier: Path, tmp_path: Path,
                                                                         target: str):
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text("precious")
    pointee = {"earlier_bundle": earlier, "project": project, "dangling": tmp_path / "gone"}[target]
    link = tmp_path / "link"
    link.symlink_to(pointee, target_is_directory=True)
    before = {p.name: _snapshot(p) if p.is_dir() and not p.is_symlink() else None for p in tmp_path.iterdir()}
    result = _scan_force(link)
    assert result.exit_code == 2, result.output
    assert "symbolic link" in result.output
    assert link.is_symlink() and os.readlink(link) == str(pointee)
    after = {p.name: _snapshot(p) if p.is_dir() and not p.is_symlink() else None for p in tmp_path.iterdir()}
    assert after == before  # no .partial folder, nothing changed behind the link


def test_a_symlink_inside_the_bundle_is_foreign_and_never_followed(earlier: Path, tmp_path: Path):
    outside = tmp_path / "home"
    outside.mkdir()
    (outside / "id_rsa").write_text("key")
    (earlier / "code" / "more").symlink_to(outside, target_is_directory=True)
    result = _scan_force(earlier)
    assert result.exit_code == 2, result.output
    assert "code/more" in result.output
    assert (outside / "id_rsa").read_text() == "key"
    assert (earlier / "code" / "more").is_symlink()


def test_a_bundle_changed_between_check_and_replace_is_put_back(earlier: Path, tmp_path: Path):
    new = tmp_path / "new"
    new.mkdir()
    (new / "report.md").write_text("new")
    (earlier / "late.txt").write_text("written while the run went on")
    with pytest.raises(OSError):
        bundle_module._move_into_place(new, earlier, force=True)
    assert (earlier / "late.txt").read_text() == "written while the run went on"
    assert (new / "report.md").is_file()


# --- a write that fails says why ------------------------------------------------------------------------


def _fail_fill_with(monkeypatch: pytest.MonkeyPatch, action) -> None:
    real_fill = bundle_module.fill

    def fill(report, spec, folder, **kwargs):
        real_fill(report, spec, folder, **kwargs)
        action(folder)

    monkeypatch.setattr(bundle_module, "fill", fill)


def test_a_folder_that_appears_during_the_write_is_named_as_the_cause(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch):
    out = tmp_path / "b"

    def appear(folder: Path) -> None:
        out.mkdir()
        (out / "theirs.txt").write_text("made by another process")

    _fail_fill_with(monkeypatch, appear)
    with pytest.raises(OutputError) as info:
        write_bundle(Report(command="probe"), load_spec(NAN_DATA), out)
    message = str(info.value)
    assert "appeared while nandoctor was running" in message and "space" not in message
    assert (out / "theirs.txt").read_text() == "made by another process"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


@pytest.mark.parametrize(("code", "expected", "not_expected"), [
    (errno.ENOSPC, "disk (or your quota) is full", "permission"),
    (errno.EACCES, "permission denied", "space"),
    (errno.EIO, "Input/output error", "space"),
])
def test_write_errors_name_their_real_cause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int,
                                            expected: str, not_expected: str):
    def fail(folder: Path) -> None:
        raise OSError(code, os.strerror(code), str(folder / "batch.npz"))

    _fail_fill_with(monkeypatch, fail)
    with pytest.raises(OutputError) as info:
        write_bundle(Report(command="probe"), load_spec(NAN_DATA), tmp_path / "b")
    assert expected in str(info.value) and not_expected not in str(info.value)
    assert list(tmp_path.iterdir()) == []  # the partial folder is gone


def test_bundle_permissions_follow_the_umask(tmp_path: Path):
    old = os.umask(0o027)
    try:
        out = write_bundle(Report(command="probe"), load_spec(NAN_DATA), tmp_path / "b")
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o750  # not mkdtemp's 0700
    assert stat.S_IMODE((out / "code").stat().st_mode) == 0o750
    assert stat.S_IMODE((out / "report.md").stat().st_mode) == 0o640


def test_a_name_too_long_for_the_file_system_is_refused_before_the_run(tmp_path: Path):
    out = tmp_path / ("b" * 245)  # fits alone, not with the temporary folder's suffix
    result = _cli("scan", str(NAN_DATA), "--bundle", str(out), "--json", str(tmp_path / "r.json"))
    assert result.exit_code == 2, result.output
    assert "too long" in result.output
    assert list(tmp_path.iterdir()) == []  # refused before the run: no report, no probe folder


def test_a_folder_without_manifest_is_answered_from_its_top_level(tmp_path: Path):
    big = tmp_path / "home"
    (big / "deep" / "er").mkdir(parents=True)
    (big / "deep" / "er" / "x.txt").write_text("x")
    (big / "a.txt").write_text("a")
    assert foreign_files(big) == ["a.txt", "deep/"]
