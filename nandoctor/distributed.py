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

    def first_rank(self) -> int | None:
        """The lowest rank with a fault of its own; else the lowest with non-finite gradients."""
        for level in (2, 1):
            for r, v in enumerate(self.levels):
                if v >= level:
                    return r
        return None

    def merge(self, report: Any) -> None:
        """Every rank: its own report goes to report_dir/rank-N/; rank 0, after a barrier, takes the first
        faulting rank's findings into `report` and lists what every rank saw."""
        self.own = report

    def finish(self, doctor: Any, report: Any) -> Any:
        """Write this rank's report, wait for every rank, then (rank 0) build the merged one."""
        import paddle.distributed as dist

        from nandoctor.findings import Report
        from nandoctor.inloop import outcome

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
        merged = Report(command="probe", findings=list(source.findings), first_fault=source.first_fault,
                        timeline=list(source.timeline), environment=dict(report.environment),
                        run=dict(report.run), details=dict(source.details))
        for loc in [merged.first_fault] + [f.location for f in merged.findings]:
            if loc is not None and hasattr(loc, "rank"):  # the contract's `rank` (findings.py may carry it)
                loc.rank = first
        merged.details["ranks"] = [{"rank": r, "saw_nonfinite": bool(v), "own_fault": v == 2,
                                    "report": f"rank-{r}/report.json"} for r, v in enumerate(self.levels)]
        merged.details["first_rank"] = first
        merged.run["world_size"] = self.world
        return merged
