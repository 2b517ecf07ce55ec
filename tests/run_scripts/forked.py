"""A script that trains, then starts worker processes that each train a model of their own, knowing nothing
of nandoctor. For `nandoctor run`'s tests (tests/test_run_forked.py).

    python forked.py fork      # the parent trains 3 steps, then workers 1-3 (multiprocessing, fork) train
    python forked.py spawn     # the same with the spawn start method
    python forked.py fork --healthy
    python forked.py inline        # the workers one after the other in this one process
    python forked.py inline --bad 12   # 12 workers one after the other, the 12th faulty
    python forked.py groups        # the bad worker alone, with one optimizer per parameter group
    python forked.py fork --raise  # worker 2's own code raises at step 4 (a shape error in its forward)
    python forked.py fork --pool   # the workers as tasks of a multiprocessing.Pool of 2 processes

Worker 2's batch at step 4 has an all-zero sample: its radial layer's sqrt has an infinite gradient, the
update makes its weights NaN and its loss is NaN from step 5 on. Each worker prints its pid first.
"""

from __future__ import annotations

import multiprocessing
import os
import sys

import numpy as np
import paddle
from paddle import nn
from radial import Radial  # (the script's own folder is first on sys.path)

STEPS = 8
BAD_WORKER, BAD_STEP = 2, 4


class Net(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.radial = Radial(4)
        self.head = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.head(self.radial(x))


def batch(worker: int, step: int, healthy: bool) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 * worker + step)
    x = rng.normal(size=(6, 4)).astype("float32")
    y = rng.normal(size=(6, 1)).astype("float32")
    if not healthy and worker == BAD_WORKER and step == BAD_STEP:
        x[3] = 0.0
    return x, y


def build(worker: int) -> tuple[nn.Layer, paddle.optimizer.Optimizer]:
    paddle.seed(worker)
    model = Net()
    return model, paddle.optimizer.Adam(learning_rate=0.01, parameters=model.parameters())


class Groups:
    """Two optimizers over one model's parameter groups (Adam for the radial layer, SGD for the head),
    stepped one after the other."""

    def __init__(self, model: nn.Layer) -> None:
        self.parts = [paddle.optimizer.Adam(learning_rate=0.01, parameters=model.radial.parameters()),
                      paddle.optimizer.SGD(learning_rate=0.01, parameters=model.head.parameters())]

    def step(self) -> None:
        for opt in self.parts:
            opt.step()

    def clear_grad(self) -> None:
        for opt in self.parts:
            opt.clear_grad()


def train(worker: int, healthy: bool, steps: int = STEPS, groups: bool = False) -> None:
    """Worker 0 is the parent's own training; workers 1-3 are child processes."""
    print(f"worker {worker} pid {os.getpid()}", flush=True)
    model, opt = build(worker)
    if groups:
        opt = Groups(model)
    loss_fn = nn.MSELoss()
    for step in range(steps):
        x, y = (paddle.to_tensor(a) for a in batch(worker, step, healthy))
        if "--raise" in sys.argv and worker == BAD_WORKER and step == BAD_STEP:
            x = x[:, :3]  # a slicing mistake: the radial projection cannot take 3 features
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        print(f"worker {worker} step {step} loss {float(loss):.4f}", flush=True)


def main(method: str, healthy: bool) -> None:
    global BAD_WORKER
    if "--bad" in sys.argv:  # inline --bad K: K workers, the last one faulty
        BAD_WORKER = int(sys.argv[sys.argv.index("--bad") + 1])
    if method == "groups":  # the bad worker alone, in this process, its parameters in two optimizers
        train(BAD_WORKER, healthy, groups=True)
        return
    train(0, healthy, steps=3)
    if method == "inline":  # the workers one after the other in this process: a model after another
        for w in range(1, max(3, BAD_WORKER) + 1):
            train(w, healthy, steps=STEPS if w == BAD_WORKER else 3)
        print("training finished", flush=True)
        return
    context = multiprocessing.get_context(method)
    if "--pool" in sys.argv:  # the workers as a Pool's tasks: a worker process that exits loses its task
        with context.Pool(2) as pool:
            pool.starmap(train, [(w, healthy) for w in (1, 2, 3)])
        print("training finished", flush=True)
        return
    workers = [context.Process(target=train, args=(w, healthy)) for w in (1, 2, 3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    print("exit codes", [w.exitcode for w in workers], flush=True)
    print("training finished", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], "--healthy" in sys.argv)
