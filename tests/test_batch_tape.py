"""The batch tape's bookkeeping (issue 23): the probe's loop only appends a batch and lets the oldest go past
the cap; the index by position that the replays read is built when they first ask, and stays right as the
replays keep more. What it holds must be what the loader yielded, in the order and bounds of the old dicts."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice

import numpy as np
import paddle

from nandoctor.engine import batch_tape
from nandoctor.engine.batch_tape import END, BatchTape

ROWS, FEATURES = 4, 8
BATCH_BYTES = ROWS * FEATURES * 4 + ROWS * 8  # float32 features, int64 labels


def _loader(n: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)  # the same batches each time it is made (a seeded, re-readable loader)
    for i in range(n):
        yield rng.normal(size=(ROWS, FEATURES)).astype(np.float32), np.full(ROWS, i, dtype=np.int64)


def test_the_loop_keeps_the_newest_batches_within_the_cap_and_replays_read_them(monkeypatch) -> None:
    monkeypatch.setattr(batch_tape, "KEPT_FLOOR", 3 * BATCH_BYTES)  # room for three batches
    tape = BatchTape(lambda: _loader(10))
    truth = list(_loader(10))
    seen = list(tape.recording())  # the probe loop's epoch 0
    assert [int(y[0]) for _, y in seen] == list(range(10))
    assert list(tape.batches) == [(0, 7), (0, 8), (0, 9)] and tape.evicted == 7
    assert tape.nbytes == 3 * BATCH_BYTES and tape.kept_from() == (0, 7)
    assert all(tape.batches[(0, i)] is seen[i] for i in (7, 8, 9))  # references, not copies
    assert tape.ends == {0: 10} and len(tape.records) == 0  # a generator has no batch sampler: no records

    # a replay from batch 5: the two let go come from one fresh loader (checked against the kept ones),
    # then the kept ones as they are, then the epoch's end
    got = list(islice(tape.read(0, 5, {}), 6))  # (a replay reads on into the next epoch, as far as it trains)
    assert [(e, b) for e, b, _ in got] == [(0, 5), (0, 6), (0, 7), (0, 8), (0, 9), (0, 10)]
    assert got[-1][2] is END and tape.stream is None and tape.loaders == 1
    for (_, b, batch), want in zip(got[:-1], truth[5:]):
        assert all(np.array_equal(x, y) for x, y in zip(batch, want)), b
    # what that replay read before the kept ones was not kept: it would have let go of the training's own
    # batches at later positions, which the replay was about to check the loader against and read (issue 34)
    assert list(tape.batches) == [(0, 7), (0, 8), (0, 9)] and tape.nbytes == 3 * BATCH_BYTES
    assert tape.evicted == 7 and all(tape.batches[(0, i)] is seen[i] for i in (7, 8, 9))
    assert set(tape.batches) == {e[0] for e in tape._kept}


def test_records_follow_the_batch_sampler_and_go_with_their_batch(monkeypatch) -> None:
    monkeypatch.setattr(batch_tape, "KEPT_FLOOR", 2 * ROWS * FEATURES * 4 + 2 * ROWS * 8 + 64)

    class Data(paddle.io.Dataset):
        def __len__(self) -> int:
            return 6 * ROWS

        def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
            return np.full(FEATURES, i, dtype=np.float32), np.array(i, dtype=np.int64)

    paddle.seed(3)
    tape = BatchTape(lambda: paddle.io.DataLoader(Data(), batch_size=ROWS, shuffle=True))
    order = [[int(v) for v in y.numpy()] for _, y in tape.recording()]  # what the training drew
    records = tape.records
    assert sorted(records) == [(0, 4), (0, 5)]  # two batches fit: the newest two, with their indices
    assert records[(0, 4)] == order[4] and records[(0, 5)] == order[5]
    assert records.get((0, 0)) is None
