"""The instrumented training loop: one host sync per step, detection before `optimizer.step()`.

Each step reads one vector (loss, the previous update's parameter sum, data finiteness, per-parameter
gradient norms, sampled per-layer maxima). When it shows a fault, the optimizer has not stepped, so the
parameters and optimizer state are exactly those that produced it and the replay needs no snapshot;
only the RNG state (captured before the step) is restored. The loop owns epochs, timing of the
adaptive stats sampling and the crash/interrupt boundaries; localisation and warnings live elsewhere.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nandoctor.batches import batch_size, to_numpy
from nandoctor.findings import Phase
from nandoctor.probe.monitors import StepMonitor, StepStats
from nandoctor.workload import Workload

# What the probe may add to a plain step on average (the target is 5%; keep a margin): the every-step
# detection's measured share first (~1.5% on a model of 300 tiny tensors), the sampled per-layer
# stats get the rest, but never less than half a percent. 3%, not 4%: the loop's own bookkeeping
# (~1% of a 16 ms step) is not in the measured share, and the stats fill whatever is left.
_TOTAL_BUDGET = 0.03
_MIN_STATS_BUDGET = 0.005


@dataclass
class Fault:
    """What stopped the loop: a non-finite value (kind 'nonfinite'), a crash, or an update fault."""

    kind: str  # "data" | "nonfinite" | "update" | "crash"
    step: int
    batch_index: int | None
    epoch: int
    fields: dict[str, Any] | None = None
    rng: Any = None
    stats: StepStats | None = None
    exc: BaseException | None = None
    phase: Phase | None = None  # for crashes: where the loop was
    bad_fields: dict[str, list[int]] = field(default_factory=dict)  # data: field -> sample rows
    bad_params: list[str] = field(default_factory=list)
    grad_norm: float | None = None  # update: the norm of the step whose update did it
    update_range: tuple[int, int] | None = None  # update: the first and last step that may have done it


@dataclass
class StepRecord:
    step: int
    loss: float
    grad_norm: float | None
    grad_sq: np.ndarray | None
    act_max: np.ndarray | None
    loss_scale: float | None = None
    skipped: bool | None = None


@dataclass
class LoopResult:
    records: list[StepRecord] = field(default_factory=list)
    fault: Fault | None = None
    interrupted: bool = False
    steps_run: int = 0
    epochs: int = 1
    stats_every: list[int] = field(default_factory=list)


class StatsSchedule:
    """When to collect per-layer stats: step 0, every k-th step (k from measured cost), and after warnings."""

    def __init__(self) -> None:
        self.k = 1
        self.last = -10**9
        self.plain: list[float] = []
        self.stats: list[float] = []
        self.detect: list[float] = []  # seconds of the every-step reductions and the sync, on plain steps
        self.alert = False

    def want(self, step: int) -> bool:
        if step == 0 or self.alert:
            return True
        if step == 1:  # one plain step to measure against
            return False
        if step == 2:  # and one stats step that is not the first (warm-up) step
            return True
        # k == 1 (stats every step) would leave no plain step to measure against, so a plain step
        # measured slow once (a first-call cost, a load spike) would keep it at 1: measure one in 16.
        return step - self.last >= self.k and not (self.k == 1 and step % 16 == 0)

    def record(self, step: int, stats: bool, seconds: float, detect_seconds: float = 0.0) -> None:
        if step == 0:
            self.last = step
            return  # warm-up: allocations, first-call costs
        (self.stats if stats else self.plain).append(seconds)
        if not stats:
            self.detect.append(detect_seconds)
        if stats:
            self.last = step
        if self.plain and self.stats:
            plain = min(self.plain[-20:])  # min: one slow plain step (first calls, load) must not make stats look free
            detect = statistics.median(self.detect[-20:]) / max(plain, 1e-9)
            budget = max(_MIN_STATS_BUDGET, _TOTAL_BUDGET - detect)
            extra = max(0.0, statistics.median(self.stats[-20:]) - plain)
            self.k = max(1, math.ceil(extra / max(budget * plain, 1e-9)))


class ProbeLoop:
    """Runs up to `steps` steps of the user's training; stops at the first fault, crash or Ctrl-C."""

    def __init__(self, workload: Workload, optimizer: Any, steps: int, progress: Any, warn: Any) -> None:
        self.w = workload
        self.opt = optimizer
        self.steps = steps
        self.progress = progress
        self.warn = warn  # warnings.WarningTracker: update(step, record) -> alert flag
        self.monitor: StepMonitor | None = None
        self.schedule = StatsSchedule()
        self.scaler: Any = None  # paddle.amp.GradScaler on a GPU with amp enabled; inert (None) on CPU

    def run(self) -> LoopResult:
        import paddle

        res = LoopResult()
        model = self.w.model
        self.monitor = StepMonitor(model)
        mon = self.monitor
        epoch, batch_index = 0, 0
        it = None
        fields: dict[str, Any] | None = None
        history: list[tuple[int, int, int, float | None, Any]] = []
        next_stats: bool | None = None
        try:
            step = 0
            while step < self.steps:
                phase = Phase.DATA
                try:
                    if it is None:
                        it = iter(self.w.make_loader())  # raises UserCodeError for the user's exception
                    try:
                        batch = next(it)
                    except StopIteration:
                        if batch_index == 0:  # an empty loader: nothing to train on
                            break
                        epoch, batch_index, it = epoch + 1, 0, None
                        res.epochs = epoch + 1
                        continue
                    fields = self.w.layout.fields(batch, batch_index)
                    bad = _host_nonfinite(fields)
                    if bad:
                        res.fault = Fault("data", step, batch_index, epoch, fields, bad_fields=bad)
                        break
                    device_checks = _device_checks(fields)
                    rng = paddle.get_rng_state()
                    stats_step = self.schedule.want(step) if next_stats is None else next_stats
                    next_stats = None
                    t0 = time.perf_counter()
                    mon.begin_step(stats_step)
                    phase = Phase.FORWARD
                    loss = self.w.compute_loss(model, fields)
                    if not isinstance(loss, paddle.Tensor):
                        raise TypeError(f"the loss is a {type(loss).__name__}, not a paddle.Tensor")
                    phase = Phase.BACKWARD
                    scaler = self.scaler
                    if scaler is not None:
                        scaler.scale(loss).backward()
                    else:
                        loss.backward()
                    phase = Phase.OPTIMIZER
                    t_read = time.perf_counter()
                    st = mon.read(loss, device_checks, full=stats_step, scale=getattr(scaler, "_scale", None))
                    t_read = time.perf_counter() - t_read
                    mon.active = False
                except (KeyboardInterrupt, _SpecErrors()):
                    raise
                except Exception as exc:  # noqa: BLE001 - the user's code raised: that is the finding
                    if isinstance(exc, StopIteration):
                        exc = RuntimeError("the data iterator raised StopIteration from inside a batch")
                    res.fault = Fault("crash", step, batch_index, epoch, fields if phase != Phase.DATA else None,
                                      exc=exc, phase=phase)
                    break
                if st.params_sum is not None:
                    if not math.isfinite(st.params_sum) and self._update_fault(res, history, step):
                        break
                    if math.isfinite(st.params_sum):
                        history = []
                bad_data = [k for k, ok in st.data_finite.items() if not ok]
                if bad_data:
                    rows = {k: _bad_rows(fields[k]) for k in bad_data}
                    res.fault = Fault("data", step, batch_index, epoch, fields, bad_fields=rows)
                    break
                record = StepRecord(step, st.loss, st.grad_norm, st.grad_sq, st.act_max, st.loss_scale)
                skipped = self.scaler is not None and math.isfinite(st.loss) and not st.grads_finite
                if skipped:  # AMP overflow: the scaler skips this update and lowers the scale; not a fault
                    record.skipped = True
                elif math.isfinite(st.loss) and not st.grads_finite and mon.recheck_grads(st):
                    record = StepRecord(step, st.loss, st.grad_norm, st.grad_sq, st.act_max)
                if not skipped and (not math.isfinite(st.loss) or not st.grads_finite):
                    # NaN weights written by the last update make the loss NaN too: blame the update
                    if history and self._update_fault(res, history, step, latest=True):
                        break
                    res.fault = Fault("nonfinite", step, batch_index, epoch, fields, rng=rng, stats=st)
                    res.records.append(record)
                    break
                res.records.append(record)
                self.schedule.alert = bool(self.warn.update(record))
                try:
                    if self.scaler is not None:
                        self.scaler.step(self.opt)
                        self.scaler.update()
                    else:
                        self.opt.step()
                    self.opt.clear_grad()
                except KeyboardInterrupt:
                    raise
                except Exception as exc:  # noqa: BLE001 - e.g. a user-written optimizer hook
                    res.fault = Fault("crash", step, batch_index, epoch, fields, exc=exc, phase=Phase.OPTIMIZER)
                    break
                self.schedule.record(step, stats_step, time.perf_counter() - t0, t_read)
                next_stats = self.schedule.want(step + 1)
                # Small models: the parameter check after every update. Many-tensor models: on stats steps,
                # since it costs ~7% of a 500-layer MLP's step; a NaN weight shows in the next step's loss
                # anyway, and then an exact check names the update that wrote it (`_update_fault`).
                mon.after_update(check=next_stats or mon.small)
                # updates since the parameters were last seen finite (at most k of them)
                history.append((step, batch_index, epoch, st.grad_norm, fields))
                res.stats_every.append(self.schedule.k)
                step += 1
                batch_index += 1
                res.steps_run = step
                self.progress(step, self.steps, "probe step")
            if res.fault is None and not res.interrupted and history:
                total = mon.read_pending_params()  # the last update, checked once more
                if total is None or not math.isfinite(total):
                    self._update_fault(res, history, res.steps_run)
        except KeyboardInterrupt:
            res.interrupted = True
        finally:
            mon.begin_step(False)  # detach the stats hooks before any replay
        return res

    def _update_fault(self, res: LoopResult, history: list[Any], step: int, latest: bool = False) -> bool:
        """Parameters are (maybe) non-finite before `step`: if an exact check confirms it, the update that
        did it is among `history` (the updates since they were last seen finite). With one candidate it
        is that one; else the last (`latest`: the loss just went non-finite, so the weights were still
        fine one step earlier) or the first."""
        from nandoctor.probe.monitors import param_nonfinite

        names = param_nonfinite(self.w.model)
        trainable = set(self.monitor.param_names) if self.monitor else set()
        names = [n for n in names if n in trainable] or names
        if not names or not history:
            return False
        first, batch_index, epoch, grad_norm, fields = history[-1] if latest else history[0]
        res.fault = Fault("update", first, batch_index, epoch, fields, bad_params=names, grad_norm=grad_norm,
                          update_range=(first, history[-1][0]))
        return True

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()


def _SpecErrors() -> type[BaseException]:
    from nandoctor.errors import NandoctorError

    return NandoctorError


def _is_float(arr: np.ndarray) -> bool:
    return arr.dtype.kind in "fc"


def _host_nonfinite(fields: dict[str, Any]) -> dict[str, list[int]]:
    """Numpy fields are on the host already: check them there, no device work, no sync."""
    import paddle

    out: dict[str, list[int]] = {}
    for k, v in fields.items():
        if isinstance(v, paddle.Tensor):
            continue
        arr = to_numpy(v)
        if arr is not None and _is_float(arr) and arr.size and not np.isfinite(arr).all():
            out[k] = _bad_rows(arr)
    return out


def _device_checks(fields: dict[str, Any]) -> dict[str, Any]:
    """Tensor fields: a finiteness flag each, read with the step's vector."""
    import paddle

    return {k: paddle.isfinite(v).all() for k, v in fields.items()
            if isinstance(v, paddle.Tensor) and v.dtype in (paddle.float32, paddle.float16, paddle.float64,
                                                            paddle.bfloat16) and v.size > 0}


def _bad_rows(value: Any) -> list[int]:
    arr = to_numpy(value)
    if arr is None:
        return []
    if arr.ndim == 0:
        return [0] if not np.isfinite(arr) else []
    bad = ~np.isfinite(arr.reshape(arr.shape[0], -1)).all(axis=1)
    return sorted(int(i) for i in np.where(bad)[0])


def fields_batch_size(fields: dict[str, Any]) -> int | None:
    return batch_size(fields)
