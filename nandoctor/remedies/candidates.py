"""The remedies worth a replay after a fault: each with the change the replay makes, the text the user reads,
and the state it restarts from (or why it cannot be tried), kept to those the cause found calls for, in the
order a practitioner would try them. trial.py replays them; judging.py judges each replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nandoctor.advice import Z_LOSS_COEF, qk_norm_text, qk_norm_unidentified
from nandoctor.engine.op_guards import guard_for
from nandoctor.engine.replay import Change
from nandoctor.engine.snapshots import Snapshot, SnapshotRing
from nandoctor.engine.warnings import CLIP_FACTOR
from nandoctor.engine.watcher import FaultKind
from nandoctor.findings import Code, Report
from nandoctor.remedies import changes as rt
from nandoctor.remedies.qk_sites import attention_layer_of, qk_sites
from nandoctor.remedies.weights import init_stds, nan_rows, rows_text

_RECURRENT = ("RNN", "SimpleRNN", "LSTM", "GRU", "RNNCellBase", "RNNBase")

# the findings a fault itself makes at its step (the others are causes found before it)
SYMPTOMS = (Code.ACTIVATION_NONFINITE, Code.LOSS_NONFINITE, Code.GRAD_NONFINITE, Code.UPDATE_NONFINITE,
            Code.DATA_NONFINITE)


@dataclass
class Candidate:
    """One remedy to replay: its name, the change as the user makes it (`change_text`) and as the replay
    makes it (`change`), the snapshot it restarts from, and the row's extra evidence."""

    remedy: str
    change_text: str
    change: Change
    start: Snapshot | None
    why_not: str | None = None  # not applicable: why
    extra: dict[str, Any] = field(default_factory=dict)
    accumulate: int = 1
    nan_weights: frozenset[str] = frozenset()  # drop_samples: the NaN weights (param.nonfinite) the samples read


@dataclass
class _Found:
    """What one fault's candidates follow from: the probe's report and run, the fault's own finding (its
    symptom) and the gradient growth before it, and the states a replay can restart from."""

    report: Report
    fault: Any
    workload: Any
    ring: SnapshotRing
    symptom: Any
    growth: Any
    here: Snapshot | None  # right before the failing step
    first: Snapshot | None  # before the first step
    diverge_start: Snapshot | None  # before the growth began, else `here`
    norms: list[tuple[int, float]] | None = None  # (step, norm) every read stride reads (conclusive_norms)

    @property
    def growth_step(self) -> int | None:
        return self.growth.location.step if self.growth is not None else None


def candidates_for(report: Report, fault: Any, workload: Any, ring: SnapshotRing, here: Snapshot | None,
                   amp: bool, norms: list[tuple[int, float]] | None = None) -> list[Candidate]:
    """Every remedy for this fault, each ready to replay or saying why not, kept to those its cause calls
    for and put in the order a practitioner would try them. `norms`: the gradient norms every read stride reads
    (conclusive_norms), for a clip threshold that does not follow the machine's load."""
    found = _found(report, fault, workload, ring, here)
    found.norms = norms
    repairs = _reinit_rows(found)
    drop = _drop_samples(found)
    drop.nan_weights = frozenset(name for c in repairs for name in c.change.reinit_rows)
    out = [_op_guard(found), *repairs, drop, *_reinit(found), _grad_clip(found), _lower_lr(found), _warmup(found),
           *_model_changes(_ModelChanges.after(found))]
    if amp:  # (on a GPU, try_remedies has returned with a note before getting here)
        out += _amp_remedies()
    for c in out:
        c.accumulate = _accumulate(workload)
    out = [c for c in out if c.remedy in _by_cause(fault, found.symptom, found.growth)]
    return _ordered(out, report, fault, found.symptom, found.growth, workload.model)


def model_change_candidates(report: Report, workload: Any, ring: SnapshotRing, start: int,
                            end_step: int) -> list[Candidate]:
    """qk-layernorm where the attention logits grew, z-loss where the head's log Z diverged, for a run without a
    fault (remedies/divergence.py): changed from `start` (before the earliest warning began), the same candidates
    as after a fault, their warnings read up to `end_step`."""
    return _model_changes(_ModelChanges(report, workload, end_step, start, ring.latest(start), None))


def _found(report: Report, fault: Any, workload: Any, ring: SnapshotRing, here: Snapshot | None) -> _Found:
    """The findings the candidates follow from, and the snapshots to restart from: the first step's, the last
    before the gradient growth began (divergence remedies), the failing step's."""
    first = ring.first
    growth = _growth_before(report, fault.step)
    growth_step = growth.location.step if growth is not None else None
    before_growth = ring.latest(growth_step) if growth_step is not None else None
    symptom = next((f for f in report.findings if f.location.step == fault.step and f.code in SYMPTOMS), None)
    return _Found(report, fault, workload, ring, symptom, growth, here, first, before_growth or here)


# Warnings whose step is where a growth toward the fault began: the gradient norm's first, else the loss's
# divergence and the transformer precursors' (issue 35), the earliest of them
GROWTHS = (Code.LOSS_DIVERGENCE, Code.ATTENTION_LOGIT_GROWTH, Code.OUTPUT_LOGIT_DIVERGENCE,
           Code.ACTIVATION_NORM_GROWTH)


def _growth_before(report: Report, fault_step: int) -> Any:
    """The warning of the growth that led to the fault, whose step the divergence remedies start from."""
    before = [f for f in report.findings if (f.location.step or 0) <= fault_step]
    explosion = next((f for f in before if f.code == Code.GRAD_EXPLOSION), None)
    if explosion is not None:
        return explosion
    growths = [f for f in before if f.code in GROWTHS and f.location.step is not None]
    return min(growths, key=lambda f: f.location.step, default=None)


def _op_guard(found: _Found) -> Candidate:
    """An epsilon or clamp for the faulting op, at the line the report names."""
    symptom = found.symptom
    op = symptom.location.op if symptom is not None else None
    source = symptom.evidence.get("source") if symptom is not None else None
    guard = guard_for(op)
    if guard is None:
        return Candidate("op_guard", "an epsilon or clamp for the faulting op", Change(), None,
                         why_not=f"no guard for op {op}" if op else "no single op was named")
    where = f" at {source}" if source else ""
    return Candidate("op_guard", f"{guard.change}{where}", Change(guard=guard, source=source), found.here)


def _reinit_rows(found: _Found) -> list[Candidate]:
    """The NaN rows of each weight param.nonfinite names, re-drawn from its finite rows."""
    report = found.report
    return [Candidate("reinit_rows", rows_text(name, bad, report), Change(reinit_rows={name: bad}), found.here)
            for name, bad in nan_rows(report, found.workload.model, found.here).items()]


def _drop_samples(found: _Found) -> Candidate:
    """Leave out the samples at fault: those holding NaN/Inf for a data fault, else those the localisation
    named (not applicable when the batch as a whole is at fault)."""
    fault, rows = found.fault, _offending_rows(found.fault, found.symptom)
    if fault.kind == FaultKind.DATA:
        text = rt.drop_nonfinite_text(fault, rows)  # the mask fits each field's shape (an NCHW image too)
        return Candidate("drop_samples", text, Change(drop_nonfinite=True), found.here)
    if rows and _sample_specific(found.report, found.symptom):
        return _drop_rows(found, rows)
    return Candidate("drop_samples", "leave out the offending samples", Change(), None,
                     why_not="no subset of the batch was found to cause the fault (not sample-specific: the "
                     "batch as a whole or the weights are at fault)")


def _drop_rows(found: _Found, rows: list[int]) -> Candidate:
    """The named samples left out wherever they come again: as dataset records when the batch sampler names
    them, else by a fingerprint of their values (a list or generator names nothing); as that position of
    that batch only when neither can be had (with the skip list to resume with)."""
    fault, workload = found.fault, found.workload
    records = _records(found.ring, fault, rows)
    if records is not None:  # the dataset's own indices: left out wherever the sampler yields them
        return Candidate("drop_samples", _records_text(fault, rows, records), Change(
            drop_records=frozenset(records)), found.here, extra={"records": records})
    prints = _fingerprints(found, rows)
    if prints is not None:  # no sampler: the records named by their values, left out wherever they come
        return Candidate("drop_samples", rt.fingerprints_text(fault, rows, prints), Change(
            drop_fingerprints=frozenset(prints)), found.here, extra={"fingerprints": prints})
    drop = (fault.epoch, fault.batch_index or 0, rows)
    return Candidate("drop_samples", _skip_text(fault, rows, workload), Change(drop=drop), found.here,
                     extra={"skip_list": _skip_list(fault, rows, workload)})


def _fingerprints(found: _Found, rows: list[int]) -> list[str] | None:
    """The fingerprints of the faulty batch's `rows` (the batch the probe kept, else the fault's own), in the
    order of `rows`, without repeats; None when the batch is gone or has no rows to hash."""
    from nandoctor.tensors.fingerprint import row_fingerprints

    fields = fault_fields(found.fault, found.workload, found.ring)
    prints = row_fingerprints(fields) if fields else None
    if prints is None or any(r >= len(prints) for r in rows):
        return None
    return list(dict.fromkeys(prints[r] for r in rows))


def fault_fields(fault: Any, workload: Any, ring: SnapshotRing) -> dict[str, Any] | None:
    """The named fields of the batch the training read at the fault: the one the probe kept, else the fault's
    own (None once those were let go)."""
    tape = ring.batches
    pos = (fault.epoch, fault.batch_index or 0)
    batch = tape.batches.get(pos) if tape is not None else None
    return workload.layout.fields(batch, pos[1]) if batch is not None else fault.fields


def _reinit(found: _Found) -> list[Candidate]:
    """Weights initialised far off their fan-in scale (param.init_scale), re-drawn from the first step."""
    first = found.first
    stds = init_stds(found.report, found.workload.model, first)
    if not stds:
        return []
    names = ", ".join(list(stds)[:4]) + ("…" if len(stds) > 4 else "")
    text = (f"re-initialise {names} with a fan-in aware initializer (std ~{min(stds.values()):.3g}): "
            "weight_attr=paddle.ParamAttr(initializer=paddle.nn.initializer.XavierNormal()), or drop the "
            "custom init (Paddle's default is fan-in scaled)")
    return [Candidate("reinit", text, Change(reinit=stds), first,
                      why_not=None if first is not None else "no snapshot of the initial state")]


def _grad_clip(found: _Found) -> Candidate:
    """Gradient clipping at a threshold from the norms before the fault, from before the growth began."""
    clip = _clip_threshold(found.report, found.growth, found.fault.step, found.norms)
    if clip is None:
        return Candidate("grad_clip", "optimizer.grad_clip: {global_norm: ...}", Change(), None,
                         why_not="no finite gradient norm before the fault to set a threshold from")
    # the change texts and their spec_change mappings: report/remedies_text.py
    edit = rt.clip_change(clip)
    clip = edit[rt.CLIP_KEY]["global_norm"]  # the replay verifies the very threshold the text states
    return Candidate("grad_clip", rt.change_text(edit), Change(clip_norm=clip, from_step=found.growth_step),
                     found.diverge_start, extra={"threshold": clip, "spec_change": edit})


def _lower_lr(found: _Found) -> Candidate:
    """The learning rate x0.1, from before the growth began."""
    lr_edit, lr_note = rt.lr_change(found.workload.spec.optimizer, _lr(found.report, found.fault.step), 0.1)
    return Candidate("lr_x0.1", rt.change_text(lr_edit, lr_note) if lr_edit else lr_note,
                     Change(lr_scale=0.1, from_step=found.growth_step), found.diverge_start,
                     extra={"spec_change": lr_edit} if lr_edit else {})


def _warmup(found: _Found) -> Candidate:
    """A linear warmup over the steps up to the growth (else the fault), from the first step."""
    fault, first = found.fault, found.first
    warm = max(1, found.growth_step or fault.step)
    warm_edit = rt.warmup_change(warm)
    return Candidate("warmup", rt.change_text(warm_edit, f"a linear warmup from 0 over the first {warm} steps"),
                     Change(warmup_steps=warm), first, extra={"spec_change": warm_edit},
                     why_not="the fault is at the first steps: no steps before it to warm up over"
                     if fault.step < 2 else (None if first is not None else "no snapshot of the first step"))


@dataclass
class _ModelChanges:
    """What the model changes (qk-layernorm, z-loss) follow from, after a fault or without one: the warnings
    up to step `up_to`, the step the change starts at and the snapshot before it, the faulting layer if any."""

    report: Report
    workload: Any
    up_to: int
    from_step: int | None
    start: Snapshot | None
    symptom_layer: str | None

    @classmethod
    def after(cls, found: _Found) -> _ModelChanges:
        symptom = found.symptom.location.layer if found.symptom is not None else None
        return cls(found.report, found.workload, found.fault.step, found.growth_step, found.diverge_start, symptom)

    def warning(self, code: Code) -> Any:
        """The precursor warning `code` whose growth began by step `up_to` (None: none)."""
        return next((f for f in self.report.findings if f.code == code and f.location.step is not None
                     and f.location.step <= self.up_to), None)


def _model_changes(at: _ModelChanges) -> list[Candidate]:
    return [*_qk_norm(at), *_z_loss(at)]


def _z_loss(at: _ModelChanges) -> list[Candidate]:
    """A z-loss on the head whose log Z diverged before the fault (output.logit_divergence), from before the
    growth began; none without that warning."""
    growth = at.warning(Code.OUTPUT_LOGIT_DIVERGENCE)
    head = growth.location.layer if growth is not None else None
    if head is None:
        return []
    text, edit = rt.z_loss_change(at.workload.spec, head, Z_LOSS_COEF)
    if head not in dict(at.workload.model.named_sublayers()):
        return [Candidate("z_loss", text, Change(), None, why_not=f"the head {head} is no sublayer of the model")]
    return [Candidate("z_loss", text, Change(z_loss=(head, Z_LOSS_COEF), from_step=at.from_step),
                      at.start, extra={"z_loss": {"layer": head, "coef": Z_LOSS_COEF},
                                       **({"spec_change": edit} if edit else {})})]


def _qk_norm(at: _ModelChanges) -> list[Candidate]:
    """qk-layernorm on every attention layer's query and key projections, where the attention logits grew
    before the fault (attention.logit_growth) or the fault is inside an attention layer; from before the growth
    began. Not applicable, with the code change to make, where the projections cannot be identified."""
    model = at.workload.model
    growth = at.warning(Code.ATTENTION_LOGIT_GROWTH)
    if growth is not None:
        named = [growth.location.layer, *[o.get("layer") for o in growth.evidence.get("layers", [])]]
        wanted = [n for n in dict.fromkeys(named) if n]
    else:
        inside = attention_layer_of(model, at.symptom_layer)
        if inside is None:
            return []
        wanted = [inside]
    sites = qk_sites(model, wanted)
    if sites.unknown or not sites.projections:
        why = sites.unknown or {w: "no q/k projections found" for w in wanted}
        return [Candidate("qk_norm", qk_norm_unidentified(why), Change(), None,
                          why_not="its query and key projections could not be identified")]
    layers = dict(model.named_sublayers())
    classes = [type(layers[a]).__name__ for a in sites.layers]
    shown = [(p.layer, p.heads, p.head_dim) for p in sites.projections]
    return [Candidate("qk_norm", qk_norm_text(sites.layers, classes, shown, sites.fused),
                      Change(qk_norm=tuple(sites.projections), from_step=at.from_step), at.start,
                      extra={"qk_norm": {"layers": sites.layers, "projections": [
                          {"layer": p.layer, "heads": p.heads, "parts": [list(r) for r in p.parts]}
                          for p in sites.projections]}})]


def _amp_remedies() -> list[Candidate]:
    """The float16 remedies, named but not tried: the probe ran on CPU, where AMP is inactive."""
    why = "the probe ran on CPU, where AMP is inactive: float16 remedies need a GPU"
    return [Candidate("fp32_layer", "run the faulting layer in float32 (paddle.amp.auto_cast(enable=False) "
                      "around it)", Change(), None, why_not=why),
            Candidate("loss_scale", "amp.init_loss_scaling: a lower start (YAML)", Change(), None, why_not=why)]


_DATA_REMEDIES = {"drop_samples", "reinit_rows"}
_DIVERGENCE = ("loss.jump", Code.GRAD_EXPLOSION.value)


def _by_cause(fault: Any, symptom: Any, growth: Any) -> set[str]:
    """The remedies worth a replay for the cause found: a NaN in the data is the data's (a learning rate,
    clipping or warmup cannot remove it); an overflow at the end of a divergence is the step size's (an epsilon
    on the op that overflowed last only hides it)."""
    every = {"op_guard", "drop_samples", "reinit_rows", "reinit", "grad_clip", "lr_x0.1", "warmup", "fp32_layer",
             "loss_scale", "qk_norm", "z_loss"}
    if fault.kind == FaultKind.DATA:
        return _DATA_REMEDIES
    causes = set(symptom.evidence.get("causes", [])) if symptom is not None else set()
    if growth is not None or causes & set(_DIVERGENCE):
        return every - {"op_guard"}
    return every


def _ordered(cands: list[Candidate], report: Report, fault: Any, symptom: Any, growth: Any,
             model: Any) -> list[Candidate]:
    """The order a practitioner would try them in, given the cause the probe found."""
    causes = set(symptom.evidence.get("causes", [])) if symptom is not None else set()
    if Code.PARAM_INIT_SCALE.value in causes:
        pref = ["reinit", "op_guard", "grad_clip", "lr_x0.1", "warmup", "drop_samples"]
    elif growth is not None or fault.kind == FaultKind.UPDATE:
        recurrent = any(type(m).__name__ in _RECURRENT for _, m in model.named_sublayers())
        pref = (["grad_clip", "lr_x0.1"] if recurrent else ["lr_x0.1", "grad_clip"]) + \
            ["warmup", "qk_norm", "z_loss", "reinit", "op_guard", "drop_samples"]
    else:
        pref = ["op_guard", "drop_samples", "reinit", "qk_norm", "grad_clip", "lr_x0.1", "warmup", "z_loss"]
    rank = {name: i for i, name in enumerate(["reinit_rows", *pref])}  # a NaN weight is repaired first
    return sorted(cands, key=lambda c: rank.get(c.remedy, len(pref)))


def _offending_rows(fault: Any, symptom: Any) -> list[int]:
    if fault.kind == FaultKind.DATA:
        return sorted({r for rows in fault.bad_fields.values() for r in rows})
    return list(symptom.location.sample_indices or []) if symptom is not None else []


def _skip_list(fault: Any, rows: list[int], workload: Any) -> dict[str, Any]:
    """What to resume with: the batch and sample ids, and PaddleFormers' `skip_data_intervals` (1-based
    optimizer steps, inclusive) for skipping that whole step."""
    return skip_list_of([(fault.epoch, fault.batch_index, fault.step, rows)], _accumulate(workload))


def skip_list_of(dropped: list[tuple[int, int | None, int, list[int]]], accumulate: int) -> dict[str, Any]:
    steps = sorted({step // accumulate + 1 for _, _, step, _ in dropped})
    return {"batches": [{"epoch": e, "batch_index": b, "step": s, "samples": rows} for e, b, s, rows in dropped],
            "skip_data_intervals": [[g, g] for g in steps]}


def _accumulate(workload: Any) -> int:
    return workload.spec.optimizer.accumulate_steps


def _skip_text(fault: Any, rows: list[int], workload: Any) -> str:
    sl = _skip_list(fault, rows, workload)
    return (f"leave out sample(s) {rows} of batch {fault.batch_index} (epoch {fault.epoch}), or skip that step: "
            f"skip_data_intervals: {sl['skip_data_intervals']} (the loader has no batch sampler to name the records "
            "by, so this leaves out that position of that batch only: if the loader yields the same records again, "
            "in another epoch, they are not left out there)")


def _sample_specific(report: Report, symptom: Any) -> bool:
    """Whether the localisation named samples as the cause (a whole-batch fault names none)."""
    ff = report.first_fault
    if ff is not None and not ff.sample_indices:
        return False
    return symptom is None or symptom.evidence.get("samples_scope") != "not_sample_specific"


def _records(ring: SnapshotRing, fault: Any, rows: list[int]) -> list[int] | None:
    """The dataset indices of the faulty batch's rows, from its batch sampler (None: no sampler, or the batch
    was not kept)."""
    tape = ring.batches
    ids = tape.records.get((fault.epoch, fault.batch_index or 0)) if tape is not None else None
    if ids is None or any(r >= len(ids) for r in rows):
        return None
    return sorted({ids[r] for r in rows})


def _records_text(fault: Any, rows: list[int], records: list[int]) -> str:
    return (f"leave out record(s) {records} of the dataset (dataset index, from the batch sampler; sample(s) {rows} "
            f"of batch {fault.batch_index}, epoch {fault.epoch}) in every epoch: filter them out of the dataset, or "
            "give the DataLoader a sampler without them")


def _clip_threshold(report: Report, growth: Any, fault_step: int,
                    norms: list[tuple[int, float]] | None = None) -> float | None:
    """The growth warning's threshold, else CLIP_FACTOR times the median norm before `fault_step`: of the norms
    every read stride reads when given (a timeline's others were read because timing allowed it)."""
    if growth is not None and growth.evidence.get("clip_threshold"):
        return float(growth.evidence["clip_threshold"])
    return clip_from_norms(norms if norms is not None else
                           [(p.step, p.grad_norm) for p in report.timeline if p.grad_norm is not None], fault_step)


def clip_from_norms(norms: list[tuple[int, float]], before: int) -> float | None:
    """CLIP_FACTOR times the median of the finite norms of the steps before `before` (None: no such norm)."""
    vals = sorted(v for s, v in norms if s < before and v == v and v != float("inf"))
    return float(vals[len(vals) // 2]) * CLIP_FACTOR if vals else None


def conclusive_norms(records: list[Any]) -> list[tuple[int, float]]:
    """(step, gradient norm) of the steps whose norm every read stride reads (StepRecord.conclusive)."""
    return [(r.step, float(r.grad_norm)) for r in records
            if r.grad_norm is not None and getattr(r, "conclusive", True)]


def _lr(report: Report, step: int) -> float | None:
    lrs = [p.lr for p in report.timeline if p.lr is not None and p.step <= step]
    return lrs[0] if lrs else None
