"""A crash inside a paddle.io.DataLoader's worker or reader thread, reported as the user's own exception.

With `num_workers > 0` the user's `__getitem__`/`collate_fn` runs in a worker process; when it raises,
Paddle re-raises it (as text) in a background reader thread, which dies printing a long traceback to
the terminal, and the training loop only sees `SystemError: Blocking queue is killed`. With
`num_workers=0` the reader thread dies the same way and `next()` blocks for ever (Paddle 3.3.1 does
not kill the queue on that path).

`guard_loader` wraps a DataLoader so that each of its iterators watches its reader thread: the
thread's exception is caught (nothing printed) and the queue is killed so `next()` returns. The
batches the reader had fetched ahead were lost with the queue, so `next()` then rebuilds the batches
from the one it stopped at, in this process, from the loader's own dataset, recorded batch indices and
collate_fn: the good ones are returned as usual, and the failing one raises the user's real exception
with its real traceback, at the right batch index. When that is not possible (an IterableDataset, a
failure that does not repeat) the worker's exception is rebuilt from its text with the user's type
and message, raised from a frame at the user's file and line, so that every consumer's "innermost
frame in the user's code" finds it.
"""

from __future__ import annotations

import ast
import itertools
import re
import threading
from pathlib import Path
from typing import Any

from nandoctor.workload.entrypoints import is_user_file

_WORKER_RE = re.compile(r"^DataLoader worker\((?P<worker>\d+)\) caught (?P<type>[\w.]+) with message:\n(?P<tb>.*)$",
                        re.S)
_FRAME_RE = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)', re.M)
_JOIN_SECONDS = 5.0

_lock = threading.Lock()
_watched: dict[threading.Thread, _Watch] = {}
_previous_hook: Any = None
# The watch of an iterator being created: its reader thread starts inside `iter(loader)` and can die
# (an early bad item) before the thread is known and registered; its exception must not be lost.
_arming: _Watch | None = None


class _Watch:
    """One DataLoader iterator's reader thread and the exception it died with, if any."""

    def __init__(self, it: Any) -> None:
        self.it = it
        self.exc: BaseException | None = None


def _excepthook(args: Any) -> None:
    """threading.excepthook while a guarded loader runs: keep its reader thread's exception, print nothing."""
    watch = _watched.get(args.thread) or _arming
    if watch is None:
        (_previous_hook or threading.__excepthook__)(args)
        return
    watch.exc = args.exc_value
    _kill(watch)


def _kill(watch: _Watch) -> None:
    kill = getattr(watch.it, "_exit_thread_unexpectedly", None)
    if callable(kill):  # wakes a `next()` blocked on the queue (the num_workers=0 path never does)
        try:
            kill()
        except Exception:  # noqa: BLE001 - best effort; the main thread then reports what it sees
            pass


def _arm(watch: _Watch | None) -> None:
    """Install the hook (if needed) and catch reader threads that die before they are registered."""
    global _previous_hook, _arming
    with _lock:
        if watch is not None and threading.excepthook is not _excepthook:
            _previous_hook = threading.excepthook
            threading.excepthook = _excepthook
        _arming = watch
        if watch is None and not _watched and threading.excepthook is _excepthook:
            threading.excepthook = _previous_hook or threading.__excepthook__
            _previous_hook = None


def _register(thread: threading.Thread, watch: _Watch) -> None:
    global _previous_hook
    with _lock:
        if threading.excepthook is not _excepthook:
            _previous_hook = threading.excepthook
            threading.excepthook = _excepthook
        _watched[thread] = watch


def _unregister(thread: threading.Thread | None, watch: _Watch) -> None:
    global _previous_hook
    with _lock:
        if thread is None or _watched.get(thread) is not watch:  # a persistent loader's next epoch took it over
            return
        del _watched[thread]
        if not _watched and threading.excepthook is _excepthook:
            threading.excepthook = _previous_hook or threading.__excepthook__
            _previous_hook = None


def guard_loader(loader: Any, base_dir: Path) -> Any:
    """`loader` wrapped when it is a paddle.io.DataLoader (anything else is returned as it is)."""
    try:
        import paddle
    except ImportError:  # pragma: no cover - paddle is a dependency
        return loader
    if isinstance(loader, paddle.io.DataLoader):
        return GuardedLoader(loader, base_dir)
    return loader


class _RecordingSampler:
    """The loader's batch sampler, remembering the indices of each batch until it has been delivered."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.pending: dict[int, list[int]] = {}

    def __iter__(self) -> Any:
        self.pending = {}
        for n, indices in enumerate(self.inner):
            self.pending[n] = list(indices)
            yield indices

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _SkippingSampler:
    """A batch sampler past its first `skip` batches: their indices are drawn (a shuffle's order stays the
    same) but never loaded from the dataset or collated."""

    def __init__(self, inner: Any, skip: int) -> None:
        self.inner = inner
        self.skip = skip

    def __iter__(self) -> Any:
        it = iter(self.inner)
        for _ in itertools.islice(it, self.skip):
            pass
        yield from it

    def __len__(self) -> int:
        return max(len(self.inner) - self.skip, 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def skip_batches(loader: Any, skip: int) -> Any:
    """An iterator over `loader` past its first `skip` batches (a resumed run's trained ones): through the
    batch sampler of a DataLoader over a map-style dataset, otherwise by iterating and dropping them."""
    iter_from = getattr(loader, "iter_from", None)  # a GuardedLoader, or a wrapper around one that says so
    if skip > 0 and callable(iter_from):
        it = iter_from(skip)
        if it is not None:
            return it
    it = iter(loader)
    for _ in itertools.islice(it, skip):
        pass
    return it


class GuardedLoader:
    """A DataLoader whose iterators raise the user's exception; every other attribute is the loader's."""

    def __init__(self, loader: Any, base_dir: Path) -> None:
        self._loader = loader
        self._base_dir = base_dir

    def __iter__(self) -> _GuardedIterator:
        it = self.iter_from(0)
        assert it is not None
        return it

    def iter_from(self, skip: int) -> _GuardedIterator | None:
        """An iterator from batch `skip` on; None when skipping needs the batches themselves (an
        IterableDataset, or no batch sampler), which the caller then iterates and drops."""
        import paddle

        loader = self._loader
        sampler = getattr(loader, "batch_sampler", None)
        recorder = None
        map_style = sampler is not None and not isinstance(getattr(loader, "dataset", None), paddle.io.IterableDataset)
        if skip and not map_style:
            return None
        if map_style:
            recorder = _RecordingSampler(_SkippingSampler(sampler, skip) if skip else sampler)
            loader.batch_sampler = recorder  # read once, by the iterator made below
        watch = _Watch(None)
        _arm(watch)
        try:
            try:
                it = iter(loader)
            finally:
                if recorder is not None:
                    loader.batch_sampler = sampler
            watch.it = it
            guarded = _GuardedIterator(it, self._base_dir, recorder, watch)
        finally:
            _arm(None)
        if watch.exc is not None:  # the reader died before it was registered: wake the queue now
            _kill(watch)
        return guarded

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _GuardedIterator:
    def __init__(self, it: Any, base_dir: Path, recorder: _RecordingSampler | None = None,
                 watch: _Watch | None = None) -> None:
        self._it = it
        self._base_dir = base_dir
        self._recorder = recorder
        self._delivered = 0  # batches returned so far
        self._fallback: BaseException | None = None  # set once the reader died: replaying in-process
        self._thread: threading.Thread | None = getattr(it, "_thread", None)
        self._watch = watch if watch is not None else _Watch(it)
        if isinstance(self._thread, threading.Thread):
            _register(self._thread, self._watch)
        else:
            self._thread = None

    def __iter__(self) -> _GuardedIterator:
        return self

    def __next__(self) -> Any:
        if self._fallback is not None:
            return self._replay()
        try:
            batch = next(self._it)
        except StopIteration:
            self.close()
            raise
        except Exception as exc:
            real = self._thread_exception(exc)
            self.close()
            if real is None:
                raise
            self._fallback = user_exception(real, self._base_dir)
            self._shutdown()
            if self._recorder is None or not isinstance(real, Exception):
                raise self._fallback from None
            return self._replay()
        if self._recorder is not None:
            self._recorder.pending.pop(self._delivered, None)
        self._delivered += 1
        return batch

    def _replay(self) -> Any:
        """The next batch built in this process, as the worker did; the failing one raises for real."""
        assert self._fallback is not None
        indices = self._recorder.pending.pop(self._delivered, None) if self._recorder is not None else None
        if indices is None:  # the failure did not repeat in the batches fetched ahead: report what the worker saw
            raise self._fallback from None
        samples = [self._it._dataset[i] for i in indices]
        batch = self._it._collate_fn(samples)
        self._delivered += 1
        return batch

    def _shutdown(self) -> None:
        """Stop the worker processes now, not when the iterator is collected."""
        stop = getattr(self._it, "_try_shutdown_all", None)
        if callable(stop):
            try:
                stop()
            except Exception:  # noqa: BLE001 - they are daemons; shutting down is a courtesy
                pass

    def __len__(self) -> int:
        return len(self._it)

    def _thread_exception(self, seen: BaseException) -> BaseException | None:
        """The reader thread's exception; the main thread can see the killed queue a moment before it."""
        if self._watch.exc is None and self._thread is not None and "Blocking queue" in str(seen):
            self._thread.join(_JOIN_SECONDS)
        return self._watch.exc

    def close(self) -> None:
        _unregister(self._thread, self._watch)
        self._thread = None

    def __del__(self) -> None:
        self.close()


def user_exception(exc: BaseException, base_dir: Path) -> BaseException:
    """The exception to show the user for what a reader thread died with.

    A worker's exception arrives as text; it is rebuilt (type, message) and raised from a frame at the
    user's file and line. Anything that is not an Exception (sys.exit in a worker) becomes a RuntimeError,
    so it is a finding and not a silent exit of nandoctor.
    """
    text = exc.args[0] if len(exc.args) == 1 and isinstance(exc.args[0], str) else str(exc)  # KeyError quotes str()
    m = _WORKER_RE.match(text)
    if m is None:
        if isinstance(exc, Exception):
            return exc
        return RuntimeError(f"the data loader's reader thread ended with {type(exc).__name__}: {exc}")
    tb = m.group("tb").split("Traceback (most recent call last):")[-1]
    frames = list(_FRAME_RE.finditer(tb))
    message = _message(tb, frames, m.group("type"))
    rebuilt = _rebuild(type(exc), message, m.group("type"))
    rebuilt.add_note(f"(raised in DataLoader worker {m.group('worker')}; rebuilt from the worker's traceback)")
    base = base_dir.resolve()
    user = [f for f in frames if is_user_file(Path(f.group("file")), base)]
    if not user:
        return rebuilt
    frame = user[-1]
    return _raised_at(rebuilt, frame.group("file"), int(frame.group("line")), frame.group("func"))


def _message(tb: str, frames: list[re.Match[str]], type_name: str) -> str:
    """The exception's own text: what follows the last frame's source lines in a formatted traceback."""
    rest = tb[frames[-1].end():] if frames else tb
    lines = rest.splitlines()[1:] if frames else rest.splitlines()
    while lines and (lines[0].startswith("    ") or not lines[0].strip()):
        lines = lines[1:]  # the frame's source line and its ^^^ markers
    text = "\n".join(lines).strip()
    for prefix in (f"{type_name}: ", f"{type_name.rsplit('.', 1)[-1]}: "):
        if text.startswith(prefix):
            return text[len(prefix):]
    return "" if text in (type_name, type_name.rsplit(".", 1)[-1]) else text


def _rebuild(exc_type: type[BaseException], message: str, type_name: str) -> BaseException:
    if not issubclass(exc_type, Exception):  # SystemExit, KeyboardInterrupt raised inside a worker
        return RuntimeError(f"a DataLoader worker ended with {type_name}({message}); a dataset or collate_fn "
                            "must raise an exception, not exit")
    arg: Any = message
    if issubclass(exc_type, KeyError):  # KeyError prints its argument's repr: undo it
        try:
            arg = ast.literal_eval(message)
        except (ValueError, SyntaxError):
            pass
    try:
        return exc_type(arg)
    except Exception:  # noqa: BLE001 - a custom exception whose __init__ wants other arguments
        rebuilt = exc_type.__new__(exc_type, arg)
        rebuilt.args = (arg,)
        return rebuilt


def _raised_at(exc: BaseException, file: str, line: int, func: str) -> BaseException:
    """`exc` with a traceback whose innermost frame is `file:line in func` (as the worker had it)."""
    name = func if func.isidentifier() and line >= 2 else None
    if name is not None:  # `def func():` on the line before, `raise` on the user's line
        source = "\n" * (line - 2) + f"def {name}():\n    raise _nandoctor_exc\n"
    else:
        source = "\n" * max(line - 1, 0) + "raise _nandoctor_exc\n"
    namespace: dict[str, Any] = {"_nandoctor_exc": exc}
    try:
        code = compile(source, file, "exec")
        exec(code, namespace)  # noqa: S102 - our own two-line source; only its file name and line are the user's
        if name is not None:
            namespace[name]()
    except BaseException as raised:  # noqa: BLE001 - this is the exception we raised, with its new frame
        if raised is exc:
            return exc
        raise
    return exc
