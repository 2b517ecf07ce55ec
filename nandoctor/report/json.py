"""The JSON report (`nandoctor.report/1`, the contract): `Report.to_dict` as strict, indented JSON.

Strict means no `NaN`/`Infinity` literals (most JSON parsers refuse them): `findings._jsonable` turns
them into the strings "nan"/"inf", and it is applied once more here over the whole document so a numpy
integer or a float NaN that a finding's location carries cannot slip through.
"""

from __future__ import annotations

import json

from nandoctor.findings import Report, _jsonable


def render(report: Report) -> str:
    """The report as JSON text ending in a newline; `allow_nan=False` makes a stray NaN a bug, not output."""
    return json.dumps(_jsonable(report.to_dict()), indent=2, ensure_ascii=False, allow_nan=False) + "\n"
