"""The one table `make bench` prints: a row per measurement, its target and whether it was met."""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass
class Row:
    """One measured quantity. `value` None means it could not be measured (the note says why)."""

    row: str  # "1 whole process", ...
    workload: str
    setting: str
    value: float | None
    unit: str  # "x" for a ratio, "s" for seconds
    target: str  # "<= 1.10", ">= 0.80", "" (no target: an anchor)
    note: str = ""

    @property
    def status(self) -> str:
        if self.value is None:
            return "n/a"
        if not self.target:
            return "info"
        op, bound = self.target.split()
        ok = self.value <= float(bound) if op == "<=" else self.value >= float(bound)
        return "pass" if ok else "MISS"

    def shown(self) -> str:
        if self.value is None:
            return "-"
        return f"{self.value:.2f}{self.unit}" if self.unit == "x" else f"{self.value:.1f} {self.unit}"


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


HEADERS = ("#", "measure", "workload", "setting", "value", "target", "result", "notes")


def render(rows: list[Row], header: str) -> str:
    """Plain fixed-width text: readable in a terminal, in CI logs and pasted into a ticket."""
    cells = [HEADERS] + [
        (r.row.split()[0], " ".join(r.row.split()[1:]), r.workload, r.setting, r.shown(),
         f"{r.target}{r.unit if r.unit == 'x' else ' ' + r.unit}" if r.target else "-", r.status, r.note)
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(HEADERS) - 1)]

    def line(c: tuple[str, ...]) -> str:
        return "  ".join(v.ljust(w) for v, w in zip(c, widths)) + "  " + c[-1]

    rule = "-" * (sum(widths) + 2 * len(widths) + 20)
    out = [header, rule, line(cells[0]), rule, *[line(c) for c in cells[1:]], rule]
    misses = sum(r.status == "MISS" for r in rows)
    unmeasured = sum(r.status == "n/a" for r in rows)
    out.append(f"{len(rows)} rows: {sum(r.status == 'pass' for r in rows)} pass, {misses} miss, "
               f"{unmeasured} not measured, {sum(r.status == 'info' for r in rows)} info")
    return "\n".join(out)
