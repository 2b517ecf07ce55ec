"""The data checks: one streaming pass over the batches, per-field running state, findings at the end.

`DataScanner.add_batch` sees each batch once and keeps only bounded state (see stats.py), so a scan
of a million batches needs the memory of a scan of ten. Small batches are checked several at a time
(chunks.py) for speed; every finding still names its own batch and sample. Decisions that need the whole picture
(outliers, constant fields) are made in `findings()`.

Outliers, the one judgement call: a sample is a gross outlier in a float field when its max |value|
is at least 1000x the field's typical scale *and* beyond the healthy spread. The typical scale is
the median of the per-sample max |value| over every sample seen (non-zero ones; a streaming median
from a fixed log-histogram), the spread its median absolute deviation in decades; the threshold is
median + max(3 decades, 6 MADs). The largest 64 samples per field are kept as candidates and judged
against the final median, so an outlier in batch 0 is caught as well as one in batch 900. When more
than 1% of the samples are above the threshold they are a mode of the data, not outliers, and nothing
is said. Integer and bool fields (ids, labels, masks) are never judged for outliers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nandoctor.advice import advice_for
from nandoctor.findings import Code, Finding, Location, Phase, Severity
from nandoctor.scan.chunks import MAX_BYTES, MAX_ROWS, Chunk, ChunkBuffer, lone_chunk
from nandoctor.scan.model_facts import TargetCheck, target_scale_finding
from nandoctor.scan.pieces import joined, nonfinite_in, pieces, positions
from nandoctor.scan.stats import MAX_SAMPLES, FieldStats, LogHistogram, Occurrences, TopK
from nandoctor.tensors.convert import not_a_tensor, to_numpy
from nandoctor.tensors.sizes import batch_size as common_batch_size

OUTLIER_DECADES = 3.0  # 1000x
OUTLIER_MADS = 6.0
OUTLIER_MIN_SAMPLES = 16  # below this the median is not worth trusting
OUTLIER_MAX_FRACTION = 0.01
IGNORE_INDEX = -100  # Paddle's default `ignore_index` for cross_entropy: not a bad label
_LENGTH_FIELDS = ("lengths", "length", "lens", "seq_len", "seq_lens", "seq_lengths")


@dataclass
class DataLimits:
    """What the data is checked against: the spec's `checks` and facts read from the model."""

    label_bounds: tuple[float, float] | None = None  # inclusive
    label_source: str | None = None  # "checks.num_classes", "the model's output width on batch 0" ...
    value_range: tuple[float, float] | None = None
    max_seq_len: int | None = None
    position_table: tuple[str, int] | None = None  # (layer name, num_embeddings), the smallest
    inputs_to_model: bool = True  # the input fields go to the model as they are (False with a `step`)
    target: TargetCheck | None = None  # a float label's scale against the model's initial output


@dataclass
class _FieldState:
    stats: FieldStats
    nonfinite: Occurrences = field(default_factory=Occurrences)
    masked: Occurrences = field(default_factory=Occurrences)  # batches whose only NaN/Inf is a mask's -inf
    out_of_range: Occurrences = field(default_factory=Occurrences)
    bad_labels: Occurrences = field(default_factory=Occurrences)
    too_long: dict[str, Occurrences] = field(default_factory=dict)  # per limit source
    scales: LogHistogram = field(default_factory=LogHistogram)
    candidates: TopK = field(default_factory=TopK)
    ignored_labels: int = 0
    not_tensor: tuple[int, str] | None = None  # (first batch, why) for a text or ragged model input

    def state_size(self) -> int:
        parts = [self.stats, self.nonfinite, self.masked, self.out_of_range, self.bad_labels, self.scales,
                 self.candidates, *self.too_long.values()]
        return sum(p.state_size() for p in parts)


class DataScanner:
    """Feed it named batches with `add_batch`; ask for `findings()` and `details()` at the end.

    Batches are checked in chunks (chunks.py): `add_batch` may only copy the batch into a buffer, and
    `flush()` checks what is pending. `findings()`, `details()` and `state_size()` flush first; a
    caller that stops early (Ctrl-C, a crashing loader) calls `flush()` itself before reporting.
    `max_rows=0` checks every batch on its own (the reference the chunked path must match).
    """

    def __init__(self, limits: DataLimits, max_rows: int = MAX_ROWS, max_bytes: int = MAX_BYTES) -> None:
        self.limits = limits
        self.fields: dict[str, _FieldState] = {}
        self.empty = Occurrences()
        self.n_batches = 0
        self.n_samples = 0
        self.error_batch: tuple[int, dict[str, np.ndarray]] | None = None  # first batch with a data error
        self._buffer = ChunkBuffer(max_rows, max_bytes) if max_rows > 0 else None

    def add_empty(self, batch_index: int) -> None:
        self.n_batches += 1
        self.empty.add(batch_index, [], 0)

    def add_batch(self, batch_index: int, fields: dict[str, Any], label: str | None, inputs: list[str],
                  batch_size: int | None) -> None:
        """Check one named batch (now or at the next flush); `label`/`inputs` give each field's role."""
        self.n_batches += 1
        self.n_samples += batch_size or 0
        arrays = {name: to_numpy(value) for name, value in fields.items()}
        for name, arr in arrays.items():
            state = self.fields.get(name)
            if state is None:
                role = "label" if name == label else ("input" if name in inputs else "other")
                state = self.fields[name] = _FieldState(FieldStats(name, role=role))
            stats = state.stats
            if arr is None or arr.dtype.kind not in "fiub":
                stats.kind = "other"
                self._note_not_tensor(state, batch_index, fields[name])
            else:
                stats.kind = {"f": "float", "b": "bool"}.get(arr.dtype.kind, "int")
            if arr is not None:
                stats.note_layout(arr)
        buf = self._buffer
        if buf is not None and batch_size:
            layout = ChunkBuffer.layout(arrays, batch_size)
            if layout is not None:
                if not buf.fits(layout, batch_size):
                    self.flush()
                    if not buf.can_hold(layout, batch_size):
                        self._check_chunk(lone_chunk(batch_index, arrays))
                        return
                if buf.add(batch_index, arrays, layout, batch_size):
                    self.flush()  # full
                return
        self.flush()  # what is pending came first
        self._check_chunk(lone_chunk(batch_index, arrays))

    def _note_not_tensor(self, state: _FieldState, batch_index: int, value: Any) -> None:
        """Text and ragged lists: shown as such in the field table; as model inputs, a finding."""
        why = not_a_tensor(value)
        if why is None:
            return
        stats = state.stats
        if why.startswith("a ragged") and "ragged list" not in stats.dtypes:
            stats.n_batches += 1
            stats.dtypes.append("ragged list")
            stats.shapes.append([len(value)])
        if state.not_tensor is None and stats.role == "input" and self.limits.inputs_to_model:
            state.not_tensor = (batch_index, why)

    def flush(self) -> None:
        """Check the pending batches. The buffer is emptied first, so a second call never counts twice."""
        chunk = self._buffer.take() if self._buffer is not None else None
        if chunk is not None:
            self._check_chunk(chunk)

    def _check_chunk(self, chunk: Chunk) -> None:
        for name in chunk.blocks:
            self._check_field(self.fields[name], chunk, name)
        if self.error_batch is None:
            self._keep_error_batch(chunk)

    def _keep_error_batch(self, chunk: Chunk) -> None:
        """A copy of the first batch with NaN/Inf, a bad label or an over-long sequence (for --bundle)."""
        firsts = [occ.first_batch for st in self.fields.values()
                  for occ in (st.nonfinite, st.bad_labels, *st.too_long.values()) if occ]
        if firsts and min(firsts) in chunk.ids:  # type: ignore[type-var]
            b = min(firsts)  # type: ignore[type-var]
            arrays = chunk.batch_arrays(chunk.ids.index(b))  # type: ignore[arg-type]
            # a lone batch's arrays are the loader's own, captured by the caller before the loader runs again
            # (a copy here was a 100 MB batch held to the end of the scan); a slab is refilled: copied
            copy = chunk.originals is None
            kept = {k: np.array(v, copy=True) if copy else v for k, v in arrays.items() if v is not None}
            self.error_batch = (b, kept)  # type: ignore[assignment]

    def _check_field(self, st: _FieldState, chunk: Chunk, name: str) -> None:
        stats, rows = st.stats, chunk.rows(name)
        kind = rows.dtype.kind
        if rows.size == 0:
            return  # no values (a (n, 0) field, or a lone batch whose fields disagree on their length)
        if kind == "f":
            self._check_floats(st, chunk, name)
        else:
            stats.moments.add_block(chunk.blocks[name], float(rows.min()), float(rows.max()))
        if stats.role == "label" and self.limits.label_bounds is not None and kind != "b":
            self._check_labels(st, chunk, name)
        trailing = chunk.trailing[name]
        if stats.role == "input" and kind in "iu" and trailing is not None and len(trailing) == 1:
            self._check_length(st, chunk, name)

    def _check_floats(self, st: _FieldState, chunk: Chunk, name: str) -> None:
        """Moments, per-sample max |value| (scales and outlier candidates), NaN/Inf and range flags of a
        float field, PIECE_VALUES values at a time: a chunk of small batches is one piece, and a 100 MB
        batch's temporaries stay a few MB (its float64 copies, per-sample arrays and whole-batch masks were
        4.7 batches beyond a plain loop's peak: issue 34)."""
        rows = chunk.rows(name)
        check_range = self.limits.value_range is not None and st.stats.role != "label"
        nonfinite: list[np.ndarray] = []  # rows holding a NaN/Inf, piece by piece
        out_of_range: list[np.ndarray] = []  # rows holding a finite value outside checks.value_range
        for a, piece in pieces(rows):
            pmax, pmin = piece.max(axis=1), piece.min(axis=1)  # fast: the slab is (features, rows)
            with np.errstate(invalid="ignore"):
                all_finite = bool(np.isfinite(pmax).all() and np.isfinite(pmin).all())  # NaN propagates
            if all_finite:
                st.stats.moments.add_block(piece.T, float(pmin.min()), float(pmax.max()))
                maxabs = np.maximum(pmax, -pmin)
                if check_range:
                    lo, hi = self.limits.value_range  # type: ignore[misc]
                    out_of_range.append(np.flatnonzero((pmin < lo) | (pmax > hi)) + a)
            else:  # the details, only for a piece that has a NaN or Inf somewhere
                finite = np.isfinite(piece)
                nonfinite.append(np.flatnonzero(~finite.all(axis=1)) + a)
                st.stats.moments.add(piece[finite])
                maxabs = np.where(finite, np.abs(piece), 0).max(axis=1)
                if check_range:
                    lo, hi = self.limits.value_range  # type: ignore[misc]
                    with np.errstate(invalid="ignore"):
                        out_of_range.append(np.flatnonzero((finite & ((piece < lo) | (piece > hi))).any(axis=1)) + a)
            st.scales.add(maxabs[maxabs > 0].astype(np.float64))
            st.candidates.add_chunk(maxabs.astype(np.float64), chunk.ids, chunk.starts[name], offset=a)
        for i in chunk.batches_at(name, joined(nonfinite)):
            self._note_nonfinite(st, chunk, name, i)
        if check_range:
            self._check_range(st, chunk, name, joined(out_of_range))

    def _note_nonfinite(self, st: _FieldState, chunk: Chunk, name: str, i: int) -> None:
        s, e = chunk.starts[name][i], chunk.starts[name][i + 1]
        scalar = chunk.trailing[name] is None
        found = nonfinite_in(chunk.rows(name)[s:e])
        st.stats.n_nan += found.nan
        st.stats.n_inf += found.bad - found.nan
        # a mask's -inf is intended, as in the probe: harmful are NaN and +inf then (every NaN/Inf otherwise)
        harm_rows = found.any_rows if scalar or not found.mask_like else found.harm_rows
        harmful = bool(harm_rows)
        rows = harm_rows if harmful else found.any_rows
        samples = [] if scalar else rows
        where = [] if scalar else positions(chunk.rows(name)[s:e], rows, chunk.trailing[name],  # type: ignore[arg-type]
                                            only_harmful=harmful and found.mask_like)
        (st.nonfinite if harmful else st.masked).add(chunk.ids[i], samples, found.bad, where)

    def _check_range(self, st: _FieldState, chunk: Chunk, name: str, flagged: np.ndarray) -> None:
        """The batches of the `flagged` rows (those with a finite value outside checks.value_range): only
        those rows are read again."""
        lo, hi = self.limits.value_range  # type: ignore[misc]
        rows, starts = chunk.rows(name), chunk.starts[name]
        for i in chunk.batches_at(name, flagged):
            s, e = starts[i], starts[i + 1]
            sel = flagged[(flagged >= s) & (flagged < e)]
            r = rows[sel]
            with np.errstate(invalid="ignore"):
                bad = np.isfinite(r) & ((r < lo) | (r > hi))
            bad_values = r[bad]
            st.out_of_range.add(chunk.ids[i], (sel - s)[bad.any(axis=1)].tolist(), int(bad.sum()),
                                values=[float(bad_values.min()), float(bad_values.max())])

    def _check_labels(self, st: _FieldState, chunk: Chunk, name: str) -> None:
        """Labels outside the bounds (Paddle's ignore_index aside), a piece at a time: a uint8 mask's boolean
        temporaries are its own size, so whole-field masks would be three copies of a large label."""
        rows, starts = chunk.rows(name), chunk.starts[name]
        flagged = joined([self._bad_label_rows(st, piece) + a for a, piece in pieces(rows)])
        for i in chunk.batches_at(name, flagged):
            s, e = starts[i], starts[i + 1]
            sel = flagged[(flagged >= s) & (flagged < e)]
            r = rows[sel]
            b_bad = self._bad_labels(r)
            values = np.unique(r[b_bad])[:10].tolist()
            st.bad_labels.add(chunk.ids[i], (sel - s)[b_bad.any(axis=1)].tolist(), int(b_bad.sum()), values=values)

    def _bad_labels(self, rows: np.ndarray) -> np.ndarray:
        lo, hi = self.limits.label_bounds  # type: ignore[misc]
        with np.errstate(invalid="ignore"):
            bad = (rows < lo) | (rows > hi)
        if lo > IGNORE_INDEX:
            bad &= rows != IGNORE_INDEX
        return bad

    def _bad_label_rows(self, st: _FieldState, piece: np.ndarray) -> np.ndarray:
        """Rows of a piece holding a bad label; counts the ignored ones as it goes."""
        if self.limits.label_bounds[0] > IGNORE_INDEX:  # type: ignore[index]
            st.ignored_labels += int(np.count_nonzero(piece == IGNORE_INDEX))
        return np.flatnonzero(self._bad_labels(piece).any(axis=1))

    def _check_length(self, st: _FieldState, chunk: Chunk, name: str) -> None:
        padded = int(chunk.trailing[name][0])  # type: ignore[index]
        limits = []
        if self.limits.max_seq_len is not None:
            limits.append(("checks.max_seq_len", self.limits.max_seq_len))
        if self.limits.position_table is not None:
            layer, size = self.limits.position_table
            limits.append((f"position table {layer}", size))
        limits = [(source, limit) for source, limit in limits if padded > limit]
        for i in range(len(chunk.ids) if limits else 0):
            n = int(chunk.starts[name][i + 1] - chunk.starts[name][i])
            arrays = chunk.batch_arrays(i)
            lengths = _real_lengths(arrays, common_batch_size(arrays))
            for source, limit in limits:
                if lengths is not None and len(lengths) == n:
                    samples = np.flatnonzero(lengths > limit).tolist() or list(range(n))
                else:
                    samples = list(range(n))
                occ = st.too_long.setdefault(source, Occurrences())
                occ.add(chunk.ids[i], samples, len(samples), values=[padded])

    # ---- the end of the pass ------------------------------------------------------------------------

    def findings(self) -> list[Finding]:
        self.flush()
        out: list[Finding] = []
        if self.empty:
            out.append(_empty_finding(self.empty))
        for st in self.fields.values():
            out += self._field_findings(st)
            if st.not_tensor is not None:
                out.append(_not_tensor_finding(st.stats.name, *st.not_tensor))
        target = self.limits.target
        if target is not None and target.field in self.fields:
            m = self.fields[target.field].stats.moments
            found = target_scale_finding(target, m.mean if m.count else None, m.std, self.n_batches)
            out += [found] if found is not None else []
        return out

    def _field_findings(self, st: _FieldState) -> list[Finding]:
        name, stats, out = st.stats.name, st.stats, []
        if st.nonfinite:
            o = st.nonfinite
            out.append(_finding(
                Code.DATA_NONFINITE, Severity.ERROR, o, name,
                f"Field '{name}' holds {stats.n_nan} NaN and {stats.n_inf} Inf value(s) in {o.n_samples} "
                f"sample(s) of {o.n_batches} batch(es); the first is batch {o.first_batch}, "
                f"{_samples(o.first_samples)}{_pos(o.first_positions)}. A NaN input makes that step's loss "
                "and gradients NaN: drop or clean these samples in the loader.",
                {"nan": stats.n_nan, "inf": stats.n_inf}))
        if st.masked and not st.nonfinite:
            o = st.masked
            mask = _finding(
                Code.DATA_NONFINITE, Severity.INFO, o, name,
                f"Field '{name}' holds -inf in {o.n_samples} sample(s) of {o.n_batches} batch(es) (the first is "
                f"batch {o.first_batch}) and otherwise only 0 (or <= -1e30): an additive attention mask, whose "
                "-inf is intended. The probe does not count it as a fault.", {"mask": True, "inf": o.n_values})
            mask.advice = [f"Nothing to do if '{name}' is a mask. If it is not, clean it in the loader; if a "
                           "fully masked row gives NaN (a hand-written softmax does), fill with -1e9 instead."]
            out.append(mask)
        if st.out_of_range:
            o = st.out_of_range
            lo, hi = self.limits.value_range  # type: ignore[misc]
            out.append(_finding(
                Code.DATA_RANGE, Severity.WARNING, o, name,
                f"Field '{name}' has {o.n_values} value(s) outside checks.value_range [{lo:g}, {hi:g}] in "
                f"{o.n_samples} sample(s); the first is batch {o.first_batch}, {_samples(o.first_samples)} "
                f"(offending values from {o.values[0]:.4g} to {o.values[-1]:.4g}). Check how this field is "
                "normalised, or widen checks.value_range if these values are real.",
                {"kind": "value_range", "value_range": [lo, hi], "examples": o.values}))
        outlier = self._outlier_finding(st)
        if outlier is not None:
            out.append(outlier)
        if st.bad_labels:
            o = st.bad_labels
            lo, hi = self.limits.label_bounds  # type: ignore[misc]
            out.append(_finding(
                Code.DATA_LABEL_RANGE, Severity.ERROR, o, name,
                f"Label field '{name}' has {o.n_values} value(s) outside [{lo:g}, {hi:g}] (num_classes "
                f"{int(hi) + 1}, from {self.limits.label_source}): batch {o.first_batch}, "
                f"{_samples(o.first_samples)} (bad values: {_values(o.values)}). cross_entropy raises on "
                "these on CPU and gives garbage or NaN on GPU: fix the label mapping or set ignore_index.",
                {"bad_values": o.values, "allowed": [lo, hi],
                 "num_classes_source": self.limits.label_source}))
        for source, o in st.too_long.items():
            if source == "checks.max_seq_len":
                layer, limit = None, self.limits.max_seq_len
            else:
                layer, limit = self.limits.position_table  # type: ignore[misc]
            what = (f"checks.max_seq_len ({limit})" if layer is None else
                    f"the model's position table '{layer}' ({limit} positions)")
            f = _finding(
                Code.DATA_SEQ_LEN, Severity.ERROR, o, name,
                f"Field '{name}' has sequences of length {max(o.values)} in {o.n_batches} batch(es), longer "
                f"than {what}: the first is batch {o.first_batch}, {_samples(o.first_samples)} (length "
                f"{o.values[0]}). Truncate to {limit} tokens in the collate function"
                + (" or enlarge that table." if layer else "."),
                {"limit": limit, "limit_source": source, "lengths": o.values})
            f.location.layer = layer
            out.append(f)
        if (stats.kind == "float" and stats.role != "label" and "mask" not in name.lower()
                and stats.moments.count >= 2 and stats.moments.min == stats.moments.max):
            value = stats.moments.min
            out.append(Finding(
                Code.DATA_CONSTANT, Severity.WARNING,
                f"Field '{name}' is {value:g} in every one of its {stats.moments.count} values over "
                f"{stats.n_batches} batch(es): it carries no signal, and normalising it divides by a zero "
                "std. Check that the loader reads the right column.",
                Location(phase=Phase.DATA, field=name),
                {"value": value, "n_values": stats.moments.count, "n_batches": stats.n_batches},
                advice_for(Code.DATA_CONSTANT.value)))
        return out

    def _outlier_finding(self, st: _FieldState) -> Finding | None:
        hist, name = st.scales, st.stats.name
        if st.stats.kind != "float" or hist.total < OUTLIER_MIN_SAMPLES:
            return None
        med, mad = hist.log_median(), hist.log_mad()
        assert med is not None and mad is not None
        threshold = med + max(OUTLIER_DECADES, OUTLIER_MADS * mad)
        flagged = [(v, b, s) for v, b, s in st.candidates.items() if v > 0 and math.log10(v) >= threshold]
        if not flagged:
            return None
        n_above = max(hist.count_at_least(threshold), len(flagged))
        if n_above > max(1, OUTLIER_MAX_FRACTION * hist.total):
            return None  # a mode of the data, not a few bad samples
        first = min(b for _, b, _ in flagged)
        samples = sorted(s for _, b, s in flagged if b == first)
        worst = flagged[0]
        typical = 10.0 ** med
        listed = sorted(flagged, key=lambda t: (t[1], t[2]))[:20]
        return Finding(
            Code.DATA_RANGE, Severity.WARNING,
            f"Field '{name}': batch {first}, {_samples(samples)} has max |value| {worst[0]:.3g}"
            f"{'' if worst[1] == first else f' (the largest, batch {worst[1]} sample {worst[2]})'}, "
            f"{worst[0] / typical:.3g}x the field's typical per-sample max |value| ({typical:.3g}); "
            f"{n_above} such sample(s) in all. Outliers this large overflow activations: remove or clip "
            "them, or check how this field is scaled.",
            Location(phase=Phase.DATA, batch_index=first, sample_indices=samples[:MAX_SAMPLES], field=name),
            {"kind": "outlier", "typical_max_abs": typical, "threshold": 10.0 ** threshold,
             "n_outlier_samples": n_above,
             "outliers": [{"batch_index": b, "sample": s, "max_abs": v} for v, b, s in listed]},
            advice_for(Code.DATA_RANGE.value))

    def details(self) -> dict[str, Any]:
        self.flush()
        out: dict[str, Any] = {
            "batches": self.n_batches, "samples": self.n_samples,
            "fields": {name: st.stats.summary() for name, st in self.fields.items()},
            "num_classes": None if self.limits.label_bounds is None else int(self.limits.label_bounds[1]) + 1,
            "num_classes_source": self.limits.label_source,
        }
        if self.limits.position_table is not None:
            layer, size = self.limits.position_table
            out["position_table"] = {"layer": layer, "size": size}
        target = self.limits.target
        if target is not None:  # measured, whether or not it was far: the reader sees the comparison ran
            out["target_scale"] = {"field": target.field, "batch_index": target.batch_index, "rows": target.rows,
                                   "target_rms": target.target.rms, "output_rms": target.output.rms,
                                   "ratio": target.ratio}
        ignored = {n: st.ignored_labels for n, st in self.fields.items() if st.ignored_labels}
        if ignored:
            out["ignored_labels"] = {"value": IGNORE_INDEX, "counts": ignored}
        return out

    def state_size(self) -> int:
        """Items held in the running state: flat in the number of batches (a test checks it)."""
        self.flush()
        return self.empty.state_size() + sum(st.state_size() for st in self.fields.values())


def _real_lengths(arrays: dict[str, np.ndarray | None], batch_size: int | None) -> np.ndarray | None:
    """Per-sample unpadded lengths from a 2-D `*mask*` field (last non-zero + 1) or a 1-D `lengths` field.

    Deliberately simple: only these two conventions, and only to say *which* samples are too long;
    the padded length is what is compared with the limit, because that is what the model indexes.
    """
    for name, arr in arrays.items():
        if arr is None or batch_size is None:
            continue
        low = name.lower()
        if "mask" in low and arr.ndim == 2 and arr.shape[0] == batch_size and arr.dtype.kind in "fiub":
            nz = arr != 0
            last = arr.shape[1] - np.argmax(nz[:, ::-1], axis=1)
            return np.where(nz.any(axis=1), last, 0)
        if low in _LENGTH_FIELDS and arr.ndim == 1 and arr.shape[0] == batch_size and arr.dtype.kind in "iu":
            return arr.astype(np.int64)
    return None


def _finding(code: Code, severity: Severity, o: Occurrences, name: str, message: str,
             extra: dict[str, Any]) -> Finding:
    return Finding(code, severity, message,
                   Location(phase=Phase.DATA, batch_index=o.first_batch,
                            sample_indices=o.first_samples or None, field=name),
                   {**extra, **o.evidence()}, advice_for(code.value))


def _not_tensor_finding(name: str, batch_index: int, why: str) -> Finding:
    return Finding(Code.DATA_NOT_TENSOR, Severity.ERROR,
                   f"Field '{name}' holds {why} (first in batch {batch_index}) and is one of the model's inputs "
                   "(`data.inputs`, or every field but the label when it is not set); it cannot be turned into a "
                   "tensor, so training would stop at the first step.",
                   Location(phase=Phase.DATA, batch_index=batch_index, field=name), {"holds": why},
                   [f"Tokenize '{name}' in your collate_fn (ids as a padded array, plus a mask), or leave it out "
                    "of `data.inputs` (list the fields the model takes, e.g. `inputs: [input_ids, mask]`)."])


def _empty_finding(o: Occurrences) -> Finding:
    return Finding(Code.DATA_EMPTY, Severity.ERROR,
                   f"The loader yielded {o.n_batches} empty batch(es); the first is batch {o.first_batch}. "
                   "A mean over an empty batch is NaN: drop empty batches (`drop_last=True`, or filter them "
                   "in the loader).",
                   Location(phase=Phase.DATA, batch_index=o.first_batch),
                   {"batches": o.batches, "n_batches": o.n_batches}, advice_for(Code.DATA_EMPTY.value))


def _samples(samples: list[int]) -> str:
    if not samples:
        return "the whole field"
    shown = ", ".join(str(s) for s in samples[:8]) + (", …" if len(samples) > 8 else "")
    return f"sample{'s' if len(samples) > 1 else ''} {shown}"


def _pos(positions: list[list[int]]) -> str:
    return f" (first at index {tuple(positions[0])})" if positions else ""


def _values(values: list[Any]) -> str:
    return ", ".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)
