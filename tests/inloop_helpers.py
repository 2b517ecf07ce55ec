"""Shared by the integration tests: a sample config's own modules, and the probe's answer on it.

The in-loop API, the hapi callback and `nandoctor run` must name the same first fault as `nandoctor
probe` on the same workload, so each test runs both: the probe on the sample's config.yaml, and a
plain Paddle loop built from the very same model.py / data.py the config names.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_configs"
EXAMPLES = ROOT / "examples"

FAULT_KEYS = ("step", "phase", "layer", "op", "parameter", "batch_index", "sample_indices")


def sample_module(sample: str, name: str) -> Any:
    """Import sample_configs/<sample>/<name>.py under a unique module name (samples share file names)."""
    path = SAMPLES / sample / f"{name}.py"
    key = f"_sample_{sample}_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module


def probe_first_fault(sample: str) -> dict[str, Any]:
    """`nandoctor probe sample_configs/<sample>/config.yaml`'s first fault, as the JSON has it."""
    from nandoctor.probe import ProbeOptions, run_probe
    from nandoctor.spec import load_spec

    spec = load_spec(SAMPLES / sample / "config.yaml")
    report = run_probe(spec, ProbeOptions(steps=spec.probe.steps, seed=spec.probe.seed, device="cpu"))
    return fault_of(report)


def fault_of(report: Any) -> dict[str, Any]:
    assert report is not None and report.first_fault is not None
    ff = report.to_dict()["first_fault"]
    return {k: ff[k] for k in FAULT_KEYS}


def example_module(name: str) -> Any:
    key = f"_example_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module


def probe_plain_loop(tmp_path: Path, healthy: bool = False) -> dict[str, Any]:
    """`nandoctor probe` on examples/plain_loop.py's own model and batches (the spec the examples stand for)."""
    import yaml

    from nandoctor.probe import ProbeOptions, run_probe
    from nandoctor.spec import load_spec

    example = EXAMPLES / "plain_loop.py"
    raw = {"version": 1, "model": {"entry": f"{example}:Siamese"},
           "data": {"entry": f"{example}:batches", "args": {"healthy": healthy}, "fields": ["a", "b", "target"],
                    "inputs": ["a", "b"], "label": "target"},
           "loss": {"builtin": "mse"}, "optimizer": {"name": "Adam", "args": {"learning_rate": 0.003}}}
    path = tmp_path / "plain_loop.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return fault_of(run_probe(load_spec(path), ProbeOptions(steps=20, seed=0, device="cpu")))


def first_nonfinite_step(model: Any, batches: Any, *, grads: bool, lr: float = 0.01) -> int | None:
    """Ground truth from a plain Paddle loop (Adam at `lr`, cross-entropy, as tests/probe_models.py's specs
    train): the first step whose loss (or, with `grads`, any gradient) is non-finite, judged on the host
    in float64."""
    import numpy as np
    import paddle

    opt = paddle.optimizer.Adam(learning_rate=lr, parameters=model.parameters())
    for step, (x, y) in enumerate(batches):
        loss = paddle.nn.functional.cross_entropy(model(paddle.to_tensor(x)), paddle.to_tensor(y).unsqueeze(-1))
        if not np.isfinite(float(loss)):
            return step
        loss.backward()
        if grads and not all(np.isfinite(p.grad.numpy().astype("float64")).all()
                             for p in model.parameters() if p.grad is not None):
            return step
        opt.step()
        opt.clear_grad()
    return None


def first_hooked_fault(model: Any, batches: Any, loss_of: Any, optimizer: Any = None) -> dict[str, Any] | None:
    """Ground truth from a plain Paddle loop with forward post-hooks on every sublayer: the first step at which
    a sublayer's output, the loss or (trained with `optimizer`: backward and update) a gradient holds NaN/Inf,
    judged on the host in float64. Returns {step, loss, bad_layers (in call order), bad_grads, bad_rows (the
    rows of the first bad layer's output that hold NaN/Inf), outputs (each sublayer's output at that step, its
    last call's, float64)}; None when the loop stays finite. Without an optimizer the loop only computes the
    loss (evaluation, loss monitoring)."""
    import numpy as np
    import paddle

    seen: list[tuple[str, Any]] = []

    def hook(name: str) -> Any:
        def post(_layer: Any, _inputs: Any, output: Any) -> None:
            if isinstance(output, paddle.Tensor):
                seen.append((name, output.numpy().astype("float64")))
        return post

    handles = [layer.register_forward_post_hook(hook(name)) for name, layer in model.named_sublayers()]
    try:
        for step, batch in enumerate(batches):
            seen.clear()
            loss = loss_of(model, batch)
            bad_layers = [n for n, out in seen if not np.isfinite(out).all()]
            bad_grads: list[str] = []
            if optimizer is not None:
                loss.backward()
                bad_grads = [n for n, p in model.named_parameters()
                             if p.grad is not None and not np.isfinite(p.grad.numpy().astype("float64")).all()]
            value = float(loss.numpy().astype("float64"))
            if bad_layers or bad_grads or not np.isfinite(value):
                first = next(out for n, out in seen if n == bad_layers[0]) if bad_layers else None
                rows = sorted({int(r) for r in np.argwhere(~np.isfinite(first))[:, 0]}) if first is not None else []
                return {"step": step, "loss": value, "bad_layers": bad_layers, "bad_grads": bad_grads,
                        "bad_rows": rows, "outputs": dict(seen)}
            if optimizer is not None:
                optimizer.step()
                optimizer.clear_grad()
    finally:
        for h in handles:
            h.remove()
    return None
