"""The remedies, in one place: what to change for each kind of finding, and for each Paddle op.

Scan and probe ask `advice_for(code, op=..., **facts)`; nothing else in nandoctor writes advice text,
so the domain knowledge can be read and improved here alone.
"""

from __future__ import annotations

import math
from typing import Any

# Starting points for ClipGradByGlobalNorm that practitioners use per architecture.
CLIP_NORM_BY_ARCH = {"transformer": 1.0, "rnn": 0.25, "cnn": 5.0}

_BY_OP: dict[str, list[str]] = {
    "log": ["Clamp the argument before the log: `paddle.log(paddle.clip(x, min=1e-12))`, or use a fused "
            "stable form (`F.log_softmax`, `F.binary_cross_entropy_with_logits`) instead of log(softmax/sigmoid)."],
    "log_grad": ["The log's argument reached 0: its gradient 1/x is infinite there. Clamp it "
                 "(`paddle.clip(x, min=1e-12)`) before the log, also where `where()` masks the result."],
    "sqrt": ["sqrt of a negative number: clamp the argument at 0 (`paddle.clip(x, min=0)`) or check its sign."],
    "sqrt_grad": ["The gradient of sqrt at 0 is infinite: add an epsilon inside, `paddle.sqrt(x + 1e-12)`, "
                  "e.g. for distances and norms."],
    "divide": ["Division by zero: add an epsilon to the denominator (`x / (d + 1e-8)`) or guard empty masks "
               "(`mask.sum().clip(min=1)`)."],
    "divide_grad": ["The gradient of a division blew up: the denominator is at or near 0. Add an epsilon to it."],
    "elementwise_div": ["Division by zero: add an epsilon to the denominator or guard empty masks."],
    "mean": ["A mean over an empty selection is 0/0: check the mask is non-empty (`mask.sum() > 0`) or divide by "
             "`mask.sum().clip(min=1)`."],
    "exp": ["exp overflows float32 above ~88: subtract the max first (`x - x.max(axis, keepdim=True)`), "
            "clamp the argument (`paddle.clip(x, max=80)`), or use `F.softmax`/`paddle.logsumexp`."],
    "exp_grad": ["exp overflowed: subtract the max or clamp the argument before exp."],
    "pow": ["A fractional power of a negative number is NaN: use `paddle.abs(x) ** p` with the sign kept apart, "
            "or clamp at 0 first."],
    "pow_grad": ["The gradient of x**p with p < 1 is infinite at 0: add an epsilon (`(x + 1e-12) ** p`)."],
    "acos_grad": ["The gradient of acos at ±1 is infinite: clamp the argument to [-1 + 1e-7, 1 - 1e-7]."],
    "asin_grad": ["The gradient of asin at ±1 is infinite: clamp the argument to [-1 + 1e-7, 1 - 1e-7]."],
    "where_grad": ["`where(mask, f(x), 0)` still back-propagates through f(x) at masked positions: make the input "
                   "safe first (`f(where(mask, x, 1))`) so the unused branch is finite too."],
    "matmul": ["A matmul overflowed: activations or weights are too large. Check the initialisation "
               "(Xavier/Kaiming) and normalise inputs; add LayerNorm before large projections."],
    "softmax": ["Use `F.softmax` on finite logits; with masks, fill with a large negative number (-1e9), not -inf, "
                "so fully-masked rows stay finite."],
    "adam_": ["Adam's update turned a parameter non-finite: raise `epsilon` (1e-8 -> 1e-6), lower the learning "
              "rate, and clip gradients."],
    "adamw_": ["AdamW's update turned a parameter non-finite: raise `epsilon` (1e-8 -> 1e-6), lower the learning "
               "rate, and clip gradients."],
    "sgd_": ["The SGD update turned a parameter non-finite: lower the learning rate and clip gradients."],
}

_BY_CODE: dict[str, list[str]] = {
    "data.nonfinite": ["Clean the data: drop or impute NaN/Inf at the source (`np.nan_to_num` or a filter in the "
                       "Dataset's __getitem__), and add an assertion in the loader so it cannot come back."],
    "data.label_range": ["Labels must lie in [0, num_classes): check the label mapping, an off-by-one (labels "
                         "1..C instead of 0..C-1), or an ignore value such as -1 or 255 (pass `ignore_index`)."],
    "data.seq_len": ["Truncate sequences to the model's maximum (`x[:, :max_len]` in the collate function), or "
                     "enlarge the position table."],
    "data.range": ["Normalise the field (subtract the mean, divide by the standard deviation) and remove or clip "
                   "gross outliers; values far outside the training range overflow activations."],
    "data.empty": ["The loader yielded an empty batch: use `drop_last=True` or filter empty batches; a mean over "
                   "nothing is NaN."],
    "data.constant": ["A field that never changes carries no signal and normalising it divides by a zero std: "
                      "check the loader reads the right column."],
    "param.nonfinite": ["A parameter is NaN/Inf before training: the checkpoint is corrupt or was saved after the "
                        "run diverged. Load an earlier checkpoint or re-initialise that layer."],
    "param.init_scale": ["Re-initialise with a fan-in aware scheme: `nn.initializer.XavierUniform()` for "
                         "tanh/linear layers, `nn.initializer.KaimingNormal()` for ReLU layers."],
    "param.zero": ["An all-zero weight matrix makes every unit identical (no symmetry breaking): use Xavier or "
                   "Kaiming initialisation for weights; zeros are for biases only."],
    "activation.nonfinite": ["A layer's output went non-finite in the forward pass: see the op-specific advice, "
                             "check the layer's inputs for extreme values, and its initialisation."],
    "loss.nonfinite": ["The loss went non-finite while the model's outputs were finite: the loss formula itself is "
                       "unstable (log of 0, division by 0). Use the fused, stable loss functions."],
    "grad.nonfinite": ["A gradient went non-finite in backward while the forward pass was finite: an op with an "
                       "infinite derivative at the input it got (sqrt, log, pow, acos at their edge)."],
    "grad.explosion": ["Clip gradients: `optimizer.grad_clip: {global_norm: 1.0}` (ClipGradByGlobalNorm).",
                       "Lower the learning rate (by 3-10x) and add a warmup of a few hundred steps."],
    "update.nonfinite": ["The optimizer step turned finite parameters non-finite: lower the learning rate, raise "
                         "the optimizer's epsilon (1e-8 -> 1e-6), and clip gradients."],
    "precision.fp16_overflow": ["float16 tops out at 65504: keep this layer in float32 (a custom black list for "
                                "`paddle.amp.auto_cast`), use bfloat16, or normalise before it (LayerNorm)."],
    "grad.vanishing": ["Gradients this small underflow in float16 (below ~6e-8): use loss scaling "
                       "(`paddle.amp.GradScaler(init_loss_scaling=65536)`), or check for saturated activations."],
    "amp.inactive": ["AMP has no float16 kernels on CPU, so nandoctor judged float16 risk from float32 magnitudes; "
                     "run the probe on a GPU to exercise real AMP."],
    "amp.scale_collapse": ["The loss scale keeps falling: some gradient overflows every step. Find it with the "
                           "first-fault report, keep that layer in float32, or use bfloat16."],
    "user_code.error": ["Fix the exception in your code at the file and line shown; nandoctor stopped there."],
    "run.interrupted": ["The run was interrupted: this report holds only the steps seen before Ctrl-C."],
}


def lower_lr_advice(lr: float | None, at: str = "") -> str:
    """How far to lower the learning rate, scaled to the one in use: 3-10x is right for 3e-3, not for 1000."""
    if not isinstance(lr, (int, float)) or lr <= 0 or lr != lr:
        return "Lower the learning rate by 3-10x and add a warmup of a few hundred steps."
    where = f" ({lr:g}{' ' + at if at else ''})"
    if lr > 1.0:
        exponent = math.log10(lr)
        if exponent >= 1 and abs(exponent - round(exponent)) < 1e-9:  # 10, 1e3, 1e4: a lost minus sign?
            k = round(exponent)
            return (f"The learning rate{where} is far beyond any usual value (about 1e-5 to 1e-3 for Adam/AdamW, "
                    f"1e-3 to 0.1 for SGD/Momentum): set it in that range. If 1e-{k} was meant, the exponent's "
                    f"minus sign is missing (1e{k}).")
        return (f"The learning rate{where} is far beyond any usual value (about 1e-5 to 1e-3 for Adam/AdamW, "
                "1e-3 to 0.1 for SGD/Momentum): set it in that range, e.g. 1e-3, and add a warmup.")
    if lr >= 0.1:
        return f"Lower the learning rate{where} by about 10x (to {lr / 10:.2g} or less) and add a warmup."
    return f"Lower the learning rate{where} by 3-10x and add a warmup of a few hundred steps."


def cause_advice(cause: str, **facts: Any) -> list[str]:
    """What to change for the cause the probe found before the fault (grad.explosion, a loss jump, a NaN
    parameter read, weights initialised too large): asked before the op's generic advice, which only
    says what such an op does wrong in general."""
    lr, at = facts.get("learning_rate"), facts.get("lr_step")
    at_text = f"at step {at}" if at is not None else ""
    if cause in ("grad.explosion", "loss.jump"):
        what = ("the gradient norm grew step after step" if cause == "grad.explosion" else
                "the loss jumped in one update")
        return [f"The fault follows from the step size: {what} before it. " + lower_lr_advice(lr, at_text),
                f"Clip gradients (`optimizer.grad_clip: {{global_norm: {facts.get('clip_norm') or 1.0:.3g}}}`) so "
                "one large gradient cannot throw the weights this far."]
    if cause == "param.nonfinite":
        name = facts.get("parameter") or "the parameter"
        return [f"Nothing overflowed here: the op read {name}, which held NaN/Inf before training (see "
                "param.nonfinite). Load it from an earlier, finite checkpoint or re-initialise the bad rows."]
    if cause == "param.init_scale":
        return ["The weights start far above their fan-in's scale (see param.init_scale): re-initialise with "
                "`nn.initializer.XavierUniform()` (tanh/linear) or `nn.initializer.KaimingNormal()` (ReLU)."]
    return []


def advice_for(code: str, op: str | None = None, **facts: Any) -> list[str]:
    """The remedies for a finding: for the cause found when there is one (`cause`: grad.explosion,
    loss.jump, param.nonfinite, param.init_scale), then op-specific (most concrete), then the code's
    general ones. A cause replaces the code's generic guess; a NaN parameter also the op's (the op only
    read it).

    `facts` tailor the text: `clip_norm` (a threshold derived from observed norms), `learning_rate`,
    `lr_step`, `parameter`, `expected_std`, `arch`.
    """
    cause = facts.pop("cause", None)
    if cause:
        out = cause_advice(cause, **facts)
        if out:
            if cause != "param.nonfinite" and op:
                base = op.removesuffix("_grad") if op not in _BY_OP else op
                out += _BY_OP.get(op, _BY_OP.get(base, []))
            return list(dict.fromkeys(out))
    out: list[str] = []
    if op:
        base = op.removesuffix("_grad") if op not in _BY_OP else op
        out += _BY_OP.get(op, _BY_OP.get(base, []))
    if code == "grad.explosion" and facts.get("clip_norm") is not None:
        lr = facts.get("learning_rate")
        at = f"at step {facts['lr_step']}" if facts.get("lr_step") is not None else "now"
        lr_text = f" ({lr:g} {at})" if isinstance(lr, (int, float)) else ""
        typical = facts.get("typical_norm")
        seen = (f"{facts['clip_norm'] / typical:.2g}x the typical norm before the growth began ({typical:.3g})"
                if typical else "the norm seen before the growth began")
        clip = [f"Clip gradients at about {facts['clip_norm']:.3g}, {seen}: "
                f"`optimizer.grad_clip: {{global_norm: {facts['clip_norm']:.3g}}}`."]
        lower = lower_lr_advice(lr, at if lr_text else "")
        # a learning rate beyond any usual value is the thing to fix first; clipping would only hide it
        out += [lower, *clip] if isinstance(lr, (int, float)) and lr > 1.0 else [*clip, lower]
        return out
    if code == "param.nonfinite" and facts.get("frozen"):
        return ["The parameter is frozen, so training will never repair it: load it from a finite checkpoint, "
                "or drop it from the model if nothing reads it."]
    if code == "param.nonfinite" and facts.get("rows"):
        rows = ", ".join(str(r) for r in facts["rows"][:10])
        what = "token id(s)" if facts.get("token_ids") else "row(s)"
        return [f"Only {what} {rows} of {facts.get('name', 'the parameter')} are bad: load them from an earlier, "
                f"finite checkpoint, or re-initialise just those rows (e.g. with the mean of the finite rows).",
                _BY_CODE[code][0]]
    if code == "param.init_scale" and facts.get("expected_std") is not None:
        out.append(f"Its standard deviation should be about {facts['expected_std']:.3g} for its fan-in; "
                   + _BY_CODE[code][0])
        return out
    out += _BY_CODE.get(code, [])
    return list(dict.fromkeys(out))  # op and code advice may overlap; keep the first of each
