"""Warnings before the NaN (issue 35): attention-logit growth, log Z divergence and linear-output growth.

Ground truth: the same small decoders (tests/precursor_models.py), seeds, data and warmup trained by a plain
AdamW loop that records every step's attention logits and entropy, the head's log Z and each linear layer's
output RMS on the host in float64 with its own forward hooks (run_truth.precursor_record). The test finds
the growth in that record itself (its early level, the step it passed the threshold, the last step before
it still near the early level) and checks that the probe names the same layer, a start step near the
truth's and before the fault, measured levels that match the record, and a lead time to the fault; and
that each run's twin at a 10x lower peak LR gets no warning at all.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import pytest
import yaml

from nandoctor.engine import precursor_rules as rules
from nandoctor.engine import precursors as pc
from nandoctor.findings import Report, Severity
from nandoctor.probe import ProbeOptions, run_probe
from nandoctor.spec import load_spec

sys.path.insert(0, str(Path(__file__).resolve().parent))
import precursor_models as pm  # noqa: E402
from inloop_helpers import ROOT  # noqa: E402
from run_truth import nandoctor_run, precursor_record  # noqa: E402

MODELS = Path(pm.__file__).resolve()
WARMUP = 30
PRECURSORS = {"attention.logit_growth", "output.logit_divergence", "activation.norm_growth"}


def probe(tmp_path: Path, *, peak: float, steps: int, loss: str = "cross_entropy", **model: Any) -> Report:
    path = write_spec(tmp_path, peak=peak, steps=steps, loss=loss, **model)
    return run_probe(load_spec(path), ProbeOptions(steps=steps, seed=0, device="cpu"))


def write_spec(tmp_path: Path, *, peak: float, steps: int, loss: str = "cross_entropy", **model: Any) -> Path:
    raw = {"version": 1, "model": {"entry": f"{MODELS}:gpt", "args": model},
           "data": {"entry": f"{MODELS}:tokens", "args": {"batches": steps}, "fields": ["ids", "label"],
                    "label": "label"},
           "loss": {"entry": f"{MODELS}:{loss}"},
           "optimizer": {"name": "AdamW", "args": {"learning_rate": peak},
                         "lr_scheduler": {"warmup": {"steps": WARMUP, "start_lr": 0.0}}},
           "probe": {"steps": steps}}  # (a plain script of the spec, under `nandoctor run`, trains as many)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def truth(*, peak: float, steps: int, loss: str = "cross_entropy", **model: Any) -> tuple[dict, list, int | None]:
    """The plain loop, seeded as the probe seeds (paddle, numpy) before it builds the model."""
    paddle.seed(0)
    np.random.seed(0)
    return precursor_record(pm.gpt(**model), pm.tokens(steps), getattr(pm, loss), peak_lr=peak, warmup=WARMUP)


def crossing(values: list[float], ratio: float, floor: float = 0.0) -> tuple[float, int, int] | None:
    """(early level, first step past max(ratio x early, floor), last step before it within 2x early) of an
    every-step record; None when it never gets there."""
    early = statistics.median(values[:rules.EARLY_STEPS])
    over = next((i for i, v in enumerate(values) if v >= max(ratio * early, floor)), None)
    if over is None:
        return None
    start = max((i for i in range(over) if values[i] <= rules.START_BAND * early), default=0)
    return early, over, start


def first_to_cross(record: dict, suffix: str, ratio: float, floor: float = 0.0) -> dict[str, tuple[float, int, int]]:
    return {k.rsplit(":", 1)[0]: c for k, v in record.items() if k.endswith(suffix)
            for c in [crossing(v, ratio, floor)] if c is not None}


def warning(report: Report, code: str) -> Any:
    found = [f for f in report.findings if f.code.value == code]
    assert len(found) == 1, [(f.code.value, f.message) for f in report.findings]
    assert found[0].severity == Severity.WARNING
    return found[0]


def check_growth(f: Any, record: dict, suffix: str, crossed: dict[str, tuple[float, int, int]]) -> None:
    """The probe's finding against the plain loop's record: the layer that crossed first (or one that crossed
    within a sampling stride of it), a start step near the truth's, and levels the record holds."""
    first = min(c[1] for c in crossed.values())
    near = {layer for layer, c in crossed.items() if c[1] <= first + pc.EVERY_ATTENTION}
    ev = f.evidence
    assert ev["layer"] in near and f.location.layer == ev["layer"]
    early, over, start = crossed[ev["layer"]]
    stride = ev["sample_every"]
    assert stride == pc.EVERY_ATTENTION
    assert abs(ev["start_step"] - start) <= 2 * stride, (ev["start_step"], start)
    assert abs(ev["alarm_step"] - over) <= 3 * stride, (ev["alarm_step"], over)
    series = record[f"{ev['layer']}:{suffix}"]
    assert ev["early_level"] == pytest.approx(early, rel=1.0)  # a median of 2 samples against one of 8 steps
    # ... and exactly the record's at the steps sampled (every stride-th from the stride on, in every way in)
    sampled = [series[s] for s in range(stride, stride + rules.EARLY_STEPS, stride)]
    assert ev["early_level"] == pytest.approx(statistics.median(sampled), rel=1e-3)
    assert ev["level"] == pytest.approx(series[ev["level_step"]], rel=1e-3)
    assert ev["peak"] == pytest.approx(max(series[s] for s in range(0, ev["level_step"] + 1, stride)), rel=1e-3)


@pytest.fixture(scope="module")
def attention_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Report, dict, int | None]:
    report = probe(tmp_path_factory.mktemp("attn"), peak=0.1, steps=120)
    record, _, fault = truth(peak=0.1, steps=120)
    return report, record, fault


def test_attention_logit_growth_is_named_at_its_layer_and_start(attention_run: tuple) -> None:
    report, record, fault = attention_run
    assert fault is None and report.verdict.value == "at_risk"
    crossed = first_to_cross(record, ":max", rules.ATTENTION_RATIO)
    assert crossed, "the plain loop's attention logits never grew 50x: the model no longer blows up"
    f = warning(report, "attention.logit_growth")
    check_growth(f, record, "max", crossed)
    ev = f.evidence
    entropy = record[f"{ev['layer']}:entropy"]
    assert ev["entropy"] == pytest.approx(entropy[ev["level_step"]], rel=1e-3)
    assert ev["entropy"] < ev["entropy_early"] / 4  # the collapse that comes with the growth
    assert ev["lead_steps"] is None and "No NaN yet" in f.message
    assert f"step {ev['start_step']}" in f.message and ev["layer"] in f.message


def test_activation_growth_with_qk_layernorm(tmp_path: Path) -> None:
    """qk-layernorm holds the attention logits down; the first block's FC2 output grows instead."""
    report = probe(tmp_path, peak=0.1, steps=80, qk_norm=True)
    record, _, _ = truth(peak=0.1, steps=80, qk_norm=True)
    assert not first_to_cross(record, ":max", rules.ATTENTION_RATIO)
    assert "attention.logit_growth" not in {f.code.value for f in report.findings}
    crossed = first_to_cross(record, ":rms", rules.RMS_RATIO)
    f = warning(report, "activation.norm_growth")
    check_growth(f, record, "rms", crossed)
    assert f.evidence["layer"] == "blocks.0.fc2"


def test_log_z_divergence_comes_before_the_overflow_and_the_fault_says_so(tmp_path: Path) -> None:
    """No final LayerNorm and a hand-written log(sum(exp(logits))): log Z drifts until exp overflows. The
    warning comes before the fault, and the fault's finding names it rather than its batch's samples alone."""
    report = probe(tmp_path, peak=0.2, steps=40, loss="naive_cross_entropy", final_ln=False)
    record, _, fault = truth(peak=0.2, steps=40, loss="naive_cross_entropy", final_ln=False)
    assert fault is not None and report.first_fault is not None
    assert abs(report.first_fault.step - fault) <= 2  # (summation order: paddle-notes)
    f = warning(report, "output.logit_divergence")
    ev = f.evidence
    log_z = record["head:log_z"]
    early, over, start = crossing(log_z[:fault], rules.LOGZ_RATIO, rules.LOGZ_FLOOR)
    assert ev["layer"] == "head"
    assert abs(ev["start_step"] - start) <= 2 * pc.EVERY_ATTENTION
    assert ev["start_step"] < ev["alarm_step"] < report.first_fault.step
    assert ev["lead_steps"] == report.first_fault.step - ev["alarm_step"] > 0
    assert ev["level"] == pytest.approx(log_z[ev["level_step"]], rel=1e-3)
    assert max(log_z[:fault]) > 2 * early
    errors = [g for g in report.findings if g.severity == Severity.ERROR]
    assert errors and "output.logit_divergence" in errors[0].message
    assert errors[0].evidence["precursors"][0]["start_step"] == ev["start_step"]


@pytest.mark.parametrize(("peak", "steps", "model", "loss"), [
    (0.01, 120, {}, "cross_entropy"),
    (0.01, 80, {"qk_norm": True}, "cross_entropy"),
    (0.02, 40, {"final_ln": False}, "naive_cross_entropy"),
], ids=["attention", "qk_norm", "no_final_ln"])
def test_the_lower_lr_twins_stay_quiet(tmp_path: Path, peak: float, steps: int, model: dict, loss: str) -> None:
    report = probe(tmp_path, peak=peak, steps=steps, loss=loss, **model)
    record, losses, fault = truth(peak=peak, steps=steps, loss=loss, **model)
    assert fault is None and min(losses) < 0.5 * losses[0]  # it trains
    assert report.verdict.value == "healthy", [(f.code.value, f.message) for f in report.findings]
    assert not PRECURSORS & {f.code.value for f in report.findings}
    assert report.remedies == [] and "remedies" not in report.details  # no warning: nothing replayed
    # and the record agrees: nothing near a threshold
    assert not first_to_cross(record, ":max", rules.ATTENTION_RATIO / 2)
    assert not first_to_cross(record, ":rms", rules.RMS_RATIO / 2)


class _HiddenAttention(paddle.nn.Layer):
    """Named like attention, but its softmax is one Paddle's functional module does not hand out."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = paddle.nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = paddle.split(self.qkv(x), 3, axis=-1)
        s = paddle.matmul(q, k, transpose_y=True)
        w = paddle.exp(s - s.max(-1, keepdim=True))
        return paddle.matmul(w / w.sum(-1, keepdim=True), v)


def test_multihead_attention_and_sdpa_are_seen_and_softmax_is_put_back() -> None:
    """nn.MultiHeadAttention (F.softmax inside) and F.scaled_dot_product_attention are seen at their layers,
    with the logits a plain computation of q k^T / sqrt(d) gives; F.softmax is Paddle's own again after."""
    import paddle.nn.functional as F

    original = F.softmax
    paddle.seed(0)
    enc = paddle.nn.TransformerEncoder(paddle.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0), 2)
    x = paddle.randn([3, 5, 16])
    mon = pc.PrecursorMonitor(enc)
    for step in (0, 4):  # the first step's sample finds the layers; the series starts at step 4
        mon.begin(step)
        enc(x)
        mon.end()
    mon.read()
    assert F.softmax is original
    assert mon.attention == ["layers.0.self_attn", "layers.1.self_attn"]
    attn = enc.layers[0].self_attn
    h = enc.layers[0].norm1(x) if enc.layers[0].normalize_before else x
    q = attn.q_proj(h).reshape([3, 5, 2, 8]).transpose([0, 2, 1, 3]).numpy().astype("float64")
    k = attn.k_proj(h).reshape([3, 5, 2, 8]).transpose([0, 2, 1, 3]).numpy().astype("float64")
    expected = (q @ k.transpose(0, 1, 3, 2) / np.sqrt(8)).max()
    assert mon.series[(rules.ATTN_MAX, "layers.0.self_attn")][0][1] == pytest.approx(expected, rel=1e-4)
    # the first sample found attention: the linear layers of its blocks are tracked from then on
    assert {n for n, _ in mon._tracked} >= {"layers.0.linear2", "layers.1.self_attn.q_proj"}
    assert mon.every == pc.EVERY_ATTENTION and mon.next_due(5) == 8

    class Sdpa(paddle.nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = paddle.nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = [t.reshape([3, 5, 2, 8]) for t in paddle.split(self.qkv(x), 3, axis=-1)]
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    model = Sdpa()
    mon = pc.PrecursorMonitor(model)
    mon.begin(0)
    try:
        model(x)
    except (RuntimeError, ValueError, NotImplementedError):  # a CPU build without the kernel: nothing to see
        pytest.skip("scaled_dot_product_attention has no CPU kernel here")
    finally:
        mon.end()
    assert mon.attention == ["Sdpa"]
    assert F.softmax is original


def test_attention_that_cannot_be_seen_is_said() -> None:
    model = paddle.nn.Sequential(_HiddenAttention(), paddle.nn.Linear(8, 4))
    mon = pc.PrecursorMonitor(model)
    mon.begin(0)
    model(paddle.randn([2, 3, 8]))
    mon.end()
    found = [f for f in mon.findings(None) if f.code.value == "attention.unseen"]
    assert len(found) == 1 and found[0].severity == Severity.INFO and found[0].location.layer == "0"
    # nothing more is sampled: the head's log Z alone, one step in 64, could never fire its rule
    assert mon.every is None and not any(mon.due(s) for s in range(1, 300)) and mon.next_due(1) > 10**9


def test_log_z_sampled_one_step_in_64_could_never_warn() -> None:
    """Why a model without attention is no longer sampled after its first step: a head whose log Z doubles every
    8 steps up to overflow, seen one step in 64, gives the log-Z rule nothing to fire on (no two samples within
    LOGZ_DOUBLING_STEPS); seen one step in 4, it warns."""
    from nandoctor.engine.precursor_rules import LOG_Z, judge

    def warned(every: int) -> bool:
        series = {(LOG_Z, "head"): [(s, 2.0 * 2 ** (s / 8)) for s in range(every, 400, every)]}
        return any(f.code.value == "output.logit_divergence" for f in judge(series, None, {}, every))

    assert warned(pc.EVERY_ATTENTION) and not warned(64)


def test_watch_in_the_users_loop_gives_the_probes_warning(attention_run: tuple, tmp_path: Path) -> None:
    """The same run in the user's own loop under `nandoctor.watch` (step_fn and the batch given, so steps may be
    left quiet and unread as the measured cost decides): the samples are taken at the same fixed steps
    whatever is read when, so the warning is the probe's."""
    import nandoctor

    probe_report, _, _ = attention_run
    paddle.seed(0)
    np.random.seed(0)
    model = pm.gpt()
    sched = paddle.optimizer.lr.LinearWarmup(0.1, WARMUP, 0.0, 0.1)
    opt = paddle.optimizer.AdamW(learning_rate=sched, parameters=model.parameters())

    def step_fn(m: Any, batch: Any) -> Any:
        return pm.cross_entropy(m(paddle.to_tensor(batch[0])), paddle.to_tensor(batch[1]))

    with nandoctor.watch(model, opt, step_fn=step_fn, report_dir=tmp_path / "r", fields=["ids", "label"]) as doctor:
        for batch in pm.tokens(120):
            loss = step_fn(model, batch)
            loss.backward()
            doctor.check(loss, batch)
            opt.step()
            opt.clear_grad()
            sched.step()
    series = doctor.watcher.precursors.series
    # the watch opens its step inside the model's forward: the head is still measured, at the same steps
    # (the first step's sample only finds the layers, in every way in: the series start at step 4)
    assert [s for s, _ in series[(rules.LOG_Z, "head")]] == list(range(4, 120, pc.EVERY_ATTENTION))
    assert [s for s, _ in series[(rules.ATTN_MAX, "blocks.0.attn")]] == list(range(4, 120, pc.EVERY_ATTENTION))
    mine = {f.code.value: f for f in doctor.report.findings if f.code.value in PRECURSORS}
    theirs = {f.code.value: f for f in probe_report.findings if f.code.value in PRECURSORS}
    assert "attention.logit_growth" in theirs and set(mine) == set(theirs)
    for code, f in theirs.items():
        for key in ("layer", "start_step", "alarm_step", "level_step", "peak_step"):
            assert mine[code].evidence[key] == f.evidence[key], (code, key)
        assert mine[code].evidence["level"] == pytest.approx(f.evidence["level"], rel=1e-3)


def test_a_failing_measurement_is_never_the_users_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A measurement of ours that raises inside the user's forward is swallowed: the forward returns what it
    would have, F.softmax is Paddle's again, and no later step is sampled."""
    import paddle.nn.functional as F

    original = F.softmax
    paddle.seed(0)
    model = pm.gpt()
    ids = paddle.to_tensor(pm.tokens(1)[0][0])
    expected = model(ids).numpy()
    mon = pc.PrecursorMonitor(model)

    def boom(*args: Any) -> None:
        raise RuntimeError("a bug of ours")

    monkeypatch.setattr(mon, "_put", boom)
    mon.begin(0)
    out = model(ids)
    mon.end()
    assert np.array_equal(out.numpy(), expected)
    assert F.softmax is original and mon.broken == "RuntimeError: a bug of ours"
    assert not mon.due(4) and mon.next_due(4) > 10**9


def test_a_step_opened_after_its_forward_does_not_end_the_search_for_attention() -> None:
    """`nandoctor run` opens its first step after that step's forward: the attention is looked for at the
    next sampled forward, not given up for the run."""
    paddle.seed(0)
    model = pm.gpt()
    ids = paddle.to_tensor(pm.tokens(1)[0][0])
    mon = pc.PrecursorMonitor(model)
    model(ids)
    mon.begin(0)  # opened after the forward
    mon.end()
    assert mon.due(1)
    mon.begin(1)
    model(ids)
    mon.end()
    assert mon.attention == ["blocks.0.attn", "blocks.1.attn"] and mon.every == pc.EVERY_ATTENTION


def test_run_gives_the_probes_warnings_from_the_same_step(attention_run: tuple, tmp_path: Path) -> None:
    """`nandoctor run` on a plain script training the probe's spec (tests/parity/plain_train.py; the child process
    is what this door is): it finds the model only at step 0's update, after that step's forward, and finds the
    attention at step 1's; the series start at step 4 in every way in, so its findings are the probe's: codes,
    layers, start steps, levels (main's run started at step 1 and said start step 12 where the probe said 8)."""
    probe_report, record, _ = attention_run
    spec = write_spec(tmp_path, peak=0.1, steps=120)
    _, report = nandoctor_run(ROOT / "tests" / "parity" / "plain_train.py", [str(spec)], tmp_path)
    assert report["run"]["mode"] == "run" and report["verdict"] == "at_risk"
    probed = {f.code.value: f for f in probe_report.findings if f.code.value in PRECURSORS}
    ran = {f["code"]: f for f in report["findings"] if f["code"] in PRECURSORS}
    assert probed and set(ran) == set(probed)
    for code, f in probed.items():
        ev = ran[code]["evidence"]
        for key in ("layer", "start_step", "alarm_step", "level_step", "peak_step", "sample_every"):
            assert ev[key] == f.evidence[key], (code, key)
        assert ev["early_level"] == pytest.approx(f.evidence["early_level"], rel=1e-4)
        assert ev["level"] == pytest.approx(f.evidence["level"], rel=1e-4)
    # the first sample is the plain loop's step 4
    ev = ran["attention.logit_growth"]["evidence"]
    assert ev["history"][0][0] == pc.EVERY_ATTENTION
    assert ev["history"][0][1] == pytest.approx(record[f"{ev['layer']}:max"][pc.EVERY_ATTENTION], rel=1e-4)


def test_the_hapi_callback_gives_the_probes_warning(attention_run: tuple, tmp_path: Path) -> None:
    """The same run through `paddle.Model.fit` with NanDoctorCallback, the fourth way in: hapi rebuilds the
    probe's batches from single items (shuffle off) and steps the warmup every batch; the precursors are the
    engine's, so the codes, layers and steps are the probe's."""
    from paddle.static import InputSpec

    from nandoctor.hapi import NanDoctorCallback

    probe_report, _, _ = attention_run

    class Items(paddle.io.Dataset):
        def __init__(self) -> None:
            self.items = [(x[i], y[i]) for x, y in pm.tokens(120) for i in range(len(x))]

        def __getitem__(self, i: int) -> Any:
            return self.items[i]

        def __len__(self) -> int:
            return len(self.items)

    class Loss(paddle.nn.Layer):
        def forward(self, logits: Any, label: Any) -> Any:
            return pm.cross_entropy(logits, label)

    paddle.seed(0)
    np.random.seed(0)
    net = pm.gpt()
    sched = paddle.optimizer.lr.LinearWarmup(0.1, WARMUP, 0.0, 0.1)
    model = paddle.Model(net, inputs=[InputSpec([None, pm.SEQ], "int64", "ids")],
                         labels=[InputSpec([None, pm.SEQ], "int64", "label")])
    model.prepare(paddle.optimizer.AdamW(learning_rate=sched, parameters=net.parameters()), Loss())
    cb = NanDoctorCallback(report_dir=tmp_path / "r")
    model.fit(Items(), epochs=1, batch_size=16, shuffle=False, verbose=0, callbacks=[cb])
    assert cb.report is not None
    mine = {f.code.value: f for f in cb.report.findings if f.code.value in PRECURSORS}
    theirs = {f.code.value: f for f in probe_report.findings if f.code.value in PRECURSORS}
    assert "attention.logit_growth" in theirs and set(mine) == set(theirs)
    for code, f in theirs.items():
        for key in ("layer", "start_step", "alarm_step"):
            assert mine[code].evidence[key] == f.evidence[key], (code, key)
