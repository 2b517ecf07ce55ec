"""The probe when the user's code raises (translated Paddle errors included) and its early warnings."""

from __future__ import annotations

from probe_spec import codes, probe

from nandoctor.findings import Phase


def test_label_out_of_range_becomes_data_label_range(tmp_path):
    report = probe(tmp_path, data_args={"label_batch": 2, "label_row": 5, "label_value": 3})
    assert report.crashed and report.verdict.value == "crashed" and report.exit_code == 1
    [f] = [f for f in report.findings if f.code.value == "data.label_range"]
    assert f.location.sample_indices == [5] and f.location.batch_index == 2 and f.location.field == "label"
    assert "3" in f.message and "[0, 2]" in f.message
    ff = report.first_fault
    assert (ff.step, ff.batch_index, ff.sample_indices) == (2, 2, [5])
    assert "user_code.error" in codes(report, "error")


def test_position_beyond_the_table_becomes_data_seq_len_naming_the_layer(tmp_path):
    report = probe(tmp_path, model="position_model", data="token_loader", data_args={"long_batch": 2})
    [f] = [f for f in report.findings if f.code.value == "data.seq_len"]
    assert f.location.layer == "pos_emb" and "12" in f.message and "8 rows" in f.message
    assert report.first_fault.step == 2 and report.first_fault.layer == "pos_emb" and report.crashed


def test_id_beyond_a_vocabulary_table_becomes_data_range(tmp_path):
    report = probe(tmp_path, model="position_model", data="token_loader",
                   data_args={"long_batch": -1, "bad_id_batch": 1, "bad_id_row": 2})
    [f] = [f for f in report.findings if f.code.value == "data.range"]
    assert f.location.layer == "tok" and f.location.sample_indices == [2] and f.location.field == "x"


def test_user_exception_names_step_layer_and_line(tmp_path):
    # the model's bad reshape fires only for one batch size: not this one, then this one
    report = probe(tmp_path, model_args={"crash_at_batch_size": 5}, data_args={"batches": 4, "batch_size": 8},
                   steps=3)
    assert report.findings == [] and not report.crashed  # every batch has 8 samples: no crash
    report = probe(tmp_path, model_args={"crash_at_batch_size": 8}, steps=3)
    [f] = report.findings
    assert f.code.value == "user_code.error" and report.crashed
    assert f.location.step == 0 and f.location.phase == Phase.FORWARD and f.location.layer is None
    assert "probe_models.py:" in f.evidence["origin"] and "forward" in f.evidence["origin"]
    ff = report.first_fault
    assert (ff.step, ff.phase) == (0, Phase.FORWARD)


def test_user_exception_inside_a_sublayer_names_it(tmp_path):
    report = probe(tmp_path, model="position_model", data="token_loader",
                   data_args={"long_batch": -1, "bad_id_batch": 0}, steps=2)
    assert report.first_fault.layer == "tok"


def test_grad_explosion_warns_before_the_fault(tmp_path):
    report = probe(tmp_path, model="regressor", loss="mse", data_args={"regression": True, "scale": 3.0,
                                                                       "batches": 40},
                   optimizer={"name": "SGD", "args": {"learning_rate": 1.0}}, steps=40)
    ff = report.first_fault
    assert ff is not None and report.verdict.value == "nan_found"
    [w] = [f for f in report.findings if f.code.value == "grad.explosion"]
    assert w.severity.value == "warning" and w.location.step < ff.step
    assert any("global_norm" in a for a in w.advice)


def test_no_warning_on_a_healthy_regression(tmp_path):
    report = probe(tmp_path, model="regressor", loss="mse", data_args={"regression": True, "batches": 40},
                   optimizer={"name": "SGD", "args": {"learning_rate": 0.01}}, steps=40)
    assert report.findings == []


def test_fp16_headroom_warning_and_amp_inactive_on_cpu(tmp_path):
    amp = {"amp": {"enabled": True, "dtype": "float16"}}
    report = probe(tmp_path, data_args={"scale": 3e5}, extra=amp, steps=3)
    assert "amp.inactive" in codes(report, "info")
    warns = [f for f in report.findings if f.code.value == "precision.fp16_overflow"]
    assert warns and warns[0].evidence["margin"] > 1 and warns[0].location.layer
    assert {f.severity.value for f in warns} == {"warning"}
    # the same magnitudes without AMP: the float16 what-if is still reported, as info (no warning)
    report = probe(tmp_path, data_args={"scale": 3e5}, steps=3)
    assert "precision.fp16_overflow" not in codes(report, "warning", "error")
    infos = [f for f in report.findings if f.code.value == "precision.fp16_overflow"]
    assert {f.severity.value for f in infos} == {"info"} and all("no float16 AMP" in f.message for f in infos)
    # the same layers past 65504 (which one is largest may differ: with AMP stats are sampled every step)
    assert {x["layer"] for f in infos for x in f.evidence["layers"]} == \
        {x["layer"] for f in warns for x in f.evidence["layers"]}
    assert max(f.evidence["margin"] for f in infos) > 1
    # one finding a run, at the largest layer; every layer past 65504 is in its evidence, largest first
    assert len(infos) == 1 and len(warns) == 1
    [info] = infos
    layers = info.evidence["layers"]
    assert len(layers) == info.evidence["n_layers"] >= 2, layers
    assert layers[0]["layer"] == info.location.layer and layers[0]["max_abs"] == info.evidence["max_abs"]
    assert all(a["max_abs"] >= b["max_abs"] > 65504 for a, b in zip(layers, layers[1:]))
    assert f"{len(layers) - 1} other layer(s) also exceed it" in info.message
    assert report.verdict.value == "healthy"


def test_a_growth_begins_at_a_lone_jump_not_at_the_noise_before_it():
    """Reads spaced out (one step in 256): two reads of different batches before a 1e4x jump differ by 1.4x.
    That is the level's noise, not a growth (under 3x): the growth began at the read before the jump. A real
    rise before the jump (4x, then 4x) still puts the start where it began."""
    from nandoctor.engine.warnings import find_rise

    noisy = [(0, 1.0), (256, 0.9), (512, 1.3), (768, 1.0e4)]
    rise = find_rise(noisy)
    assert (rise.start_step, rise.end_step) == (512, 768)
    growing = [(0, 1.0), (1, 1.0), (2, 4.0), (3, 16.0), (4, 2000.0)]
    assert find_rise(growing).start_step == 1
