"""The probe names the user's source line that created the offending op, and Paddle's C++ output
from the checked replay (the [PRECISION] line, the op-creation stack) never reaches the terminal."""

from __future__ import annotations

from pathlib import Path

import pytest

from nandoctor.probe import ProbeOptions, run_probe
from nandoctor.spec import load_spec

SAMPLES = Path(__file__).resolve().parent.parent / "sample_configs"


def _line_of(path: Path, needle: str) -> int:
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if needle in line:
            return number
    raise AssertionError(f"{needle!r} not in {path}")


@pytest.mark.parametrize(
    ("sample", "needle", "phase"),
    [
        ("sqrt_at_zero", "paddle.sqrt(", "backward"),  # backward op: from the stack Paddle recorded in forward
        ("masked_where_grad", "paddle.log(", "backward"),
        ("div_by_zero_layer", "/", "forward"),  # forward op: from the line running when the checker logged it
        ("causal_padding_decoder", "scores - rowmax", "forward"),  # not the mask's -inf lines
        ("masked_attention", "self.encoder(", "forward"),  # softmax inside Paddle: the line calling into it
        ("gated_mlp_backward", "paddle.sqrt(", "backward"),
    ],
)
def test_source_line_of_the_offending_op(sample: str, needle: str, phase: str, capfd: pytest.CaptureFixture[str]
                                         ) -> None:
    report = run_probe(load_spec(SAMPLES / sample / "config.yaml"), ProbeOptions(steps=40, seed=0, device="cpu"))
    finding = report.findings[0]
    assert finding.location.phase.value == phase
    source = finding.evidence["source"]
    file, line = source.split(" ")[0].split(":")
    assert file == "model.py"
    text = (SAMPLES / sample / "model.py").read_text().splitlines()[int(line) - 1]
    assert needle in text, f"{source} points at {text!r}"
    assert f"created at {source}" in finding.message
    from rich.console import Console

    from nandoctor.report import console as console_report
    from nandoctor.report import markdown as markdown_report

    screen = Console(width=100, record=True, force_terminal=False)
    console_report.render(report, screen)
    panel = screen.export_text().split("first fault", 1)[1].split("╰", 1)[0]
    assert "source" in panel and source.split(" ")[0] in panel  # model.py:N in the first-fault panel
    assert f"created at `{source}`" in markdown_report.render(report)
    printed = capfd.readouterr()
    assert "[PRECISION]" not in printed.out + printed.err
    assert "There are nan/inf" not in printed.out + printed.err


def test_the_interpreters_own_files_and_nandoctors_console_script_are_not_the_users(tmp_path: Path) -> None:
    """With a library model and a builtin loss no frame is the user's: the outermost one left was the
    `nandoctor` console script in the venv's bin/ ("created at .../bin/nandoctor:8"), which must not be
    named as the user's source."""
    import sys

    from nandoctor.workload.entrypoints import is_user_file

    bin_dir = Path(sys.executable).parent
    assert not is_user_file(bin_dir / "nandoctor", None)
    assert not is_user_file(bin_dir / "some-tool", None)  # any script installed next to the interpreter
    assert not is_user_file(Path(sys.prefix) / "share" / "x.py", None)
    assert not is_user_file(Path("/elsewhere/venv/bin/nandoctor"), None)  # our console script in another venv
    user = tmp_path / "train.py"
    user.write_text("x = 1\n")
    assert is_user_file(user, None) and is_user_file(user, tmp_path.resolve())
    assert is_user_file(bin_dir / "train.py", bin_dir.resolve())  # the spec's own folder always counts
    # ... but for a venv inside it: installed packages, not the user's code (nandoctor run's folder is the
    # working folder when the model is a library's, and a project's .venv sits there)
    venv_lib = tmp_path / ".venv" / "lib" / "python3.11" / "site-packages" / "lib_x" / "layers.py"
    assert not is_user_file(venv_lib, tmp_path.resolve())
    assert is_user_file(tmp_path / "src" / "model.py", tmp_path.resolve())


def test_no_paddle_warning_caused_by_nandoctors_own_ops(tmp_path: Path) -> None:
    """Paddle logs "Got different data type, run type promotion automatically" (glog, once a process) when an
    op mixes dtypes; a plain loop over this sample never logs it, so a probe (scan of the weights' scale,
    watcher, localisation, remedy replays) must not either. A fresh process: the line is logged only once."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "nandoctor", "probe", str(SAMPLES / "log_of_zero" / "config.yaml"),
                           "--json", str(tmp_path / "r.json"), "-q"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "type promotion" not in done.stderr, done.stderr
