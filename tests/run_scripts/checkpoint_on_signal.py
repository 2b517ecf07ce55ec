"""A plain training script that, like a careful user's, saves a checkpoint when SIGINT or SIGTERM arrives
(slowly: the save takes a second), then exits 0; it writes `started` once it trains. For `nandoctor run`'s
signal tests. `--no-handler` leaves the signals alone; `--kill-self N` dies of SIGKILL at step N."""

from __future__ import annotations

import os
import signal
import sys
import time

import paddle

stop: list[int] = []
if "--no-handler" not in sys.argv:
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    signal.signal(signal.SIGINT, lambda signum, frame: stop.append(signum))
kill_at = int(sys.argv[sys.argv.index("--kill-self") + 1]) if "--kill-self" in sys.argv else -1
paddle.seed(0)
model = paddle.nn.Linear(4, 1)
opt = paddle.optimizer.SGD(learning_rate=0.01, parameters=model.parameters())
for step in range(100000):
    loss = (model(paddle.randn([8, 4])) ** 2).mean()
    loss.backward()
    opt.step()
    opt.clear_grad()
    if step == 3:
        open("started", "w").close()
    if step == kill_at:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.02)
    if stop:
        time.sleep(1.0)
        with open("ckpt.txt", "w") as f:
            f.write(f"saved at step {step}\n")
        sys.exit(0)
