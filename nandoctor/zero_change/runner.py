"""The parent side of `nandoctor run`: run COMMAND with the watcher preloaded, then report.

The command runs as a child with its own stdin/stdout/stderr, so its output passes through untouched;
with nothing found its exit status is ours. After a fault the child writes the report (JSON) to a file
in a private temporary folder and stops with status 1 (unless --keep-going); the parent renders it,
writes --json / --markdown, and exits 1. Under `python -m paddle.distributed.launch` every rank is
watched (the variable and PYTHONPATH are inherited) and rank 0's merged report is the one shown; the
parent also watches where each rank stands (rank_progress.py), as `probe --nproc` does, to name a rank
that raised alone, was killed or hung, and kills every rank left when the launch ends. Child
processes the script starts itself (multiprocessing, fork or spawn) are each watched on their own, and the
first fault of any process is the one shown (processes.py).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from nandoctor.errors import OutputError, SpecError
from nandoctor.findings import Report, Verdict
from nandoctor.parallel.rank_progress import ENV as RANK_PROGRESS
from nandoctor.parallel.rank_progress import Ending, RankWatch
from nandoctor.parallel.supervisor import Supervisor
from nandoctor.zero_change.processes import OWN_ERROR, merge_children

if TYPE_CHECKING:
    from rich.console import Console

SITE = Path(__file__).resolve().parent / "site"


def _stderr() -> Console:
    from rich.console import Console  # (here: a healthy run's parent prints without rich, _say)

    return Console(stderr=True, highlight=False, soft_wrap=True)


def _say(message: str) -> None:
    """One line of nandoctor's own on standard error, as it is (no markup, no wrapping)."""
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def run_script(command: list[str], console: Callable[[], Console], *, json_path: Path | None = None,
               markdown_path: Path | None = None, bundle: Path | None = None, keep_going: bool = False,
               quiet: bool = False, force: bool = False) -> int:
    """Run `command` watched; the exit status `nandoctor run` returns. `console()`: where the report for
    people goes (made only when one is shown: a healthy run's verdict line goes to standard error)."""
    from nandoctor.engine import interrupt
    from nandoctor.report.writer import is_stdout

    _check_before(command, json_path, markdown_path, bundle, force)
    # SIGINT/SIGTERM outside the supervisor's forwarding (the script has ended; its report is being merged
    # and shown) raise, so the temporary folder still goes, instead of the default action killing this process
    with interrupt.handled(), tempfile.TemporaryDirectory(prefix="nandoctor-run-") as tmp:
        result = Path(tmp) / "report.json"
        # the ranks of a launch in the command each keep their position there (rank_progress.py)
        ranks = RankWatch(Path(tmp) / "progress", whole_loop=False)
        env = _script_env(result, ranks, bundle, keep_going)
        # `--json -` gives standard output to the report: the script's own output goes to standard error
        script = _start(command, env, ranks, stdout=2 if is_stdout(json_path) or is_stdout(markdown_path) else None)
        returncode, stopped_by = script.wait()
        if ranks.ending.seen:
            _merge_ranks(result, ranks.ending, failed=stopped_by is None and returncode != 0)
        merge_children(result)  # a child process of the script's that trained and faulted first
        if not result.is_file():
            return _without_report(command, Path(tmp), returncode, stopped_by)
        report = _read_report(result, stopped_by)
    report.run["command_line"] = shlex.join(command)
    _write(report, console, bundle=bundle, ranks_seen=ranks.ending.seen, json_path=json_path,
           markdown_path=markdown_path, quiet=quiet)
    return _exit_status(report, returncode, stopped_by, ranks.ending)


def _check_before(command: list[str], json_path: Path | None, markdown_path: Path | None, bundle: Path | None,
                  force: bool) -> None:
    """A command to run, and outputs that can be written, before the script starts."""
    from nandoctor.report.writer import check_writable_file

    if not command:
        raise SpecError("nothing to run: give the command after --, e.g. `nandoctor run -- python train.py`.")
    for path in (json_path, markdown_path):
        if path is not None:
            check_writable_file(path)
    if bundle is not None:  # as probe and scan do: never over a folder of the user's, never found out late
        from nandoctor.report.bundle import check_bundle_target  # (here: it imports the spec and report stack)

        check_bundle_target(bundle, force)


def _script_env(result: Path, ranks: RankWatch, bundle: Path | None, keep_going: bool) -> dict[str, str]:
    """The script's environment: the watcher preloaded (site/), where it writes, where ranks keep their place."""
    config = {"result": str(result), "report_dir": str(bundle.resolve()) if bundle is not None else None,
              "keep_going": keep_going}
    env = dict(os.environ)
    env["NANDOCTOR_RUN"] = json.dumps(config)
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), *filter(None, [env.get("PYTHONPATH")])])
    env[RANK_PROGRESS] = str(ranks.folder)
    return env


def _start(command: list[str], env: dict[str, str], ranks: RankWatch, stdout: int | None) -> Supervisor:
    """The user's command in its own process group, so a signal to `nandoctor run` reaches it once: SIGINT and
    SIGTERM are passed on to the group, and only after the grace period is it killed. The ranks of a launch
    it may start are looked at meanwhile: when none has moved for the hang limit, every process of the
    command is killed; when it ends, the ranks left (each in a session of its own) are."""
    try:
        return Supervisor(command, ranks, forward_signals=True, on_forward=_said_forwarded, env=env, stdout=stdout)
    except FileNotFoundError:
        raise SpecError(f"cannot run {command[0]!r}: no such program. Give the full command after --, e.g. "
                        "`nandoctor run -- python train.py`.") from None
    except PermissionError:
        raise SpecError(f"cannot run {command[0]!r}: it is not executable.") from None


def _said_forwarded(signum: int, grace: float) -> None:
    _say(f"nandoctor run: {_signal_name(signum)} passed to the script; it has {grace:g} s to "
         "stop on its own (its handlers, a checkpoint save) before it is killed.")


def _without_report(command: list[str], tmp: Path, returncode: int, stopped_by: int | None) -> int:
    """The exit status when the script left no report, and why there is none."""
    if stopped_by is not None:
        _say(f"nandoctor run: {_signal_name(stopped_by)} stopped the script before it wrote a "
             "report (before its first training step, or a library it imports had taken over "
             "the signal); no report.")
        return 128 + stopped_by
    if returncode < 0:
        return _killed(-returncode)
    own_error = tmp / OWN_ERROR
    if own_error.is_file():
        _say(f"nandoctor run: nandoctor failed while writing the report at the script's end "
             f"({own_error.read_text(encoding='utf-8')[:300]}). This is a bug in nandoctor, "
             "not in your script; no report was written. The command's own exit status "
             "follows.")
        return returncode
    if not (tmp / "watched").exists():
        _say(f"nandoctor run: nothing was watched: {' '.join(command[:3])} never stepped a "
             "Paddle optimizer on a model in training mode (or its Python cannot import "
             "nandoctor). The command's own exit status follows.")
    return returncode  # nothing found: the script's own status


def _read_report(result: Path, stopped_by: int | None) -> Report:
    """The watched run's report; partial, with what stopped it, when a signal did before any fault."""
    try:
        report = Report.from_dict(json.loads(result.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise OutputError(f"the watched run's report could not be read ({exc}).") from None
    if stopped_by is not None and not report.first_fault:
        from nandoctor.engine.interrupt import interrupted_finding

        report.partial = True
        steps = f"{report.run.get('steps_run', 0)} step(s)"
        report.findings.append(interrupted_finding("nandoctor run", steps, signum=stopped_by))
    return report


def _write(report: Report, console: Callable[[], Console], *, bundle: Path | None, ranks_seen: bool,
           json_path: Path | None, markdown_path: Path | None, quiet: bool) -> None:
    """The report shown and written: --json, --markdown, and the job's report in the --bundle folder."""
    from nandoctor.report.common import plain_text_stream
    from nandoctor.report.writer import write_outputs

    if bundle is not None and ranks_seen and report.exit_code and not (bundle / "report.json").is_file():
        from nandoctor.report.writer import write_folder

        write_folder(report, bundle)  # the job's report, beside the ones ranks wrote alone (rank-N/)
    # A clean run's output stays the script's own: one line on stderr (plain text where rich would add no
    # style: common.plain_text_stream); the files are written all the same
    healthy = report.verdict == Verdict.HEALTHY
    shown = (None if plain_text_stream(sys.stderr) else _stderr()) if healthy else console()
    write_outputs(report, shown, json_path=json_path, markdown_path=markdown_path, quiet=quiet or healthy)
    if bundle is not None and (bundle / "report.json").is_file():
        console().print(f"Report folder written to [bold]{bundle}[/].", soft_wrap=True)


def _exit_status(report: Report, returncode: int, stopped_by: int | None, ending: Ending | None = None) -> int:
    """128 + the signal passed on; 128 + a signal nandoctor did not send; 1 for a fault; 0 for a healthy
    launch whose only failure came after every rank had ended (Paddle's teardown); else the script's."""
    if stopped_by is not None:
        return 128 + stopped_by
    signum = teardown_signal(ending, returncode) if ending is not None and not report.exit_code else None
    if signum is not None:
        _say(f"nandoctor run: a rank of the launch died of {_signal_name(signum)} after its script "
             "had ended and its report was written: in the native teardown at interpreter exit "
             "(Paddle's C++ destructors), after every rank had run all its exit handlers. The "
             f"training and this report are complete; exit 0, not the launcher's {returncode}. "
             "Nothing to rerun (docs/paddle-teardown.md).")
        return 0
    if returncode < 0 and not report.exit_code:
        return _killed(-returncode)
    return 1 if report.exit_code else (returncode or 0)


def _merge_ranks(result: Path, ending: Ending, *, failed: bool) -> None:
    """The job's report when the ranks of a launch did not agree on one: ranks whose own code raised each
    wrote theirs alone (`report.rankN.json`, rank 0's where the result goes; no collective: the others were
    inside one of the script's), and where each rank stood says which one was killed or hung (`failed`: the
    launch did not end well on its own; a rank gone without a word from a launch that exited 0 ended its
    own way). The result is written where rank 0's goes, unless the ranks agreed on a fault."""
    from nandoctor.findings import Mode
    from nandoctor.parallel.distributed import rank_failure
    from nandoctor.report import json as json_report

    own = _load_report(result)
    if own is not None and own.exit_code and "rank" not in own.run:
        return  # rank 0's merged report of a fault the ranks agreed on
    reports = {}
    for path in result.parent.glob(f"{result.stem}.rank*{result.suffix}"):
        try:
            rank = int(path.stem.rsplit(".rank", 1)[1])
        except ValueError:
            continue
        report = _load_report(path)
        if report is not None and report.exit_code:  # (not a healthy one written as the launcher stopped it)
            reports[rank] = report
    if own is not None and own.exit_code:
        reports[int(own.run["rank"])] = own
    if not failed and not ending.hung:
        ending = Ending(ending.world, positions=ending.positions, logs=ending.logs)
    if not reports and not ending.died and not ending.hung:
        return
    import paddle

    merged = rank_failure(reports, ending, mode=Mode.RUN, device=str(paddle.device.get_device()))
    if merged is not None:
        result.write_text(json_report.render(merged), encoding="utf-8")


def teardown_signal(ending: Ending, returncode: int) -> int | None:
    """The signal a rank died of after its whole Python exit (`Ending.all_exited`), read from the launch's
    status (Paddle's launcher exits with its failed rank's own status: -11, SIGSEGV, becomes 245); None when
    the launch failed otherwise (a status of the script's own, sys.exit(1) after a raise) or some rank did not
    get that far (a crash in the script or in an exit handler stays the launch's failure)."""
    if returncode == 0 or not ending.all_exited:
        return None
    signum = -returncode if returncode < 0 else 256 - returncode if 128 < returncode < 256 else 0
    try:
        return int(signal.Signals(signum))
    except ValueError:
        return None


def _load_report(path: Path) -> Report | None:
    try:
        return Report.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _killed(signum: int) -> int:
    """The script died of a signal nandoctor did not send (SIGKILL from the OOM killer): 128 + its number."""
    why = " (the kernel's out-of-memory killer sends it, and so does kill -9)" if signum == signal.SIGKILL else ""
    _say(f"nandoctor run: the script was killed by {_signal_name(signum)}{why}; exit {128 + signum}.")
    return 128 + signum
