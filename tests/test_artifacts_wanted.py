"""A probe without --bundle keeps no copy of the fault's batch and model state: nothing would write them,
and for large batches or a large model each is a copy of its own (100 MB batches: 1123 -> 1019 MB peak)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nandoctor.probe import ProbeOptions, run_probe
from nandoctor.spec import load_spec

SAMPLES = Path(__file__).resolve().parent.parent / "sample_configs"


@pytest.mark.parametrize("bundle", [False, True])
def test_the_fault_material_is_copied_only_for_a_bundle(bundle: bool) -> None:
    spec = load_spec(SAMPLES / "sqrt_at_zero" / "config.yaml")
    report = run_probe(spec, ProbeOptions(steps=8, try_fixes=False, bundle=bundle))
    assert report.first_fault is not None and report.first_fault.step == 6
    assert ("batch" in report.artifacts) is bundle
    assert ("model_state" in report.artifacts) is bundle
