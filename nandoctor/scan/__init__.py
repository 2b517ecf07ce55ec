"""Static checks before training: the data a loader yields and the parameters a model starts with.

`run_scan` owns the order of work and the handling of the user's exceptions: build the workload,
check the parameters (params.py), stream the loader once through the data checks (data.py, which
checks batches in chunks: chunks.py), flush the last chunk however the pass ends, and return a Report.
An exception in the user's model or loader becomes a `user_code.error` finding and the report keeps
everything scanned before it; a model that cannot be built still gets its data scanned. Nothing
here prints; progress goes through the callback.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from nandoctor import env
from nandoctor.advice import advice_for
from nandoctor.diagnosis.params import scan_params
from nandoctor.engine.artifacts import capture
from nandoctor.engine.interrupt import interrupted_finding, reassert, stop_loader
from nandoctor.errors import UserCodeError
from nandoctor.findings import Code, Finding, FirstFault, Location, Phase, Report, Severity
from nandoctor.progress import ProgressFn, no_progress
from nandoctor.scan.model_facts import eval_outputs, first_rows, num_classes_from, position_tables, target_check
from nandoctor.spec import Spec
from nandoctor.tensors.sizes import batch_size
from nandoctor.workload.batches import BatchLayout
from nandoctor.workload.build import build_workload, loader_factory, scan_outputs
from nandoctor.workload.entrypoints import call_user, library_origin, user_import_path, user_origin

if TYPE_CHECKING:  # the data checks load when a scan runs, not when the probe imports scan.params (5 ms)
    from nandoctor.scan.data import DataLimits, DataScanner

__all__ = ["ScanOptions", "run_scan"]

# A loader without a length may be endless (a generator over a stream): without --batches, stop here.
UNSIZED_BATCH_LIMIT = 1000


@dataclass
class ScanOptions:
    """`batches`: stop after this many batches (None: the whole loader)."""

    batches: int | None = None


def run_scan(spec: Spec, options: ScanOptions | None = None, progress: ProgressFn = no_progress) -> Report:
    """Scan parameters, then data; a SpecError (bad entry point, field names) propagates (exit 2)."""
    options = options or ScanOptions()
    report = Report(command="scan", run={"batches": options.batches})
    report.environment = env.collect()
    _seed(spec.probe.seed)
    try:
        _scan(spec, options, progress, report)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM while the model was built or the parameters checked
        _interrupted(report, 0)
    report.first_fault = _first_fault(report)
    return report


def _seed(seed: int) -> None:
    """The probe's seed (`probe.seed`): the model starts from the weights a probe would train, and the
    figures read from it (its output scale against the target's) are the same on every run."""
    import random

    import numpy as np
    import paddle

    paddle.seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def _interrupted(report: Report, done: int) -> None:
    if report.partial:
        return
    report.partial = True
    report.findings.append(interrupted_finding("scan", f"{done} batch(es)", batch_index=done, phase=Phase.DATA))


def _scan(spec: Spec, options: ScanOptions, progress: ProgressFn, report: Report) -> None:
    model: Any = None
    uses_step = spec.step is not None
    try:
        try:
            workload = build_workload(spec)
        except SystemExit as exc:  # sys.exit() in the user's module or factory: a finding, not a silent exit
            raise UserCodeError(f"model.entry {spec.model.entry}", exc) from None
        model, layout, make_loader, uses_step = (workload.model, workload.layout, workload.make_loader,
                                                 workload.uses_step)
    except UserCodeError as err:
        # The data can still be checked without the model: do that rather than stop at the first problem.
        report.findings.append(_user_code_finding(err, spec, Phase.PARAMS, None,
                                                  "The model could not be built, so its parameters were not "
                                                  "checked; the data scan below ran without it."))
        report.crashed = True
        layout = BatchLayout(spec.data, str(spec.path))
        make_loader = loader_factory(spec)
    reassert()  # the user's imports (paddleformers) may have reset SIGTERM in C: a signal must still report
    if model is not None and spec.resume is not None:  # the checkpoint's weights are what gets checked
        from nandoctor.workload.resume import load_model_state

        load_model_state(spec.resume, model)
        report.details["resumed"] = {"from": spec.resume.source, "model": str(spec.resume.model)}
    if model is not None:
        progress(0, None, "checking parameters")
        found, summary = scan_params(model)
        report.findings += found
        report.details["parameters"] = summary
    from nandoctor.scan.data import DataScanner

    scanner = DataScanner(_limits(spec, model))
    try:
        _scan_loader(spec, layout, make_loader, model, uses_step, scanner, options.batches, progress, report)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM while a batch was read or checked
        _interrupted(report, scanner.n_batches)
    finally:
        # The last chunk of batches is checked here, whether the loader ended, raised or was interrupted.
        try:
            scanner.flush()
        finally:
            _keep_error_batch(scanner, report)
            report.findings += scanner.findings()
            report.details.update(scanner.details())


def _limits(spec: Spec, model: Any) -> DataLimits:
    checks = spec.checks
    from nandoctor.scan.data import DataLimits

    limits = DataLimits(value_range=checks.value_range, max_seq_len=checks.max_seq_len)
    limits.inputs_to_model = spec.step is None  # a step may tokenize text fields itself
    bounds = checks.label_bounds()
    if bounds is not None:
        limits.label_bounds = bounds
        limits.label_source = "checks.num_classes" if checks.num_classes is not None else "checks.label_range"
    if model is not None:
        tables = position_tables(model)
        if tables:
            limits.position_table = min(tables, key=lambda t: t[1])
    return limits


def _scan_loader(spec: Spec, layout: BatchLayout, make_loader: Callable[[], Any], model: Any, uses_step: bool,
                 scanner: DataScanner, limit: int | None, progress: ProgressFn, report: Report) -> None:
    """One pass over the loader; stops at `limit` batches (UNSIZED_BATCH_LIMIT for a loader without a
    length, which may never end), at the end, or at the user's exception."""
    base = spec.base_dir
    try:
        try:
            loader = make_loader()
            total = _length(loader)
            with user_import_path(base):
                it = call_user(f"data.entry {spec.data.entry} (iter)", iter, loader, base_dir=base)
            reassert()
        except SystemExit as exc:
            raise UserCodeError(f"data.entry {spec.data.entry}", exc) from None
    except UserCodeError as err:
        report.findings.append(_user_code_finding(err, spec, Phase.DATA, None, "No batch could be read."))
        report.crashed = True
        return
    bounded = False
    if limit is None and total is None:  # no length: maybe endless (an infinite generator); bound it
        limit, bounded = UNSIZED_BATCH_LIMIT, True
    if limit is not None:
        total = limit if total is None else min(total, limit)
    try:
        index = _read_batches(spec, layout, it, model, uses_step, scanner, limit, total, progress, report)
    finally:
        stop_loader(it)  # DataLoader workers stop now, however the pass ended
    if bounded and index >= UNSIZED_BATCH_LIMIT:
        report.findings.append(Finding(
            Code.DATA_UNBOUNDED, Severity.INFO,
            f"data.entry {spec.data.entry} has no length and had not ended after {UNSIZED_BATCH_LIMIT} batches, so "
            f"the scan stopped there (it may never end). Pass --batches N to scan more or fewer batches.",
            Location(phase=Phase.DATA, batch_index=index), {"batches_scanned": index, "limit": UNSIZED_BATCH_LIMIT},
            ["Use `--batches N` to choose how many batches to scan.",
             "Give the dataset a `__len__` if it is finite, so the scan knows where it ends."]))


def _read_batches(spec: Spec, layout: BatchLayout, it: Any, model: Any, uses_step: bool, scanner: DataScanner,
                  limit: int | None, total: int | None, progress: ProgressFn, report: Report) -> int:
    """The loop over batches; returns how many were read."""
    base = spec.base_dir
    first_forward = model is not None
    index = 0
    progress(0, total, "scanning data")
    with user_import_path(base):
        while limit is None or index < limit:
            try:
                batch = next(it)
            except StopIteration:
                break
            except KeyboardInterrupt:
                _interrupted(report, index)
                return index
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's loader raised: that is the finding
                err = UserCodeError(f"data.entry {spec.data.entry} (producing batch {index})", exc,
                                    user_origin(exc, base))
                report.findings.append(_user_code_finding(
                    err, spec, Phase.DATA, index,
                    f"The scan stopped there; {index} batch(es) before it were checked."))
                report.crashed = True
                return index
            if _is_empty(batch):
                scanner.add_empty(index)
            else:
                fields = layout.fields(batch, index)
                n = batch_size(fields)
                if n == 0:
                    scanner.add_empty(index)
                else:
                    if first_forward:
                        first_forward = False
                        _first_forward(spec, layout, model, uses_step, fields, n, index, scanner, report)
                    label = layout.label_name(fields)
                    scanner.add_batch(index, fields, label, layout.input_names(fields), n)
                    _keep_error_batch(scanner, report)
            index += 1
            progress(index, total, "scanning data")
    return index


def _keep_error_batch(scanner: DataScanner, report: Report) -> None:
    """The first batch with NaN/Inf, a bad label or an over-long sequence, for --bundle (copied once)."""
    if scanner.error_batch is not None and scanner.error_batch[1] and "batch" not in report.artifacts:
        index, arrays = scanner.error_batch
        capture(report, arrays, step=None, batch_index=index)
        scanner.error_batch = (index, {})  # the capture holds it now (a large one on disk): the scanner no more


def _first_forward(spec: Spec, layout: BatchLayout, model: Any, uses_step: bool, fields: dict[str, Any], n: int,
                   index: int, scanner: DataScanner, report: Report) -> None:
    """The model's output on the first rows of the first batch, run once for two facts: the class count
    (when the spec gives none) and, for a regression target, the target's scale against the output's."""
    label = layout.label(fields)
    if label is None:
        return
    need_classes = scanner.limits.label_bounds is None
    if need_classes and _dtype_name(label) is not None and not _dtype_name(label).startswith(("int", "uint")):
        need_classes = False  # no forward for it: only integer labels are class ids
        report.details["num_classes_unknown"] = "the label is not an integer array"
    regression = _regression_target(spec, label)
    if not need_classes and not regression:
        return
    try:
        outputs, part = _outputs(spec, layout, model, fields, first_rows(fields, n))
    except UserCodeError as err:
        if uses_step:  # with `step`, the model may not take the fields as they are: no guess, no blame
            scanner.limits.label_source = None
            report.details["num_classes_unknown"] = f"the model cannot be called on the fields alone ({err})"
            return
        report.findings.append(_user_code_finding(
            err, spec, Phase.FORWARD, index,
            "Labels were not range-checked: set checks.num_classes in the spec." if need_classes else
            "The target's scale was not compared with the model's output."))
        return
    part_label = layout.label(part)
    if need_classes:
        _note_classes(num_classes_from(outputs, part_label), scanner, report)
    if regression:  # judged in the scanner's findings, with the target's mean and std over every batch
        scanner.limits.target = target_check(layout.label_name(fields) or "label", index, part_label, outputs,
                                             spec.data.entry)


def _outputs(spec: Spec, layout: BatchLayout, model: Any, fields: dict[str, Any],
             part: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """The model's output on `part`, and `part`; a model that cannot take fewer rows (a batch size written
    into its forward) is called on the whole batch instead, and its error then is the user's."""
    def on(batch: dict[str, Any]) -> Any:  # the model as the spec calls it (keyword inputs, `model.output`)
        return eval_outputs(model, lambda m: call_user("the model's forward pass", scan_outputs, spec, layout, m,
                                                        batch, base_dir=spec.base_dir))

    if part is not fields:
        try:
            return on(part), part
        except UserCodeError:
            pass
    return on(fields), fields


def _regression_target(spec: Spec, label: Any) -> bool:
    """A float label under a loss that compares it with the output value for value (mse, l1, the user's
    own loss): cross_entropy's soft labels and bce's 0/1 targets are probabilities, not regression targets."""
    if spec.model.output == "loss" or (spec.loss is not None and spec.loss.builtin in ("cross_entropy",
                                                                                       "bce_with_logits")):
        return False
    name = _dtype_name(label)
    return name is not None and name.startswith(("float", "bfloat"))


def _dtype_name(value: Any) -> str | None:
    """'float32', 'int64', ... of an array, a tensor or a list of numbers; None for anything else."""
    from nandoctor.tensors.convert import to_numpy

    dtype = getattr(value, "dtype", None)
    if dtype is None:
        arr = to_numpy(value)
        dtype = None if arr is None else arr.dtype
    return None if dtype is None else str(dtype).split(".")[-1]


def _note_classes(found: tuple[int | None, str], scanner: DataScanner, report: Report) -> None:
    n, why = found
    if n is None:
        report.details["num_classes_unknown"] = why
        return
    scanner.limits.label_bounds = (0, n - 1)
    scanner.limits.label_source = why


def _is_empty(batch: Any) -> bool:
    try:
        return isinstance(batch, (list, tuple, dict)) and len(batch) == 0
    except TypeError:
        return False


def _length(loader: Any) -> int | None:
    try:
        return int(len(loader))
    except Exception:  # noqa: BLE001 - iterables without a length (generators, IterableDataset) are fine
        return None


def _user_code_finding(err: UserCodeError, spec: Spec, phase: Phase, batch_index: int | None,
                       consequence: str) -> Finding:
    exc = err.exc
    library = library_origin(exc, spec.base_dir)  # the library line that raised, inside the user's
    where = f" Open {err.origin} and fix it." if err.origin else ""
    if library:
        where = f" It was raised inside library code at {library}.{where}"
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-6))
    return Finding(
        Code.USER_CODE_ERROR, Severity.ERROR,
        f"{err}.{' ' + consequence if consequence else ''}{where}",
        Location(phase=phase, batch_index=batch_index),
        {"exception": type(exc).__name__, "error": str(exc), "origin": err.origin, "library_origin": library,
         "what": err.what, "traceback": tb.splitlines()[-40:]},
        advice_for(Code.USER_CODE_ERROR.value))


def _first_fault(report: Report) -> FirstFault | None:
    """The earliest non-finite value or crash in training order: parameters, then batches by index."""
    order = {Phase.PARAMS: 0, Phase.DATA: 1, Phase.FORWARD: 1}
    crash = report.crashed
    candidates = [f for f in report.findings
                  if (f.code in (Code.PARAM_NONFINITE, Code.DATA_NONFINITE) and f.severity != Severity.INFO)
                  or (crash and f.code == Code.USER_CODE_ERROR and f.location.phase != Phase.FORWARD)]
    if not candidates:
        return None
    best = min(candidates, key=lambda f: (order.get(f.location.phase, 2), f.location.batch_index or 0))
    loc = best.location
    return FirstFault(step=None, phase=loc.phase or Phase.DATA, layer=loc.layer, parameter=loc.parameter,
                      batch_index=loc.batch_index, sample_indices=loc.sample_indices)
