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
import contextlib
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __name__ == "__main__" and sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # run by the launcher as a file: nandoctor's own folder must not shadow top-level modules

from nandoctor.errors import SpecError
from nandoctor.findings import Code, Finding, FirstFault, Location, Mode, Report, Severity
from nandoctor.rank_progress import HANG_SECONDS, Position

TIMEOUT = 3600  # seconds for the whole launch; a rank left waiting must not hang the command for ever


def launch_probe(config: Path, steps: int, seed: int, nproc: int, device: str = "auto") -> Report:
    """Run the ranks; rank 0's merged report. A rank whose own code raised, that was killed, or that
    stopped moving is named in a report of its own (`_without_agreement`); a launch that left nothing to
    read is a SpecError with the ranks' last output."""
    with tempfile.TemporaryDirectory(prefix="nandoctor-nproc-") as tmp:
        out = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc), "--log_dir",
               str(Path(tmp) / "log"), str(Path(__file__).resolve()), str(config), "--steps", str(steps),
               "--seed", str(seed), "--out", str(out), "--device", device]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_")}
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        ending = _wait(proc, out, nproc)
        launcher_out = proc.stdout.read() if proc.stdout is not None else ""
        if out.is_file():
            report = Report.from_dict(json.loads(out.read_text(encoding="utf-8")))
        else:
            report = _without_agreement(out.with_name("ranks"), nproc, ending, Path(tmp) / "log")
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


@dataclass
class _Ending:
    """How a launch ended, as the parent saw it: ranks that vanished mid-loop in the order they did, and
    where every rank stood; `hung` when the parent stopped a launch in which none moved for the limit."""

    died: list[int] = field(default_factory=list)
    positions: dict[int, Position] = field(default_factory=dict)
    hung: bool = False


def _wait(proc: subprocess.Popen, out: Path, world: int) -> _Ending:
    """Wait for the launch, watching every rank's position (rank_progress.py): a rank whose process is
    gone while its loop was running died without a word (the first to go is the one that died of it; the
    others stopped after it); when none moved for the hang limit, or the whole launch passed TIMEOUT, every
    process of the launch is stopped."""
    from nandoctor.rank_progress import died_in_collective, hang_seconds, read_positions

    limit = hang_seconds()
    ranks = out.with_name("ranks")
    ending = _Ending()
    started = last_move = time.monotonic()
    try:
        while True:
            try:
                proc.wait(timeout=0.05)
                # the launcher ends at its first failed rank; the others may still wait in a collective
                _stop(proc, out)
                return ending
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            positions = read_positions(ranks, world)
            gone = [r for r, where in positions.items()
                    if where.phase is not None and r not in ending.died and not where.alive]
            # a rank whose peer died aborts in gloo within milliseconds ("Connection reset by peer"): of the
            # ranks gone since the last look, those that died of a collective go after the one that did not
            ending.died += sorted(gone, key=lambda r: died_in_collective(out.with_name("log") / f"workerlog.{r}"))
            if positions != ending.positions:
                ending.positions, last_move = positions, now
            # a hang is judged once every rank has started (start-up on a loaded machine can be slow)
            stalled = len(positions) == world and now - last_move > limit
            if stalled or now - started > TIMEOUT:
                ending.hung = not ending.died
                _stop(proc, out)
                return ending
    except BaseException:  # Ctrl-C, SIGTERM: no rank trains on as an orphan
        _stop(proc, out)
        raise


def _stop(proc: subprocess.Popen, out: Path) -> None:
    """Kill the launcher's process group and every rank (the launcher starts each in a session of its own,
    so they are found by `out`, which every rank's command line holds), and wait until they are gone."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 5.0
    while (ranks := _processes_with(str(out))) and time.monotonic() < deadline:
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _processes_with(marker: str) -> list[int]:
    """Live processes whose command line holds `marker` (Linux /proc; elsewhere none are found)."""
    from nandoctor.rank_progress import process_alive

    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline and process_alive(int(entry.name)):
            found.append(int(entry.name))
    return found


def _without_agreement(ranks: Path, world: int, ending: _Ending, logs: Path) -> Report | None:
    """The job's report when the ranks did not reach the merged one: a rank's own exception (its report in
    ranks/rank-N/), else the rank that died first without a word, else the ranks the others waited for."""
    from nandoctor.distributed import merge_crashed
    from nandoctor.rank_progress import behind, hang_seconds, read_positions, signal_in_log

    reports = {}
    for r in range(world):
        path = ranks / f"rank-{r}" / "report.json"
        if path.is_file():
            reports[r] = Report.from_dict(json.loads(path.read_text(encoding="utf-8")))
    positions = ending.positions or read_positions(ranks, world)
    fates: dict[int, str] = {}
    if reports and ending.died:  # a rank raised; the others aborted at the collective it never reached
        fates.update({r: f"stopped after rank {min(reports)} raised" for r in ending.died})
    elif ending.died:
        first = ending.died[0]
        fates[first] = f"died first, at {positions[first].describe()}, without a Python exception"
        fates.update({r: f"stopped after rank {first} died" for r in ending.died[1:]})
    elif ending.hung:
        fates.update({r: f"no progress for {hang_seconds():g} s at {positions[r].describe()}"
                      for r in behind(positions)})
    merged = merge_crashed(reports, world, fates)
    if merged is not None:
        return merged
    if ending.died:
        first = ending.died[0]
        return _rank_report(world, first, positions, fates, Code.RANK_KILLED,
                            _died_message(first, world, positions[first], signal_in_log(logs / f"workerlog.{first}")),
                            ["If it was the out-of-memory killer (`dmesg` says so), lower this rank's memory: a "
                             "smaller batch per rank, or fewer ranks per machine. A native crash (SIGSEGV, "
                             "SIGABRT) points at a custom op or an extension: the rank's log has its stack."])
    if ending.hung and fates:
        first = min(fates)
        return _rank_report(world, first, positions, fates, Code.RANK_HUNG,
                            f"Rank {first} of {world} stopped moving at {positions[first].describe()}: no rank made "
                            f"progress for {hang_seconds():g} s, and the others were waiting for it at a collective "
                            "(DataParallel's gradient all-reduce, or nandoctor's check). The job was stopped.",
                            [f"Look for what rank {first} does alone at that point: a data loader that blocks on "
                             "this rank only, a collective called on some ranks and not others, or input/output "
                             "that waits. NANDOCTOR_RANK_HANG_SECONDS sets how long a rank may stand still "
                             f"(default {HANG_SECONDS:g} s)."])
    return None


def _died_message(rank: int, world: int, where: Position, signame: str | None) -> str:
    what = (f"died of {signame} (a crash in native code: Paddle printed it in the rank's log)" if signame else
            "was killed by a signal no process can catch (SIGKILL: the kernel's out-of-memory killer, or kill -9)")
    return (f"Rank {rank} of {world} {what} at {where.describe()}, without a Python exception; the other ranks "
            "stopped after it.")


def _rank_report(world: int, first: int, positions: dict[int, Position], fates: dict[int, str], code: Code,
                 message: str, advice: list[str]) -> Report:
    """A report of one rank that stopped the job without a report of its own (verdict `crashed`)."""
    from nandoctor.inloop import outcome

    where = positions.get(first)
    step = where.step if where is not None and where.step >= 0 else None
    phase = where.phase if where is not None else None
    report = outcome.new_report("cpu", Mode.PROBE)
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


def rank_main(config: Path, steps: int, seed: int, out: Path, device: str = "auto") -> int:
    """One rank: the spec's training as a watched loop under DataParallel."""
    import numpy as np
    import paddle
    import paddle.distributed as dist

    from nandoctor.device import resolve_device, use_device
    from nandoctor.distributed import RankSync
    from nandoctor.findings import Phase
    from nandoctor.inloop.doctor import Doctor
    from nandoctor.probe.loop import UserRaised, user_call
    from nandoctor.rank_progress import RankProgress
    from nandoctor.spec import load_spec
    from nandoctor.training import StepEngine
    from nandoctor.workload import build_optimizer, build_workload

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
    doctor = Doctor(dp, optimizer, step_fn=workload.compute_loss, report_dir=ranks_dir, sync=RankSync(),
                    target=workload.target(), scaler=engine.scaler, fp16=fp16, mode=Mode.PROBE)
    loop = engine.with_boundary(user_call)  # the user's calls: their exception is this rank's finding, ours is not
    progress = RankProgress(ranks_dir, rank)
    fields: dict[str, Any] | None = None
    try:
        it = iter(user_call(Phase.DATA, lambda: iter(_shard(workload.make_loader(), rank, world))))
        for step in range(steps):
            progress.at(step, Phase.DATA)
            fields = None
            batch = user_call(Phase.DATA, next, it, _END)
            if batch is _END:  # a new epoch
                loop.end_epoch()
                it = user_call(Phase.DATA, lambda: iter(_shard(workload.make_loader(), rank, world)))
                batch = user_call(Phase.DATA, next, it, _END)
                if batch is _END:
                    break
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
    except UserRaised as raised:  # this rank alone: its report in ranks/rank-N/, the parent merges
        progress.at(doctor.step, None)  # out of its loop: not a rank the others wait for, nor one that died
        doctor.crashed(raised.exc, fields if raised.phase != Phase.DATA else None)
        doctor.close()
        return 1
    finally:
        doctor.close()
    progress.at(doctor.step, None)
    report = doctor.report
    if rank == 0:
        if report is None:
            from nandoctor.inloop import outcome

            report = outcome.new_report(str(paddle.get_device()), Mode.PROBE)
            outcome.fill_report(report, doctor.watcher, None, doctor.step, target=workload.target(),
                                optimizer=optimizer)
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


_END = object()


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
