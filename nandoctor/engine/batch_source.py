"""The training loops' one primitive: the batches of steps `start`..`end` across epochs, drawn behind the
boundary that turns the user's exception into a finding.

The probe's loop (loop.py), each rank of `probe --nproc` (probe/ranks.py) and every replay (replay.py) read
their batches through a `BatchSource`: `for step, epoch, batch_index, batch in source`. It makes each
epoch's loader (`iter(make_loader())`), draws its batches (`next()`), and at an epoch's end (`END`, the one
sentinel) calls the epoch's hook and goes on to a fresh loader; an epoch that yields no batch ends the
data. What each loop does with a batch (the watcher, the snapshots, a remedy's change) stays in the loop.

Only the user's own calls sit inside the boundary (`user_call`): `iter()`/`next()` on the loader, the
resume's skip, and the engine's calls (step.py, through `StepEngine.with_boundary`). An exception anywhere
else is nandoctor's own and propagates (the CLI reports it as an internal error), so a bug of ours is never
blamed on the user's loader. A replay draws without the boundary (`user=False`): its caller turns any
exception into the replay's error.

A step costs one generator step and one `next()` on the loader: the probe's loop is measured against a plain
loop on a 0.3 ms step.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Iterator
from typing import Any, Callable

from nandoctor.engine.batch_tape import END
from nandoctor.engine.interrupt import stop_loader
from nandoctor.errors import NandoctorError, UserCodeError
from nandoctor.findings import Phase

__all__ = ["END", "BatchSource", "UserRaised", "user_call"]


class UserRaised(Exception):
    """The user's call raised `exc` (SystemExit included) in `phase`; carries it out of `user_call`."""

    def __init__(self, exc: BaseException, phase: Phase) -> None:
        super().__init__(str(exc))
        self.exc = exc
        self.phase = phase


def user_call(phase: Phase, fn: Callable[..., Any], *args: Any, what: str | None = None) -> Any:
    """Call the user's code: its exception (or sys.exit) becomes `UserRaised`; ours and Ctrl-C pass through.
    `what` names the call in the finding when the phase alone would not (the LR scheduler's step)."""
    try:
        return fn(*args)
    except NandoctorError:  # a spec mistake found while calling (a loader that is not iterable): exit 2
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's code raised: that is the finding
        if isinstance(exc, StopIteration):
            exc = RuntimeError("the data iterator raised StopIteration from inside a batch")
        raise UserRaised(UserCodeError(what, exc) if what else exc, phase) from None


def _direct(_phase: Phase, fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


def _next(it: Iterator[Any]) -> Any:
    """`next(it)` behind the boundary (as `user_call(Phase.DATA, ...)`, one call less a step), with the loader's
    normal end as `END` rather than StopIteration."""
    try:
        return next(it)
    except StopIteration:
        return END
    except NandoctorError:
        raise
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's loader raised: that is the finding
        raise UserRaised(exc, Phase.DATA) from None


def _next_direct(it: Iterator[Any]) -> Any:
    return next(it, END)


def _fresh(make_loader: Callable[[], Iterable[Any]]) -> Iterator[Any]:
    """A fresh loader's iterator: the user's `make_loader()` and `iter()` on it, one call through the boundary."""
    return iter(make_loader())


class BatchSource:
    """(step, epoch, batch_index, batch) for the steps `start`..`end - 1`, across epochs.

    Where the batches come from, one of:
      `make_loader`: the user's loader, a fresh one each epoch; `resume()`, if given, is called (behind the
          boundary) for the first batches instead and returns (epoch, batch_index, iterator): a run resumed
          from a checkpoint, or a replay from a snapshot, with the batches before its position skipped.
      `positions`: (epoch, batch_index, batch) already read (the probe's batch tape), `END` as the batch
          where an epoch ended; when they stop, so does the data (`exhausted`).
    The hooks: `before_epoch(epoch)` before an epoch's loader is made (the snapshot ring keeps the RNG its
    shuffle draws from); `opened()` after each loader the user's code made; `end_epoch()` where an epoch
    ended, before the next begins (an epoch LR scheduler's step); `before_step(step)` before each step's batch
    is drawn, a true result stops the batches there (a replay's deadline).

    Once the source stopped (it raised, ran to `end` or out of data, or was closed), `step`, `epoch` and
    `batch_index` say where: the step it was drawing the batch of, or the step the loop was training when it
    closed the source (so the steps run are `step - start`). They are not kept up to date while it runs: a
    step pays for a generator step and the loader's `next()`, nothing more. `ended`: the data ran out before
    `end` (an epoch without a batch, or the positions stopped). `close()` ends the current loader.
    """

    def __init__(self, end: int, *, start: int = 0, make_loader: Callable[[], Iterable[Any]] | None = None,
                 resume: Callable[[], tuple[int, int, Iterator[Any]]] | None = None,
                 positions: Generator[tuple[int, int, Any], None, None] | None = None, user: bool = True,
                 before_epoch: Callable[[int], Any] | None = None, opened: Callable[[], Any] | None = None,
                 end_epoch: Callable[[], Any] | None = None,
                 before_step: Callable[[int], Any] | None = None) -> None:
        if (make_loader is None) == (positions is None):
            raise ValueError("a BatchSource reads either make_loader or positions")
        self.end = end
        self.step, self.epoch, self.batch_index = start, 0, 0
        self.first_epoch = 0
        self.ended = False
        self.exhausted = False
        self.make_loader, self.positions, self.resume = make_loader, positions, resume
        self.before_epoch, self.opened, self.end_epoch, self.before_step = before_epoch, opened, end_epoch, before_step
        self._call = user_call if user else _direct
        self._next = _next if user else _next_direct
        self._steps: Any = None

    @property
    def epochs(self) -> int:
        """The epochs begun since the first (an empty one that ended the data included)."""
        return self.epoch + 1 - self.first_epoch

    def __iter__(self) -> Iterator[tuple[int, int, int, Any]]:
        self._steps = self._from_loader() if self.positions is None else self._from_positions()
        return self._steps

    def close(self) -> None:
        """Stop drawing: the current loader ends now (a DataLoader's workers, a tape's read left open)."""
        if self._steps is not None:
            self._steps.close()
        elif self.positions is not None:
            self.positions.close()

    def _from_loader(self) -> Iterator[tuple[int, int, int, Any]]:
        step, end, before_step, draw = self.step, self.end, self.before_step, self._next
        epoch = batch_index = 0
        it: Any = None
        try:
            while step < end:
                if before_step is not None and before_step(step):
                    return
                if it is None:
                    epoch, batch_index, it = self._open(epoch)
                batch = draw(it)
                if batch is END:
                    if not self._epoch_ended(batch_index):
                        return
                    epoch, batch_index, it = epoch + 1, 0, None
                    continue
                yield step, epoch, batch_index, batch
                step += 1
                batch_index += 1
        finally:
            self.step, self.epoch, self.batch_index = step, epoch, batch_index
            stop_loader(it)

    def _from_positions(self) -> Iterator[tuple[int, int, int, Any]]:
        step, end, before_step, positions = self.step, self.end, self.before_step, self.positions
        assert positions is not None
        epoch = batch_index = 0
        try:
            while step < end:
                if before_step is not None and before_step(step):
                    return
                item = next(positions, END)
                if item is END:
                    self.ended = self.exhausted = True
                    return
                epoch, batch_index, batch = item
                if batch is END:
                    if not self._epoch_ended(batch_index):
                        return
                    continue
                yield step, epoch, batch_index, batch
                step += 1
        finally:
            self.step, self.epoch, self.batch_index = step, epoch, batch_index
            positions.close()

    def _open(self, epoch: int) -> tuple[int, int, Iterator[Any]]:
        """The iterator of `epoch`, about to begin, and where it starts: the resume's on the first, else a
        fresh loader's."""
        resume = self.resume
        if resume is not None:
            self.resume = None
            epoch, batch_index, it = self._call(Phase.DATA, resume)
            self.first_epoch = epoch
        else:
            if self.before_epoch is not None:
                self.before_epoch(epoch)
            batch_index, it = 0, self._call(Phase.DATA, _fresh, self.make_loader)
        if self.opened is not None:
            self.opened()
        return epoch, batch_index, it

    def _epoch_ended(self, batch_index: int) -> bool:
        """`END` drawn after `batch_index` batches: an epoch that yielded none ends the data (False); else the
        epoch's hook, and on to the next epoch (True). The spent iterator is let go, not stopped: a loader the
        user's code keeps and iterates again each epoch (persistent workers) must keep its workers."""
        if batch_index == 0:
            self.ended = True
            return False
        if self.end_epoch is not None:
            self.end_epoch()
        return True
