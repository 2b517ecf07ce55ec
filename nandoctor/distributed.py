"""Ranks of a `paddle.distributed.launch` run agreeing on a fault: one collective per step.

Every rank's doctor calls `agree()` once per `check()`, after its own detection: a vector with one slot
per rank (0 healthy, 1 non-finite gradients only, 2 a non-finite value of its own: data, loss or
update) is summed over the ranks. Every rank then knows the same thing, so all stop at the same step
and none waits at a collective the others never reach. The rank that faulted "first" is the lowest
rank with a fault of its own (2); gradients alone (1) may have come from another rank through
DataParallel's gradient all-reduce. Only on a fault is there more: each rank writes its own report
beside the merged one, a barrier, and rank 0 merges.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from nandoctor.probe.watcher import Fault, FaultKind

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

    @property
    def writes_report(self) -> bool:
        return self.rank == 0

    def agree(self, doctor: Any, fault: Fault | None) -> Fault | None:
        """The step's collective: every rank learns every rank's level; a peer's fault stops this rank too."""
        import paddle
        import paddle.distributed as dist

        vec = [0] * self.world
        vec[self.rank] = own_level(fault)
        t = paddle.to_tensor(vec, dtype="int32")
        dist.all_reduce(t)
        levels = [int(v) for v in t.numpy().tolist()]
        if not any(levels):
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
        from nandoctor.inloop import outcome

        _mark_rank(report, self.rank)
        report.run["world_size"] = self.world
        if doctor.report_dir is not None:
            outcome.write_report(report, Path(doctor.report_dir) / f"rank-{self.rank}")
        return report

    def finish(self, doctor: Any, report: Any) -> Any:
        """After a fault, on every rank: learn whose own batch reproduces it, write this rank's report to
        report_dir/rank-N/, wait for every rank, then (rank 0) return the merged report."""
        import paddle
        import paddle.distributed as dist

        from nandoctor.findings import Report
        from nandoctor.inloop import outcome

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
        outcome.write_report(report, mine)
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
