"""Ground truth for `nandoctor run`'s multi-model and child-process tests: a plain Paddle loop over a test
script's own functions, with Paddle's tensor checker in abort mode around each backward.

`first_backward_fault` trains phase after phase (a phase: a model, its optimizer and its loss) until a
backward aborts, and answers what the report must say: the step and op (the checker's), the layer (the
sublayer whose class's forward holds the script line Paddle printed as the op's creator, with
FLAGS_call_stack_level=3, in the script's folder; None for the model's own forward), the parameter (the first in
`named_parameters()` order whose gradient is NaN/Inf when that backward runs again without the checker)
and the samples (each row of the batch alone, on the same parameters).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import paddle
import pytest
from inloop_helpers import ROOT

from nandoctor.report.json import schema_path

# (step, model, optimizer, loss of the whole batch, loss of one row of it, rows)
Phase = tuple[int, Any, Any, Callable[[], Any], Callable[[int], Any], int]


def run_script(path: Path) -> Any:
    """A test script of tests/run_scripts/ imported as a module (its functions are the ground truth's),
    with its folder on sys.path as when Python runs it (the scripts import their shared layers from it)."""
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    spec = importlib.util.spec_from_file_location(f"_run_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def printed_frames(text: str) -> list[tuple[Path, int, str]]:
    """The frames of the Python stacks Paddle printed (with FLAGS_call_stack_level=3: where the op that
    went non-finite was created), outermost first, as (resolved file, line, function)."""
    return [(Path(f).resolve(), int(n), fn) for f, n, fn in _FRAME_RE.findall(text)]


def innermost_under(frames: list[tuple[Path, int, str]], folder: Path) -> tuple[Path, int, str]:
    """The innermost of `frames` whose file is under `folder` (the script's, or a library's)."""
    found = [f for f in frames if f[0].is_relative_to(folder.resolve())]
    assert found, f"no frame under {folder}"
    return found[-1]


def bad_params(model: Any) -> list[str]:
    return [n for n, p in model.named_parameters()
            if p.grad is not None and not np.isfinite(p.grad.numpy().astype("float64")).all()]


def first_backward_fault(phases: Iterable[Phase], script: Path, capfd: pytest.CaptureFixture,
                         clear: Callable[[], None], with_source: bool = False) -> tuple[Any, dict[str, Any]]:
    """(the faulting model, the first fault's step/phase/layer/op/parameter/sample_indices). `clear()`
    clears every optimizer's gradients (a GAN's generator loss backpropagates into both models).
    `with_source`: also `source`, the line Paddle printed as the op's creator ('radial.py:18 in forward',
    relative to the script's folder, where the model classes of these scripts live)."""
    from paddle.amp import debugging

    checker = debugging.TensorCheckerConfig(enable=True, debug_mode=debugging.DebugMode.CHECK_NAN_INF_AND_ABORT)
    old = paddle.get_flags(["FLAGS_call_stack_level"])
    paddle.set_flags({"FLAGS_call_stack_level": 3})
    found = None
    try:
        for step, model, opt, loss_of, row_loss, rows in phases:
            opt.clear_grad()
            loss = loss_of()
            capfd.readouterr()
            debugging.enable_tensor_checker(checker)
            try:
                loss.backward()
            except RuntimeError as exc:
                found = (step, model, loss_of, row_loss, rows, re.search(r"op=(\w+)", str(exc)).group(1),
                         capfd.readouterr())
                break
            finally:
                debugging.disable_tensor_checker()
            opt.step()
    finally:
        paddle.set_flags(old)
    assert found is not None, "the plain loop never went non-finite"
    step, model, loss_of, row_loss, rows, op, printed = found
    frames = [(f, n) for f, n, fn in printed_frames(printed.out + printed.err)
              if f.parent == script.resolve().parent and fn == "forward"]
    assert frames, printed.err[-2000:]

    def owns(layer: Any) -> bool:
        file, line = frames[-1]
        lines, first = inspect.getsourcelines(type(layer).forward)
        return (Path(inspect.getsourcefile(type(layer).forward)).resolve() == file
                and first <= line < first + len(lines))

    owners = [n for n, layer in [("", model), *model.named_sublayers()] if owns(layer)]
    assert len(owners) == 1, owners
    clear()  # the failing backward again, without the checker: the parameters are those it faulted with
    loss_of().backward()
    bad = bad_params(model)
    clear()
    samples = []
    for row in range(rows):
        row_loss(row).backward()
        if bad_params(model):
            samples.append(row)
        clear()
    found = {"step": step, "phase": "backward", "layer": owners[0] or None, "op": op,
             "parameter": bad[0] if bad else None, "sample_indices": samples}
    if with_source:
        file, line = frames[-1]
        found["source"] = f"{file.relative_to(script.resolve().parent)}:{line} in forward"
    return model, found


def nandoctor_run(script: Path, args: list[str], cwd: Path, columns: int = 120
                  ) -> tuple[subprocess.CompletedProcess, dict[str, Any]]:
    """`nandoctor run --json r.json --markdown r.md -- python SCRIPT ARGS` from `cwd`, as a process (the run's
    child and its stderr are what is checked) -> the process and its report.json, checked against the schema."""
    cmd = [sys.executable, "-m", "nandoctor", "run", "--json", "r.json", "--markdown", "r.md", "--",
           sys.executable, str(script), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": str(columns)}
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)
    assert (cwd / "r.json").is_file(), proc.stderr[-3000:]
    data = json.loads((cwd / "r.json").read_text(encoding="utf-8"))
    jsonschema.validate(data, json.loads(schema_path().read_text(encoding="utf-8")))
    return proc, data


def precursor_hooks(model: Any, record: dict[str, list[float]], entropy_rows: int = 4) -> list[Any]:
    """precursor_record's forward hooks (its docstring says what each records into `record`, every forward, in
    float64 on the host); the caller removes the handles. With qk-layernorm switched on in a test decoder's code
    (`plain_qk_norm`), its attention logits are read from its `scores` sublayer (q and k normed before it)."""
    def put(key: str, value: float) -> None:
        record.setdefault(key, []).append(value)

    def put_attention(name: str, scores: np.ndarray) -> None:
        logit_max, entropy = causal_attention_stats(scores, entropy_rows)
        put(f"{name}:max", logit_max)
        put(f"{name}:entropy", entropy)

    def scores_hook(name: str, attn: Any) -> Callable[..., None]:
        def hook(layer: Any, inputs: Any, out: Any) -> None:
            if attn.qk_norm or attn.plain_qk_norm:
                put_attention(name, out.numpy().astype("float64"))
        return hook

    def head_hook(layer: Any, inputs: Any, out: Any) -> None:
        a = out.numpy().astype("float64")
        m = a.max(-1, keepdims=True)
        put("head:log_z", float(np.abs(m[..., 0] + np.log(np.exp(a - m).sum(-1))).max()))

    def rms_hook(name: str) -> Callable[..., None]:
        def hook(layer: Any, inputs: Any, out: Any) -> None:
            a = out.numpy().astype("float64")
            put(f"{name}:rms", math.sqrt(float((a * a).mean())))
        return hook

    def projection_hook(name: str, attn: Any) -> Callable[..., None]:
        def hook(layer: Any, inputs: Any, out: Any) -> None:
            if not attn.plain_qk_norm:  # q and k straight from the projection
                put_attention(name, qk_logits(out.numpy(), attn.heads))
        return hook

    handles = []
    layers = dict(model.named_sublayers())
    for name, layer in layers.items():
        parent = name.rsplit(".", 1)[0]
        attn = layers.get(parent)
        if name.endswith("qkv") and not getattr(attn, "qk_norm", True):
            handles.append(layer.register_forward_post_hook(projection_hook(parent, attn)))
        elif name.endswith("scores") and hasattr(attn, "plain_qk_norm"):  # (q and k normed before it)
            handles.append(layer.register_forward_post_hook(scores_hook(parent, attn)))
        elif name == "head":
            handles.append(layer.register_forward_post_hook(head_hook))
        if isinstance(layer, paddle.nn.Linear) and name != "head":
            handles.append(layer.register_forward_post_hook(rms_hook(name)))
    return handles


def precursor_record(model: Any, batches: list[tuple[Any, Any]], loss_fn: Callable[[Any, Any], Any], *,
                     peak_lr: float, warmup: int, entropy_rows: int = 4) -> tuple[dict[str, list[float]], list[float],
                                                                                 int | None]:
    """Issue 35's ground truth: a plain AdamW loop with a linear warmup to `peak_lr` that records, every step
    and on the host in float64, through forward hooks of its own: per attention layer (q k^T / sqrt(d) from its
    QKV projection's output, or with qk-layernorm from its `scores` sublayer's, before the causal mask) the
    largest logit (`<layer>:max`,
    the mask's -1e9 added as the model adds it) and the attention entropy in nats, the mean over the rows of the
    batch's first `entropy_rows` sequences (`<layer>:entropy`); the
    head's largest |logsumexp(logits)| (`head:log_z`); each Linear's output RMS (`<layer>:rms`). Returns the
    records, the losses, and the first step whose loss was non-finite (None: none)."""
    record: dict[str, list[float]] = {}
    handles = precursor_hooks(model, record, entropy_rows)
    sched = paddle.optimizer.lr.LinearWarmup(peak_lr, warmup, 0.0, peak_lr)
    opt = paddle.optimizer.AdamW(learning_rate=sched, parameters=model.parameters())
    losses: list[float] = []
    fault = None
    try:
        for step, (x, y) in enumerate(batches):
            loss = loss_fn(model(paddle.to_tensor(x)), paddle.to_tensor(y))
            losses.append(float(loss))
            if not math.isfinite(losses[-1]):
                fault = step
                break
            loss.backward()
            opt.step()
            opt.clear_grad()
            sched.step()
    finally:
        for h in handles:
            h.remove()
    return record, losses, fault


def qk_logits(qkv: np.ndarray, heads: int) -> np.ndarray:
    """q k^T / sqrt(d) in float64 from a fused QKV projection's output [batch, seq, 3 * d] (q, k, v side by
    side, each [heads, d / heads] as the test decoders split them): [batch, heads, seq, seq]."""
    b, t, three_d = qkv.shape
    x = qkv.astype("float64").reshape(b, t, 3, heads, three_d // 3 // heads).transpose(2, 0, 3, 1, 4)
    return x[0] @ x[1].transpose(0, 1, 3, 2) / math.sqrt(x.shape[-1])


def causal_attention_stats(scores: np.ndarray, entropy_rows: int) -> tuple[float, float]:
    """The largest attention logit (with the causal mask's -1e9 added as the test decoders add it) and the
    attention entropy in nats, the mean over the query rows of the first `entropy_rows` sequences."""
    t = scores.shape[-1]
    a = scores.astype("float64") + np.triu(np.full((t, t), -1.0e9), 1)
    p = np.exp(a - a.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    p = p[:entropy_rows]
    return float(a.max()), float(-(p * np.log(np.maximum(p, 1e-300))).sum(-1).mean())


def changed_from(model: Any, batches: list[tuple[Any, Any]], loss_fn: Callable[[Any, Any], Any], *, peak_lr: float,
                 warmup: int, start: int, change: Callable[[], None] | None = None,
                 changed_loss: Callable[[Any, Any], Any] | None = None,
                 lr_scale: float = 1.0, clip: float | None = None,
                 record: dict[str, list[float]] | None = None, record_every: int = 1) -> tuple[list[float], int | None]:
    """A remedy's ground truth: precursor_record's plain AdamW loop with its linear warmup to `peak_lr`, unchanged
    before step `start` and changed from there: `change()` called once (a change to the model's own code),
    the loss made by `changed_loss`, the learning rate times `lr_scale`, the gradients clipped to a global norm of
    `clip`. Returns the losses (the user's own `loss_fn`, as a replay records them) and the first step whose loss
    or gradients went non-finite. `record`: filled with precursor_record's quantities of the forward of every
    `record_every`-th step (from step 0)."""
    opt = paddle.optimizer.AdamW(learning_rate=0.0, parameters=model.parameters())
    handles: list[Any] = []
    losses: list[float] = []
    try:
        for step, (x, y) in enumerate(batches):
            if record is not None and step % record_every == 0:
                handles = precursor_hooks(model, record)
            if step == start and change is not None:
                change()
            if step == start and clip is not None:
                opt._grad_clip = paddle.nn.ClipGradByGlobalNorm(clip)
            opt.set_lr(peak_lr * min(1.0, step / warmup) * (lr_scale if step >= start else 1.0))
            logits = model(paddle.to_tensor(x))
            label = paddle.to_tensor(y)
            loss = loss_fn(logits, label)
            for h in handles:
                h.remove()
            handles = []
            losses.append(float(loss))
            total = changed_loss(logits, label) if changed_loss is not None and step >= start else loss
            total.backward()
            if not math.isfinite(losses[-1]) or step_went_nonfinite(total, model):
                return losses, step
            opt.step()
            opt.clear_grad()
    finally:
        for h in handles:
            h.remove()
    return losses, None


# (step, the model's forward, the loss code on its output, the loss of one row of the batch, rows)
LossStep = tuple[int, Callable[[], Any], Callable[[Any], Any], Callable[[int], Any], int]


def first_loss_code_fault(steps: Iterable[LossStep], model: Any, opt: Any) -> dict[str, Any]:
    """For a fault in loss code written as functions: the first step that Paddle's tensor checker (abort mode)
    stops in, its phase ("loss" when the loss code's forward stops, else "backward") and op, and the samples
    whose loss or gradients alone are non-finite (each row replayed on the parameters of that step, which the
    loop never updated). The model's own layers are not where it is: layer None."""
    from paddle.amp import debugging

    checker = debugging.TensorCheckerConfig(enable=True, debug_mode=debugging.DebugMode.CHECK_NAN_INF_AND_ABORT)
    found = None
    for step, forward, loss_of, row_loss, rows in steps:
        loss = None
        debugging.enable_tensor_checker(checker)
        try:
            loss = loss_of(forward())
            loss.backward()
        except RuntimeError as exc:
            found = (step, "loss" if loss is None else "backward", re.search(r"op=(\w+)", str(exc)).group(1),
                     row_loss, rows)
            break
        finally:
            debugging.disable_tensor_checker()
        opt.step()
        opt.clear_grad()
    assert found is not None, "the plain loop never went non-finite"
    step, phase, op, row_loss, rows = found
    opt.clear_grad()
    samples = []
    for row in range(rows):
        loss = row_loss(row)
        loss.backward()
        if not np.isfinite(float(loss)) or bad_params(model):
            samples.append(row)
        opt.clear_grad()
    return {"step": step, "phase": phase, "layer": None, "op": op, "sample_indices": samples}


def step_went_nonfinite(loss: Any, model: Any) -> bool:
    """After `loss.backward()`: whether the loss or any parameter's gradient holds NaN/Inf, read on the host in
    float64 (a harness's own `p.grad ** 2` on the device can overflow under the checker and be taken for the
    run's fault)."""
    grads = [np.asarray(p.grad.numpy(), "float64") for p in model.parameters() if p.grad is not None]
    return not np.isfinite(float(loss)) or not all(np.isfinite(g).all() for g in grads)
