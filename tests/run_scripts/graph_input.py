"""A model whose input is a library object with state, as pgl's `Graph` is (pgl itself is not needed): the
graph holds numpy arrays until `graph.tensor()` converts them in place, `graph.numpy()` converts them back,
and the model refuses a graph not in tensor state. For `nandoctor run`'s tests (tests/test_run_inputs.py).

    python graph_input.py fault        # x of samples 1 and 4 is all zeros at step 3: Radial's sqrt has an
                                       # infinite gradient there (layer `radial`, op sqrt_grad)
    python graph_input.py release      # the same, but the script hands the graph back to numpy right after
                                       # backward (to free it), before optimizer.step(): a replay of the model
                                       # call then meets the graph no longer in tensor state
    python graph_input.py healthy      # trains clean

The model is a label-graph classifier (as ML-GCN): each sample's features x [B, 8] are scored against label
embeddings made by one round of message passing over a label graph that is built afresh for each batch
(its edges drop out at random), so the samples are the rows of x and the graph is shared by all of them.
`FORWARD_CALLS` counts the model's forward calls (the script's and any replay's).
"""

from __future__ import annotations

import sys

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn
from radial import Radial  # (the script's own folder is first on sys.path)

STEPS = 6
FAULT_STEP = 3
FAULT_ROWS = (1, 4)
LABELS = 5
FORWARD_CALLS = [0]


class Graph:
    """A graph whose arrays become Paddle tensors only when `tensor()` is called, in place (as pgl.Graph)."""

    def __init__(self, num_nodes: int, edges: np.ndarray, node_feat: np.ndarray) -> None:
        self.num_nodes = num_nodes
        self.edges = edges
        self.node_feat = node_feat
        self._is_tensor = False

    def is_tensor(self) -> bool:
        return self._is_tensor

    def tensor(self, inplace: bool = True) -> Graph:
        if not self._is_tensor:
            self.edges = paddle.to_tensor(self.edges)
            self.node_feat = paddle.to_tensor(self.node_feat)
            self.degree = paddle.bincount(self.edges[:, 1], minlength=self.num_nodes).astype("float32")
            self._is_tensor = True
        return self

    def numpy(self, inplace: bool = True) -> Graph:
        if self._is_tensor:
            self.edges = self.edges.numpy()
            self.node_feat = self.node_feat.numpy()
            # as pgl's EdgeIndex.numpy() does: its degree goes through to_tensor again, already a tensor, and
            # Paddle warns "To copy construct from a tensor..." on the caller's stderr
            self.degree = paddle.to_tensor(self.degree)
            self._is_tensor = False
        return self


class LabelGraphNet(nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.radial = Radial(8)
        self.label_proj = nn.Linear(6, 8)

    def forward(self, graph: Graph, x: paddle.Tensor) -> paddle.Tensor:
        FORWARD_CALLS[0] += 1
        if not graph.is_tensor():
            raise ValueError("You must call Graph.tensor() first")
        h = self.radial(x)
        src, dst = graph.edges[:, 0], graph.edges[:, 1]
        msg = paddle.geometric.send_u_recv(graph.node_feat, src, dst, reduce_op="sum", out_size=graph.num_nodes)
        labels = self.label_proj(graph.node_feat + msg / (1.0 + graph.degree.unsqueeze(1)))
        return paddle.matmul(h, labels, transpose_y=True)


def label_graph(step: int) -> Graph:
    """The label graph of one batch: fixed label features, each edge of a ring kept with probability 0.8."""
    rng = np.random.default_rng(1000 + step)
    feat = np.random.default_rng(7).normal(size=(LABELS, 6)).astype("float32")
    ring = np.array([[i, (i + 1) % LABELS] for i in range(LABELS)], dtype="int64")
    kept = ring[rng.random(LABELS) < 0.8]
    return Graph(LABELS, np.concatenate([kept, kept[:, ::-1]]) if len(kept) else ring, feat)


def batch(kind: str, step: int) -> tuple[np.ndarray, np.ndarray]:
    """(x, y) of one step: y is a multi-label target in [0, 1]."""
    rng = np.random.default_rng(step)
    x = rng.normal(size=(6, 8)).astype("float32")
    y = rng.random(size=(6, LABELS)).astype("float32")
    if kind != "healthy" and step == FAULT_STEP:
        x[list(FAULT_ROWS)] = 0.0
    return x, y


def build() -> tuple[LabelGraphNet, paddle.optimizer.Optimizer]:
    paddle.seed(0)
    model = LabelGraphNet()
    return model, paddle.optimizer.Adam(learning_rate=0.01, parameters=model.parameters())


def loss_of(model: LabelGraphNet, graph: Graph, x: paddle.Tensor, y: paddle.Tensor) -> paddle.Tensor:
    return F.mse_loss(model(graph, x), y)


def main(kind: str) -> None:
    model, opt = build()
    steps = 0
    try:
        for step in range(STEPS):
            x, y = (paddle.to_tensor(a) for a in batch(kind, step))
            graph = label_graph(step)
            graph.tensor()
            loss = loss_of(model, graph, x, y)
            steps += 1
            loss.backward()
            if kind == "release":
                graph.numpy()  # done with it: back to host memory
            opt.step()
            opt.clear_grad()
            print(f"step {step} loss {float(loss):.4f}", flush=True)
        print("training finished", flush=True)
    finally:  # (also when nandoctor run stops the script at a fault)
        print(f"model called {steps} times by the loop, {FORWARD_CALLS[0]} in all", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
