"""Data scan: running statistics, each data check, the outlier rule's quiet side, and run_scan end to end
on small specs written to a temporary folder (list, generator, dict and paddle.io.DataLoader batches)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import paddle
import pytest

from nandoctor.findings import Code, Phase, Severity, Verdict
from nandoctor.scan import ScanOptions, run_scan
from nandoctor.scan.data import DataLimits, DataScanner
from nandoctor.scan.stats import LogHistogram, Moments
from nandoctor.spec import load_spec


def feed(batches, limits=None, label="y", inputs=("x",)) -> DataScanner:
    scanner = DataScanner(limits or DataLimits())
    for i, fields in enumerate(batches):
        n = next(iter(fields.values())).shape[0]
        if n == 0:
            scanner.add_empty(i)
        else:
            scanner.add_batch(i, fields, label, list(inputs), n)
    return scanner


def codes(findings) -> list[str]:
    return sorted(f.code.value for f in findings)


def normal_batches(n=10, size=16, dim=8, seed=0):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((size, dim)).astype("float32"),
             "y": rng.integers(0, 3, size=size).astype("int64")} for _ in range(n)]


# ---- running statistics --------------------------------------------------------------------------

def test_moments_match_numpy_over_uneven_chunks():
    rng = np.random.default_rng(1)
    data = rng.normal(5.0, 3.0, 10_000)
    m = Moments()
    for chunk in np.split(data, [3, 100, 101, 5000, 9999]):
        m.add(chunk)
    assert m.count == data.size
    assert m.mean == pytest.approx(data.mean(), rel=1e-12)
    assert m.std == pytest.approx(data.std(), rel=1e-9)
    assert (m.min, m.max) == (data.min(), data.max())


def test_log_histogram_median_and_count():
    h = LogHistogram()
    h.add(np.array([1.0] * 50 + [10.0] * 49 + [1e6]))
    assert 10 ** h.log_median() == pytest.approx(1.0, rel=0.05)
    assert h.count_at_least(5.0) == 1


def test_state_stays_flat_as_batches_grow():
    def size(n):
        batches = normal_batches(n)
        for i in range(0, n, 7):  # problems everywhere, so every capped list is exercised
            batches[i]["x"][i % 16, 0] = np.nan
            batches[i]["y"][0] = 9
        return feed(batches, DataLimits(label_bounds=(0, 2), label_source="t")).state_size()

    assert size(150) == size(1500)


# ---- the checks ----------------------------------------------------------------------------------

def test_nonfinite_one_finding_per_field_located_at_first_batch():
    batches = normal_batches(6)
    batches[1]["x"][4, 2] = np.nan
    batches[1]["x"][9, 0] = np.inf
    batches[3]["x"][0, 0] = -np.inf
    [f] = feed(batches).findings()
    assert f.code == Code.DATA_NONFINITE and f.severity == Severity.ERROR
    assert (f.location.batch_index, f.location.sample_indices, f.location.field) == (1, [4, 9], "x")
    assert f.location.phase == Phase.DATA
    assert (f.evidence["nan"], f.evidence["inf"]) == (1, 2)
    assert f.evidence["batches"] == [1, 3] and f.evidence["first_positions"][0] == [4, 2]
    assert "batch 1" in f.message and "sample" in f.message and "'x'" in f.message


def test_an_additive_mask_is_info_not_an_error_and_a_nan_in_it_is_an_error():
    """-inf where the other values are 0 (or finfo.min-style fills) is an attention mask, as the probe
    takes it; a NaN in the same field, or -inf in a field of real values, is still an error."""
    causal = np.triu(np.full((4, 4), -np.inf, "float32"), 1)
    batches = normal_batches(4, size=3)
    for b in batches:
        b["mask"] = np.repeat(causal[None], 3, 0)
    batches[2]["mask"][1, 0, 0] = -3.4e38
    [f] = feed(batches, inputs=("x", "mask")).findings()
    assert (f.code, f.severity, f.location.field) == (Code.DATA_NONFINITE, Severity.INFO, "mask")
    assert "attention mask" in f.message and f.evidence["mask"] is True and "Nothing to do" in f.advice[0]
    batches[3]["mask"][2, 3, 3] = np.nan
    [f] = feed(batches, inputs=("x", "mask")).findings()
    assert (f.severity, f.location.batch_index, f.location.sample_indices) == (Severity.ERROR, 3, [2])
    assert f.evidence["first_positions"][0] == [2, 3, 3]


def test_nonfinite_in_paddle_tensor_batches():
    x = paddle.randn([8, 4])
    x[2, 1] = float("nan")
    [f] = feed([{"x": x, "y": paddle.zeros([8], dtype="int64")}]).findings()
    assert f.code == Code.DATA_NONFINITE and f.location.sample_indices == [2]


def test_value_range_on_inputs_not_on_label():
    batches = normal_batches(4)
    batches[2]["x"][7, 1] = 50.0
    [f] = feed(batches, DataLimits(value_range=(-10.0, 10.0))).findings()
    assert f.code == Code.DATA_RANGE and f.severity == Severity.WARNING
    assert (f.location.batch_index, f.location.sample_indices, f.location.field) == (2, [7], "x")
    assert f.evidence["kind"] == "value_range"


@pytest.mark.parametrize("batch", [0, 5, 39])
def test_gross_outlier_found_wherever_it_is(batch):
    batches = normal_batches(40)
    batches[batch]["x"][11, 3] = 3.0e5
    [f] = feed(batches).findings()
    assert f.code == Code.DATA_RANGE and f.evidence["kind"] == "outlier"
    assert (f.location.batch_index, f.location.sample_indices, f.location.field) == (batch, [11], "x")


def _quiet(batches, **kw):
    found = feed(batches, **kw).findings()
    assert found == [], [f.message for f in found]


def test_outlier_rule_quiet_on_healthy_and_awkward_data():
    rng = np.random.default_rng(3)
    _quiet(normal_batches(50, dim=1))  # scalar-per-sample normal: small values are common, big ones rare
    _quiet([{"x": rng.uniform(0, 1, (32, 64)).astype("float32"), "y": np.zeros(32, "int64")}
            for _ in range(30)])
    _quiet([{"x": rng.lognormal(0, 2, (32, 4)).astype("float32"), "y": np.zeros(32, "int64")}
            for _ in range(30)])  # heavy tailed but a smooth spread
    sparse = []
    for _ in range(20):
        x = np.zeros((32, 16), "float32")
        x[rng.random((32, 16)) < 0.02] = 1.0  # mostly all-zero samples
        sparse.append({"x": x, "y": np.zeros(32, "int64")})
    _quiet(sparse)
    ids = [{"x": rng.integers(0, 50_000, (32, 12)), "y": rng.integers(0, 3, 32)} for _ in range(10)]
    for b in ids:
        b["x"][:, 1:] = 1  # mostly tiny ids, a few huge: integers are never judged as outliers
    _quiet(ids)
    mode = normal_batches(20)
    for b in mode:
        b["x"][:2] *= 1e5  # 1 in 8 samples in another unit: a mode of the data, not an outlier
    _quiet(mode)


def test_labels_against_bounds_with_ignore_index():
    batches = normal_batches(5)
    batches[3]["y"][[2, 6]] = [3, -1]
    batches[1]["y"][0] = -100  # Paddle's default ignore_index is not a bad label
    scanner = feed(batches, DataLimits(label_bounds=(0, 2), label_source="checks.num_classes"))
    [f] = scanner.findings()
    assert f.code == Code.DATA_LABEL_RANGE and f.severity == Severity.ERROR
    assert (f.location.batch_index, f.location.sample_indices, f.location.field) == (3, [2, 6], "y")
    assert f.evidence["bad_values"] == [-1, 3]
    assert "checks.num_classes" in f.message
    assert scanner.details()["ignored_labels"]["counts"] == {"y": 1}


@pytest.mark.parametrize("max_rows", [8192, 1024])  # the batch in the chunk buffer, or checked on its own
def test_a_batch_read_a_piece_at_a_time_gives_what_numpy_gives_on_the_whole(monkeypatch, max_rows):
    """The checks read a large batch PIECE_VALUES values at a time (a few MB, not copies of a 100 MB batch):
    with pieces of 32 rows, NaN/Inf, out-of-range values, bad labels, moments and the outlier candidates
    are what numpy finds on the whole batch (float64)."""
    from nandoctor.scan import pieces, stats

    monkeypatch.setattr(pieces, "PIECE_VALUES", 256)
    monkeypatch.setattr(stats, "PIECE_VALUES", 256)
    rng = np.random.default_rng(3)
    x = rng.normal(size=(3000, 8)).astype("float32")
    x[1234, 5], x[2999, 0], x[100, 2] = np.nan, np.inf, -np.inf
    x[[500, 2500], 1] = [50.0, -60.0]
    x[1700, 4] = 4.0e4  # a gross outlier (typical max |value| ~2)
    y = rng.integers(0, 3, size=3000)
    y[[7, 2800]] = [5, -2]
    y[9] = -100  # ignore_index
    batches = [normal_batches(1, size=3000)[0], {"x": x, "y": y}]
    limits = DataLimits(label_bounds=(0, 2), label_source="t", value_range=(-1.0e5, 1.0e5))
    scanner = DataScanner(limits, max_rows=max_rows)
    for i, b in enumerate(batches):
        scanner.add_batch(i, b, "y", ["x"], 3000)
    found = {(f.code.value, f.evidence.get("kind")): f for f in scanner.findings()}
    finite = np.isfinite(x)
    nan = found[("data.nonfinite", None)]
    assert (nan.evidence["nan"], nan.evidence["inf"]) == (int(np.isnan(x).sum()), int((~finite).sum() - 1))
    assert nan.location.sample_indices == np.flatnonzero(~finite.all(axis=1)).tolist()
    assert nan.evidence["first_positions"] == np.argwhere(~finite).tolist()
    labels = found[("data.label_range", None)]
    bad = (y < 0) | (y > 2)
    bad &= y != -100
    assert labels.location.sample_indices == np.flatnonzero(bad).tolist() and labels.evidence["bad_values"] == [-2, 5]
    assert scanner.details()["ignored_labels"]["counts"] == {"y": 1}
    outlier = found[("data.range", "outlier")]
    assert (outlier.location.batch_index, outlier.location.sample_indices) == (1, [1700])
    every = np.concatenate([batches[0]["x"].ravel(), x[finite]]).astype(np.float64)
    summary = scanner.details()["fields"]["x"]
    assert summary["mean"] == pytest.approx(every.mean(), rel=1e-5)
    assert summary["std"] == pytest.approx(every.std(), rel=1e-5)
    assert (summary["min"], summary["max"]) == (every.min(), every.max())
    limits.value_range = (-10.0, 10.0)  # the same batch against a range: the rows with a finite value outside it
    scanner = DataScanner(limits, max_rows=max_rows)
    scanner.add_batch(0, {"x": x, "y": y}, "y", ["x"], 3000)
    [rng_finding] = [f for f in scanner.findings() if f.evidence.get("kind") == "value_range"]
    with np.errstate(invalid="ignore"):
        outside = finite & ((x < -10) | (x > 10))
    assert rng_finding.location.sample_indices == np.flatnonzero(outside.any(axis=1)).tolist()
    assert rng_finding.evidence["n_values"] == int(outside.sum()) and rng_finding.evidence["examples"] == [-60.0, 4.0e4]


def test_seq_len_with_mask_names_the_long_samples_and_without_names_all():
    rng = np.random.default_rng(4)
    ids = rng.integers(1, 100, (4, 12))
    mask = np.ones((4, 12), "int64")
    mask[[0, 2, 3], 6:] = 0  # only sample 1 is really 12 long
    limits = DataLimits(max_seq_len=8, position_table=("pos_emb", 10))
    found = feed([{"ids": ids, "mask": mask, "y": np.zeros(4, "int64")}], limits, inputs=("ids",)).findings()
    assert {f.evidence["limit_source"] for f in found} == {"checks.max_seq_len", "position table pos_emb"}
    assert all(f.location.sample_indices == [1] and f.location.field == "ids" for f in found)
    assert [f.location.layer for f in found if f.evidence["limit"] == 10] == ["pos_emb"]
    no_mask = [{"ids": ids, "y": np.zeros(4, "int64")}]
    [f] = feed(no_mask, DataLimits(max_seq_len=8), inputs=("ids",)).findings()
    assert f.location.sample_indices == [0, 1, 2, 3] and f.evidence["lengths"] == [12]


def test_empty_and_constant():
    batches = normal_batches(4)
    batches[2] = {"x": np.zeros((0, 8), "float32"), "y": np.zeros(0, "int64")}
    for b in batches:
        b["bias"] = np.full((b["x"].shape[0], 2), 0.5, "float32")
        b["attn_mask"] = np.ones((b["x"].shape[0], 3), "float32")  # masks are allowed to be constant
    scanner = feed(batches, inputs=("x", "bias", "attn_mask"))
    found = scanner.findings()
    assert codes(found) == ["data.constant", "data.empty"]
    empty = next(f for f in found if f.code == Code.DATA_EMPTY)
    assert empty.location.batch_index == 2 and empty.severity == Severity.ERROR
    const = next(f for f in found if f.code == Code.DATA_CONSTANT)
    assert const.location.field == "bias" and const.severity == Severity.WARNING
    assert scanner.details()["batches"] == 4 and scanner.details()["samples"] == 48


# ---- run_scan end to end on specs in a temporary folder ------------------------------------------

MODEL = """
import paddle
import paddle.nn as nn

class Net(nn.Layer):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 16)
        self.bn = nn.BatchNorm1D(16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.bn(self.fc(x)))

def build_model():
    paddle.seed(0)
    return Net()

def broken_model():
    raise ValueError("hidden size must be even")
"""


def write_spec(tmp_path: Path, data_src: str, data_block: str, model_entry: str = "model.py:build_model",
               extra: str = "") -> Path:
    (tmp_path / "model.py").write_text(MODEL)
    (tmp_path / "data.py").write_text(textwrap.dedent(data_src))
    cfg = tmp_path / "config.yaml"
    data = textwrap.indent(textwrap.dedent(data_block), "  ")
    cfg.write_text(f"version: 1\nmodel:\n  entry: \"{model_entry}\"\n"
                   f"data:\n  entry: \"data.py:build_loader\"\n{data}"
                   f"loss:\n  builtin: cross_entropy\n{extra}")
    return cfg


def test_run_scan_numpy_tuples_infers_classes_and_keeps_the_model_untouched(tmp_path, monkeypatch):
    cfg = write_spec(tmp_path, """
        import numpy as np
        def build_loader():
            rng = np.random.default_rng(0)
            out = [(rng.standard_normal((8, 6)).astype("float32"), rng.integers(0, 3, 8)) for _ in range(5)]
            out[4][1][6] = 3
            return out
        """, "fields: [x, y]\nlabel: y\n")
    built = {}
    import nandoctor.scan as scan_mod

    real = scan_mod.build_workload

    def spy(spec):
        built["w"] = real(spec)
        built["bn_mean"] = built["w"].model.bn._mean.numpy().copy()
        return built["w"]

    monkeypatch.setattr(scan_mod, "build_workload", spy)
    report = run_scan(load_spec(cfg))
    [f] = report.findings
    assert f.code == Code.DATA_LABEL_RANGE
    assert (f.location.batch_index, f.location.sample_indices, f.location.field) == (4, [6], "y")
    assert report.details["num_classes"] == 3 and "output" in report.details["num_classes_source"]
    model = built["w"].model
    assert model.training  # eval mode for the inference call was undone
    np.testing.assert_array_equal(model.bn._mean.numpy(), built["bn_mean"])  # no running-stat update
    assert report.exit_code == 1


@pytest.mark.parametrize("fixed_batch", [False, True])
def test_the_first_forward_sees_a_few_rows_unless_the_model_needs_the_whole_batch(tmp_path, fixed_batch):
    """The class count needs the output's width, not 500 rows of activations: the model sees FORWARD_ROWS
    rows once; a model with its batch size written into its forward (reshape to [500, ...]) fails on them
    and is called on the whole batch, and its count is still found (no finding blames it)."""
    from nandoctor.scan.model_facts import FORWARD_ROWS

    (tmp_path / "sizes.py").write_text(textwrap.dedent(f"""
        import paddle
        class Net(paddle.nn.Layer):
            def __init__(self):
                super().__init__()
                self.fc = paddle.nn.Linear(6, 4)
            def forward(self, x):
                with open({str(tmp_path / "seen.txt")!r}, "a") as f:
                    f.write(f"{{int(x.shape[0])}}\\n")
                if {fixed_batch}:
                    x = x.reshape([500, 6])
                return self.fc(x)
        def build_model():
            return Net()
        """))
    cfg = write_spec(tmp_path, """
        import numpy as np
        def build_loader():
            rng = np.random.default_rng(0)
            return [(rng.standard_normal((500, 6)).astype("float32"), rng.integers(0, 4, 500)) for _ in range(3)]
        """, "fields: [x, y]\nlabel: y\n", model_entry="sizes.py:build_model")
    report = run_scan(load_spec(cfg))
    seen = [int(n) for n in (tmp_path / "seen.txt").read_text().split()]
    assert report.findings == [] and report.details["num_classes"] == 4, (report.details, seen)
    assert seen == ([FORWARD_ROWS, 500] if fixed_batch else [FORWARD_ROWS])


def test_run_scan_dict_generator_stops_after_batches_with_progress(tmp_path):
    cfg = write_spec(tmp_path, """
        import numpy as np
        def build_loader():
            for i in range(100):
                x = np.ones((4, 6), "float32") * i
                if i == 50:
                    x[0, 0] = float("nan")
                yield {"x": x, "y": np.zeros(4, "int64")}
        """, "label: y\n")
    seen = []
    report = run_scan(load_spec(cfg), ScanOptions(batches=20), lambda d, t, s: seen.append((d, t)))
    assert report.findings == [] and report.verdict == Verdict.HEALTHY
    assert report.details["batches"] == 20 and report.details["samples"] == 80
    assert seen[-1] == (20, 20)


def test_run_scan_paddle_dataloader(tmp_path):
    cfg = write_spec(tmp_path, """
        import numpy as np
        import paddle
        class DS(paddle.io.Dataset):
            def __init__(self):
                rng = np.random.default_rng(0)
                self.x = rng.standard_normal((40, 6)).astype("float32")
                self.x[13, 2] = np.inf
            def __getitem__(self, i):
                return self.x[i], np.int64(i % 3)
            def __len__(self):
                return 40
        def build_loader():
            return paddle.io.DataLoader(DS(), batch_size=8, shuffle=False)
        """, "fields: [x, label]\n")
    seen = []
    report = run_scan(load_spec(cfg), progress=lambda d, t, s: seen.append((d, t)))
    [f] = report.findings
    assert f.code == Code.DATA_NONFINITE
    assert (f.location.batch_index, f.location.sample_indices, f.location.field) == (1, [5], "x")
    assert f.evidence["inf"] == 1
    assert report.first_fault.batch_index == 1 and report.verdict == Verdict.NAN_FOUND
    assert seen[-1] == (5, 5)


def test_run_scan_loader_raising_mid_epoch_keeps_what_was_scanned(tmp_path):
    cfg = write_spec(tmp_path, """
        import numpy as np
        def build_loader():
            for i in range(6):
                if i == 3:
                    raise KeyError("fish")
                yield np.zeros((4, 6), "float32") + i, np.zeros(4, "int64")
        """, "fields: [x, y]\nlabel: y\n")
    report = run_scan(load_spec(cfg))
    [f] = report.findings
    assert f.code == Code.USER_CODE_ERROR and f.severity == Severity.ERROR
    assert (f.location.phase, f.location.batch_index) == (Phase.DATA, 3)
    assert f.evidence["origin"].startswith("data.py:6") and "data.py:6" in f.message
    assert report.crashed and report.verdict == Verdict.CRASHED and report.details["batches"] == 3


def test_run_scan_model_that_raises_still_scans_the_data(tmp_path):
    cfg = write_spec(tmp_path, """
        import numpy as np
        def build_loader():
            x = np.zeros((4, 6), "float32") + np.arange(6, dtype="float32")
            x[1, 1] = np.nan
            return [(x, np.zeros(4, "int64"))]
        """, "fields: [x, y]\nlabel: y\n", model_entry="model.py:broken_model")
    report = run_scan(load_spec(cfg))
    assert codes(report.findings) == ["data.nonfinite", "user_code.error"]
    crash = next(f for f in report.findings if f.code == Code.USER_CODE_ERROR)
    assert crash.location.phase == Phase.PARAMS and "model.py:20" in crash.message
    assert report.crashed and report.exit_code == 1
