"""Which sublayer created a backward op: the innermost layer whose `forward` is on the op's creation stack.

With FLAGS_call_stack_level=3 Paddle prints, for a backward op that turns non-finite, the Python stack
that created its forward op. Each frame running a layer's `forward` is matched to the sublayer instances
whose class `forward` code holds that file and line, walking down from the model. Instances of the same
class under one parent (gate_proj / up_proj, blocks.0 / blocks.1) are told apart by where they were
called from: the forward replay records each call's calling line (`CallSites`). What is still ambiguous
(a loop over blocks calls each block from the same line) is returned as candidates for the caller to
break with the gradient hooks.
"""

from __future__ import annotations

import dis
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nandoctor.engine.native import FRAME_RE
from nandoctor.workload.entrypoints import is_library_file, is_own_file, is_user_file, library_site, short_path

_MACHINERY = ("paddle/nn/layer/layers.py", "paddle\\nn\\layer\\layers.py")


def printed_frames(text: str) -> list[tuple[str, int, str]]:
    """(file, line, function) of the first stack Paddle printed, outermost first."""
    start = text.find("There are nan/inf in")
    block = text[start:] if start >= 0 else text
    end = block.find("While running Node")
    block = block[:end] if end >= 0 else block
    return [(f, int(n), fn) for f, n, fn in FRAME_RE.findall(block)]


_OWN = str(Path(__file__).resolve().parent.parent)


def creation_lines(frames: list[tuple[str, int, str]], base_dir: Path | None) -> tuple[str | None, str | None]:
    """(the user's line, the library line) on an op's creation stack (outermost first): the innermost frame
    of the user's code, and the innermost frame of a library's code inside it (None when the user's own line
    made the op, or Paddle's).

    Only frames inside nandoctor's outermost frame count: the replay runs there, and the user's frames around
    it (the loop that called `check()`, the script's `opt.step()` under `nandoctor run`) did not make the op.
    A stack with no frame of nandoctor's (a plain run) counts whole."""
    base = base_dir.resolve() if base_dir else None
    first_own = next((i for i, (file, _, _) in enumerate(frames) if is_own_file(file)), -1)
    user = library = None
    for file, line, func in frames[first_own + 1:]:
        if is_user_file(Path(file), base):
            user, library = f"{short_path(Path(file), base_dir)}:{line} in {func}", None
        elif is_library_file(file, base):
            library = library_site(file, line, func)
    return user, library


def live_stack(frame: Any) -> list[tuple[str, int, str]]:
    """The running stack from `frame` out, outermost first, as `printed_frames` gives a printed one."""
    out = []
    while frame is not None:
        out.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return out[::-1]


def _machinery(file: str) -> bool:
    """Paddle's Layer.__call__ and nandoctor's own hooks: between a caller and the forward it calls."""
    return file.endswith(_MACHINERY) or file.startswith(_OWN)


def _code_range(layer: Any) -> tuple[str, int, int] | None:
    fn = inspect.unwrap(getattr(type(layer), "forward", None))
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    lines = [ln for _, ln in dis.findlinestarts(code) if ln is not None]
    return code.co_filename, code.co_firstlineno, max(lines, default=code.co_firstlineno)


@dataclass
class CallSites:
    """For each sublayer call in a forward: the (file, line) that called it (Paddle's machinery skipped)."""

    sites: dict[str, set[tuple[str, int]]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)

    def hooks(self, sublayers: list[tuple[str, Any]]) -> list[Any]:
        out = []
        for name, layer in sublayers:
            def pre(_layer: Any, _inputs: Any, _n: str = name) -> None:
                frame = sys._getframe(1)
                while frame is not None and _machinery(frame.f_code.co_filename):
                    frame = frame.f_back
                if frame is not None:
                    self.sites.setdefault(_n, set()).add((frame.f_code.co_filename, frame.f_lineno))
                self.order.append(_n)

            out.append(layer.register_forward_pre_hook(pre))
        return out


def in_forward_of(frames: list[tuple[str, int, str]], layer: Any) -> bool:
    """Whether `layer`'s own `forward` is on `frames` (for the root model: its own forward made the op)."""
    rng = _code_range(layer)
    return rng is not None and any(f == rng[0] and rng[1] <= n <= rng[2] and fn == "forward" for f, n, fn in frames)


def layers_on_stack(frames: list[tuple[str, int, str]], sublayers: list[tuple[str, Any]],
                    sites: CallSites) -> list[str]:
    """The innermost sublayer whose forward is on `frames`; several names when the stack cannot tell them
    apart (same class, same calling line); [] when no sublayer's forward is on it."""
    ranges = {name: _code_range(layer) for name, layer in sublayers}
    current: list[str] = [""]
    caller: tuple[str, int] | None = None
    for file, line, func in frames:
        if _machinery(file):
            continue
        matches = _forwards_at(ranges, current, file, line, func)
        if matches:
            current = _outermost_called(matches, caller, sites)
        caller = (file, line)
    return [] if current == [""] else current


def _forwards_at(ranges: dict[str, tuple[str, int, int] | None], current: list[str], file: str, line: int,
                 func: str) -> list[str]:
    """The sublayers below `current` (the layers the stack is in so far; "" the model) whose class's
    `forward` holds this frame: the next layer down the stack, one of them."""
    matches = []
    for name, rng in ranges.items():
        if rng is None or rng[0] != file or not rng[1] <= line <= rng[2] or func != "forward":
            continue
        parents = [c for c in current if c == "" or name.startswith(c + ".")]
        if parents and name not in current:
            matches.append(name)
    return matches


def _outermost_called(matches: list[str], caller: tuple[str, int] | None, sites: CallSites) -> list[str]:
    """Of the matches, those the previous frame's line called (when the replay saw any called from it),
    and of those the outermost: the layers the stack is in now."""
    called = [m for m in matches if caller is not None and caller in sites.sites.get(m, set())]
    matches = called or matches
    depth = min(m.count(".") for m in matches)
    return [m for m in matches if m.count(".") == depth]
