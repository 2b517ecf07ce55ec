"""Which weights a remedy repairs: those named by param.init_scale (re-drawn at their fan-in scale) and the
NaN/Inf rows of those named by param.nonfinite (a corrupt checkpoint's embedding row, re-drawn from the
distribution of the weight's finite rows).
"""

from __future__ import annotations

from typing import Any

from nandoctor.engine.snapshots import Snapshot
from nandoctor.findings import Code, Report
from nandoctor.tensors.finite import nonfinite_rows


def nan_rows(report: Report, model: Any, here: Snapshot | None) -> dict[str, list[int]]:
    """Parameters named by param.nonfinite -> the rows (first axis) that still hold NaN/Inf in the state the
    replays start from (a NaN an update wrote is not there yet: those are not repaired row by row)."""

    if here is None:
        return {}
    named = {f.location.parameter for f in report.findings if f.code == Code.PARAM_NONFINITE and f.location.parameter}
    trainable = {n for n, p in model.named_parameters() if not p.stop_gradient}
    out: dict[str, list[int]] = {}
    for name in sorted(named & trainable):
        arr = here.model.get(name)
        if arr is None or arr.dtype.kind != "f" or arr.ndim == 0:
            continue
        bad = nonfinite_rows(arr)
        if bad and len(bad) < arr.shape[0]:  # a wholly NaN weight is not a row to repair: restore the checkpoint
            out[name] = bad
    return out


def rows_text(name: str, rows: list[int], report: Report) -> str:
    shown = ", ".join(map(str, rows[:8])) + ("…" if len(rows) > 8 else "")
    tokens = any(f.code == Code.PARAM_NONFINITE and f.location.parameter == name and f.evidence.get("token_ids")
                 for f in report.findings)
    what = f"row(s) {shown} of {name}" + (f" (token id(s) {shown})" if tokens else "")
    return (f"re-initialise {what} from the distribution of its finite rows, or restore them from an earlier finite "
            f"checkpoint: after loading, w = p.numpy(); ok = np.isfinite(w).all(1); w[~ok] = np.random.normal("
            "w[ok].mean(), w[ok].std(), w[~ok].shape); p.set_value(w)")


def init_stds(report: Report, model: Any, first: Snapshot | None) -> dict[str, float]:
    """Weights to re-initialise -> the std their fan-in needs. Those named by param.init_scale, and (only
    then) the other weights of the initial state as far off their fan-in scale that the check skips as too
    small to judge (a [256, 1] output head drawn with the same wrong init)."""
    from nandoctor.diagnosis.params import expected_band, owners

    out: dict[str, float] = {}
    for f in report.findings:
        if f.code == Code.PARAM_INIT_SCALE and f.location.parameter and f.evidence.get("expected_std") \
                and f.evidence.get("ratio", 1) > 1:
            lo, hi = f.evidence["expected_std"]
            if lo > 0 and hi > 0:
                out[f.location.parameter] = float((lo * hi) ** 0.5)
    if not out or first is None:
        return out
    own = owners(model)
    for name, p in model.named_parameters():
        arr = first.model.get(name)
        if name in out or arr is None or arr.ndim < 2 or arr.dtype.kind != "f":
            continue
        _, layer = own.get(id(p), (None, None))
        kind, _, band, quoted = expected_band(name, list(arr.shape), layer)
        if kind != "embedding" and quoted[0] > 0 and float(arr.std()) > 3 * band[1]:
            out[name] = float((quoted[0] * quoted[1]) ** 0.5)
    return out
