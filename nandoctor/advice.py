"""The remedies, in one place: what to change for each kind of finding, and for each Paddle op.

Scan and probe ask `advice_for(code, op=..., **facts)`; nothing else in nandoctor writes advice text,
so the domain knowledge can be read and improved here alone. A setting (clipping, learning rate, warmup)
is written for the way the user ran: spec keys in YAML for `scan`/`probe` (`mode` None or PROBE), Python
for their own script under `run`, `watch` and the hapi callback, TrainingArguments under the Trainer
(`setting_text`; `fit_mode` re-writes a report's findings for its mode once they are all made).
"""

from __future__ import annotations

import inspect
import math
from typing import Any

from nandoctor.findings import Code, Mode, Report

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
    "data.target_scale": ["Standardise a regression target (subtract its mean, divide by its std) before the loss "
                          "and turn predictions back afterwards; a lower learning rate only hides the gap."],
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
    "grad.nonfinite": ["A gradient went non-finite in backward while the loss was finite: an op with an "
                       "infinite derivative at the input it got (sqrt, log, pow, acos at their edge)."],
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


_HIDDEN_NAN_ADVICE = ("A finite loss does not mean a clean forward pass: an op made NaN there and a later op hid "
                      "it from the loss (Paddle's relu turns NaN into 0). Fix the op that made it (above), not "
                      "what hid it.")


WARMUP_STEPS = 200  # "a few hundred steps": the example a warmup line gives when nothing measured says more


def spec_mode(mode: Mode | str | None) -> bool:
    """A spec's run (`scan`, `probe`, `--nproc` ranks): its settings are YAML keys of that spec."""
    return mode is None or Mode(mode) == Mode.PROBE


LR_KEY = "optimizer.args.learning_rate"
SCHED_ARGS_KEY = "optimizer.lr_scheduler.args"


def num3(x: float) -> float:
    """Three significant digits, as a float YAML writes and reads back exactly."""
    return float(f"{x:.3g}")


def flow_yaml(value: Any) -> str:
    """A value as one line of YAML (flow style), keys in their own order."""
    import yaml  # (here: only a spec's advice is YAML; a watched script's start need not load PyYAML)

    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**6)
    return text.strip().removesuffix("...").strip()  # a bare scalar ends its document with "..."


def lr_edit(optimizer: Any, scale: float | None, rate: float | None) -> tuple[dict[str, Any] | None, str]:
    """The learning rate times `scale` as a spec edit (dotted key -> value) and a note, naming only keys the
    validator accepts: the base rate `optimizer.args.learning_rate` (a scheduler by name that takes one, or a
    warmup alone, starts from it); a scheduler whose rates are its own arguments (PiecewiseDecay's `values`,
    OneCycleLR's `max_learning_rate`) gets those scaled; an `entry` scheduler has no key to set (None, and the
    note says what to change in the user's function). `rate`: the rate in use, when the spec gives none."""
    sched = getattr(optimizer, "lr_scheduler", None)
    base = (getattr(optimizer, "args", None) or {}).get("learning_rate")
    by = f" by {scale:.2g}" if scale else ""
    if sched is not None and sched.entry:
        return None, f"scale the learning rates your optimizer.lr_scheduler.entry ({sched.entry}) returns{by}"
    if sched is not None and sched.name and _rates_are_arguments(sched.name):
        return _scheduler_rates_edit(sched, scale, by)
    return _base_rate_edit(base, rate, scale, scheduled=sched is not None)


def _rates_are_arguments(name: str) -> bool:
    """A scheduler class of paddle.optimizer.lr that takes no base `learning_rate`: its rates are its own
    arguments (PiecewiseDecay's `values`, OneCycleLR's `max_learning_rate`)."""
    from nandoctor.workload.schedulers import scheduler_classes

    cls = scheduler_classes().get(name)
    return cls is not None and "learning_rate" not in inspect.signature(cls).parameters


def _scheduler_rates_edit(sched: Any, scale: float | None, by: str) -> tuple[dict[str, Any] | None, str]:
    """The scheduler's own rate arguments times `scale`, the others kept; none to scale (or text where a
    number belongs): only a note."""
    rates = {k: v for k, v in sched.args.items() if "learning_rate" in k or k == "values"}
    if not all(_numbers(v) for v in rates.values()):  # YAML's `1.0e36` (no exponent sign) is text
        rates = {}
    if not rates or not scale:
        return None, f"scale the rates of optimizer.lr_scheduler ({sched.name}){by}"
    scaled = {k: [num3(x * scale) for x in v] if isinstance(v, list) else num3(v * scale)
              for k, v in rates.items()}
    return {SCHED_ARGS_KEY: {**sched.args, **scaled}}, f"the scheduler's rates x{scale:.2g}"


def _base_rate_edit(base: Any, rate: float | None, scale: float | None, *,
                    scheduled: bool) -> tuple[dict[str, Any] | None, str]:
    """`optimizer.args.learning_rate` times `scale`, from the spec's rate (else the one in use); with no
    number to start from, only a note."""
    start = base if isinstance(base, (int, float)) else rate
    if not isinstance(start, (int, float)) or not scale:
        return None, f"the learning rate{' x' + format(scale, '.2g') if scale else ''}"
    what = "the scheduler's base rate" if scheduled else "was"
    return {LR_KEY: num3(start * scale)}, f"{what} {start:g}"


def _numbers(v: Any) -> bool:
    """A rate argument nandoctor can scale: a number, or a list of numbers."""
    items = v if isinstance(v, list) else [v]
    return all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in items)


def setting_text(what: str, value: Any, mode: Mode | str | None = None, *, lr: float | None = None,
                 optimizer: Any = None) -> str:
    """One setting as the user writes it where they ran: `what` is `clip` (a global norm), `lr` (a
    learning rate; `lr` the one in use) or `warmup` (steps; `lr` the rate it warms up to). A code span,
    ready for a sentence. For a spec, `optimizer` (the spec's OptimizerSpec) picks the key that sets a
    learning rate there (`lr_edit`)."""
    v = f"{value:.3g}" if isinstance(value, float) else str(value)
    if spec_mode(mode):
        if what == "lr" and optimizer is not None:
            edit, note = lr_edit(optimizer, value / lr if isinstance(lr, (int, float)) and lr > 0 else None, lr)
            return " ".join(f"`{k}: {flow_yaml(x)}` in the spec" for k, x in edit.items()) if edit else note
        key = {"clip": "optimizer.grad_clip", "lr": LR_KEY, "warmup": "optimizer.lr_scheduler.warmup"}[what]
        shown = {"clip": f"{{global_norm: {v}}}", "lr": v, "warmup": f"{{steps: {v}, start_lr: 0.0}}"}[what]
        return f"`{key}: {shown}` in the spec"
    if Mode(mode) == Mode.TRAINER:
        arg = {"clip": "max_grad_norm", "lr": "learning_rate", "warmup": "warmup_steps"}[what]
        return f"`{arg}={v}` in your TrainingArguments"
    if what == "clip":
        return f"`grad_clip=paddle.nn.ClipGradByGlobalNorm({v})` passed to your optimizer"
    if what == "lr":
        return f"`learning_rate={v}` for your optimizer or its LR scheduler"
    end = f"{lr:.3g}" if isinstance(lr, (int, float)) else "<your learning rate>"
    stepped = ("Model.fit's LRScheduler callback steps it after each batch" if Mode(mode) == Mode.HAPI else
               "with `scheduler.step()` after each `optimizer.step()`")
    return (f"`paddle.optimizer.lr.LinearWarmup(learning_rate=<your rate or scheduler>, warmup_steps={v}, "
            f"start_lr=0.0, end_lr={end})` as the optimizer's learning_rate; {stepped}")


def lower_lr_advice(lr: float | None, at: str = "", mode: Mode | str | None = None, optimizer: Any = None) -> str:
    """How far to lower the learning rate, scaled to the one in use: 3-10x is right for 3e-3, not for 1000;
    the new rate and the warmup written for `mode` (and, for a spec, its `optimizer` block)."""
    warm = f"add a warmup of a few hundred steps ({setting_text('warmup', WARMUP_STEPS, mode, lr=lr)})"

    def new_rate(rate: float) -> str:
        return setting_text("lr", rate, mode, lr=lr, optimizer=optimizer)

    if not isinstance(lr, (int, float)) or lr <= 0 or lr != lr:
        return f"Lower the learning rate by 3-10x and {warm}."
    where = f" ({lr:g}{' ' + at if at else ''})"
    if lr > 1.0:
        exponent = math.log10(lr)
        if exponent >= 1 and abs(exponent - round(exponent)) < 1e-9:  # 10, 1e3, 1e4: a lost minus sign?
            k = round(exponent)
            return (f"The learning rate{where} is far beyond any usual value (about 1e-5 to 1e-3 for Adam/AdamW, "
                    f"1e-3 to 0.1 for SGD/Momentum): set it in that range. If 1e-{k} was meant, the exponent's "
                    f"minus sign is missing (1e{k}).")
        return (f"The learning rate{where} is far beyond any usual value (about 1e-5 to 1e-3 for Adam/AdamW, "
                f"1e-3 to 0.1 for SGD/Momentum): set it in that range, e.g. 1e-3 ({new_rate(1e-3)}), "
                f"and {warm}.")
    if lr >= 0.1:
        return (f"Lower the learning rate{where} by about 10x (to {lr / 10:.2g} or less), e.g. "
                f"{new_rate(float(f'{lr / 10:.2g}'))}, and {warm}.")
    return (f"Lower the learning rate{where} by 3-10x (e.g. {new_rate(float(f'{lr / 5:.2g}'))}) "
            f"and {warm}.")


def clip_advice(clip: float | None, mode: Mode | str | None = None, why: str = "") -> str:
    """Clip the gradients' global norm, at a threshold from the norms seen when there is one."""
    return f"Clip gradients{why}: {setting_text('clip', float(clip) if clip else 1.0, mode)}."


# Ops that overflow on large inputs: their advice still fits a divergence. The others' (log of 0, a mean
# over an empty selection, a division by 0) speaks of a singular input, which a divergence is not.
_OVERFLOW_OPS = {"matmul", "exp", "exp_grad", "adam_", "adamw_", "sgd_"}


def scale_advice(scales: list[dict[str, Any]] | None) -> str:
    """Normalise inputs and targets, citing the fields whose measured scale is far from 1 (`scales`:
    {field, role (input/target), mean, std, rms, batch} measured in float64 on the faulting batch)."""
    cited = []
    for s in scales or []:
        orders = int(math.floor(math.log10(s["rms"]))) if s.get("rms") else 0
        if orders < 1:
            continue
        what = {"target": "the target", "input": "the input"}.get(str(s.get("role")), "the")
        cited.append(f"{what} field '{s['field']}' of batch {s['batch']} has mean {s['mean']:.3g} and standard "
                     f"deviation {s['std']:.3g} (root mean square {s['rms']:.3g}, {orders} order(s) of magnitude "
                     "above unit scale)")
    roles = {str(s.get("role")) for s in scales or [] if s.get("rms") and s["rms"] >= 10}
    what = ("the inputs (subtract the mean, divide by the standard deviation, computed on the training set)"
            if cited and roles == {"input"} else
            "the inputs and the regression targets (subtract the mean, divide by the standard deviation, computed "
            "on the training set; un-scale the predictions afterwards)")
    head = f"Standardise {what}"
    if not cited:
        return head + ": features or targets far from unit scale make large errors and large gradients."
    return (f"{head}: {'; '.join(cited)}. Errors and gradients start that large, so a learning rate that suits "
            "unit-scale data overshoots.")


def cause_advice(cause: str, **facts: Any) -> list[str]:
    """What to change for the cause the probe found before the fault (grad.explosion, a loss jump, a NaN
    parameter read, weights initialised too large): asked before the op's generic advice, which only
    says what such an op does wrong in general. `mode` writes the settings where the user ran."""
    lr, at, mode = facts.get("learning_rate"), facts.get("lr_step"), facts.get("mode")
    at_text = f"at step {at}" if at is not None else ""
    if cause in ("grad.explosion", "loss.jump"):
        what = ("the gradient norm grew step after step" if cause == "grad.explosion" else
                "the loss jumped in one update")
        lower = lower_lr_advice(lr, at_text, mode, facts.get("optimizer"))
        out = [f"The fault follows from the step size: {what} before it. " + lower,
               clip_advice(facts.get("clip_norm"), mode, " so one large gradient cannot throw the weights this far")]
        scaled = scale_advice(facts.get("scales"))
        # data measured an order of magnitude or more off unit scale is the root: a learning rate suits the
        # data's scale, and standardising fixes the run where a lower rate only slows it
        far = any((s.get("rms") or 0) >= 10 for s in facts.get("scales") or [])
        return [scaled, *out] if far else [*out, scaled]
    if cause == "param.nonfinite":
        name = facts.get("parameter") or "the parameter"
        return [f"Nothing overflowed here: the op read {name}, which held NaN/Inf before training (see "
                "param.nonfinite). Load it from an earlier, finite checkpoint or re-initialise the bad rows."]
    if cause == "param.init_scale":
        return ["The weights start far above their fan-in's scale (see param.init_scale): re-initialise with "
                "`nn.initializer.XavierUniform()` (tanh/linear) or `nn.initializer.KaimingNormal()` (ReLU)."]
    return []


def _op_advice(op: str | None) -> list[str]:
    if not op:
        return []
    base = op.removesuffix("_grad") if op not in _BY_OP else op
    return list(_BY_OP.get(op, _BY_OP.get(base, [])))


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
        out = _cause_first(cause, op, facts)
        if out:
            return out
    out: list[str] = _op_advice(op)
    if code == "grad.explosion":
        return out + _explosion_advice(facts)
    if code == "data.nonfinite" and facts.get("shapes"):
        return [nonfinite_filter_advice(facts["shapes"]), *_BY_CODE[code]]
    if code == "param.nonfinite" and facts.get("frozen"):
        return ["The parameter is frozen, so training will never repair it: load it from a finite checkpoint, "
                "or drop it from the model if nothing reads it."]
    if code == "param.nonfinite" and facts.get("rows"):
        return [_bad_rows_advice(facts), _BY_CODE[code][0]]
    if code == "grad.nonfinite" and facts.get("hidden_op"):  # the forward was not clean: its op's NaN first
        return list(dict.fromkeys([*_op_advice(facts["hidden_op"]), *out, _HIDDEN_NAN_ADVICE]))
    if code == "param.init_scale" and facts.get("expected_std") is not None:
        out.append(f"Its standard deviation should be about {facts['expected_std']:.3g} for its fan-in; "
                   + _BY_CODE[code][0])
        return out
    out += _BY_CODE.get(code, [])
    return list(dict.fromkeys(out))  # op and code advice may overlap; keep the first of each


def _cause_first(cause: str, op: str | None, facts: dict[str, Any]) -> list[str]:
    """The cause's advice, then the op's where it still fits: an overflowing op's after a divergence (the
    op overflowed; its input was not singular), none after a NaN parameter (the op only read it). Empty for
    a cause with no advice of its own."""
    out = cause_advice(cause, **facts)
    if not out:
        return []
    if cause in ("grad.explosion", "loss.jump"):
        out += [a for a in _op_advice(op) if op in _OVERFLOW_OPS]
    elif cause != "param.nonfinite":
        out += _op_advice(op)
    return list(dict.fromkeys(out))


def precursor_advice(code: str, learning_rate: float | None = None, mode: Mode | str | None = None,
                     optimizer: Any = None, at: str = "", layer: str | None = None) -> list[str]:
    """What to change for a precursor's growth (issue 35; docs/how-it-works.md, "Precursors"), written for
    the way the user ran: the step size first (it drives all three), then the change to the model that keeps
    the quantity bounded (`layer`: the one that grew, the head whose logits a z-loss reads)."""
    lower = lower_lr_advice(learning_rate, at, mode, optimizer)
    if code == "attention.logit_growth":
        return [lower, "Normalise the queries and keys of each head (qk-layernorm: a `paddle.nn.LayerNorm(head_dim)` "
                "on q and on k before `q @ k^T`; Dehghani et al. 2023, Wortsman et al. 2023) so the attention logits "
                "cannot grow with the weights, and keep weight decay on the QKV projection."]
    if code == "output.logit_divergence":
        z_loss = ("a z-loss on the head: return `your_loss + " + z_loss_term() + "` from a loss entry that wraps "
                  f"yours (`loss: {{entry: {Z_LOSS_ENTRY}}}` in the spec)" if spec_mode(mode) else
                  "a z-loss on the head, right after your loss: `" + z_loss_line(layer) + "`")
        return [f"Add {z_loss} (PaLM; Wortsman et al. 2023): it pulls log Z back towards 0.",
                "Put a final LayerNorm before the output head, and compute log(sum(exp(logits))) with "
                "`paddle.logsumexp` or `F.cross_entropy` (they subtract the maximum; a hand-written one overflows "
                "once the logits pass ~88 in float32, ~11 in float16).", lower]
    return [lower, "Gradient clipping (" + setting_text("clip", 1.0, mode) + ") and qk-layernorm on the QKV "
            "projections keep these outputs from growing step after step (Rybakov et al. 2024); so does weight "
            "decay on the linear layers."]


Z_LOSS_COEF = 1.0e-4  # PaLM's coefficient: small enough to leave the cross-entropy's optimum alone
Z_LOSS_ENTRY = "z_loss.py:loss_with_z_loss"  # the loss entry a spec's z-loss is written in, beside the spec


def z_loss_term(coef: float = Z_LOSS_COEF, logits: str = "logits") -> str:
    """The z-loss term in Python: coef * mean(logsumexp(logits, -1)^2)."""
    return f"{coef_text(coef)} * paddle.logsumexp({logits}, axis=-1).square().mean()"


def coef_text(coef: float) -> str:
    """A small coefficient as people write it: 1e-4, not 0.0001."""
    return f"{coef:.0e}".replace("e-0", "e-") if 0 < coef < 1e-3 and float(f"{coef:.0e}") == coef else f"{coef:g}"


def z_loss_line(head: str | None = None, coef: float = Z_LOSS_COEF) -> str:
    """The line to add right after the loss in the user's own code (`logits`: the head's output)."""
    return f"loss = loss + {z_loss_term(coef)}" + (f"  # logits: the output of layer {head}" if head else "")


def qk_norm_text(layers: list[str], classes: list[str], projections: list[tuple[str, int, int]], fused: bool) -> str:
    """qk-layernorm as the user writes it in the attention's forward (a model change: the same in every mode),
    and how the replay made it (`projections`: layer, heads, head_dim)."""
    heads, hd = projections[0][1], projections[0][2]
    shown = ", ".join(layers[:4]) + (f" and {len(layers) - 4} more" if len(layers) > 4 else "")
    hooked = ", ".join(p[0] for p in projections[:4]) + ("…" if len(projections) > 4 else "")
    parts = "their q and k parts (laid out [q | k | v])" if fused else "their outputs"
    return (f"in the forward of {shown} ({', '.join(dict.fromkeys(classes))}), normalise the queries and keys of "
            f"each head before q @ k^T: `q, k = F.layer_norm(q, {hd}), F.layer_norm(k, {hd})` on q and k shaped "
            f"[..., {heads}, {hd}] (`import paddle.nn.functional as F`; a `paddle.nn.LayerNorm({hd})` on each also "
            f"learns a scale). The replay did this with a forward post-hook on {hooked} returning {parts} "
            f"layer-normed per head ({heads} heads of {hd}).")


def qk_norm_unidentified(why: dict[str, str]) -> str:
    """qk-layernorm as a code change, where the query and key projections could not be identified."""
    said = "; ".join(f"{layer}: {reason}" for layer, reason in list(why.items())[:3])
    return ("normalise the queries and keys of each head (qk-layernorm: `F.layer_norm(q, head_dim)` and "
            "`F.layer_norm(k, head_dim)`, or a `paddle.nn.LayerNorm(head_dim)` on each, before q @ k^T) in your "
            f"attention's forward; not replayed: its query and key projections could not be identified ({said}; "
            "a replay needs Linear sublayers named q/k, q_proj/k_proj or query/key, or a fused qkv Linear, and "
            "a head count attribute such as num_heads)")


def _explosion_advice(facts: dict[str, Any]) -> list[str]:
    """Clip at the threshold the norms before the growth give, and lower the learning rate: the rate first
    when it is beyond any usual value (clipping would only hide it)."""
    mode = facts.get("mode")
    lr = facts.get("learning_rate")
    at = f"at step {facts['lr_step']}" if facts.get("lr_step") is not None else "now"
    lr_text = f" ({lr:g} {at})" if isinstance(lr, (int, float)) else ""
    clip_norm = facts.get("clip_norm")
    clip = [clip_advice(clip_norm, mode, _clip_seen(clip_norm, facts.get("typical_norm")))]
    lower = lower_lr_advice(lr, at if lr_text else "", mode, facts.get("optimizer"))
    return [lower, *clip] if isinstance(lr, (int, float)) and lr > 1.0 else [*clip, lower]


def _clip_seen(clip_norm: float | None, typical: float | None) -> str:
    """Where the clipping threshold comes from: a multiple of the typical norm before the growth began."""
    if clip_norm and typical:
        return (f" at about {clip_norm:.3g}, {clip_norm / typical:.2g}x the typical norm before the growth began "
                f"({typical:.3g})")
    return f" at about {clip_norm:.3g}, from the norm seen before the growth began" if clip_norm else ""


def _bad_rows_advice(facts: dict[str, Any]) -> str:
    """Only some rows of a parameter hold NaN/Inf (an embedding's token ids): repair those rows alone."""
    rows = ", ".join(str(r) for r in facts["rows"][:10])
    what = "token id(s)" if facts.get("token_ids") else "row(s)"
    return (f"Only {what} {rows} of {facts.get('name', 'the parameter')} are bad: load them from an earlier, "
            f"finite checkpoint, or re-initialise just those rows (e.g. with the mean of the finite rows).")


def finite_rows_expr(name: str, ndim: int) -> str:
    """numpy for 'this sample holds no NaN/Inf' over a field of `ndim` dimensions, the batch first: every
    axis but the batch's (`.all(axis=1)` alone is wrong for an NCHW image: it keeps a (N, H, W) mask)."""
    if ndim <= 1:
        return f"np.isfinite({name})"
    if ndim == 2:
        return f"np.isfinite({name}).all(axis=1)"
    return f"np.isfinite({name}).reshape(len({name}), -1).all(axis=1)"


def nonfinite_filter_advice(shapes: dict[str, list[int]]) -> str:
    """Filter the samples holding NaN/Inf, with a mask that fits each bad field's shape."""
    masks = " & ".join(finite_rows_expr(n, len(s)) for n, s in shapes.items())
    shown = ", ".join(f"'{n}' {tuple(s)}" for n, s in shapes.items())
    return (f"Filter the samples holding NaN/Inf out of the training set (field(s) {shown}): keep the samples "
            f"where `{masks}` (one boolean per sample), or check each sample in the Dataset's __getitem__.")


_PRECURSOR_CODES = (Code.ATTENTION_LOGIT_GROWTH, Code.OUTPUT_LOGIT_DIVERGENCE, Code.ACTIVATION_NORM_GROWTH)


def fit_mode(report: Report, optimizer: Any = None) -> None:
    """Settings in the report's advice written for the way the user ran (`Report.mode`): the findings whose
    advice names a setting are re-made from their evidence; for a spec, with the keys its `optimizer` block
    accepts (a learning rate is not always `optimizer.args.learning_rate`)."""
    mode = report.mode
    if spec_mode(mode) and (optimizer is None or set(lr_edit(optimizer, 0.5, 1.0)[0] or {}) == {LR_KEY}):
        return  # the YAML written already names optimizer.args.learning_rate, the key this spec takes
    for f in report.findings:
        if f.code in (Code.LOSS_DIVERGENCE, Code.LOSS_SPIKE):
            _refit_lr_advice(f, mode, optimizer)
        elif f.code in _PRECURSOR_CODES:  # (the replays' verdicts on its remedies kept, as grad.explosion's)
            kept = [a for a in f.advice if a.startswith(("Verified by", "Tried by"))]
            f.advice = precursor_advice(f.code.value, f.evidence.get("learning_rate"), mode, optimizer,
                                        layer=f.location.layer, at=f"at step {f.evidence.get('alarm_step')}") + kept
        if f.code != Code.GRAD_EXPLOSION:
            continue
        ev = f.evidence
        kept = [a for a in f.advice if a.startswith(("Verified by", "Tried by"))]
        f.advice = advice_for(Code.GRAD_EXPLOSION.value, clip_norm=ev.get("clip_threshold"),
                              learning_rate=ev.get("learning_rate"), lr_step=f.location.step,
                              typical_norm=ev.get("typical_grad_norm", ev.get("typical_norm")), mode=mode,
                              optimizer=optimizer) + kept


def _refit_lr_advice(finding: Any, mode: Mode | str | None, optimizer: Any) -> None:
    """A loss warning's learning-rate line re-written with the keys this spec's `optimizer` block takes."""
    lr, at = finding.evidence.get("learning_rate"), f"at step {finding.location.step}"
    line = lower_lr_advice(lr, at, mode, optimizer)
    for i, text in enumerate(finding.advice):
        for head in ("If they are sound: ", ""):
            if text.startswith(head + "Lower the learning rate") or text.startswith(head + "The learning rate"):
                finding.advice[i] = head + line
                break
