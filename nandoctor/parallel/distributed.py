"""Ranks of a `paddle.distributed.launch` run agreeing on a fault: one collective per step.

Every rank's doctor calls `agree()` once per `check()`, after its own detection: a vector with one slot
per rank (0 healthy, 1 non-finite gradients only, 2 a non-finite value of its own: data, loss or
update) is summed over the ranks. Every rank then knows the same thing, so all stop at the same step
and none waits at a collective the others never reach. The rank that faulted "first" is the lowest
rank with a fault of its own (2); gradients alone (1) may have come from another rank through
DataParallel's gradient all-reduce. Only on a fault is there more: each rank writes its own report
beside the merged one, a barrier, and rank 0 merges.

When the ranks never agree (one raised alone, was killed, or hung), whoever watched the launch from
outside (`probe --nproc`, `nandoctor run`) builds the job's report from what the ranks left: their own
reports and where each stood (rank_progress.py), `rank_failure`.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from nandoctor.engine.watcher import Fault, FaultKind
from nandoctor.findings import Code, Mode, Phase
from nandoctor.parallel.rank_progress import (
    HANG_SECONDS,
    Ending,
    Position,
    behind,
    hang_seconds,
    launched_rank,
    signal_in_log,
)

PEER = "peer"  # Fault.evidence key: this rank stopped because another rank faulted


def world_size() -> int:
    """Processes in the job: Paddle's parallel env when initialised, else the launcher's variable."""
    try:
        import paddle.distributed as dist

        if dist.is_initialized():
            return int(dist.get_world_size())
    except Exception:  # noqa: BLE001 - no distributed support in this build: one process
        return 1
    return int(os.environ.get("PADDLE_TRAINERS_NUM", "1") or 1)


def joined_ranks() -> int:
    """How many processes share the process group the user's own code set up (`init_parallel_env`); 1 when
    it set up none. Only such a group may carry nandoctor's per-step collective: processes started by the
    launcher that never joined one would wait on each other's all-reduce until gloo times out."""
    try:
        import paddle.distributed as dist

        return int(dist.get_world_size()) if dist.is_initialized() else 1
    except Exception:  # noqa: BLE001 - no distributed support in this build: one process
        return 1


def rank() -> int:
    try:
        import paddle.distributed as dist

        return int(dist.get_rank())
    except Exception:  # noqa: BLE001
        return int(os.environ.get("PADDLE_TRAINER_ID", "0") or 0)


def own_level(fault: Fault | None) -> int:
    """0 none, 1 non-finite gradients with a finite loss (maybe another rank's), 2 a fault of this rank's."""
    if fault is None:
        return 0
    if fault.kind == FaultKind.NONFINITE and fault.stats is not None and math.isfinite(fault.stats.loss):
        return 1
    return 2


class RankSync:
    """One per doctor; call `agree` every step on every rank."""

    def __init__(self) -> None:
        import paddle.distributed as dist

        if not dist.is_initialized():
            dist.init_parallel_env()
        self.rank = rank()
        self.world = world_size()
        self.levels: list[int] = [0] * self.world
        self.step: int | None = None
        # `nandoctor run`: this rank's position for the parent (rank_progress.py), moved on at each check
        progress = launched_rank()
        self.progress = progress if progress is not None and not progress.own_loop else None
        self._following = False

    @property
    def writes_report(self) -> bool:
        return self.rank == 0

    def agree(self, doctor: Any, fault: Fault | None) -> Fault | None:
        """The step's collective: every rank learns every rank's level; a peer's fault stops this rank too."""
        import paddle
        import paddle.distributed as dist

        progress = self.progress
        if progress is not None:
            if not self._following:  # from the first check on, the model's forward and backward move it too
                self._following = True
                progress.follow(doctor.wrapper, lambda: doctor.step)
            progress.at(doctor.step, Phase.OPTIMIZER)
        vec = [0] * self.world
        vec[self.rank] = own_level(fault)
        t = paddle.to_tensor(vec, dtype="int32")
        dist.all_reduce(t)
        levels = [int(v) for v in t.numpy().tolist()]
        if not any(levels):
            if progress is not None:  # (its update, then the next step's data: no seam between the two)
                progress.at(doctor.step + 1, Phase.DATA)
            return None
        self.levels = levels
        self.step = doctor.step
        if fault is not None:
            return fault
        w = doctor.watcher
        return Fault(FaultKind.NONFINITE, doctor.step, doctor.step, 0, w._fields, rng=w._rng,
                     evidence={PEER: True})

    def barrier(self) -> None:
        import paddle.distributed as dist

        dist.barrier()

    def first_rank(self) -> int | None:
        """The lowest rank with a fault of its own (a non-finite loss or data, or a gradient fault its own
        batch reproduces alone); else the lowest with non-finite gradients."""
        reproduced = getattr(self, "reproduced", [False] * self.world)
        for r, v in enumerate(self.levels):
            if v == 2 or (v and reproduced[r]):
                return r
        return next((r for r, v in enumerate(self.levels) if v), None)

    def alone(self, doctor: Any, report: Any) -> Any:
        """This rank's own code raised: no collective (the other ranks are inside another one, DataParallel's
        gradient all-reduce, and a mismatched call aborts them all), this rank's report written to
        report_dir/rank-N/ and returned; whoever reads the ranks' folders afterwards merges (`merge_crashed`)."""
        from nandoctor.report.writer import write_folder

        _mark_rank(report, self.rank)
        report.run["world_size"] = self.world
        if doctor.report_dir is not None:
            write_folder(report, Path(doctor.report_dir) / f"rank-{self.rank}")
        return report

    def finish(self, doctor: Any, report: Any) -> Any:
        """After a fault, on every rank: learn whose own batch reproduces it, write this rank's report to
        report_dir/rank-N/, wait for every rank, then (rank 0) return the merged report."""
        import paddle
        import paddle.distributed as dist

        from nandoctor.findings import Report
        from nandoctor.report.writer import write_folder

        ff = report.first_fault
        reproduced = ff is not None and (ff.op is not None or ff.layer is not None or bool(ff.sample_indices))
        vec = [0] * self.world
        vec[self.rank] = 1 if reproduced else 0
        t = paddle.to_tensor(vec, dtype="int32")
        dist.all_reduce(t)  # the fault's second (and last) collective: whose own batch reproduces it
        self.reproduced = [bool(v) for v in t.numpy().tolist()]
        _mark_rank(report, self.rank)
        if doctor.report_dir is None:
            return report
        folder = Path(doctor.report_dir)
        mine = folder / f"rank-{self.rank}"
        write_folder(report, mine)
        dist.barrier()
        if self.rank != 0:
            return report
        first = self.first_rank()
        source = report
        if first is not None and first != self.rank:
            data = json.loads((folder / f"rank-{first}" / "report.json").read_text(encoding="utf-8"))
            source = Report.from_dict(data)
        merged = _merged(source, first, self.world, base=report)
        reproduced = getattr(self, "reproduced", [False] * self.world)
        merged.details["ranks"] = [{"rank": r, "saw_nonfinite": bool(v),
                                    "own_fault": v == 2 or (bool(v) and reproduced[r]),
                                    "step": self.step if v else None, "report": f"rank-{r}/report.json"}
                                   for r, v in enumerate(self.levels)]
        merged.artifacts = source.artifacts if source is report else {}
        return merged


def _merged(source: Any, first: int | None, world: int, *, base: Any) -> Any:
    """The job's report from the first faulting rank's own (`source`): its findings, first fault, timeline
    and details, with `base`'s environment and run; every location gets the contract's `rank`, the first
    error says which rank of how many, and `run`/`details` name the first rank."""
    from nandoctor.findings import Report

    merged = Report(command=source.command, findings=list(source.findings), first_fault=source.first_fault,
                    timeline=list(source.timeline), environment=dict(base.environment), run=dict(base.run),
                    details=dict(source.details))
    for loc in [merged.first_fault] + [f.location for f in merged.findings]:
        if loc is not None:
            loc.rank = first
    if first is not None and merged.findings and merged.findings[0].severity.value == "error":
        merged.findings[0].message = f"Rank {first} of {world}: {merged.findings[0].message}"
    merged.details["first_rank"] = first
    merged.run.pop("rank", None)
    merged.run["world_size"] = world
    merged.run["first_rank"] = first
    return merged


def _mark_rank(report: Any, rank: int) -> None:
    """The contract's `rank` on the first fault and every finding of one rank's own report."""
    report.run["rank"] = rank
    report.details["rank"] = rank
    for loc in [report.first_fault] + [f.location for f in report.findings]:
        if loc is not None:
            loc.rank = rank


def merge_crashed(reports: dict[int, Any], world: int, silent: dict[int, str] | None = None) -> Any:
    """The job's report when ranks died without agreeing (one raised, was killed or hung): the report of
    the rank whose own code raised first (lowest step, then lowest rank), named in its first finding, with
    every rank's fate in `details.ranks`. `silent` says what is known of ranks that wrote nothing (killed
    by a signal, no progress for a while). None when no rank wrote a report."""
    from nandoctor.findings import Report

    if not reports:
        return None
    def order(r: int) -> tuple[int, int]:
        ff = reports[r].first_fault
        return (ff.step if ff is not None and ff.step is not None else 1 << 62, r)

    first = min(reports, key=order)
    source: Report = reports[first]
    merged = _merged(source, first, world, base=source)
    merged.crashed = source.crashed
    merged.artifacts = dict(source.artifacts)
    silent = silent or {}
    merged.details["ranks"] = [{"rank": r, "verdict": reports[r].verdict.value if r in reports else None,
                                "step": _step(reports.get(r)), "fate": silent.get(r)}
                               for r in range(world)]
    return merged


def _step(report: Any) -> int | None:
    ff = report.first_fault if report is not None else None
    return ff.step if ff is not None else None


def rank_failure(reports: dict[int, Any], ending: Ending, *, mode: Mode, device: str) -> Any:
    """The job's report when the ranks did not reach the merged one (`ending`: rank_progress.Ending): a rank's
    own exception (`reports`: the reports ranks wrote alone), else the rank that died first without a word
    (`rank.killed`), else the rank the others waited for (`rank.hung`: the parent stopped the job, or the
    collective they waited in timed out and they died of it). None when nothing says which rank it was."""
    world = max([ending.world, *[int(r.run.get("world_size") or 0) for r in reports.values()],
                 max(reports, default=-1) + 1])
    died = ending.died
    # the ranks the others waited for (those that died of the wait are not among them)
    stuck = [r for r in behind(ending.positions) if r not in ending.in_collective]
    timed_out = bool(died) and died[0] in ending.in_collective and bool(stuck)
    fates = _fates(reports, ending, stuck, timed_out)
    merged = merge_crashed(reports, world, fates)
    if merged is not None:
        return merged
    if died and not timed_out:
        return _killed_report(world, ending, fates, mode=mode, device=device)
    if stuck and fates:
        return _hung_report(world, ending, min(stuck), fates, mode=mode, device=device)
    return None


def _fates(reports: dict[int, Any], ending: Ending, stuck: list[int], timed_out: bool) -> dict[int, str]:
    """What became of each rank that stopped the job or stopped because of it (`details.ranks`' `fate`): one
    rank's exception ended the others, or one died first without a word, or one stood still while the others
    waited for it (`stuck`), until the parent stopped the job or their collective timed out (`timed_out`)."""
    positions = ending.positions
    died = ending.died
    fates: dict[int, str] = {}
    if reports and died:  # a rank raised; the others aborted at the collective it never reached
        fates.update({r: f"stopped after rank {min(reports)} raised" for r in died})
    elif died and not timed_out:
        first = died[0]
        fates[first] = f"died first, {positions[first].said()}, without a Python exception"
        fates.update({r: f"stopped after rank {first} died" for r in died[1:]})
    elif ending.hung or timed_out:
        why = (f"no progress for {hang_seconds():g} s" if ending.hung else
               "no progress while the others waited for it")
        fates.update({r: f"waited for rank {min(stuck)} at a collective until it timed out"
                      for r in died if r in ending.in_collective})
        fates.update({r: f"{why} {positions[r].said()}" for r in stuck})
    return fates


def _killed_report(world: int, ending: Ending, fates: dict[int, str], *, mode: Mode, device: str) -> Any:
    """`rank.killed`: the rank that died first, without a Python exception (a signal: its log may name it)."""
    positions = ending.positions
    first = ending.died[0]
    return _rank_report(world, first, positions, fates, Code.RANK_KILLED,
                        _died_message(first, world, positions[first], signal_in_log(ending.logs.get(first))),
                        ["If it was the out-of-memory killer (`dmesg` says so), lower this rank's memory: a "
                         "smaller batch per rank, or fewer ranks per machine. A native crash (SIGSEGV, "
                         "SIGABRT) points at a custom op or an extension: the rank's log has its stack."],
                        mode=mode, device=device)


def _hung_report(world: int, ending: Ending, first: int, fates: dict[int, str], *, mode: Mode,
                 device: str) -> Any:
    """`rank.hung`: rank `first` stood still while the others waited for it, until the parent stopped the job
    (`ending.hung`) or their collective timed out and they died of it."""
    positions = ending.positions
    if ending.hung:
        how = (f"no rank made progress for {hang_seconds():g} s, and the others were waiting for it at a "
               "collective (DataParallel's gradient all-reduce, or nandoctor's check). The job was stopped.")
    else:
        how = (f"the others waited for it at a collective (DataParallel's gradient all-reduce, or nandoctor's "
               f"check) until it timed out, and rank {ending.died[0]} died of it (its log ends in a gloo error).")
    return _rank_report(world, first, positions, fates, Code.RANK_HUNG,
                        f"Rank {first} of {world} stopped moving {positions[first].said()}: {how}",
                        [f"Look for what rank {first} does alone at that point: a data loader that blocks on "
                         "this rank only, a collective called on some ranks and not others, or input/output "
                         "that waits. NANDOCTOR_RANK_HANG_SECONDS sets how long a rank may stand still "
                         f"(default {HANG_SECONDS:g} s)."], mode=mode, device=device)


def _died_message(rank: int, world: int, where: Position, signame: str | None) -> str:
    what = (f"died of {signame} (a crash in native code: Paddle printed it in the rank's log)" if signame else
            "was killed by a signal no process can catch (SIGKILL: the kernel's out-of-memory killer, or kill -9)")
    return (f"Rank {rank} of {world} {what} {where.said()}, without a Python exception; the other ranks "
            "stopped after it.")


def _rank_report(world: int, first: int, positions: dict[int, Position], fates: dict[int, str], code: Code,
                 message: str, advice: list[str], *, mode: Mode, device: str) -> Any:
    """A report of one rank that stopped the job without a report of its own (verdict `crashed`)."""
    from nandoctor.diagnosis import assemble as outcome
    from nandoctor.findings import Finding, FirstFault, Location, Severity

    where = positions.get(first)
    step = where.step if where is not None and where.step >= 0 else None
    phase = where.phase if where is not None else None
    report = outcome.new_report(device, mode)
    report.crashed = True
    report.findings.append(Finding(code, Severity.ERROR, message,
                                   Location(step=step, phase=phase, batch_index=step, rank=first), advice=advice))
    if phase is not None:  # where that rank was when it stopped; unknown before its first step
        report.first_fault = FirstFault(step=step, phase=phase, batch_index=step, rank=first)
    report.run["first_rank"] = first
    report.run["world_size"] = world
    report.details["first_rank"] = first
    report.details["ranks"] = [{"rank": r, "position": positions[r].describe() if r in positions else None,
                                "fate": fates.get(r)} for r in range(world)]
    return report
