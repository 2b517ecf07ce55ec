"""The documentation's relative links resolve, and its reference pages name every code they must.

Every relative Markdown link `[text](path)` or `[text](path#anchor)` in README.md, docs/*.md,
benchmarks/README.md and sample_configs/README.md must point at a file that exists; an anchor into a
Markdown file must match one of its headings, slugged as GitHub slugs them. Links inside code (fenced
blocks, inline code spans) are not links and are skipped, as are http(s) and mailto links. No Paddle.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nandoctor.findings import Code, Verdict

ROOT = Path(__file__).resolve().parents[1]

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
_CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
# [text](target) or [text](target "title"); text may hold inline code and span lines
_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t#]*$", re.M)


def doc_files() -> list[Path]:
    """The pages whose links are checked."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md",
            ROOT / "sample_configs" / "README.md"]


def _prose(text: str) -> str:
    """The text with code blocks and code spans blanked (kept line for line, for the line numbers)."""
    text = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return _CODE_SPAN.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (no code ticks, link targets or emphasis marks) in lower
    case, every character but letters, digits, spaces, hyphens and underscores dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a Markdown file, with GitHub's -1, -2 ... for repeated ones."""
    seen: dict[str, int] = {}
    out = set()
    for match in _HEADING.finditer(_FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(match.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    """Each relative link of `path` that does not resolve, as 'file:line: target (why)'."""
    text = _prose(path.read_text(encoding="utf-8"))
    problems = []
    for match in _LINK.finditer(text):
        target = match.group(1)
        if re.match(r"(?i)(https?|mailto):", target):
            continue
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:" \
                f"{text.count(chr(10), 0, match.start()) + 1}: {target}"
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            problems.append(f"{where} (no such file)")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{where} (no heading with anchor #{anchor} in {resolved.name})")
    return problems


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert path.is_file(), f"{path} is missing"
    assert not broken_links(path), "\n".join(broken_links(path))


def test_the_checker_finds_a_broken_link_and_a_broken_anchor(tmp_path):
    """The check above can fail: a missing file, a missing heading, and what must not count as a link."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "spec.md").write_text("# The spec\n\n## Every key\n\n## Every key\n", encoding="utf-8")
    page = tmp_path / "README.md"
    page.write_text(
        "See [the spec](docs/spec.md), [keys](docs/spec.md#every-key), [again](docs/spec.md#every-key-1)\n"
        "and [this page](#top) and [the web](https://docs.python.org/3/missing.md).\n"
        "# Top\n"
        "`[not a link](missing-in-code.md)`\n"
        "```\n[not a link](missing-in-fence.md)\n```\n"
        "Broken: [gone](docs/gone.md), [bad anchor](docs/spec.md#no-such-heading),\n"
        "[split\ntext](docs/also-gone.md).\n", encoding="utf-8")
    problems = broken_links(page)
    assert len(problems) == 3, problems
    assert problems[0].endswith("README.md:8: docs/gone.md (no such file)"), problems[0]
    assert "#no-such-heading" in problems[1]
    assert "docs/also-gone.md (no such file)" in problems[2]


def test_slugs_follow_github():
    assert slug("No code change: `nandoctor run -- COMMAND`") == "no-code-change-nandoctor-run----command"
    assert slug("Your own loop: `nandoctor.watch`") == "your-own-loop-nandoctorwatch"
    assert slug("PaddleFormers and paddlenlp `Trainer`") == "paddleformers-and-paddlenlp-trainer"
    assert slug("`paddle.Model.fit` (hapi)") == "paddlemodelfit-hapi"


def test_reports_page_names_every_finding_code_and_verdict():
    """docs/reports.md is where a reader looks a code up: every code and verdict nandoctor can write."""
    text = (ROOT / "docs" / "reports.md").read_text(encoding="utf-8")
    missing = [c.value for c in Code if f"| `{c.value}` |" not in text]
    assert not missing, f"finding codes without a row in docs/reports.md: {missing}"
    missing = [v.value for v in Verdict if f"`{v.value}`" not in text]
    assert not missing, f"verdicts not described in docs/reports.md: {missing}"
