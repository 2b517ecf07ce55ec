"""The training loops' one batch source (engine/batch_source.py): the probe's loop, each rank of `--nproc` and
every replay draw their batches through it. The steps it yields across epochs, where the data ends, the epoch
hooks and their order, and the user's exception from `iter()`/`next()` as a finding at the right position."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from nandoctor.engine.batch_source import END, BatchSource, UserRaised
from nandoctor.errors import SpecError
from nandoctor.findings import Phase


def _steps(source: BatchSource) -> list[tuple[int, int, int, Any]]:
    try:
        return list(source)
    finally:
        source.close()


class _Loader:
    """A re-iterable loader of `n` batches that notes every call the source makes on it."""

    def __init__(self, n: int, calls: list[str], raise_iter: BaseException | None = None,
                 raise_at: int | None = None) -> None:
        self.n, self.calls, self.raise_iter, self.raise_at = n, calls, raise_iter, raise_at

    def __iter__(self) -> Iterator[str]:
        self.calls.append("iter")
        if self.raise_iter is not None:
            raise self.raise_iter
        return self._batches()

    def _batches(self) -> Iterator[str]:
        for i in range(self.n):
            if i == self.raise_at:
                raise ValueError(f"bad record in batch {i}")
            self.calls.append(f"next {i}")
            yield f"b{i}"


def test_several_epochs_give_every_step_its_epoch_and_batch_and_call_the_hooks_in_order() -> None:
    calls: list[str] = []

    def make() -> _Loader:
        calls.append("make")
        return _Loader(3, calls)

    source = BatchSource(8, make_loader=make, before_epoch=lambda e: calls.append(f"before {e}"),
                         opened=lambda: calls.append("opened"), end_epoch=lambda: calls.append("end"))
    got = _steps(source)
    assert [(s, e, b) for s, e, b, _ in got] == [(0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 1, 0), (4, 1, 1),
                                                (5, 1, 2), (6, 2, 0), (7, 2, 1)]
    assert [batch for *_, batch in got] == ["b0", "b1", "b2"] * 2 + ["b0", "b1"]
    epoch_0 = ["before 0", "make", "iter", "opened", "next 0", "next 1", "next 2", "end"]
    assert calls[:8] == epoch_0 and calls[8:12] == ["before 1", "make", "iter", "opened"]
    # the last epoch is not drawn past step 7: no batch is made that no step trains on, nor its end seen
    assert calls[-2:] == ["next 0", "next 1"] and calls.count("end") == 2
    assert (source.step, source.epoch, source.epochs, source.ended) == (8, 2, 3, False)


def test_a_loader_that_yields_nothing_ends_the_data_without_an_epoch_hook() -> None:
    ends: list[int] = []
    source = BatchSource(5, make_loader=lambda: [], end_epoch=lambda: ends.append(1))
    assert _steps(source) == []
    assert source.ended and not source.exhausted and ends == [] and source.epochs == 1 and source.step == 0


def test_a_generator_spent_after_one_epoch_ends_the_data_at_the_next_epoch() -> None:
    """A loader the user's code returns again each epoch, already spent: the next epoch is empty, so the data
    ends there, after the first epoch's hook (as the probe counts it: two epochs begun)."""
    gen = (f"b{i}" for i in range(3))
    ends: list[int] = []
    source = BatchSource(10, make_loader=lambda: gen, end_epoch=lambda: ends.append(1))
    assert [(s, e, b) for s, e, b, _ in _steps(source)] == [(0, 0, 0), (1, 0, 1), (2, 0, 2)]
    assert source.ended and ends == [1] and (source.step, source.epoch, source.batch_index) == (3, 1, 0)
    assert source.epochs == 2


def test_the_loader_raising_in_iter_is_the_users_exception_in_the_data_phase_at_its_position() -> None:
    calls: list[str] = []
    made = [_Loader(2, calls), _Loader(2, calls, raise_iter=OSError("no such shard"))]
    source = BatchSource(10, make_loader=made.pop)  # (the last, raising, first)
    with pytest.raises(UserRaised) as raised:
        _steps(source)
    assert raised.value.phase == Phase.DATA and isinstance(raised.value.exc, OSError)
    assert (source.step, source.epoch, source.batch_index) == (0, 0, 0)

    made = [_Loader(2, calls), _Loader(2, calls, raise_iter=OSError("no such shard"))]
    source = BatchSource(10, make_loader=lambda: made.pop(0))  # the second epoch's loader raises
    seen: list[int] = []
    with pytest.raises(UserRaised) as raised:
        for step, *_ in source:
            seen.append(step)
    source.close()
    assert seen == [0, 1] and raised.value.phase == Phase.DATA
    assert (source.step, source.epoch, source.batch_index) == (2, 1, 0)


def test_the_loader_raising_in_next_is_named_at_the_batch_being_drawn() -> None:
    source = BatchSource(10, make_loader=lambda: _Loader(5, [], raise_at=3))
    seen: list[int] = []
    with pytest.raises(UserRaised) as raised:
        for step, _, _, _ in source:
            seen.append(step)
    assert seen == [0, 1, 2]
    assert raised.value.phase == Phase.DATA and str(raised.value.exc) == "bad record in batch 3"
    assert (source.step, source.epoch, source.batch_index) == (3, 0, 3)


def test_what_the_boundary_lets_through_and_what_it_turns_into_a_finding() -> None:
    def not_iterable() -> Any:
        raise SpecError("data.entry returned an int")

    with pytest.raises(SpecError):  # a spec mistake is exit 2, not the user's crash
        _steps(BatchSource(3, make_loader=not_iterable))

    def stop_in_iter() -> Any:
        raise StopIteration

    with pytest.raises(UserRaised) as raised:  # never mistaken for the data's end
        _steps(BatchSource(3, make_loader=stop_in_iter))
    assert isinstance(raised.value.exc, RuntimeError)

    def interrupted() -> Iterator[int]:
        yield 0
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _steps(BatchSource(3, make_loader=interrupted))


def test_without_the_boundary_the_loaders_exception_is_raised_as_it_is() -> None:
    """A replay draws without the boundary: its caller makes any exception the replay's error."""
    with pytest.raises(ValueError, match="bad record in batch 1"):
        _steps(BatchSource(5, make_loader=lambda: _Loader(3, [], raise_at=1), user=False))


def test_an_exception_in_the_epoch_hook_is_at_the_end_of_the_epoch() -> None:
    def end() -> None:
        raise UserRaised(ZeroDivisionError("scheduler"), Phase.OPTIMIZER)

    source = BatchSource(10, make_loader=lambda: ["a", "b"], end_epoch=end)
    with pytest.raises(UserRaised) as raised:
        _steps(source)
    assert raised.value.phase == Phase.OPTIMIZER
    assert (source.step, source.epoch, source.batch_index) == (2, 0, 2)


def test_a_resumed_source_starts_at_its_position_and_numbers_steps_on() -> None:
    """The resume's skip (a checkpoint's step, a snapshot's position) gives the first epoch's iterator; the
    epochs after it are made as usual, each after `before_epoch`."""
    calls: list[str] = []

    def resume() -> tuple[int, int, Iterator[str]]:
        calls.append("resume")
        return 4, 1, iter(["b1", "b2"])

    source = BatchSource(14, start=10, make_loader=lambda: ["b0", "b1", "b2"], resume=resume,
                         before_epoch=lambda e: calls.append(f"before {e}"), opened=lambda: calls.append("opened"))
    got = _steps(source)
    assert [(s, e, b, x) for s, e, b, x in got] == [(10, 4, 1, "b1"), (11, 4, 2, "b2"), (12, 5, 0, "b0"),
                                                   (13, 5, 1, "b1")]
    assert calls == ["resume", "opened", "before 5", "opened"]
    assert source.epochs == 2


def test_before_step_stops_before_the_batch_is_drawn() -> None:
    calls: list[str] = []
    source = BatchSource(10, make_loader=lambda: _Loader(10, calls), before_step=lambda step: step >= 2)
    assert [s for s, *_ in _steps(source)] == [0, 1]
    assert calls == ["iter", "next 0", "next 1"] and not source.ended and source.step == 2


def test_nothing_is_made_before_the_first_step_is_drawn() -> None:
    calls: list[str] = []
    source = BatchSource(3, start=3, make_loader=lambda: calls.append("make") or [], resume=lambda: calls.append("x"))
    assert _steps(source) == [] and calls == []


def test_positions_already_read_end_epochs_at_END_and_stop_the_data_when_they_stop() -> None:
    """The probe's batch tape as a replay reads it: (epoch, batch_index, batch) with END where an epoch ended."""
    closed: list[bool] = []

    def tape() -> Iterator[tuple[int, int, Any]]:
        try:
            yield from [(2, 1, "x"), (2, 2, "y"), (2, 3, END), (3, 0, "z")]
        finally:
            closed.append(True)

    ends: list[int] = []
    source = BatchSource(20, start=7, positions=tape(), end_epoch=lambda: ends.append(1))
    got = _steps(source)
    assert got == [(7, 2, 1, "x"), (8, 2, 2, "y"), (9, 3, 0, "z")]
    assert source.ended and source.exhausted and ends == [1] and closed == [True] and source.step == 10

    source = BatchSource(20, positions=(p for p in [(0, 0, "a"), (0, 1, END), (1, 0, END)]),
                         end_epoch=lambda: ends.append(2))
    assert [x for *_, x in _steps(source)] == ["a"]
    assert source.ended and not source.exhausted and ends == [1, 2]  # an empty epoch: the data's end


def test_close_stops_the_current_loader_and_the_positions_read() -> None:
    stopped: list[int] = []

    class _DataLoaderIter:
        def __init__(self) -> None:
            self.n = 0

        def __iter__(self) -> _DataLoaderIter:
            return self

        def __next__(self) -> int:
            self.n += 1
            return self.n

        def _try_shutdown_all(self) -> None:  # what interrupt.stop_loader calls on a DataLoader's iterator
            stopped.append(self.n)

    source = BatchSource(100, make_loader=_DataLoaderIter)
    for step, *_ in source:
        if step == 4:
            break
    assert stopped == []
    source.close()
    assert stopped == [5]
    assert (source.step, source.batch_index) == (4, 4)  # closed while step 4 trained: 4 steps ran

    closed: list[bool] = []

    def tape() -> Iterator[tuple[int, int, Any]]:
        try:
            while True:
                yield 0, 0, "a"
        finally:
            closed.append(True)

    source = BatchSource(100, positions=tape())
    next(iter(source))
    source.close()
    assert closed == [True]


def test_a_source_reads_one_kind_of_batches() -> None:
    with pytest.raises(ValueError):
        BatchSource(3)
    with pytest.raises(ValueError):
        BatchSource(3, make_loader=list, positions=(p for p in []))
