"""Reading a spec file as YAML: safely, refusing duplicate keys, alias bombs and deep nesting.

Split from spec.py, which validates what this returns. Every problem is a SpecError naming the file and,
where the parser knows it, the line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from nandoctor.errors import SpecError
from nandoctor.standalone.reproduce import yaml12_floats

# A spec is a page of YAML: far more values than this (after expanding &anchors/*aliases) or deeper
# nesting is an alias bomb or a generated file, refused before it can eat memory or the stack.
MAX_YAML_NODES = 20_000
MAX_YAML_DEPTH = 32


def read_yaml(path: Path) -> Any:
    """The parsed YAML document in `path` (a SafeLoader: nothing in it runs as code)."""
    if not path.exists():
        raise SpecError(f"{path}: no such file. Pass the path of your nandoctor YAML spec (see docs/spec.md).")
    if path.is_dir():
        raise SpecError(f"{path} is a folder; pass the YAML spec file inside it (for example {path}/config.yaml).")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot be read ({exc}).") from None
    try:
        raw = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: nothing in the YAML runs as code
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        if isinstance(exc, _Refused):  # valid YAML, but not something a spec can be
            raise SpecError(f"{path}{where}: refused: {problem}.") from None
        # The problem mark is where the parser gave up; the context mark is where the broken part began.
        context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
        if context and context_mark is not None and (mark is None or context_mark.line != mark.line):
            problem += f"; {context} at line {context_mark.line + 1}"
        raise SpecError(f"{path}{where}: not valid YAML ({problem}). Check the indentation and quoting there."
                        + not_yaml_hint(path)) from None
    return raw


class _Refused(yaml.composer.ComposerError):
    """A YAML document refused for its size or shape (alias bomb, deep nesting, an alias loop)."""

    def __init__(self, problem: str, mark: Any) -> None:
        super().__init__(None, None, problem, mark)


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping; PyYAML would silently keep the last.

    Two `loss:` or `optimizer:` blocks are an easy paste mistake, and the silent winner is rarely the
    one the user is looking at. It also counts, while composing, how many values the document holds
    once every `*alias` is expanded and how deep it nests: an alias bomb ("billion laughs") is a few
    lines of YAML that expand to billions of values, and would surface as a MemoryError or a message
    tens of megabytes long; deep nesting would overflow the stack.
    """

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._sizes: dict[int, tuple[int, int]] = {}  # id(node) -> (values once expanded, depth)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.events.AliasEvent):
            mark = self.peek_event().start_mark
            node = super().compose_node(parent, index)
            if id(node) not in self._sizes:
                raise _Refused("an alias refers to the block that contains it (a loop); write the values out "
                               "instead", mark)
            return node
        mark = self.peek_event().start_mark
        self._depth += 1
        if self._depth > MAX_YAML_DEPTH:
            raise _Refused(f"the document nests more than {MAX_YAML_DEPTH} levels deep; a spec needs a few "
                           "levels, so this is not one", mark)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        children: list[Any] = []
        if isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        sizes = [self._sizes[id(c)] for c in children]
        size = 1 + sum(s for s, _ in sizes)
        depth = 1 + max((d for _, d in sizes), default=0)
        if size > MAX_YAML_NODES or depth > MAX_YAML_DEPTH:
            what = (f"more than {MAX_YAML_NODES} values" if size > MAX_YAML_NODES
                    else f"more than {MAX_YAML_DEPTH} levels of nesting")
            raise _Refused(f"the document expands to {what} once its *aliases are filled in (an alias "
                           "bomb?); a spec is a page of keys, so write the values out and drop the "
                           "&anchors/*aliases", mark)
        self._sizes[id(node)] = (size, depth)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:  # an unhashable key; SafeLoader reports it itself
                continue
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is given twice in the same block; the second would "
                    "silently replace the first, so keep one", key_node.start_mark)
        return super().construct_mapping(node, deep)


# `1e-4` and `1.0e36` are numbers, as in YAML 1.2 (PyYAML's YAML 1.1 reads them as text). The rule lives in
# reproduce.py, which reads the bundle's copy of this spec without nandoctor installed.
yaml12_floats(_UniqueKeyLoader)


def not_yaml_hint(path: Path) -> str:
    """A hint for the common slip of passing models.py (or another file) instead of the spec."""
    if path.suffix.lower() in (".yaml", ".yml"):
        return ""
    return (f" ({path.name} does not look like a nandoctor spec: pass the YAML file that names your model, "
            "data and loss, e.g. config.yaml, not your Python code.)")
