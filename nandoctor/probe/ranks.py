"""`nandoctor probe CONFIG --nproc N`: the spec's workload trained by N processes of Paddle's own launcher.

The parent (`launch_probe`) runs `python -m paddle.distributed.launch --nproc_per_node N` on this file;
each rank (`rank_main`) builds the spec's model, optimizer and loader, wraps the model in
`paddle.DataParallel`, gives itself its share of the data (a `DistributedBatchSampler` when the loader
is a `paddle.io.DataLoader` over a map-style dataset, else every N-th batch), and trains with
`nandoctor.watch` on every rank: the same detection, the same agreement on a fault (one collective per
step) and the same merged report naming the first faulting rank as a user's own multi-process loop.
Rank 0 writes the merged report as JSON for the parent, which renders and writes it like any probe's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if __name__ == "__main__" and sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # run by the launcher as a file: nandoctor's own folder must not shadow top-level modules

from nandoctor.diagnosis.diagnose import spec_target
from nandoctor.errors import SpecError
from nandoctor.findings import Mode, Report

if TYPE_CHECKING:
    from nandoctor.parallel.rank_progress import Ending

TIMEOUT = 3600  # seconds for the whole launch; a rank left waiting must not hang the command for ever


def launch_probe(config: Path, steps: int, seed: int, nproc: int, device: str = "auto") -> Report:
    """Run the ranks; rank 0's merged report. A rank whose own code raised, that was killed, or that
    stopped moving is named in a report of its own (distributed.rank_failure); a launch that left nothing
    to read is a SpecError with the ranks' last output."""
    from nandoctor.parallel.rank_progress import ENV, RankWatch
    from nandoctor.parallel.supervisor import Supervisor

    with tempfile.TemporaryDirectory(prefix="nandoctor-nproc-") as tmp:
        out = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc), "--log_dir",
               str(Path(tmp) / "log"), str(Path(__file__).resolve()), str(config), "--steps", str(steps),
               "--seed", str(seed), "--out", str(out), "--device", device]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_")}
        watch = RankWatch(out.with_name("ranks"), nproc)
        env[ENV] = str(watch.folder)  # each rank's position, and how its processes are found
        # every rank's position looked at; a hang, TIMEOUT, Ctrl-C or SIGTERM kill every process of the launch,
        # and so does the launcher's end (it ends at its first failed rank; the others may wait in a collective)
        launch = Supervisor(cmd, watch, time_limit=TIMEOUT, kill_at_end=True, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
        launch.wait()
        proc = launch.proc
        launcher_out = proc.stdout.read() if proc.stdout is not None else ""
        if out.is_file():
            report = Report.from_dict(json.loads(out.read_text(encoding="utf-8")))
        else:
            report = _without_agreement(out.with_name("ranks"), watch.ending)
        if report is None:
            logs = "\n".join(p.read_text(errors="replace")[-1500:]
                             for p in sorted((Path(tmp) / "log").glob("workerlog.*")))
            raise SpecError(f"the {nproc}-process probe stopped without a report (launcher exit "
                            f"{proc.returncode}). The ranks' last output:\n{logs or launcher_out[-1500:]}")
    report.run["nproc"] = nproc
    if report.first_fault is not None and not report.crashed:
        report.details["remedies"] = {"note": f"remedies are not replayed under --nproc (each of {nproc} ranks "
                                              "would replay its own share): run `nandoctor probe` without --nproc "
                                              "to have them tried"}
    return report


def _without_agreement(ranks: Path, ending: Ending) -> Report | None:
    """The job's report when the ranks did not reach the merged one: from the reports ranks wrote alone
    (ranks/rank-N/) and where each stood."""
    from nandoctor.parallel.distributed import rank_failure

    reports = {}
    for r in range(ending.world):
        path = ranks / f"rank-{r}" / "report.json"
        if path.is_file():
            reports[r] = Report.from_dict(json.loads(path.read_text(encoding="utf-8")))
    return rank_failure(reports, ending, mode=Mode.PROBE, device="cpu")


def rank_main(config: Path, steps: int, seed: int, out: Path, device: str = "auto") -> int:
    """One rank: the spec's training as a watched loop under DataParallel."""
    import numpy as np
    import paddle
    import paddle.distributed as dist

    from nandoctor.engine.batch_source import BatchSource, UserRaised, user_call
    from nandoctor.engine.step import StepEngine
    from nandoctor.findings import Phase
    from nandoctor.inloop.doctor import Doctor
    from nandoctor.parallel.distributed import RankSync
    from nandoctor.parallel.rank_progress import RankProgress, launched_rank
    from nandoctor.spec import load_spec
    from nandoctor.tensors.device import resolve_device, use_device
    from nandoctor.workload.build import build_optimizer, build_workload

    device = resolve_device(device)
    if device == "cpu":  # a GPU rank keeps the device the launcher gave it
        use_device(device)
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    paddle.seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
    spec = load_spec(config)
    workload = build_workload(spec).on_device(device)
    model = workload.model
    optimizer = build_optimizer(spec, model)
    dp = paddle.DataParallel(model)
    engine = StepEngine.for_workload(workload, optimizer, device=device, model=dp)  # the probe loop's own step
    model.train()
    ranks_dir = out.with_name("ranks")
    fp16 = spec.amp.enabled and spec.amp.dtype == "float16"
    progress = launched_rank() or RankProgress(ranks_dir, rank)
    progress.own_loop = True  # this loop marks every phase itself: the agreement adds nothing
    doctor = Doctor(dp, optimizer, step_fn=workload.compute_loss, report_dir=ranks_dir, sync=RankSync(),
                    target=spec_target(workload), scaler=engine.scaler, fp16=fp16, mode=Mode.PROBE)
    loop = engine.with_boundary(user_call)  # the user's calls: their exception is this rank's finding, ours is not
    # this rank's share of each epoch, drawn behind the same boundary; an epoch without a batch ends the data
    batches = BatchSource(steps, make_loader=lambda: _shard(workload.make_loader(), rank, world),
                          end_epoch=loop.end_epoch, before_step=lambda step: progress.at(step, Phase.DATA))
    fields: dict[str, Any] | None = None
    try:
        for step, _, _, batch in batches:
            fields = workload.layout.fields(batch, step)
            progress.at(step, Phase.FORWARD)
            loss = loop.loss(fields)
            progress.at(step, Phase.BACKWARD)
            loop.backward(loss)
            progress.at(step, Phase.OPTIMIZER)
            if not doctor.check(loss, fields):
                break
            if loop.updates_after(step):
                loop.update()
            fields = None  # (an exception drawing the next batch, or at the epoch's end, is not this batch's)
    except UserRaised as raised:  # this rank alone: its report in ranks/rank-N/, the parent merges
        progress.at(doctor.step, None)  # out of its loop: not a rank the others wait for, nor one that died
        doctor.crashed(raised.exc, fields if raised.phase != Phase.DATA else None)
        doctor.close()
        return 1
    finally:
        batches.close()  # the loader's workers end now
        doctor.close()
    progress.at(doctor.step, None)
    report = doctor.report
    if rank == 0:
        if report is None:
            from nandoctor.diagnosis.assemble import new_report

            report = new_report(str(paddle.get_device()), Mode.PROBE)
            doctor.assemble_into(report, None, spec_target(workload))
        report.run.update({"steps": steps, "seed": seed, "world_size": world, "steps_run": doctor.step})
        from nandoctor.report import json as json_report

        out.write_text(json_report.render(report), encoding="utf-8")
    return 0


def _shard(loader: Any, rank: int, world: int) -> Any:
    """This rank's batches: a DistributedBatchSampler for a DataLoader over a map-style dataset, else
    every `world`-th batch starting at `rank`."""
    import paddle

    if isinstance(loader, paddle.io.DataLoader):
        dataset = loader.dataset
        sampler = getattr(loader, "batch_sampler", None)
        if not isinstance(dataset, paddle.io.IterableDataset) and sampler is not None:
            batch_size = getattr(sampler, "batch_size", None) or 1
            drop_last = bool(getattr(sampler, "drop_last", False))
            dist_sampler = paddle.io.DistributedBatchSampler(dataset, batch_size=batch_size, num_replicas=world,
                                                             rank=rank, shuffle=False, drop_last=drop_last)
            return paddle.io.DataLoader(dataset, batch_sampler=dist_sampler, collate_fn=loader.collate_fn)
    return itertools.islice(loader, rank, None, world)


def main() -> None:
    parser = argparse.ArgumentParser(description="one rank of `nandoctor probe --nproc N` (run by the launcher)")
    parser.add_argument("config", type=Path)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    sys.exit(rank_main(args.config, args.steps, args.seed, args.out, args.device))


if __name__ == "__main__":
    main()
