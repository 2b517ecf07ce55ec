"""A plain Paddle training script that knows nothing of nandoctor (for `nandoctor run`).

    nandoctor run --json report.json -- python examples/unmodified_loop.py          # the sqrt NaN at step 6
    nandoctor run -- python examples/unmodified_loop.py --healthy                    # passes through, exit 0
    nandoctor run -- python examples/unmodified_loop.py --loss-layer                 # the loss as nn.MSELoss()
"""

from __future__ import annotations

import sys

import paddle
import paddle.nn.functional as F

try:
    from examples.plain_loop import Siamese, batches
except ImportError:  # run as a script from the examples folder
    from plain_loop import Siamese, batches


def main() -> None:
    healthy = "--healthy" in sys.argv
    paddle.seed(0)
    model = Siamese()
    optimizer = paddle.optimizer.Adam(learning_rate=0.003, parameters=model.parameters())
    loss_layer = paddle.nn.MSELoss() if "--loss-layer" in sys.argv else None
    for step, (a, b, target) in enumerate(batches(healthy)):
        a, b, target = paddle.to_tensor(a), paddle.to_tensor(b), paddle.to_tensor(target)
        out = model(a, b)
        loss = loss_layer(out, target) if loss_layer is not None else F.mse_loss(out, target)
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        print(f"step {step} loss {float(loss):.4f}", flush=True)
    print("training finished", flush=True)


if __name__ == "__main__":
    main()
