"""A model restored from a checkpoint that was saved after the run diverged: one weight holds a NaN.

The checkpoint is written here, in a temporary folder, so the sample needs no files: a fresh model's
state dict with `classifier.weight[3, 1] = NaN`, saved with paddle.save and loaded back.
"""

import os
import tempfile

import numpy as np
import paddle
import paddle.nn as nn


class Net(nn.Layer):
    def __init__(self, in_features=16, hidden=32, num_classes=4):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU())
        self.classifier = nn.Linear(hidden, num_classes)

    def forward(self, x):
        return self.classifier(self.backbone(x))


def _write_diverged_checkpoint(path, in_features, hidden, num_classes):
    state = Net(in_features, hidden, num_classes).state_dict()
    weight = state["classifier.weight"].numpy().copy()
    weight[3, 1] = np.nan
    state["classifier.weight"] = paddle.to_tensor(weight)
    paddle.save(state, path)


def build_model(in_features=16, hidden=32, num_classes=4):
    paddle.seed(0)
    model = Net(in_features, hidden, num_classes)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "last.pdparams")
        _write_diverged_checkpoint(path, in_features, hidden, num_classes)
        model.set_state_dict(paddle.load(path))
    return model
