"""The fast_mlp workload as a user would train it: a plain Paddle loop, no nandoctor."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import paddle.nn.functional as F  # noqa: E402
from model import build_loader, build_model  # noqa: E402
from plain_loop import main  # noqa: E402


def loss_fn(logits, label):
    return F.cross_entropy(logits, label.unsqueeze(-1))


if __name__ == "__main__":
    main(__file__, build_model, build_loader, loss_fn)
