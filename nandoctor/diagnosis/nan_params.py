"""Parameters that hold NaN/Inf before training: whether the probe can train on, and the step that reads them.

A resumed checkpoint often has a few NaN rows in an embedding table: only the batches holding those token
ids go NaN, maybe hundreds of steps in. Stopping before training ("every step would be NaN") is then
false, so the probe stops only for a trained parameter that is wholly non-finite (every step reads it).
Otherwise it reports the bad rows, trains on, and afterwards names the first step that read them, the
samples and the token ids. A frozen parameter (stop_gradient, or not given to the optimizer) is only a
warning: training does not touch it, and if the model reads it the loop still catches that step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nandoctor.advice import advice_for
from nandoctor.diagnosis import faults
from nandoctor.diagnosis.params import NonfiniteParam, nonfinite_facts, owners
from nandoctor.engine.watcher import FaultKind
from nandoctor.findings import Code, Finding, FirstFault, Location, Phase, Report, Severity

_FAULT_CODES = (Code.ACTIVATION_NONFINITE, Code.LOSS_NONFINITE, Code.GRAD_NONFINITE)
_BN_STATS = ("_mean", "_variance")


@dataclass
class BadParam:
    facts: NonfiniteParam
    layer: str | None  # the dotted name of the layer that registers it ("" for the root model)
    buffer: bool
    frozen: bool  # stop_gradient, or not among the optimizer's parameters
    finding: Finding | None = None
    users: list[str] = field(default_factory=list)  # every layer that registers it (tied weights: several)

    @property
    def name(self) -> str:
        return self.facts.name

    @property
    def stops_training(self) -> bool:
        """Every value non-finite in a parameter the optimizer trains: every step reads it."""
        return self.facts.wholly and not self.buffer and not self.frozen


@dataclass
class _ModelIndex:
    """What `inspect` reads of the model and optimizer once, to look each bad name up in."""

    own: dict[int, tuple[str, Any]]  # id(parameter) -> (layer name, layer) of the outermost layer holding it
    params: dict[str, Any]
    trained: set[int]  # ids of the optimizer's parameters (empty: it lists none)
    layers: dict[str, Any]
    state: dict[str, Any]


def inspect(model: Any, optimizer: Any, names: list[str]) -> list[BadParam]:
    """The facts for each non-finite state-dict entry in `names` (from monitors.param_nonfinite)."""
    index = _ModelIndex(owners(model), dict(model.named_parameters()), {id(p) for p in optimizer_params(optimizer)},
                        dict(model.named_sublayers(include_self=True)), model.state_dict())
    out = []
    seen: set[int] = set()
    for name in names:
        p = index.params.get(name)
        if p is None:  # a tied weight appears in the state dict under each layer that holds it
            p = next((q for q in index.params.values() if q is index.state[name]), None)
            if p is not None and id(p) in seen:
                continue
        if p is not None:
            seen.add(id(p))
        out.append(_bad_param(index, name, p))
    return out


def _bad_param(index: _ModelIndex, name: str, p: Any) -> BadParam:
    """One entry's facts: `p` is its parameter, or None for a buffer (then read from the state dict)."""
    t = p if p is not None else index.state[name]
    layer_name, layer = index.own.get(id(p), (None, None)) if p is not None else _buffer_owner(name, index.layers)
    # Paddle keeps batch-norm running statistics as frozen parameters: they are state, like buffers
    stats = p is not None and "BatchNorm" in type(layer).__name__ and name.rsplit(".", 1)[-1] in _BN_STATS
    frozen = p is not None and not stats and _untrained(p, index.trained)
    facts = nonfinite_facts(name, np.asarray(t.numpy()), layer)
    users = [n for n, lay in index.layers.items() if p is not None
             and any(q is p for _, q in lay.named_parameters(include_sublayers=False))]
    return BadParam(facts, layer_name, buffer=p is None or stats, frozen=frozen,
                    users=users or ([layer_name] if layer_name is not None else []))


def _untrained(p: Any, trained: set[int]) -> bool:
    """stop_gradient, or left out of an optimizer that lists its parameters: training does not change it."""
    return bool(p.stop_gradient) or (bool(trained) and id(p) not in trained)


def optimizer_params(optimizer: Any) -> list[Any]:
    """The parameters the optimizer updates; param groups ([{'params': [...]}, ...]) flattened."""
    out: list[Any] = []
    for item in getattr(optimizer, "_parameter_list", None) or []:
        out += list(item.get("params", [])) if isinstance(item, dict) else [item]
    return out


def _buffer_owner(name: str, layers: dict[str, Any]) -> tuple[str | None, Any]:
    prefix = name.rpartition(".")[0]
    return (prefix, layers[prefix]) if prefix in layers else (None, None)


def before_training(report: Report, bad: list[BadParam], can_stop: bool = True) -> bool:
    """Findings for the bad parameters; True when the probe must not train (see BadParam.stops_training).
    A user's own loop cannot be stopped before it starts (`can_stop=False`): its first step then names the
    fault, and these findings its cause."""
    stop = [b for b in bad if b.stops_training] if can_stop else []
    if stop:
        faults.params_before_training(report, [b.name for b in stop] + [b.name for b in bad if b not in stop],
                                      {b.name: b.facts.evidence() for b in bad})
        return True
    for b in bad:
        what = "Buffer" if b.buffer else "Parameter"
        loc = Location(phase=Phase.PARAMS, layer=b.layer or None, parameter=b.name)
        evidence = {**b.facts.evidence(), "buffer": b.buffer, "frozen": b.frozen}
        head = (f"{what} '{b.name}' (shape {b.facts.shape}) holds {b.facts.nan} NaN and {b.facts.inf} Inf "
                f"value(s) before training, in {b.facts.where()}.")
        if b.frozen:
            b.finding = Finding(
                Code.PARAM_NONFINITE, Severity.WARNING,
                f"{head} It is frozen (stop_gradient, or not among the optimizer's parameters), so training does "
                "not change it; training went on, and a step whose loss reads it is reported as the fault.",
                loc, evidence, advice_for(Code.PARAM_NONFINITE.value, frozen=True))
        else:
            tied = [u for u in b.users if u != b.layer]
            if b.buffer:
                why = ("It is state, not trained (batch-norm running statistics, say), which a training step "
                       "may never read")
            elif tied:
                why = (f"Not every value is bad, though layer(s) {', '.join(tied)} hold it too (tied weights) and "
                       "may read every row")
            elif b.facts.token_ids:
                why = "Only batches holding these ids read them"
            else:
                why = "Not every value is bad (a step may never read these)"
            b.finding = Finding(
                Code.PARAM_NONFINITE, Severity.ERROR,
                f"{head} {why}, so training went on to find the first step that does.",
                loc, evidence, advice_for(Code.PARAM_NONFINITE.value, name=b.name, rows=b.facts.rows,
                                          token_ids=b.facts.token_ids))
        report.findings.append(b.finding)
    return False


def after_run(report: Report, bad: list[BadParam], fault: Any, target: Any, steps_run: int,
              records: list[Any]) -> None:
    """Tie the run's first fault to the bad parameter it read, or say that no step read it (and when no
    gradient ever reached it, that the loss does not use it: a warning, like a frozen one)."""
    ff = report.first_fault
    located = ff if fault is not None and fault.kind == FaultKind.NONFINITE else None
    read = _read_by(bad, located) if located is not None else None
    unused = _never_got_a_gradient(target.model, records)
    for b in bad:
        if b.finding is None:
            continue
        if b is read:
            _first_read(report, b, fault, target)
        elif b.name in unused and b.finding.severity == Severity.ERROR:
            _say_unused(b.finding, len(records))
        elif b.finding.severity == Severity.ERROR:
            _say_unread(b, fault, located, steps_run)
    if report.first_fault is None:
        _first_fault_at_error(report, bad)


def _read_by(bad: list[BadParam], located: FirstFault) -> BadParam | None:
    """The first bad parameter held by the fault's layer or a layer around it: the op that faulted could read it."""
    return next((b for b in bad if any(_inside(u, located.layer) for u in b.users)), None)


def _first_fault_at_error(report: Report, bad: list[BadParam]) -> None:
    """No first fault yet: the first bad parameter whose finding is still an error becomes it."""
    if any(b.finding is not None and b.finding.severity == Severity.ERROR for b in bad):
        first = next(b for b in bad if b.finding is not None and b.finding.severity == Severity.ERROR)
        faults.set_first(report, first.finding.location)


def _say_unused(finding: Finding, steps: int) -> None:
    """No gradient reached the parameter in any step read: the loss does not use it, so it is a warning."""
    finding.severity = Severity.WARNING
    finding.message += (f" No gradient reached it in the {steps} step(s) probed: the loss does not "
                        "use it, so it is not trained (and the NaN does no harm until something reads it).")
    finding.evidence["unused"] = True
    finding.advice = advice_for(Code.PARAM_NONFINITE.value, frozen=True)


def _say_unread(b: BadParam, fault: Any, located: FirstFault | None, steps_run: int) -> None:
    """No step is known to read it: say why (the first fault is elsewhere, it is state, or no batch reached
    its bad entries yet). `located`: the run's first fault when it is a non-finite value, else None."""
    if located is not None:
        where = f"layer {located.layer}" if located.layer else "outside every layer"
        b.finding.message += (f" The first fault (step {fault.step}, {where}) is outside the layers that "
                              "hold it, so it is not known to read it.")
    elif b.buffer:
        b.finding.message += (f" No training step read it in the {steps_run} step(s) probed; evaluation "
                              "(model.eval()) or inference that uses it will go NaN.")
    else:
        until = (f"before the fault at step {fault.step}" if fault is not None
                 else f"in the {steps_run} step(s) probed")
        which = "No batch held these ids" if b.facts.token_ids else "No step read these entries"
        b.finding.message += f" {which} {until}; a later one will go NaN."
    b.finding.evidence["first_read_step"] = None


def _never_got_a_gradient(model: Any, records: list[Any]) -> set[str]:
    """Trained parameters with no gradient on any step whose per-parameter norms were read (the loop's
    order: named_parameters without stop_gradient)."""
    names = [n for n, p in model.named_parameters() if not p.stop_gradient]
    seen = [r.grad_sq for r in records if getattr(r, "grad_sq", None) is not None and len(r.grad_sq) == len(names)]
    if not seen:
        return set()
    got = np.any(~np.isnan(np.stack(seen)), axis=0)
    return {n for n, g in zip(names, got) if not g}


def _inside(owner: str, layer: str | None) -> bool:
    """The fault's layer is the parameter's layer or one of its sublayers (the root model owns all; a fault
    outside every sublayer, layer None, is in the root's own forward or the loss)."""
    if layer is None:
        return owner == ""
    return owner == "" or layer == owner or layer.startswith(owner + ".")


def _first_read(report: Report, b: BadParam, fault: Any, target: Any) -> None:
    """The first fault read `b`: name it in the fault's findings, and the step, samples and token ids that
    read it in `b`'s own finding (the samples from the token ids when the bisection found none)."""
    ff = report.first_fault
    ff.parameter = b.name
    symptoms = [f for f in report.findings if f.code in _FAULT_CODES and f.location.step == ff.step]
    hits = _bad_ids_per_sample(b, fault, target)
    ids_hit = sorted({t for ts in hits.values() for t in ts})
    samples = ff.sample_indices
    if hits and not samples:
        samples = ff.sample_indices = sorted(hits)
        for f in symptoms:
            f.location.sample_indices = samples
    what = f"token id(s) {', '.join(str(t) for t in ids_hit[:10])}" if ids_hit else b.facts.where()
    for f in symptoms:
        f.location.parameter = b.name
        f.message += f" It read {what} of {b.name}, NaN before training."
    _say_first_read(b, ff, samples, ids_hit)


def _bad_ids_per_sample(b: BadParam, fault: Any, target: Any) -> dict[int, list[int]]:
    """Sample index -> the bad token ids (rows of `b`) it fed the embedding; empty when `b` has no token
    ids, the step cannot be replayed or its samples cannot be told apart (`_embedding_ids`)."""
    if not b.facts.token_ids:
        return {}
    per_sample = _embedding_ids(target, fault, b) if target.replay_loss is not None else None
    if per_sample is None:
        return {}
    bad_ids = set(b.facts.rows)
    return {i: sorted(bad_ids & ids) for i, ids in enumerate(per_sample) if bad_ids & ids}


def _say_first_read(b: BadParam, ff: FirstFault, samples: list[int] | None, ids_hit: list[int]) -> None:
    """`b`'s finding names the step that first read it, by which samples and token ids, and its evidence too."""
    who = f"sample(s) {', '.join(str(s) for s in samples[:10])} of batch {ff.batch_index}" if samples else \
        f"batch {ff.batch_index}"
    ids = f", which carry token id(s) {', '.join(str(t) for t in ids_hit[:10])}" if ids_hit else ""
    b.finding.message += f" First read at step {ff.step} by {who}{ids} (phase {ff.phase.value}, layer {ff.layer})."
    b.finding.evidence.update({"first_read_step": ff.step, "batch_index": ff.batch_index,
                               "samples": samples, "token_ids_read": ids_hit or None})


def _embedding_ids(target: Any, fault: Any, b: BadParam) -> list[set[int]] | None:
    """The token ids each sample of the failing batch feeds the embedding (one replay with a pre-hook on
    it; buffers and RNG restored), or None when its input has no batch dimension to split by."""
    import paddle

    from nandoctor.diagnosis.localize import Replayer
    from nandoctor.tensors.sizes import batch_size

    layer = dict(target.model.named_sublayers(include_self=True)).get(b.layer)
    if layer is None or fault.fields is None:
        return None
    seen: list[np.ndarray] = []

    def pre(_layer: Any, inputs: Any) -> None:
        if inputs and isinstance(inputs[0], paddle.Tensor):
            seen.append(np.asarray(inputs[0].numpy()))

    hook = layer.register_forward_pre_hook(pre)
    rp = Replayer(target, fault.rng)
    try:
        rp.reset_rng()
        with paddle.no_grad():
            rp.loss(fault.fields)
    except Exception:  # noqa: BLE001 - the ids are a nicety on top of the bisection's samples
        return None
    finally:
        hook.remove()
        rp.restore()
    n = batch_size(fault.fields)
    if not seen or n is None or seen[0].ndim == 0 or seen[0].shape[0] != n:
        return None
    per = [set() for _ in range(n)]
    for arr in seen:
        if arr.ndim and arr.shape[0] == n:
            for i in range(n):
                per[i].update(int(v) for v in np.unique(arr[i]))
    return per
