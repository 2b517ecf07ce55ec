"""A crash inside a paddle.io.DataLoader worker is reported as the user's exception, file and line.

Ground truth for sample_configs/loader_worker_crash, from plain Paddle (no nandoctor): iterating
`build_loader()` yields batches 0-3 and then raises `SystemError: (Fatal) Blocking queue is killed
...` in the main thread, while the reader thread prints "Exception in thread ... ValueError:
DataLoader worker(0) caught ValueError ... data.py, line 35, in __getitem__ ... record 37 has 1
column(s), expected text<TAB>label" to stderr. Record 37 is in batch 4 (batch size 8, no shuffle).
The CLI runs in a subprocess so that the worker processes' and threads' stderr is really captured.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import traceback
from pathlib import Path

import numpy as np
import pytest

from nandoctor.workload.entrypoints import user_origin
from nandoctor.workload.loader import guard_loader, user_exception

SAMPLE = Path(__file__).resolve().parents[1] / "sample_configs" / "loader_worker_crash" / "config.yaml"


@pytest.mark.parametrize("command", ["scan", "probe"])
def test_worker_crash_names_the_users_exception_and_line(tmp_path: Path, command: str):
    out = tmp_path / "report.json"
    env = {**os.environ, "COLUMNS": "120", "NO_COLOR": "1"}
    proc = subprocess.run([sys.executable, "-m", "nandoctor", command, str(SAMPLE), "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["verdict"] == "crashed"
    (finding,) = [f for f in report["findings"] if f["code"] == "user_code.error"]
    ev = finding["evidence"]
    assert ev["exception"] == "ValueError"
    assert ev["error"].startswith("record 37 has 1 column(s), expected text<TAB>label")
    assert ev["origin"] == "data.py:35 in __getitem__"
    assert finding["location"]["phase"] == "data" and finding["location"]["batch_index"] == 4
    assert report["first_fault"]["batch_index"] == 4
    terminal = proc.stdout + proc.stderr
    shown = " ".join(proc.stdout.split())  # rich wraps lines
    assert "ValueError at data.py:35 in __getitem__" in shown and "record 37 has 1 column(s)" in shown
    assert "Blocking queue" not in terminal and "Blocking queue" not in out.read_text()
    assert "Traceback" not in terminal and "Exception in thread" not in terminal


def _project(tmp_path: Path, body: str) -> Path:
    (tmp_path / "ds.py").write_text(textwrap.dedent(body))
    sys.path.insert(0, str(tmp_path))
    return tmp_path


def test_iterable_dataset_in_a_worker_falls_back_to_the_workers_traceback(tmp_path: Path):
    """No batch indices to rebuild from: the exception is rebuilt from the worker's text, at its line."""
    import paddle

    _project(tmp_path, """\
        import numpy as np
        import paddle


        class Stream(paddle.io.IterableDataset):
            def __iter__(self):
                for i in range(40):
                    if i == 20:
                        raise KeyError("fish")
                    yield np.full((3,), i, dtype="float32")
        """)
    try:
        import ds

        loader = guard_loader(paddle.io.DataLoader(ds.Stream(), batch_size=4, num_workers=1), tmp_path)
        seen = 0
        with pytest.raises(KeyError) as info:
            for _ in loader:
                seen += 1
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("ds", None)
    assert info.value.args == ("fish",)  # KeyError's repr quoting undone
    assert user_origin(info.value, tmp_path) == "ds.py:9 in __iter__"
    assert "DataLoader worker 0" in "".join(getattr(info.value, "__notes__", []))
    assert seen <= 5


def test_single_process_loader_reader_thread_does_not_hang(tmp_path: Path):
    """num_workers=0: Paddle's reader thread dies without waking next(); the guard wakes it."""
    import paddle

    _project(tmp_path, """\
        import numpy as np
        import paddle


        class Items(paddle.io.Dataset):
            def __len__(self):
                return 40

            def __getitem__(self, i):
                if i == 13:
                    raise IndexError(f"item {i} is missing")
                return np.full((3,), i, dtype="float32")
        """)
    try:
        import ds

        loader = guard_loader(paddle.io.DataLoader(ds.Items(), batch_size=4, num_workers=0), tmp_path)
        hook_before = threading.excepthook
        got = []
        with pytest.raises(IndexError, match="item 13 is missing") as info:
            for batch in loader:
                first = batch[0] if isinstance(batch, (list, tuple)) else batch
                got.append(float(np.asarray(first).reshape(-1)[0]))
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("ds", None)
    assert threading.excepthook is hook_before  # the guard's hook is gone once the iterator ended
    assert got == [0.0, 4.0, 8.0]  # batches 0-2 delivered (rebuilt where the queue lost them), batch 3 raises
    assert user_origin(info.value, tmp_path) == "ds.py:11 in __getitem__"


def test_rebuild_from_a_workers_text_keeps_type_message_and_line(tmp_path: Path):
    user_file = tmp_path / "coll.py"
    user_file.write_text("def collate(batch):\n    x = 1\n    raise RuntimeError('bad token <unk>')\n")
    code = compile(user_file.read_text(), str(user_file), "exec")
    ns: dict = {}
    exec(code, ns)
    try:
        ns["collate"]([])
    except RuntimeError as exc:
        text = "".join(traceback.format_exception(exc))
    wrapped = RuntimeError(f"DataLoader worker(1) caught RuntimeError with message:\n{text}")
    rebuilt = user_exception(wrapped, tmp_path)
    assert type(rebuilt) is RuntimeError and str(rebuilt) == "bad token <unk>"
    assert user_origin(rebuilt, tmp_path) == "coll.py:3 in collate"
    assert "raise RuntimeError('bad token <unk>')" in "".join(traceback.format_exception(rebuilt))
    exited = user_exception(SystemExit("DataLoader worker(0) caught SystemExit with message:\n"
                                       "Traceback (most recent call last):\nSystemExit: 3\n"), tmp_path)
    assert isinstance(exited, RuntimeError) and "must raise an exception, not exit" in str(exited)


def test_a_reader_that_dies_before_the_first_batch_never_hangs(tmp_path: Path):
    """Item 0 raises: the single-process reader thread can die inside iter(), before the guard knows the
    thread; its exception must still wake next() (a race that hung the suite under load)."""
    import paddle

    _project(tmp_path, """\
        import numpy as np
        import paddle


        class Items(paddle.io.Dataset):
            def __len__(self):
                return 8

            def __getitem__(self, i):
                if i == 0:
                    raise IndexError("item 0 is missing")
                return np.full((3,), i, dtype="float32")
        """)
    outcome: list[BaseException] = []
    try:
        import ds

        def consume() -> None:
            for _ in range(20):  # each new iterator races its reader thread afresh
                loader = guard_loader(paddle.io.DataLoader(ds.Items(), batch_size=4, num_workers=0), tmp_path)
                try:
                    for _batch in loader:
                        pass
                except IndexError as exc:
                    outcome.append(exc)

        worker = threading.Thread(target=consume, daemon=True)
        worker.start()
        worker.join(120)
        assert not worker.is_alive(), "next() blocked: the reader's early death was lost"
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("ds", None)
    assert len(outcome) == 20 and all("item 0 is missing" in str(e) for e in outcome)
