"""The JSON report (`nandoctor.report/1`, the contract): `Report.to_dict` as strict, indented JSON.

Strict means no `NaN`/`Infinity` literals (most JSON parsers refuse them): `Report.to_dict` turns them
into the strings "nan"/"inf" and numpy values into plain ones, over the whole document. Paths under the
project are made relative and the home folder shown as ~, since reports go into public tickets.
"""

from __future__ import annotations

import json

from nandoctor.findings import Report
from nandoctor.report.common import project_dir, public_paths


def render(report: Report) -> str:
    """The report as JSON text ending in a newline; `allow_nan=False` makes a stray NaN a bug, not output."""
    document = public_paths(report.to_dict(), project_dir(report))
    return json.dumps(document, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
