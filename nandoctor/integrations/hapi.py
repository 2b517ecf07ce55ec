"""`paddle.Model.fit` (hapi) watched by nandoctor: `callbacks=[NanDoctorCallback()]`.

hapi's `train_batch` runs forward, backward and `optimizer.minimize` in one call and clears the
gradients before any callback sees the step, so `on_train_batch_end` would be too late to stop a NaN
update. The callback therefore uses the two seams hapi itself goes through, on the instances only and
undone at `on_train_end`: `Model.train_batch` (to know the batch) and the optimizer's `minimize` (to run
`Doctor.check` between backward and the update, and to skip the update of a faulty step). Batches of
an accumulation step that does not update are checked when `train_batch` returns, before hapi clears
anything. Detection and localisation are `nandoctor.watch`'s, so the report is the probe's.

hapi reads `model.stop_training` only after an epoch (and its evaluation), so on its own it would train
the rest of the epoch after a fault. One more seam, `Model._run_one_epoch`, hands hapi's loop a train
loader that ends right after the faulting batch: no later batch is asked for or trained, the epoch's
evaluation (`eval_data`) runs as after hapi's own EarlyStopping, on the weights before the faulty
update, and `stop_training` keeps `fit` from starting another epoch. The same seam undoes the patches
when an epoch raises, since hapi then calls no `on_train_end`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paddle

from nandoctor.findings import Mode
from nandoctor.inloop.batch import to_fields
from nandoctor.inloop.doctor import Doctor

__all__ = ["NanDoctorCallback"]


class NanDoctorCallback(paddle.callbacks.Callback):
    """Stops `fit` at the first non-finite step (`stop_training=False`: skips its update and goes on) and
    writes the report to `report_dir`. `doctor.report` holds it afterwards (None when healthy)."""

    def __init__(self, report_dir: str | Path | None = "nandoctor-report", stop_training: bool = True,
                 replay: bool = True) -> None:
        super().__init__()
        self.report_dir = report_dir
        self.stop_training = stop_training
        self.replay = replay
        self.doctor: Doctor | None = None
        self._batch: tuple[list[Any], list[Any]] | None = None
        self._losses: Any = None
        self._undo: list[tuple[Any, str, Any, bool]] = []
        self._orig_loss: Any = None
        self._stopped = False  # a fault stopped training: the train loader ends after the current batch

    @property
    def report(self) -> Any:
        return self.doctor.report if self.doctor is not None else None

    # ---- fit's life cycle -------------------------------------------------------------------------------
    def on_train_begin(self, logs: dict | None = None) -> None:
        self._finish()  # a previous fit that raised between epochs left its patches: undo them first
        self._stopped = False
        hm = self.model
        net, opt = hm.network, hm._optimizer
        n_inputs = len(hm._inputs) if hm._inputs else None
        names = _names(hm)
        self.doctor = Doctor(net, opt, step_fn=self._step_fn if self.replay else None, report_dir=self.report_dir,
                             on_fault="stop" if self.stop_training else "skip_step", fields=names, mode=Mode.HAPI)
        self._n_inputs = n_inputs
        self._patch(hm, "train_batch", self._train_batch(hm.train_batch))
        self._patch(opt, "minimize", self._minimize(opt.minimize))
        self._orig_loss = hm._loss
        self._patch(hm, "_loss", self._loss(hm._loss))
        self._patch(hm, "_run_one_epoch", self._run_one_epoch(hm._run_one_epoch))

    def on_train_end(self, logs: dict | None = None) -> None:
        self._finish()

    # ---- the seams -----------------------------------------------------------------------------------
    def _train_batch(self, inner: Any) -> Any:
        def train_batch(inputs: Any, labels: Any = None, update: bool = True) -> Any:
            self._batch = (list(inputs) if isinstance(inputs, (list, tuple)) else [inputs],
                           list(labels) if isinstance(labels, (list, tuple)) else ([] if labels is None else [labels]))
            self._checked = False
            out = inner(inputs, labels, update)
            doctor = self.doctor
            if not self._checked and doctor is not None and self._losses is not None and doctor.fault is None:
                loss = paddle.add_n(list(self._losses)) if isinstance(self._losses, (list, tuple)) else self._losses
                if not doctor.check(loss, self._flat()):  # no update this batch (accumulation)
                    self._stop()
            return out

        return train_batch

    def _minimize(self, inner: Any) -> Any:
        def minimize(loss: Any, *args: Any, **kwargs: Any) -> Any:
            doctor = self.doctor
            if doctor is None or doctor._closed:
                return inner(loss, *args, **kwargs)
            if doctor.fault is not None and self.stop_training:
                return None
            self._checked = True
            if not doctor.check(loss, self._flat()):
                doctor._skip_next = False  # hapi never calls step(): skipping this minimize is the skip
                self._stop()
                return None  # the faulty update is never applied; hapi clears the gradients next
            out = inner(loss, *args, **kwargs)
            doctor.updated()
            return out

        return minimize

    def _run_one_epoch(self, inner: Any) -> Any:
        def run_one_epoch(data_loader: Any, callbacks: Any, mode: str, *args: Any, **kwargs: Any) -> Any:
            if mode == "train" and self.stop_training:
                data_loader = _UntilStopped(data_loader, lambda: self._stopped)
            try:
                return inner(data_loader, callbacks, mode, *args, **kwargs)
            except BaseException as exc:  # fit raises from here without on_train_end: leave hapi as it was
                if mode == "train" and isinstance(exc, Exception):
                    self._crashed(exc)
                self._finish()
                raise

        return run_one_epoch

    def _loss(self, inner: Any) -> Any:
        def loss(*args: Any) -> Any:
            self._losses = inner(*args)
            return self._losses

        return loss

    def _step_fn(self, net: Any, batch: Any) -> Any:
        """The replay of hapi's train step: the network on the inputs, hapi's loss on outputs + labels."""
        from paddle.hapi.model import to_list

        from nandoctor.tensors.convert import to_tensor

        batch = list(batch)
        k = self._n_inputs if self._n_inputs is not None else len(self._batch[0]) if self._batch else 1
        inputs, labels = batch[:k], batch[k:]
        # (tensors as they are: paddle.to_tensor of a tensor copies it and warns on the user's stderr)
        outputs = net(*[to_tensor(x) for x in inputs])
        losses = to_list(self._orig_loss(*(to_list(outputs) + [to_tensor(v) for v in labels])))
        return paddle.add_n(losses)

    # ---- helpers --------------------------------------------------------------------------------------
    def _flat(self) -> list[Any] | None:
        return None if self._batch is None else [*self._batch[0], *self._batch[1]]

    def _stop(self) -> None:
        if self.stop_training:
            self._stopped = True  # this epoch ends after the current batch ...
            self.model.stop_training = True  # ... and fit starts no other

    def _crashed(self, exc: Exception) -> None:
        """The user's code raised inside fit (their dataset, network, loss): a report names where, as the
        probe's does; the exception itself still reaches the caller."""
        doctor = self.doctor
        if doctor is None:
            return
        batch = self._flat()
        doctor.crashed(exc, to_fields(batch, doctor.names)[0] if batch is not None else None)

    def _finish(self) -> None:
        """Undo the patches and close the doctor (which removes its hook); safe to call twice."""
        try:
            self._unpatch()
        finally:
            if self.doctor is not None:
                self.doctor.close()

    def _patch(self, obj: Any, name: str, fn: Any) -> None:
        had = name in vars(obj)
        self._undo.append((obj, name, getattr(obj, name) if had else None, had))
        setattr(obj, name, fn)

    def _unpatch(self) -> None:
        for obj, name, old, had in reversed(self._undo):
            if had:
                setattr(obj, name, old)
            else:
                delattr(obj, name)
        self._undo = []


class _UntilStopped:
    """One epoch of hapi's train loader that ends once `stopped()` is true, before asking the loader for
    another batch (a loader's own read-ahead may have prepared some). `len()` stays the loader's: hapi
    reads it to find an accumulation's last batch."""

    def __init__(self, loader: Any, stopped: Callable[[], bool]) -> None:
        self.loader = loader
        self.stopped = stopped

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.loader)
        while not self.stopped():
            try:
                item = next(it)
            except StopIteration:
                return
            yield item


def _names(hm: Any) -> list[str] | None:
    """Field names from the Model's InputSpecs (inputs, then labels), when they are all named."""
    specs = list(hm._inputs or []) + list(hm._labels or [])
    names = [getattr(s, "name", None) for s in specs]
    if specs and all(names) and len(set(names)) == len(names):
        return [str(n) for n in names]
    return None
