"""The report's data model: findings, their locations, the first fault, the timeline and the verdict.

Everything that crosses from scan/probe to the renderers is one of these dataclasses; `Report.to_dict`
is the contract's JSON (`nandoctor.report/1`) and `Report.from_dict` reads it back for re-rendering.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any

SCHEMA = "nandoctor.report/1"
# How the JSON writes a number that is not finite (JSON has no NaN or Infinity): these three strings in every
# numeric field, the spelling of JavaScript's Number() and of protobuf's JSON mapping, which Python's float()
# reads as well. `_jsonable` is the one place that writes them; the schema (report/schemas/) names them.
NAN_TEXT, INF_TEXT, NEG_INF_TEXT = "NaN", "Infinity", "-Infinity"


class Severity(str, Enum):
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"


class Phase(str, Enum):
    DATA = "data"
    PARAMS = "params"
    FORWARD = "forward"
    LOSS = "loss"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


class Verdict(str, Enum):
    HEALTHY = "healthy"
    AT_RISK = "at_risk"
    NAN_FOUND = "nan_found"
    CRASHED = "crashed"
    INTERRUPTED = "interrupted"
    # an error that is neither a non-finite value nor a crash (labels out of range, an empty loader ...):
    # the contract forbids `at_risk` for a report with an error, and `nan_found` would be untrue
    ERROR_FOUND = "error_found"


class Code(str, Enum):
    """Finding codes; the first thirteen are fixed by the contract, the rest are ours."""

    DATA_NONFINITE = "data.nonfinite"
    DATA_LABEL_RANGE = "data.label_range"
    DATA_SEQ_LEN = "data.seq_len"
    DATA_RANGE = "data.range"
    PARAM_NONFINITE = "param.nonfinite"
    PARAM_INIT_SCALE = "param.init_scale"
    ACTIVATION_NONFINITE = "activation.nonfinite"
    LOSS_NONFINITE = "loss.nonfinite"
    GRAD_NONFINITE = "grad.nonfinite"
    GRAD_EXPLOSION = "grad.explosion"
    UPDATE_NONFINITE = "update.nonfinite"
    PRECISION_FP16_OVERFLOW = "precision.fp16_overflow"
    USER_CODE_ERROR = "user_code.error"
    # nandoctor's own additions
    REPLAY_SIDE_EFFECTS = "replay.side_effects"
    DATA_EMPTY = "data.empty"
    DATA_CONSTANT = "data.constant"
    DATA_TARGET_SCALE = "data.target_scale"  # a regression target far above the model's initial output
    PARAM_ZERO = "param.zero"
    GRAD_VANISHING = "grad.vanishing"
    AMP_INACTIVE = "amp.inactive"
    AMP_SCALE_COLLAPSE = "amp.scale_collapse"
    RUN_INTERRUPTED = "run.interrupted"
    LOSS_NOT_TENSOR = "loss.not_tensor"
    LOSS_NOT_SCALAR = "loss.not_scalar"
    LOSS_NO_GRAD = "loss.no_grad"
    MODEL_NO_TRAINABLE = "model.no_trainable"
    DATA_UNBOUNDED = "data.unbounded"
    DATA_NOT_TENSOR = "data.not_tensor"
    RANK_HUNG = "rank.hung"  # a rank of a multi-process run stopped moving; the others waited for it
    RANK_KILLED = "rank.killed"  # a rank of a multi-process run died of a signal (the OOM killer's SIGKILL)
    RUN_RESUMED = "run.resumed"  # info: the probe started from the user's checkpoint (resume / --resume)
    LOSS_DIVERGENCE = "loss.divergence"  # the loss rose several-fold above its minimum and stayed there
    LOSS_SPIKE = "loss.spike"  # the loss rose several-fold over the steps before it, then recovered
    # transformer instability precursors (issue 35; engine/precursors.py): warnings before a fault
    ATTENTION_LOGIT_GROWTH = "attention.logit_growth"
    OUTPUT_LOGIT_DIVERGENCE = "output.logit_divergence"
    ACTIVATION_NORM_GROWTH = "activation.norm_growth"
    ATTENTION_UNSEEN = "attention.unseen"  # info: layers that look like attention, whose softmax was not seen


# Codes that mean "a non-finite value was found": they make the verdict `nan_found`.
NONFINITE_CODES = frozenset(
    {
        Code.DATA_NONFINITE,
        Code.PARAM_NONFINITE,
        Code.ACTIVATION_NONFINITE,
        Code.LOSS_NONFINITE,
        Code.GRAD_NONFINITE,
        Code.UPDATE_NONFINITE,
    }
)


@dataclass
class Location:
    """Where a finding is; every field optional because a data finding has no layer, and so on."""

    step: int | None = None
    phase: Phase | None = None
    layer: str | None = None
    op: str | None = None
    parameter: str | None = None
    batch_index: int | None = None
    sample_indices: list[int] | None = None
    field: str | None = None
    rank: int | None = None  # the process of a multi-process run (null otherwise; the contract's `rank`)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["phase"] = self.phase.value if self.phase else None
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Location:
        d = dict(d or {})
        known = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        if d.get("phase"):
            d["phase"] = Phase(d["phase"])
        return cls(**d)

    def describe(self) -> str:
        """A short human phrase: 'step 6, backward, layer head.distance, op sqrt_grad'."""
        parts: list[str] = []
        if self.rank is not None:
            parts.append(f"rank {self.rank}")
        if self.step is not None:
            parts.append(f"step {self.step}")
        if self.phase is not None:
            parts.append(self.phase.value)
        if self.batch_index is not None and self.step is None:
            parts.append(f"batch {self.batch_index}")
        if self.sample_indices:
            shown = ", ".join(str(i) for i in self.sample_indices[:8])
            more = "…" if len(self.sample_indices) > 8 else ""
            parts.append(f"sample{'s' if len(self.sample_indices) > 1 else ''} {shown}{more}")
        if self.field is not None:
            parts.append(f"field '{self.field}'")
        if self.layer is not None:
            parts.append(f"layer {self.layer}")
        if self.op is not None:
            parts.append(f"op {self.op}")
        if self.parameter is not None:
            parts.append(f"parameter {self.parameter}")
        return ", ".join(parts) if parts else "—"


@dataclass
class Finding:
    code: Code
    severity: Severity
    message: str
    location: Location = field(default_factory=Location)
    evidence: dict[str, Any] = field(default_factory=dict)
    advice: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": getattr(self.code, "value", self.code),  # a newer nandoctor's code is kept as text
            "severity": self.severity.value,
            "message": self.message,
            "location": self.location.to_dict(),
            "evidence": _jsonable(self.evidence),
            "advice": list(self.advice),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Finding:
        try:
            code: Code | str = Code(d["code"])
        except ValueError:  # a newer nandoctor's code: keep it as text rather than refuse the report
            code = d["code"]
        return cls(
            code=code,  # type: ignore[arg-type]
            severity=Severity(d["severity"]),
            message=d["message"],
            location=Location.from_dict(d.get("location")),
            evidence=dict(d.get("evidence") or {}),
            advice=list(d.get("advice") or []),
        )


@dataclass
class FirstFault:
    """The first place a non-finite value (or a crash) appeared; the contract's `first_fault`."""

    step: int | None
    phase: Phase
    layer: str | None = None
    op: str | None = None
    parameter: str | None = None
    batch_index: int | None = None
    sample_indices: list[int] | None = None
    rank: int | None = None  # the first faulting process of a multi-process run (null otherwise)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["phase"] = self.phase.value
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> FirstFault | None:
        if not d:
            return None
        known = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k in known}
        d["phase"] = Phase(d["phase"])
        return cls(**d)

    def as_location(self) -> Location:
        return Location(
            step=self.step,
            phase=self.phase,
            layer=self.layer,
            op=self.op,
            parameter=self.parameter,
            batch_index=self.batch_index,
            sample_indices=self.sample_indices,
            rank=self.rank,
        )


@dataclass
class TimelinePoint:
    step: int
    loss: float | None = None
    grad_norm: float | None = None
    loss_scale: float | None = None
    skipped: bool | None = None
    lr: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: _jsonable(v) for k, v in asdict(self).items() if v is not None or k in ("loss", "grad_norm")}


class Mode(str, Enum):
    """Which way in produced a report: its title, and whether an exit status and CLI flags apply to it."""

    PROBE = "probe"
    RUN = "run"
    WATCH = "watch"
    HAPI = "hapi"
    TRAINER = "trainer"

    @property
    def title(self) -> str:
        return {"probe": "nandoctor probe", "run": "nandoctor run", "watch": "nandoctor.watch",
                "hapi": "nandoctor's hapi callback", "trainer": "nandoctor's Trainer callback"}[self.value]

    @property
    def is_command(self) -> bool:
        """A command-line run: its report has an exit status and was asked for with --json/--markdown."""
        return self in (Mode.PROBE, Mode.RUN)


@dataclass
class Report:
    command: str
    findings: list[Finding] = field(default_factory=list)
    first_fault: FirstFault | None = None
    timeline: list[TimelinePoint] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)
    # What was run, for reproduction: config path, argv, steps, seed, device ...
    run: dict[str, Any] = field(default_factory=dict)
    # Extra per-command material that renderers may show (data field statistics, per-layer maxima ...)
    details: dict[str, Any] = field(default_factory=dict)
    # The user's code raised and training could not go on (verdict `crashed`).
    crashed: bool = False
    # The run was stopped by Ctrl-C or SIGTERM and the report holds only what was seen so far.
    partial: bool = False
    # In memory only, never in the JSON: what a bundle needs to reproduce the fault (the offending
    # batch as numpy arrays, the pre-step model state, the RNG state). See report/bundle.py.
    artifacts: dict[str, Any] = field(default_factory=dict, repr=False)
    # Probe only: candidate fixes replayed after a fault, verified first (remedies/trial.py):
    # {remedy, change, outcome (fixed/not_fixed/not_applicable), steps_run, loss_before, loss_after, seconds}
    remedies: list[dict[str, Any]] = field(default_factory=list)

    @property
    def verdict(self) -> Verdict:
        """Crashed beats NaN beats any other error; a run stopped by a signal before any error is
        `interrupted`; then warnings make `at_risk`. A non-finite value reported only as a warning (a NaN
        in a frozen parameter the run trains around) is `at_risk`: the verdict never says more than the
        exit status does."""
        errors = [f for f in self.findings if f.severity == Severity.ERROR]
        if self.crashed:
            return Verdict.CRASHED
        if any(f.code in NONFINITE_CODES for f in errors):
            return Verdict.NAN_FOUND
        if errors:
            return Verdict.ERROR_FOUND
        if self.partial:
            return Verdict.INTERRUPTED
        if any(f.severity == Severity.WARNING for f in self.findings):
            return Verdict.AT_RISK
        return Verdict.HEALTHY

    @property
    def exit_code(self) -> int:
        """0 with no error-severity finding, 1 with one (the contract)."""
        return 1 if any(f.severity == Severity.ERROR for f in self.findings) else 0

    @property
    def mode(self) -> Mode | None:
        """The way in (`run.mode`) for probe-style reports: None for scan and for a spec's probe."""
        try:
            return Mode(self.run.get("mode")) if self.run.get("mode") else None
        except ValueError:
            return None

    @property
    def title(self) -> str:
        """What ran, as the report's heading names it: `nandoctor run`, `nandoctor.watch`, `nandoctor probe`."""
        mode = self.mode
        return mode.title if mode is not None else f"nandoctor {self.command}"

    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in Severity}
        for f in self.findings:
            out[f.severity.value] += 1
        return out

    def sorted_findings(self) -> list[Finding]:
        """Errors first, then warnings, then info; stable within a severity (order of discovery)."""
        rank = {Severity.ERROR: 0, Severity.WARNING: 1, Severity.INFO: 2}
        return sorted(self.findings, key=lambda f: rank[f.severity])

    def to_dict(self) -> dict[str, Any]:
        """The contract's document, JSON-ready all the way down (numpy values and NaN included), in one pass."""
        return _jsonable({
            "schema": SCHEMA,
            "command": self.command,
            "verdict": self.verdict.value,
            "partial": self.partial,
            "first_fault": self.first_fault.to_dict() if self.first_fault else None,
            "findings": [f.to_dict() for f in self.findings],
            "timeline": [p.to_dict() for p in self.timeline],
            "environment": self.environment,
            "run": self.run,
            "details": self.details,
            **({"remedies": self.remedies} if self.command == "probe" else {}),
        })

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Report:
        if d.get("schema") != SCHEMA:
            raise ValueError(f"not a nandoctor report (schema is {d.get('schema')!r}, expected {SCHEMA!r})")
        return cls(
            command=d.get("command", "?"),
            findings=[Finding.from_dict(f) for f in d.get("findings", [])],
            first_fault=FirstFault.from_dict(d.get("first_fault")),
            timeline=[TimelinePoint(**p) for p in d.get("timeline", [])],
            environment=dict(d.get("environment") or {}),
            run=dict(d.get("run") or {}),
            details=_timings_back(d.get("details")),
            crashed=d.get("verdict") == Verdict.CRASHED.value,
            partial=bool(d.get("partial", False)),
            remedies=[dict(r) for r in d.get("remedies") or [] if isinstance(r, dict)],
        )


def _timings_back(details: Any) -> dict[str, Any]:
    """The JSON keeps clock-dependent figures under `details.timings`; in memory they sit where they were made."""
    from nandoctor.findings import join_timings

    return join_timings(dict(details or {}))


def _jsonable(value: Any) -> Any:
    """numpy scalars/arrays and enums -> plain JSON values; NaN/Inf -> strings (JSON has neither)."""
    import math

    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return _jsonable(value.tolist())
    if isinstance(value, float):
        if math.isnan(value):
            return NAN_TEXT
        if math.isinf(value):
            return INF_TEXT if value > 0 else NEG_INF_TEXT
        return value
    if isinstance(value, (bool, int, str)) or value is None:
        return value
    return str(value)


# Clock-dependent figures of `details`, kept apart so two identical runs give identical JSON apart from
# `details.timings` (report/json.py writes the split form, `Report.from_dict` joins it back).
# The clock-dependent figures of `details`: whole keys; some keys of an object; every key of an object but some.
# The snapshot ring's schedule, budgets and spills follow measured step times, free memory and free disk.
TIMED_KEYS = ("stats_every", "activation_max", "grad_norms", "localization_seconds")


TIMED_PARTS = {"remedies": ("seconds", "budget_seconds", "probe_seconds"), "rollback": ("seconds",)}


TIMED_BUT = {"snapshots": ("enabled", "note")}


def split_timings(details: dict[str, Any]) -> dict[str, Any]:
    """`details` with every clock-dependent figure moved under `details["timings"]`, nested as it was."""
    out = dict(details)
    timings: dict[str, Any] = dict(out["timings"]) if isinstance(out.get("timings"), dict) else {}
    for key in TIMED_KEYS:
        if key in out:
            timings[key] = out.pop(key)
    for name, holder in list(out.items()):
        if not isinstance(holder, dict) or name not in {**TIMED_PARTS, **TIMED_BUT}:
            continue
        moved = [k for k in holder if k in TIMED_PARTS[name]] if name in TIMED_PARTS else \
            [k for k in holder if k not in TIMED_BUT[name]]
        if moved:
            timings[name] = {**(timings.get(name) or {}), **{k: holder[k] for k in moved}}
            out[name] = {k: v for k, v in holder.items() if k not in moved}  # a copy: the report keeps its own
    if timings:
        out["timings"] = timings
    return out


def join_timings(details: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `split_timings`, for a report read back from JSON."""
    timings = details.pop("timings", None)
    if not isinstance(timings, dict):
        return details
    for name, value in timings.items():
        if isinstance(value, dict) and isinstance(details.get(name), dict):
            details[name] = {**details[name], **value}
        elif name not in details:
            details[name] = value
    return details
