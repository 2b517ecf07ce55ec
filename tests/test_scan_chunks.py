"""Chunked data scan: checking many small batches at once must report exactly what checking them one by
one reports (same findings, batches, samples, fields, positions), and stopping early (loader crash,
Ctrl-C) must still check the batches that were waiting in the buffer."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from nandoctor.findings import Code, Verdict
from nandoctor.scan import run_scan
from nandoctor.scan.chunks import ChunkBuffer
from nandoctor.scan.data import DataLimits, DataScanner
from nandoctor.spec import load_spec

N_BATCHES = 120


def faulty_batches() -> list[dict[str, np.ndarray]]:
    """Small uneven batches with one of each problem somewhere inside a chunk, and a short last batch."""
    rng = np.random.default_rng(7)
    out = []
    for b in range(N_BATCHES):
        n = 5 if b == N_BATCHES - 1 else 8 + b % 3
        ids = rng.integers(1, 100, (n, 12))
        mask = np.ones((n, 12), "int64")
        mask[:, 9:] = 0  # 9 real tokens: fine for max_seq_len 10, but the padded 12 is not
        out.append({"x": rng.standard_normal((n, 6)).astype("float32"),
                    "img": rng.uniform(0, 1, (n, 2, 3)).astype("float32"),
                    "ids": ids, "mask": mask,
                    "bias": np.full((n, 1), 0.5, "float32"),
                    "y": rng.integers(0, 3, n).astype("int64")})
    out[37]["x"][5, 2] = np.nan
    out[37]["x"][6, 0] = np.inf
    out[90]["x"][1, 4] = -np.inf
    out[80]["img"][2, 1, 1] = 4.0e6  # a gross outlier
    out[55]["img"][3, 0, 2] = np.nan  # a NaN in a 3-D field: positions keep the batch's own shape
    out[12]["x"][0, 3] = 25.0  # outside value_range
    out[64]["x"][7, 5] = -30.0
    out[20]["y"][4] = -100  # ignore_index: counted, not a bad label
    out[-1]["y"][[1, 4]] = [7, -2]  # labels out of range at the last batch
    out[-1]["mask"][3, :] = 1  # sample 3 of the last batch really is 12 long
    return out


LIMITS = dict(label_bounds=(0, 2), label_source="checks.num_classes", value_range=(-20.0, 20.0),
              max_seq_len=10)


def scan(batches, **kw) -> DataScanner:
    scanner = DataScanner(DataLimits(**LIMITS), **kw)
    for i, fields in enumerate(batches):
        n = fields["x"].shape[0]
        scanner.add_batch(i, fields, "y", ["x", "img", "ids", "mask", "bias"], n)
    return scanner


def comparable(scanner: DataScanner) -> tuple[list, dict]:
    findings = [f.to_dict() for f in scanner.findings()]
    details = scanner.details()
    for summary in details["fields"].values():  # chunk sums round differently in the last digits
        for key in ("mean", "std"):
            summary[key] = pytest.approx(summary[key], rel=1e-5, abs=1e-7)
    return findings, details


@pytest.mark.parametrize("max_rows", [40, 64, 1000, 8192])
def test_chunked_scan_reports_exactly_what_batch_by_batch_reports(max_rows):
    one_by_one = scan(faulty_batches(), max_rows=0)
    chunked = scan(faulty_batches(), max_rows=max_rows)
    expected_findings, expected_details = comparable(one_by_one)
    findings, details = comparable(chunked)
    assert findings == expected_findings
    assert details == expected_details
    assert one_by_one.error_batch[0] == chunked.error_batch[0] == 0  # the padded ids are too long from batch 0
    for name, arr in one_by_one.error_batch[1].items():
        np.testing.assert_array_equal(chunked.error_batch[1][name], arr)


def test_chunked_scan_names_the_exact_batch_sample_and_field():
    found = {(f.code, f.location.field): f for f in scan(faulty_batches(), max_rows=64).findings()}
    nan = found[(Code.DATA_NONFINITE, "x")]
    assert (nan.location.batch_index, nan.location.sample_indices) == (37, [5, 6])
    assert nan.evidence["batches"] == [37, 90] and nan.evidence["first_positions"][:2] == [[5, 2], [6, 0]]
    assert found[(Code.DATA_NONFINITE, "img")].evidence["first_positions"] == [[3, 0, 2]]
    outlier = next(f for f in found.values() if f.evidence.get("kind") == "outlier")
    assert (outlier.location.batch_index, outlier.location.sample_indices, outlier.location.field) == (80, [2], "img")
    rng = found[(Code.DATA_RANGE, "x")]
    assert (rng.location.batch_index, rng.location.sample_indices, rng.evidence["batches"]) == (12, [0], [12, 64])
    label = found[(Code.DATA_LABEL_RANGE, "y")]
    assert (label.location.batch_index, label.location.sample_indices) == (N_BATCHES - 1, [1, 4])
    assert label.evidence["bad_values"] == [-2, 7]
    seq = found[(Code.DATA_SEQ_LEN, "ids")]
    assert seq.evidence["n_batches"] == N_BATCHES and seq.location.sample_indices == list(range(8))
    assert found[(Code.DATA_CONSTANT, "bias")].evidence["n_batches"] == N_BATCHES


def test_buffer_copies_so_a_loader_reusing_its_array_is_checked_as_yielded():
    shared = np.zeros((4, 3), "float32")
    scanner = DataScanner(DataLimits(), max_rows=64)
    for i in range(10):
        shared[:] = i
        shared[2, 1] = np.nan if i == 3 else i
        scanner.add_batch(i, {"x": shared}, None, ["x"], 4)
    [f] = scanner.findings()
    assert (f.code, f.location.batch_index, f.location.sample_indices) == (Code.DATA_NONFINITE, 3, [2])
    assert scanner.details()["fields"]["x"]["max"] == 9.0


def test_layout_changes_and_unbufferable_batches_keep_batch_order():
    rng = np.random.default_rng(1)
    batches = [{"x": rng.standard_normal((4, 3 + i % 2)).astype("float32")} for i in range(12)]  # width changes
    batches[5] = {"x": np.array(np.nan, "float32")}  # a 0-d field cannot be buffered: checked on its own, in order
    batches[9]["x"][1, 0] = np.inf
    scanner = DataScanner(DataLimits(), max_rows=64)
    for i, fields in enumerate(batches):
        scanner.add_batch(i, fields, None, ["x"], None if i == 5 else 4)
    [f] = scanner.findings()
    assert f.evidence["batches"] == [5, 9] and f.location.batch_index == 5
    assert ChunkBuffer.layout({"x": np.array(1.0, "float32")}, 1) is None


DATA = """
    import numpy as np
    import paddle

    def build_model():
        return paddle.nn.Linear(6, 3)

    def build_loader(stop_with=None):
        for i in range(40):
            if i == 30 and stop_with == "crash":
                raise RuntimeError("disk gone")
            if i == 30 and stop_with == "interrupt":
                raise KeyboardInterrupt
            x = np.full((4, 6), 0.1 * i, "float32")
            if i == 21:
                x[2, 3] = np.nan
            yield x, np.zeros(4, "int64")
    """


@pytest.mark.parametrize("stop_with", ["crash", "interrupt"])
def test_stopping_early_still_checks_the_buffered_batches(tmp_path, stop_with):
    (tmp_path / "data.py").write_text(textwrap.dedent(DATA))
    cfg = tmp_path / "config.yaml"
    cfg.write_text("version: 1\nmodel:\n  entry: \"data.py:build_model\"\n"
                   f"data:\n  entry: \"data.py:build_loader\"\n  args: {{stop_with: {stop_with}}}\n"
                   "  fields: [x, y]\n  label: y\nloss:\n  builtin: cross_entropy\n")
    report = run_scan(load_spec(cfg))
    nan = next(f for f in report.findings if f.code == Code.DATA_NONFINITE)
    assert (nan.location.batch_index, nan.location.sample_indices) == (21, [2])
    assert report.details["batches"] == 30
    assert report.artifacts["batch_index"] == 21 and np.isnan(report.artifacts["batch"]["x"][2, 3])
    if stop_with == "interrupt":
        assert report.partial and any(f.code == Code.RUN_INTERRUPTED for f in report.findings)
    else:
        assert report.crashed and report.verdict == Verdict.CRASHED
