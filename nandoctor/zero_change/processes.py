"""Which model and which process a `nandoctor run` report is about.

A script may train more than one model (each with its own optimizer: a GAN) and may train in child
processes it starts itself (multiprocessing with `fork` or `spawn`, `os.fork`, a new Python program started
with subprocess). Each child that trains is
watched on its own: a forked child drops the parent's watches (`os.register_at_fork`) and a spawned one
starts its own session from sitecustomize (PYTHONPATH and NANDOCTOR_RUN are inherited). A child writes its
result beside the parent's as `report.pid<N>.json`, at the fault (multiprocessing ends children with
`os._exit`: no atexit) and stops, as the command's own process would (a Pool's worker does not: its
task would be lost and the pool would wait for it forever; its faulty update is dropped, the later ones
are not watched), and the parent `nandoctor run` reports the first fault of any process
(`merge_children`), naming the process in the finding's message and in `details.process`. A
multiprocessing child whose own code raises is reported too (`watch_exceptions`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

# beside the result: nandoctor's own failure at the script's exit, as text (here, not in runtime.py, so the
# parent `nandoctor run` reads its name without importing the watcher and, through it, numpy)
OWN_ERROR = "own_error"

ROOT_PID = "NANDOCTOR_RUN_ROOT_PID"  # the pid of the command's first watched process, for its children


def name_model(report: Any, index: int, names: list[str]) -> None:
    """More than one model watched: the report says which one, by class, and its position among them."""
    from nandoctor.findings import Severity

    report.details["model"] = names[index]
    report.details["models"] = list(names)
    where = f"In {names[index]} (model {index + 1} of {len(names)} this script trains, each with its own optimizer): "
    for finding in report.findings:
        if finding.severity == Severity.ERROR and not finding.message.startswith("In "):
            finding.message = where + finding.message


# ---- the child's side ----------------------------------------------------------------------------------
_forks = 0  # children this process forked so far: a forked child's position among its siblings


def child_info() -> dict[str, Any] | None:
    """None in the command's own process; else what names this child (pid, parent, position)."""
    root = os.environ.get(ROOT_PID)
    if root is None:
        os.environ[ROOT_PID] = str(os.getpid())  # inherited by spawned children (and their env copies)
        return None
    if root == str(os.getpid()):
        return None
    if os.environ.get("PADDLE_TRAINER_ID") is not None:
        # a launcher's ranks are watched as ranks (report.rankN.json), and each keeps its position for the
        # parent from its start on, so one that dies or hangs before its first step is seen too
        from nandoctor.parallel.rank_progress import launched_rank

        launched_rank()
        return None
    spawned = "--multiprocessing-fork" in (getattr(sys, "orig_argv", None) or [])  # multiprocessing's spawn
    return {"pid": os.getpid(), "parent_pid": os.getppid(), "start": "spawn" if spawned else "exec"}


def on_fork(session: Any) -> None:
    """Count forks in the parent; in the child, reset the session (the parent's watches are not its)."""
    def before() -> None:
        global _forks
        _forks += 1

    def child() -> None:
        session.reset_child({"pid": os.getpid(), "parent_pid": os.getppid(), "start": "fork", "child": _forks})
        if "multiprocessing.process" in sys.modules:  # (a multiprocessing child: its run() comes next)
            watch_exceptions(session)

    os.register_at_fork(before=before, after_in_child=child)


def watch_exceptions(session: Any) -> None:
    """In a multiprocessing child: an exception out of the process's `run()` (its target, or a subclass's own
    `run`) is reported as the child's `user_code.error` before multiprocessing prints it and exits 1, as
    the command's own process reports one through sys.excepthook (which multiprocessing never calls)."""
    from multiprocessing import process

    bootstrap = process.BaseProcess._bootstrap
    if getattr(bootstrap, "_nandoctor", False):
        return

    def _bootstrap(self: Any, *args: Any, **kwargs: Any) -> Any:
        run = self.run

        def watched_run() -> Any:
            try:
                return run()
            except Exception as exc:
                try:
                    session.crashed(exc)
                except Exception:  # noqa: BLE001 - never stand between the user and their traceback
                    pass
                raise

        self.run = watched_run
        return bootstrap(self, *args, **kwargs)

    _bootstrap._nandoctor = True  # type: ignore[attr-defined]
    process.BaseProcess._bootstrap = _bootstrap  # type: ignore[method-assign]


def describe(process: dict[str, Any]) -> dict[str, Any]:
    """The child's details at the fault: its multiprocessing name and position where it has them."""
    info = dict(process)
    info["fault_time"] = time.time()
    try:
        import multiprocessing

        current = multiprocessing.current_process()
        if multiprocessing.parent_process() is not None:
            info["name"] = current.name
            if current._identity:  # (2,): the second child its parent started
                info["child"] = int(current._identity[-1])
    except Exception:  # noqa: BLE001 - the pid alone still names it
        pass
    return info


def in_pool_worker() -> bool:
    """A multiprocessing.Pool's worker process (ForkPoolWorker-1, SpawnPoolWorker-2)."""
    import multiprocessing

    return "PoolWorker" in multiprocessing.current_process().name


def result_path(path: Path, process: dict[str, Any] | None) -> Path:
    return path if process is None else path.with_name(f"{path.stem}.pid{process['pid']}{path.suffix}")


def mark_report(report: Any, process: dict[str, Any]) -> None:
    """A child's report names the child: in `details.process` and in front of its error findings."""
    from nandoctor.findings import Severity

    if "process" in report.details:  # (--keep-going writes the first fault's report again at exit)
        return
    info = describe(process)
    report.details["process"] = info
    for finding in report.findings:
        if finding.severity == Severity.ERROR and not finding.message.startswith("In child process"):
            finding.message = f"In child process {_who(info)}: " + finding.message


_HOW = {"fork": "forked", "spawn": "spawned by multiprocessing", "exec": "a new program"}


def _who(info: dict[str, Any]) -> str:
    position = f"child {info['child']}, " if info.get("child") else ""
    name = f" {info['name']}" if info.get("name") else ""
    how = _HOW.get(str(info.get("start")), str(info.get("start")))
    return f"pid {info['pid']}{name} ({position}{how} from pid {info.get('parent_pid')})"


# ---- the parent's side ---------------------------------------------------------------------------------
def merge_children(result: Path) -> None:
    """The first fault of any process is the run's: a child's report replaces the command's own (or stands
    in for it) when the command's own process found no fault, or found it later. When only children
    trained (a wrapper script that starts the training), a child's report is the run's, faulty or not."""
    from nandoctor.findings import Report
    from nandoctor.report import json as json_report

    children = [(path, data) for path in result.parent.glob(f"{result.stem}.pid*{result.suffix}")
                if (data := _load(path)) is not None]
    faulted = [(float((d.get("details") or {}).get("process", {}).get("fault_time") or 0.0), d)
               for _, d in children if d.get("first_fault")]
    own = _load(result)
    if faulted:
        when, best = min(faulted, key=lambda pair: pair[0])
        if own is not None and own.get("first_fault") and _mtime(result) <= when:
            return  # the command's own process wrote its report at its fault, before the child's
    elif own is None and children:  # a warning before a clean run; the last to finish among equals
        best = min(children, key=lambda c: (c[1].get("verdict") == "healthy", -_mtime(c[0])))[1]
    else:
        return
    result.write_text(json_report.render(Report.from_dict(best)), encoding="utf-8")


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return float("inf")


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
