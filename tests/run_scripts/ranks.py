"""A DataParallel training script for two ranks that knows nothing of nandoctor, one of whose ranks dies or
hangs without a word. For `nandoctor run`'s tests over the user's own launcher (tests/test_run_ranks.py).

    python -m paddle.distributed.launch --nproc_per_node 2 ranks.py kill 1 3   # rank 1 SIGKILLs itself
    python -m paddle.distributed.launch --nproc_per_node 2 ranks.py hang 1 3   # rank 1 stops moving
    python -m paddle.distributed.launch --nproc_per_node 2 ranks.py hang 1 3 forward   # ... in its forward
    python -m paddle.distributed.launch --nproc_per_node 2 ranks.py none       # trains 8 steps, healthy
    python -m paddle.distributed.launch --nproc_per_node 2 ranks.py rest -1 -1 data 15   # then both rest 15 s
    python -m paddle.distributed.launch --nproc_per_node 2 ranks.py teardown 0   # rank 0 SIGSEGVs at exit
    python -m paddle.distributed.launch --nproc_per_node 2 ranks.py atexit 0     # ... in an atexit handler

The bad rank misbehaves at the given step in the given phase (`data`: before the model is called, the
default; `forward`: inside the model's forward), while the other rank waits for it in DataParallel's
gradient all-reduce. Each rank prints "rank R pid P" first, and "rank R step S" after each update.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import time

import numpy as np
import paddle
import paddle.distributed as dist
from paddle import nn

STEPS = 8


class Net(nn.Layer):
    def __init__(self, misbehave: object) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
        self.misbehave = misbehave

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        self.misbehave("forward")
        return self.body(x)


def main() -> None:
    how = sys.argv[1]
    bad_rank = int(sys.argv[2]) if len(sys.argv) > 2 else -1
    bad_step = int(sys.argv[3]) if len(sys.argv) > 3 else -1
    where = sys.argv[4] if len(sys.argv) > 4 else "data"
    rest = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    dist.init_parallel_env()
    rank = dist.get_rank()
    print(f"rank {rank} pid {os.getpid()}", flush=True)
    step = 0

    def misbehave(phase: str) -> None:
        if rank != bad_rank or step != bad_step or phase != where:
            return
        if how == "kill":
            os.kill(os.getpid(), 9)
        if how == "hang":
            time.sleep(3600)

    paddle.seed(0)
    model = paddle.DataParallel(Net(misbehave))
    optimizer = paddle.optimizer.Adam(learning_rate=0.01, parameters=model.parameters())
    rng = np.random.default_rng(rank)
    for step in range(STEPS):
        x = paddle.to_tensor(rng.normal(size=(8, 6)).astype("float32"))
        y = paddle.to_tensor(rng.normal(size=(8, 1)).astype("float32"))
        misbehave("data")
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        print(f"rank {rank} step {step}", flush=True)
    if how == "rest":  # every rank, after training: an evaluation or a checkpoint save of the script's own
        time.sleep(rest)
        print(f"rank {rank} rested", flush=True)
    if how == "teardown" and rank == bad_rank:  # as Paddle's C++ teardown can: once Python's exit is done
        segfault_after_python()
    if how == "atexit" and rank == bad_rank:  # a native crash in an exit handler of the script's own
        atexit.register(os.kill, os.getpid(), signal.SIGSEGV)


def segfault_after_python() -> None:
    """A C exit handler that calls address 8: it runs in exit() after the interpreter has finalised, where
    C++ static destructors (Paddle's teardown) run, and dies of SIGSEGV there."""
    libc = ctypes.CDLL(None)
    libc.__cxa_atexit(ctypes.c_void_p(8), None, None)


if __name__ == "__main__":
    main()
