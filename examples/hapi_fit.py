"""`paddle.Model.fit` watched by nandoctor's callback: the Siamese distance model of plain_loop.py,
trained through hapi; its sqrt goes NaN in backward at batch 6.

    python examples/hapi_fit.py            # writes nandoctor-report/ and exits 1
    python examples/hapi_fit.py --healthy  # exit 0
    nandoctor run -- python examples/hapi_fit.py --no-callback   # the same fit, watched with no code change
"""

from __future__ import annotations

import sys

import numpy as np
import paddle
from paddle.static import InputSpec

from nandoctor.hapi import NanDoctorCallback

try:
    from examples.plain_loop import Siamese, batches
except ImportError:  # run as a script from the examples folder
    from plain_loop import Siamese, batches


class Pairs(paddle.io.Dataset):
    """The plain loop's batches, one sample at a time (fit(batch_size=8, shuffle=False) rebuilds them)."""

    def __init__(self, healthy: bool) -> None:
        self.items = [(a[i], b[i], t[i:i + 1]) for a, b, t in batches(healthy) for i in range(len(a))]

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.items[i]

    def __len__(self) -> int:
        return len(self.items)


class Mse(paddle.nn.Layer):
    def forward(self, out: paddle.Tensor, target: paddle.Tensor) -> paddle.Tensor:
        return paddle.nn.functional.mse_loss(out, target.reshape(out.shape))


def main(healthy: bool = False, report_dir: str = "nandoctor-report", callback: bool = True) -> int:
    paddle.seed(0)
    net = Siamese()
    model = paddle.Model(net, inputs=[InputSpec([None, 10], "float32", "a"), InputSpec([None, 10], "float32", "b")],
                         labels=[InputSpec([None, 1], "float32", "target")])
    model.prepare(paddle.optimizer.Adam(learning_rate=0.003, parameters=net.parameters()), Mse())
    doctor = NanDoctorCallback(report_dir=report_dir)
    model.fit(Pairs(healthy), epochs=1, batch_size=8, shuffle=False, verbose=0,
              callbacks=[doctor] if callback else None)
    print("fit finished", flush=True)
    return 1 if doctor.report is not None and doctor.report.exit_code else 0


if __name__ == "__main__":
    sys.exit(main(healthy="--healthy" in sys.argv, callback="--no-callback" not in sys.argv))
