"""The JSON report (`nandoctor.report/1`, the contract): `Report.to_dict` as strict, indented JSON.

Its JSON Schema ships in the package (`schema_path()`, `report/schemas/nandoctor.report-1.schema.json`) and
is the authority for every field. Three rules of this writer, each applied once, here or in `to_dict`:
- Strict JSON: a number that is not finite is written as the string "NaN", "Infinity" or "-Infinity" in
  every numeric field (`findings._jsonable`), never as a bare `NaN` literal that most parsers refuse.
- Figures that depend on the clock (durations, and what was sampled on a schedule chosen from measured
  step times: `stats_every`, the snapshot interval and the steps it kept, the per-layer statistics) live
  under `details.timings` (`TIMED_*` below), so two identical runs give identical JSON apart from that
  object and each remedy row's `seconds`. `Report.from_dict` puts them back where the renderers read them.
- Paths under the project are made relative and the home folder shown as ~ (reports go into public tickets).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from nandoctor.findings import Report, split_timings
from nandoctor.report.common import project_dir, public_paths

SCHEMA_FILE = "nandoctor.report-1.schema.json"  # the schema of `"schema": "nandoctor.report/1"`

def render(report: Report) -> str:
    """The report as JSON text ending in a newline; `allow_nan=False` makes a stray NaN a bug, not output."""
    document = public_paths(report.to_dict(), project_dir(report))
    if isinstance(document.get("details"), dict):
        document["details"] = split_timings(document["details"])
    return json.dumps(document, indent=2, ensure_ascii=False, allow_nan=False) + "\n"


def schema_path() -> Path:
    """The installed JSON Schema of the report (draft 2020-12), for `jsonschema` or any validator:
    `python -c "from nandoctor.report.json import schema_path; print(schema_path())"`."""
    return Path(str(resources.files("nandoctor") / "report" / "schemas" / SCHEMA_FILE))


def schema() -> dict[str, Any]:
    """The schema as a dict."""
    return json.loads(schema_path().read_text(encoding="utf-8"))
