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
from typing import Any

if __name__ == "__main__" and sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)  # run by the launcher as a file: nandoctor's own folder must not shadow top-level modules

from nandoctor.errors import SpecError
from nandoctor.findings import Report

TIMEOUT = 3600  # seconds for the whole launch; a rank left waiting must not hang the command for ever


def launch_probe(config: Path, steps: int, seed: int, nproc: int, device: str = "auto") -> Report:
    """Run the ranks; rank 0's merged report (a `user_code.error`-free failure of a rank is a SpecError)."""
    with tempfile.TemporaryDirectory(prefix="nandoctor-nproc-") as tmp:
        out = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc), "--log_dir",
               str(Path(tmp) / "log"), str(Path(__file__).resolve()), str(config), "--steps", str(steps),
               "--seed", str(seed), "--out", str(out), "--device", device]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_")}
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            raise SpecError(f"the {nproc}-process probe did not finish within {TIMEOUT} s.") from None
        if not out.is_file():
            logs = "\n".join(p.read_text(errors="replace")[-1500:]
                             for p in sorted((Path(tmp) / "log").glob("workerlog.*")))
            raise SpecError(f"the {nproc}-process probe stopped without a report (launcher exit "
                            f"{proc.returncode}). The ranks' last output:\n{logs or proc.stderr[-1500:]}")
        report = Report.from_dict(json.loads(out.read_text(encoding="utf-8")))
    report.run["nproc"] = nproc
    if report.first_fault is not None:
        report.details["remedies"] = {"note": f"remedies are not replayed under --nproc (each of {nproc} ranks "
                                              "would replay its own share): run `nandoctor probe` without --nproc "
                                              "to have them tried"}
    return report


def rank_main(config: Path, steps: int, seed: int, out: Path, device: str = "auto") -> int:
    """One rank: the spec's training as a watched loop under DataParallel."""
    import numpy as np
    import paddle
    import paddle.distributed as dist

    from nandoctor.device import resolve_device, use_device
    from nandoctor.distributed import RankSync
    from nandoctor.inloop.doctor import Doctor
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
                    target=workload.target(), scaler=engine.scaler, fp16=fp16)
    it = iter(_shard(workload.make_loader(), rank, world))
    with doctor:
        for step in range(steps):
            batch = next(it, _END)
            if batch is _END:  # a new epoch
                engine.end_epoch()
                it = iter(_shard(workload.make_loader(), rank, world))
                batch = next(it, _END)
                if batch is _END:
                    break
            fields = workload.layout.fields(batch, step)
            loss = engine.loss(fields)
            engine.backward(loss)
            if not doctor.check(loss, fields):
                break
            if engine.updates_after(step):
                engine.update()
    report = doctor.report
    if rank == 0:
        if report is None:
            from nandoctor.findings import Mode
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
