"""A plain DataParallel training script that knows nothing of nandoctor (for `nandoctor run` over the launcher).

    nandoctor run --json r.json -- python -m paddle.distributed.launch --nproc_per_node 2 \\
        examples/unmodified_distributed.py --fault-rank 1     # (or --raise-rank 1: that rank raises)
"""

from __future__ import annotations

import sys

import paddle
import paddle.distributed as dist
import paddle.nn.functional as F

try:
    from examples.distributed_train import rank_batches
    from examples.plain_loop import Siamese
except ImportError:  # run as a script from the examples folder
    from distributed_train import rank_batches
    from plain_loop import Siamese


def main() -> None:
    fault = sys.argv[sys.argv.index("--fault-rank") + 1] if "--fault-rank" in sys.argv else None
    raise_rank = sys.argv[sys.argv.index("--raise-rank") + 1] if "--raise-rank" in sys.argv else None
    dist.init_parallel_env()
    rank = dist.get_rank()
    paddle.seed(0)
    model = paddle.DataParallel(Siamese())
    optimizer = paddle.optimizer.Adam(learning_rate=0.003, parameters=model.parameters())
    for step, (a, b, target) in enumerate(rank_batches(rank, fault in ("all", str(rank)))):
        a, b, target = paddle.to_tensor(a), paddle.to_tensor(b), paddle.to_tensor(target)
        if str(rank) == raise_rank and step == 3:  # a bug of this rank alone, in its own forward's inputs
            a = a[:, :5]
        loss = F.mse_loss(model(a, b), target)
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        print(f"rank {rank} step {step} loss {float(loss):.4f}", flush=True)
    print(f"rank {rank} finished", flush=True)


if __name__ == "__main__":
    main()
