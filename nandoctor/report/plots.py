"""The bundle's pictures: loss and gradient norm per step; per-layer activation and gradient maps.

Matplotlib with the Agg backend only (no display, works on a headless CI box). Every plot is optional:
missing or empty report details mean that plot is skipped, never an exception, because a bundle must be
written even for a run that crashed at step 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nandoctor.findings import Report

FP16_MAX = 65504.0
LOSS_PLOT = "loss_and_grad_norm.png"
HEATMAP_PLOT = "activation_heatmap.png"


def make_plots(report: Report, folder: Path) -> dict[str, str]:
    """Write every plot the report has data for into `folder`; {title: file name} of those written."""
    folder.mkdir(parents=True, exist_ok=True)
    written: dict[str, str] = {}
    if plot_loss_and_grad_norm(report, folder / LOSS_PLOT):
        written["Loss and global gradient norm per step"] = LOSS_PLOT
    if plot_activation_heatmap(report, folder / HEATMAP_PLOT):
        written["Per-layer max |activation| per step"] = HEATMAP_PLOT
    return written


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=True)  # headless; never opens a window even when a display exists
    import matplotlib.pyplot as plt

    return plt


def _finite_positive(value: Any) -> float | None:
    """A value a log axis can show: finite and > 0 ('nan'/'inf' strings from a re-read JSON are missing)."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) and x > 0 else None


def _fault_step(report: Report) -> int | None:
    ff = report.first_fault
    return ff.step if ff is not None and ff.step is not None else None


def plot_loss_and_grad_norm(report: Report, path: Path) -> bool:
    """Loss and global gradient norm on a log scale; the fault step and the clipping threshold marked."""
    points = report.timeline
    series = {
        "loss": [(p.step, _finite_positive(p.loss)) for p in points],
        "global grad norm": [(p.step, _finite_positive(p.grad_norm)) for p in points],
    }
    if not any(v is not None for values in series.values() for _, v in values):
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.2), dpi=110)
    try:
        for (label, values), colour in zip(series.items(), ("tab:blue", "tab:orange")):
            xs = [s for s, v in values if v is not None]
            ys = [v for _, v in values if v is not None]
            if xs:
                ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.4, label=label, color=colour)
        # Steps whose value was NaN/Inf cannot sit on a log axis: mark them along the top instead.
        bad = [p.step for p in points if p.loss is not None and _finite_positive(p.loss) is None
               and _is_nonfinite(p.loss)]
        if bad:
            ax.plot(bad, [1.0] * len(bad), linestyle="none", marker="x", color="crimson",
                    transform=ax.get_xaxis_transform(), clip_on=False, label="loss NaN/Inf")
        fault = _fault_step(report)
        if fault is not None:
            ax.axvline(fault, color="crimson", linestyle="--", linewidth=1.2,
                       label=f"first fault (step {fault})")
        clip = _finite_positive(report.details.get("clip"))
        if clip is not None:
            ax.axhline(clip, color="grey", linestyle=":", linewidth=1.2,
                       label=f"clipping threshold ({clip:g})")
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("value (log scale)")
        ax.set_title("Loss and global gradient norm per step")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(loc="best", fontsize=8)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
    return True


def _is_nonfinite(value: Any) -> bool:
    try:
        return not math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _matrix(block: Any, names_key: str) -> tuple[list[str], list[Any], list[list[float]]] | None:
    """(names, steps, rows) from {names_key: [...], "steps": [...], "values": [[...]]}; None if unusable."""
    if not isinstance(block, dict):
        return None
    names, steps, values = block.get(names_key), block.get("steps"), block.get("values")
    if not (isinstance(names, Sequence) and isinstance(steps, Sequence) and isinstance(values, Sequence)):
        return None
    if not names or not steps or len(values) != len(names):
        return None
    rows: list[list[float]] = []
    for row in values:
        if not isinstance(row, Sequence) or len(row) != len(steps):
            return None
        rows.append([_cell(v) for v in row])
    return [str(n) for n in names], list(steps), rows


def _cell(value: Any) -> float:
    """A heat-map cell: |value|; NaN/Inf become inf so they show as 'beyond the scale'; junk is blank."""
    try:
        x = abs(float(value))
    except (TypeError, ValueError):
        return math.nan  # missing: left blank
    return math.inf if math.isnan(x) else x


def plot_activation_heatmap(report: Report, path: Path) -> bool:
    """Per-layer max |activation| per step (log colours, float16's 65504 marked); grad norms if present."""
    panels = []
    act = _matrix(report.details.get("activation_max"), "layers")
    if act is not None:
        panels.append(("Per-layer max |activation| per step", "layer", act, True))
    grads = _matrix(report.details.get("grad_norms"), "parameters")
    if grads is not None:
        panels.append(("Per-parameter gradient norm per step", "parameter", grads, False))
    if not panels:
        return False
    import numpy as np
    from matplotlib.colors import LogNorm

    plt = _pyplot()
    heights = [max(2.2, 0.28 * len(p[2][0]) + 1.4) for p in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, sum(heights)), dpi=110, squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    try:
        fault = _fault_step(report)
        for ax, (title, what, (names, steps, rows), mark_fp16) in zip(axes[:, 0], panels):
            data = np.array(rows, dtype=float)
            finite = data[np.isfinite(data) & (data > 0)]
            lo = float(finite.min()) if finite.size else 1e-3
            hi = float(finite.max()) if finite.size else 1.0
            if mark_fp16:
                hi = max(hi, FP16_MAX * 2)  # keep 65504 on the colour bar, to read off the fp16 headroom
            lo = min(lo, hi / 10)
            # NaN/Inf cells are drawn "over" every finite value (crimson); missing ones grey.
            cmap = plt.get_cmap("viridis").with_extremes(over="crimson", under="white", bad="lightgrey")
            shown = np.where(np.isinf(data), hi * 10, data)
            shown = np.where(shown <= 0, lo / 10, shown)
            norm = LogNorm(vmin=lo, vmax=hi, clip=False)
            image = ax.imshow(np.ma.masked_invalid(shown), aspect="auto", interpolation="nearest", cmap=cmap,
                              norm=norm)
            bar = fig.colorbar(image, ax=ax, extend="max", pad=0.01)
            bar.set_label("max |value| (log)\nred line: fp16 max 65504" if mark_fp16 else "norm (log)",
                          fontsize=8)
            if mark_fp16:
                bar.ax.axhline(FP16_MAX, color="red", linewidth=2)
                over = np.isfinite(data) & (data > FP16_MAX)
                if over.any():  # finite, but float16 would overflow here: outline those cells
                    ys, xs = np.nonzero(over)
                    ax.scatter(xs, ys, marker="s", s=30, facecolors="none", edgecolors="red", linewidths=0.8)
                    title += "\nred squares: above 65504 (float16 would overflow)"
            title += "; red cells: NaN/Inf" if np.isinf(data).any() else ""
            ax.set_yticks(range(len(names)))
            ax.set_yticklabels(names, fontsize=7)
            step_ticks = _tick_positions(len(steps))
            ax.set_xticks(step_ticks)
            ax.set_xticklabels([str(steps[i]) for i in step_ticks], fontsize=7)
            if fault is not None and fault in steps:
                ax.axvline(steps.index(fault), color="red", linestyle="--", linewidth=1.0)
            ax.set_xlabel("step")
            ax.set_ylabel(what)
            ax.set_title(title, fontsize=10)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
    return True


def _tick_positions(n: int, most: int = 20) -> list[int]:
    """At most `most` evenly spread column indices, always including the last."""
    if n <= most:
        return list(range(n))
    stride = math.ceil(n / most)
    ticks = list(range(0, n, stride))
    if ticks[-1] != n - 1:
        ticks.append(n - 1)
    return ticks
