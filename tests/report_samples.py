"""Hand-built Reports for renderer tests: fixed values only, so golden files are byte-stable."""

from __future__ import annotations

import math

import numpy as np

from nandoctor.findings import Code, Finding, FirstFault, Location, Phase, Report, Severity, TimelinePoint

ENVIRONMENT = {"nandoctor": "0.1.0", "paddle": "3.3.1", "python": "3.11.9", "device": "cpu",
               "os": "Linux 6.1 (x86_64)", "paddle_flags": {"FLAGS_check_nan_inf": "0"}}


def probe_nan_report() -> Report:
    """A probe that found an infinite sqrt gradient at step 36, after a warning about growing norms."""
    timeline = []
    for step in range(40):
        loss = 2.3 * math.exp(-step / 20) + 0.1
        norm = 1.5 * (1.35 ** max(step - 20, 0))
        timeline.append(TimelinePoint(step=step, loss=loss, grad_norm=norm))
    timeline[36] = TimelinePoint(step=36, loss=math.nan, grad_norm=math.inf)
    timeline[37] = TimelinePoint(step=37, loss=math.nan, grad_norm=math.nan)
    timeline[38] = TimelinePoint(step=38, loss=math.nan, grad_norm=math.nan)
    timeline[39] = TimelinePoint(step=39, loss=math.nan, grad_norm=math.nan)
    fault = FirstFault(step=36, phase=Phase.BACKWARD, layer="head.distance", op="sqrt_grad", parameter=None,
                       batch_index=np.int64(4), sample_indices=[3, 7])
    return Report(
        command="probe",
        findings=[
            Finding(Code.GRAD_EXPLOSION, Severity.WARNING,
                    "The global gradient norm grew from 1.5 to 275 over 16 steps.",
                    Location(step=21, phase=Phase.BACKWARD),
                    evidence={"start_norm": 1.5, "end_norm": 275.3},
                    advice=["Clip gradients at about 1.5: `optimizer.grad_clip: {global_norm: 1.5}`."]),
            Finding(Code.GRAD_NONFINITE, Severity.ERROR,
                    "The gradient of sqrt in layer head.distance became Inf at step 36 (|x| = 0 in 2 rows).",
                    fault.as_location(),
                    evidence={"num_inf": 2, "max": math.inf, "ratio": float("nan")},
                    advice=["The gradient of sqrt at 0 is infinite: add an epsilon inside, "
                            "`paddle.sqrt(x + 1e-12)`.", "Pipes | in advice stay readable."]),
            Finding(Code.AMP_INACTIVE, Severity.INFO, "AMP is enabled but this is a CPU run.",
                    advice=["Run on a GPU to exercise real AMP."]),
        ],
        first_fault=fault,
        timeline=timeline,
        environment=dict(ENVIRONMENT),
        run={"config": "examples/siamese/config.yaml", "steps": 40, "seed": 0, "device": "cpu",
             "command_line": "nandoctor probe examples/siamese/config.yaml --steps 40"},
        details={"steps_run": 40,
                 "offending_tensor": {"min": 0.0, "max": math.inf, "num_nan": 0, "num_inf": 2, "numel": 64,
                                      "shape": [8, 8], "dtype": "float32"},
                 "plots": {"Loss and gradient norm": "plots/loss_and_grad_norm.png"},
                 "remedies": {"seconds": 0.4, "budget_seconds": 20.0, "probe_seconds": 1.2, "fix_steps": 20,
                              "end_step": 56, "control": {"start_step": 36, "reproduced": True, "failed_at": 36}},
                 "snapshots": {"enabled": True, "every": 8, "kept_steps": [0, 32], "bytes": 2 * 2**20}},
        remedies=[
            {"remedy": "op_guard", "change": "paddle.sqrt(x + 1e-12) instead of paddle.sqrt(x) at model.py:13 in "
             "forward", "outcome": "fixed", "steps_run": 20, "loss_before": 0.19, "loss_after": 0.17,
             "seconds": 0.05, "start_step": 36, "note": None},
            {"remedy": "drop_samples", "change": "leave out sample(s) [3, 7] of batch 4 (epoch 0) | or skip it",
             "outcome": "fixed", "steps_run": 20, "loss_before": 0.19, "loss_after": 0.18, "seconds": 0.04,
             "start_step": 36, "note": None,
             "skip_list": {"batches": [{"epoch": 0, "batch_index": 4, "step": 36, "samples": [3, 7]}],
                           "skip_data_intervals": [[37, 37]]}},
            {"remedy": "lr_x0.1", "change": "optimizer.args.learning_rate: 0.0003 (YAML; was 0.003)",
             "outcome": "not_fixed", "steps_run": 0, "loss_before": 0.19, "loss_after": None, "seconds": 0.01,
             "start_step": 21, "note": "still non-finite at step 36", "failed_at": 36},
            {"remedy": "reinit", "change": "re-initialise w", "outcome": "not_applicable", "steps_run": 0,
             "loss_before": None, "loss_after": math.nan, "seconds": 0.0, "start_step": None,
             "note": "no param.init_scale finding"},
        ],
    )


def scan_report() -> Report:
    """A scan that found NaN in a data field and a label out of range, with per-field statistics."""
    return Report(
        command="scan",
        findings=[
            Finding(Code.DATA_NONFINITE, Severity.ERROR, "Field 'x' holds 3 NaN values in batch 2.",
                    Location(batch_index=2, sample_indices=[5], field="x"), evidence={"batches": [2, 9]},
                    advice=["Clean the data: drop or impute NaN/Inf at the source."]),
            Finding(Code.DATA_LABEL_RANGE, Severity.ERROR, "Label 10 is outside [0, 10) (num_classes: 10).",
                    Location(batch_index=7, sample_indices=[0, 1], field="y"),
                    advice=["Labels must lie in [0, num_classes)."]),
        ],
        environment=dict(ENVIRONMENT),
        run={"config": "cfg.yaml", "command_line": "nandoctor scan cfg.yaml"},
        details={"batches_scanned": 12, "samples_scanned": 384,
                 "fields": {"x": {"dtype": "float32", "shape": [32, 16], "min": -3.2, "max": math.nan,
                                  "mean": 0.01, "std": 1.0, "num_nan": 3},
                            "y": {"dtype": "int64", "shape": [32], "min": 0, "max": 10}}},
    )


def healthy_report() -> Report:
    return Report(command="probe",
                  timeline=[TimelinePoint(step=i, loss=1.0 / (i + 1), grad_norm=0.5) for i in range(5)],
                  environment={"paddle": "3.3.1"}, run={"command_line": "nandoctor probe ok.yaml"},
                  details={"steps_run": 5})
