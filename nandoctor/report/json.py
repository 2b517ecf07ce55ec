"""The JSON report (`nandoctor.report/1`, the contract): `Report.to_dict` as strict, indented JSON.

Strict means no `NaN`/`Infinity` literals (most JSON parsers refuse them): `Report.to_dict` turns them
into the strings "nan"/"inf" and numpy values into plain ones, over the whole document.
"""

from __future__ import annotations

import json

from nandoctor.findings import Report


def render(report: Report) -> str:
    """The report as JSON text ending in a newline; `allow_nan=False` makes a stray NaN a bug, not output."""
    return json.dumps(report.to_dict(), indent=2, ensure_ascii=False, allow_nan=False) + "\n"
