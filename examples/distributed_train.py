"""Two processes under Paddle's launcher, one `paddle.DataParallel` model, every rank watched.

    python -m paddle.distributed.launch --nproc_per_node 2 examples/distributed_train.py --fault-rank 1

`--fault-rank R` plants plain_loop.py's duplicated pair (sqrt at 0: NaN gradients) in batch 6 of rank R
only (`all`: every rank; omitted: healthy). The ranks agree on the fault at the same step (one
collective per step), rank 0 writes the merged report naming the first faulting rank, and every rank
writes its own beside it (report_dir/rank-N/). Exit status 1 on every rank after a fault.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import paddle
import paddle.distributed as dist

import nandoctor

try:
    from examples.plain_loop import Siamese, train_step
except ImportError:  # run as a script from the examples folder
    from plain_loop import Siamese, train_step


def rank_batches(rank: int, bad: bool, n: int = 12, bad_batch: int = 6) -> list[tuple[np.ndarray, ...]]:
    rng = np.random.default_rng(100 + rank)
    out = []
    for i in range(n):
        a = rng.normal(size=(8, 10)).astype("float32")
        b = a + rng.normal(scale=0.5, size=a.shape).astype("float32")
        if bad and i == bad_batch:
            b[3] = a[3]  # the duplicated pair: distance exactly 0
        out.append((a, b, np.linalg.norm(a - b, axis=1).astype("float32")))
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault-rank", default=None, help="a rank number, or 'all'")
    parser.add_argument("--report-dir", default="nandoctor-report")
    args = parser.parse_args()
    dist.init_parallel_env()
    rank = dist.get_rank()
    paddle.seed(0)
    model = paddle.DataParallel(Siamese())
    optimizer = paddle.optimizer.Adam(learning_rate=0.003, parameters=model.parameters())
    bad = args.fault_rank == "all" or args.fault_rank == str(rank)
    with nandoctor.watch(model, optimizer, step_fn=train_step, report_dir=args.report_dir,
                         fields=["a", "b", "target"]) as doctor:
        for batch in rank_batches(rank, bad):
            loss = train_step(model, batch)
            loss.backward()
            if not doctor.check(loss, batch):
                break
            optimizer.step()
            optimizer.clear_grad()
    print(f"rank {rank}: steps {doctor.step}, fault {doctor.fault is not None}", flush=True)
    return 1 if doctor.fault is not None else 0


if __name__ == "__main__":
    sys.exit(main())
