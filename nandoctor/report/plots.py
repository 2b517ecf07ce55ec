"""The bundle's pictures: loss and gradient norm per step; per-layer activation and gradient maps.

Matplotlib with the Agg backend only (no display, works on a headless CI box). Every plot is optional:
missing or empty report details mean that plot is skipped, never an exception, because a bundle must be
written even for a run that crashed at step 0.

The two pictures are read one above the other: both put the step on x over the same range, and their
plotting areas sit at the same left and right edges (the left margin fitted to the longest row label,
measured with the renderer; colour bars outside the right edge), so a step in the heat map lies under the
same step of the loss plot. They say what was measured: a NaN/Inf value is drawn as such (its own colour
and key entry), apart from a value not recorded; an axis or colour scale is logarithmic only when its
values span LOG_RANGE or more (a loss that moves 1.5x on a log axis shows ticks like 6 x 10^-1 and
nothing else). `loss_figure` and `heatmap_figure` return the figures, for tests that read their axes;
`use_log` and `left_margin` are the decisions, as functions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from nandoctor.findings import Report
from nandoctor.report.common import OVERFLOW_NOTE, overflowed_norm

FP16_MAX = 65504.0
LOSS_PLOT = "loss_and_grad_norm.png"
HEATMAP_PLOT = "activation_heatmap.png"
WIDTH = 9.0  # inches, both figures: with the margins below, their plotting areas line up
DPI = 110
LEFT, RIGHT = 0.11, 0.84  # fractions of the width: the plotting area (LEFT the least; see left_margin)
MAX_LEFT = 0.4  # the widest left margin; a longer row label is shortened in its middle to fit
ROW_FONT, LABEL_FONT = 7.0, 10.0  # points: the row labels, and the axis label beside them
LOG_RANGE = 100.0  # a log axis (or log colours) only for values spanning at least this factor
MARKERS_UP_TO = 200  # points per line drawn with markers; a longer run is a plain line
MAX_COLUMNS = 600  # heat-map cells per row: about one per pixel column of the plotting area
MISSING_COLOUR, FAULT_COLOUR, OVERFLOW_COLOUR = "lightgrey", "crimson", "darkorange"


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


def _save(figure: Any, path: Path) -> bool:
    if figure is None:
        return False
    try:
        figure.savefig(path)
    finally:
        _pyplot().close(figure)
    return True


def plot_loss_and_grad_norm(report: Report, path: Path) -> bool:
    return _save(loss_figure(report), path)


def plot_activation_heatmap(report: Report, path: Path) -> bool:
    return _save(heatmap_figure(report), path)


def use_log(values: Sequence[Any]) -> bool:
    """Whether values go on a log axis: every finite one positive, and the largest at least LOG_RANGE times
    the smallest. Non-finite and missing values are marked apart and do not count."""
    finite = [x for x in (_finite(v) for v in values) if x is not None]
    return bool(finite) and min(finite) > 0 and max(finite) >= LOG_RANGE * min(finite)


def _finite(value: Any) -> float | None:
    """A value a linear axis can show: finite ('nan'/'inf' strings from a re-read JSON are not)."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def row_names(report: Report) -> list[str]:
    """Every row label of the heat map's panels, as the report holds them."""
    return [name for panel in _heatmap_panels(report) for name in panel.names]


def left_margin(names: Sequence[str]) -> tuple[float, list[str]]:
    """The left margin (a fraction of WIDTH) that fits the longest row label and the axis label beside it,
    measured with Agg's renderer at the figures' DPI, at least LEFT and at most MAX_LEFT; and the labels
    as drawn (one too long for MAX_LEFT is shortened in its middle, keeping both ends)."""
    from matplotlib.backends.backend_agg import RendererAgg
    from matplotlib.font_manager import FontProperties

    renderer = RendererAgg(int(WIDTH * DPI), 100, DPI)
    row, label = FontProperties(size=ROW_FONT), FontProperties(size=LABEL_FONT)
    pt = DPI / 72.0
    # the tick (3.5 pt) and its pad (3.5 pt), the axis label's height and its pad (4 pt), 6 pt to the edge
    fixed = (7.0 + 4.0 + 6.0) * pt + renderer.get_text_width_height_descent("Ag", label, ismath=False)[1]
    room = MAX_LEFT * WIDTH * DPI - fixed
    shown = [_fit(str(n), room, renderer, row) for n in names]
    widest = max((renderer.get_text_width_height_descent(n, row, ismath=False)[0] for n in shown), default=0.0)
    return min(MAX_LEFT, max(LEFT, (widest + fixed) / (WIDTH * DPI))), shown


def _fit(name: str, room: float, renderer: Any, font: Any) -> str:
    """`name`, or its two ends around an ellipsis, as long as fits in `room` pixels."""
    if renderer.get_text_width_height_descent(name, font, ismath=False)[0] <= room:
        return name
    keep = len(name) - 1
    while keep > 2:
        head = (keep + 1) // 2
        text = name[:head] + "…" + name[len(name) - (keep - head):]
        if renderer.get_text_width_height_descent(text, font, ismath=False)[0] <= room:
            return text
        keep -= 1
    return name[:1] + "…"


def _finite_positive(value: Any) -> float | None:
    """A value a log axis can show: finite and > 0 ('nan'/'inf' strings from a re-read JSON are missing)."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) and x > 0 else None


def _is_nonfinite(value: Any) -> bool:
    try:
        return not math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _fault_step(report: Report) -> int | None:
    ff = report.first_fault
    return ff.step if ff is not None and ff.step is not None else None


def step_range(report: Report) -> tuple[float, float] | None:
    """The x range both figures share: every step of the timeline and of the per-step maps, half a step
    beyond each end."""
    steps = [p.step for p in report.timeline]
    for key in ("activation_max", "grad_norms"):
        block = report.details.get(key)
        found = block.get("steps") if isinstance(block, dict) else None
        if isinstance(found, Sequence) and not isinstance(found, str):
            steps += [s for s in found if isinstance(s, (int, float)) and not isinstance(s, bool)
                      and math.isfinite(s)]
    return (min(steps) - 0.5, max(steps) + 0.5) if steps else None


def _top_marks(ax: Any, steps: list[int], colour: str, marker: str, label: str) -> None:
    """Steps whose value cannot sit on a log axis, marked along the top of the plotting area."""
    if steps:
        ax.plot(steps, [1.0] * len(steps), linestyle="none", marker=marker, color=colour,
                transform=ax.get_xaxis_transform(), clip_on=False, label=label)


def loss_figure(report: Report) -> Any:
    """Loss (left axis) and global gradient norm (right axis) over the same steps, each on a log scale
    only when its values span LOG_RANGE (`use_log`); the fault step, the clipping threshold (on the norm's
    axis) and non-finite values marked. A norm float32 could not hold at a step whose gradients were
    finite is marked as that, not as a fault. The legend sits above the plotting area, off the data. None
    when there is nothing to draw."""
    points = report.timeline
    loss = [(p.step, _finite(p.loss)) for p in points]
    norm = [(p.step, _finite(p.grad_norm)) for p in points]
    if not any(v is not None for _, v in loss + norm):
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(WIDTH, 4.6), dpi=DPI)
    fig.subplots_adjust(left=left_margin(row_names(report))[0], right=RIGHT, top=0.72, bottom=0.12)
    ax_norm = ax.twinx()
    logs = [_line(axis, values, colour, label)
            for axis, values, colour, label in ((ax, loss, "tab:blue", "loss (left axis)"),
                                                (ax_norm, norm, "tab:orange", "global grad norm (right axis)"))]
    _mark_nonfinite_steps(report, ax, ax_norm)
    _mark_fault_and_clip(report, ax, ax_norm, logs[1])
    _label_loss_axes(report, ax, ax_norm, logs)
    handles, labels = ax.get_legend_handles_labels()
    more = ax_norm.get_legend_handles_labels()
    ax.legend(handles + more[0], labels + more[1], loc="lower left", bbox_to_anchor=(0.0, 1.02, 1.0, 0.2),
              mode="expand", ncol=2, fontsize=8, borderaxespad=0.0, frameon=False)
    fig.suptitle("Loss and global gradient norm per step", fontsize=11, y=0.985)
    return fig


def _line(axis: Any, values: list[tuple[int, float | None]], colour: str, label: str) -> bool:
    """The finite (step, value) pairs as one line (with markers while they stay readable), on a log axis
    when they span LOG_RANGE, else a linear one with plain numbers; returns whether the axis is log."""
    log = use_log([v for _, v in values])
    xs = [s for s, v in values if v is not None]
    ys = [v for _, v in values if v is not None]
    if xs:
        marker = "o" if len(xs) <= MARKERS_UP_TO else None
        axis.plot(xs, ys, marker=marker, markersize=3, linewidth=1.4, label=label, color=colour)
    if log:
        axis.set_yscale("log")
    else:
        axis.ticklabel_format(axis="y", style="plain", useOffset=False)
    return log


def _mark_nonfinite_steps(report: Report, ax: Any, ax_norm: Any) -> None:
    """Along the top: a NaN/Inf loss, a NaN/Inf norm, and a norm float32 could not hold (finite gradients,
    so not a fault) each in its own mark."""
    points = report.timeline
    _top_marks(ax, [p.step for p in points if _is_nonfinite(p.loss)], FAULT_COLOUR, "x", "loss NaN/Inf")
    over = [p.step for p in points if overflowed_norm(report, p.step, p.grad_norm, p.skipped)]
    bad = [p.step for p in points if _is_nonfinite(p.grad_norm) and p.step not in over]
    _top_marks(ax_norm, bad, FAULT_COLOUR, "+", "grad norm NaN/Inf")
    _top_marks(ax_norm, over, OVERFLOW_COLOUR, "^", f"grad norm {OVERFLOW_NOTE} (gradients finite)")


def _mark_fault_and_clip(report: Report, ax: Any, ax_norm: Any, norm_log: bool) -> None:
    """The first fault's step (a vertical line) and the clipping threshold (on the norm's axis), when known
    (a threshold a log axis cannot show, <= 0, is left out)."""
    fault = _fault_step(report)
    if fault is not None:
        ax.axvline(fault, color=FAULT_COLOUR, linestyle="--", linewidth=1.2, label=f"first fault (step {fault})")
    clip = (_finite_positive if norm_log else _finite)(report.details.get("clip"))
    if clip is not None:
        ax_norm.axhline(clip, color="grey", linestyle=":", linewidth=1.2, label=f"clipping threshold ({clip:g})")


def _label_loss_axes(report: Report, ax: Any, ax_norm: Any, logs: list[bool]) -> None:
    """The step range both figures share, the axis labels in their lines' colours (saying which axis is a
    log scale), and the grid."""
    limits = step_range(report)
    if limits is not None:
        ax.set_xlim(*limits)
    ax.set_xlabel("step")
    ax.set_ylabel("loss" + (" (log scale)" if logs[0] else ""), color="tab:blue")
    ax_norm.set_ylabel("global grad norm" + (" (log scale)" if logs[1] else ""), color="tab:orange")
    ax.grid(True, which="major", alpha=0.3)


def _matrix(block: Any, names_key: str) -> tuple[list[str], list[Any], list[list[float]]] | None:
    """(names, steps, rows) from {names_key: [...], "steps": [...], "values": [[...]]}; None if unusable."""
    if not isinstance(block, dict):
        return None
    names, steps, values = block.get(names_key), block.get("steps"), block.get("values")
    if not (isinstance(names, Sequence) and isinstance(steps, Sequence) and isinstance(values, Sequence)):
        return None
    if not names or not steps or len(values) != len(names):
        return None
    if not all(isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) for s in steps):
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


def _edges(steps: list[float]) -> list[float]:
    """Cell edges on the step axis: halfway between recorded steps (a step recorded every 8 covers 8)."""
    if len(steps) == 1:
        return [steps[0] - 0.5, steps[0] + 0.5]
    mids = [(a + b) / 2 for a, b in zip(steps, steps[1:])]
    return [steps[0] - 0.5] + mids + [steps[-1] + 0.5]


def _columns(data: Any, faulty: Any, over: Any, steps: list[Any]) -> tuple[Any, Any, Any, list[float], list[float]]:
    """At most MAX_COLUMNS columns (a plot 9 inches wide shows no more): longer runs are cut into runs of
    consecutive steps, each drawn as one cell holding its largest value; a run that holds a fault is a
    fault, one that holds an overflowed norm is that, and only a run with no value at all is grey.
    Returns (data, faulty, over, cell edges, cell centres)."""
    import numpy as np

    edges = _edges([float(s) for s in steps])
    n = data.shape[1]
    if n <= MAX_COLUMNS:
        return data, faulty, over, edges, [float(s) for s in steps]
    size = math.ceil(n / MAX_COLUMNS)
    starts = list(range(0, n, size))
    shown = np.full((data.shape[0], len(starts)), np.nan)
    bad = np.zeros(shown.shape, dtype=bool)
    high = np.zeros(shown.shape, dtype=bool)
    for k, a in enumerate(starts):
        block = data[:, a:a + size]
        finite = np.where(np.isfinite(block), block, -np.inf).max(axis=1)
        shown[:, k] = np.where(finite > -np.inf, finite, np.nan)
        bad[:, k] = faulty[:, a:a + size].any(axis=1)
        high[:, k] = over[:, a:a + size].any(axis=1) & ~bad[:, k]
    shown = np.where(bad | high, np.inf, shown)
    cut = [edges[a] for a in starts] + [edges[-1]]
    return shown, bad, high, cut, [(x + y) / 2 for x, y in zip(cut, cut[1:])]


class _Panel(NamedTuple):
    """One heat map of the figure: its title, what its rows are, its matrix (as `_matrix` reads it), and
    whether it holds activations (float16's limit marked) or gradient norms (overflowed norms marked)."""

    title: str
    what: str
    names: list[str]
    steps: list[Any]
    rows: list[list[float]]
    is_activation: bool


def heatmap_figure(report: Report) -> Any:
    """Per-layer max |activation| per step (log colours from the data's own range, float16's 65504 marked
    when it falls inside it), and per-parameter gradient norms if present, on the real step axis. Red:
    NaN/Inf; grey: not recorded at that step; both named in a legend. None without data."""
    panels = _heatmap_panels(report)
    if not panels:
        return None
    plt = _pyplot()
    left, shown = left_margin([n for p in panels for n in p.names])
    fig, axes = _panel_grid(plt, panels, left)
    legend: dict[str, Any] = {}
    fault = _fault_step(report)
    limits = step_range(report)
    for ax, panel in zip(axes[:, 0], panels):
        handles = _draw_panel(report, plt, fig, ax, panel)
        if _uncovered(panel, limits):  # steps of the run outside the panel's records: grey, not blank
            ax.set_facecolor(MISSING_COLOUR)
            handles.append(_missing_handle())
        names, shown = shown[:len(panel.names)], shown[len(panel.names):]
        _frame_panel(ax, names, limits, fault)
        if ax is axes[-1, 0]:  # the panels share the step axis: one label, under the last
            ax.set_xlabel("step")
        ax.set_ylabel(panel.what, fontsize=LABEL_FONT)
        ax.set_title(panel.title, fontsize=10, loc="left")
        for handle in handles:
            legend.setdefault(handle.get_label(), handle)
    if legend:  # one key for every panel, under the figure's last axis: off the cells and the titles
        fig.legend(handles=list(legend.values()), loc="lower center", ncol=min(len(legend), 3), fontsize=7,
                   frameon=False, bbox_to_anchor=(0.5 * (left + RIGHT), 0.0))
    return fig


def _uncovered(panel: _Panel, limits: tuple[float, float] | None) -> bool:
    """Whether the run's steps reach beyond the panel's first or last recorded step (the loss was read on
    steps whose activations were not)."""
    if limits is None:
        return False
    return float(min(panel.steps)) - 0.5 > limits[0] + 1e-9 or float(max(panel.steps)) + 0.5 < limits[1] - 1e-9


def _missing_handle() -> Any:
    from matplotlib.patches import Patch

    return Patch(facecolor=MISSING_COLOUR, label="not recorded at this step")


def _heatmap_panels(report: Report) -> list[_Panel]:
    """The activation panel, then the gradient-norm panel, each when the report holds a usable matrix."""
    panels = []
    act = _matrix(report.details.get("activation_max"), "layers")
    if act is not None:
        panels.append(_Panel("Per-layer max |activation| per step", "layer", *act, True))
    grads = _matrix(report.details.get("grad_norms"), "parameters")
    if grads is not None:
        panels.append(_Panel("Per-parameter gradient norm per step", "parameter", *grads, False))
    return panels


def _panel_grid(plt: Any, panels: list[_Panel], left: float) -> tuple[Any, Any]:
    """The figure and its column of axes, one per panel, each as tall as its rows need, sharing the step
    axis, with the plotting area at the same left and right edges as the loss figure's."""
    heights = [max(2.4, 0.28 * len(p.names) + 1.6) for p in panels]
    heights[-1] += 0.4  # room for the key under the last panel
    fig, axes = plt.subplots(len(panels), 1, figsize=(WIDTH, sum(heights)), dpi=DPI, squeeze=False,
                             sharex=True, gridspec_kw={"height_ratios": heights})
    fig.subplots_adjust(left=left, right=RIGHT, top=1 - 0.45 / sum(heights), bottom=0.9 / sum(heights),
                        hspace=0.45)
    return fig, axes


def _draw_panel(report: Report, plt: Any, fig: Any, ax: Any, panel: _Panel) -> list[Any]:
    """One panel's cells on log colours from its own range, faults and overflowed norms drawn over them,
    and its colour bar; the legend handles for what it marks."""
    data, faulty, over = _fault_cells(report, panel)
    data, faulty, over, edges, steps = _columns(data, faulty, over, panel.steps)
    lo, hi = _colour_range(data)
    log = hi >= LOG_RANGE * lo
    mesh = _paint_cells(plt, ax, data, faulty, over, edges, len(panel.names), lo, hi, log)
    handles = _mark_cells(plt, ax, data, faulty, over, edges, steps, len(panel.names))
    cax = fig.add_axes([RIGHT + 0.02, ax.get_position().y0, 0.015, ax.get_position().height])
    bar = fig.colorbar(mesh, cax=cax)
    label = ("max |value|" if panel.is_activation else "norm") + (" (log)" if log else "")
    if panel.is_activation:
        note, fp16_handles = _fp16_marks(ax, bar, data, steps, lo, hi)
        label += note
        handles += fp16_handles
    bar.set_label(label, fontsize=8)
    return handles


def _fault_cells(report: Report, panel: _Panel) -> tuple[Any, Any, Any]:
    """(values, faulty, overflowed) as arrays: an infinite per-parameter norm that float32 could not hold,
    before any fault, is overflowed and not a fault; every other NaN/Inf cell is a fault."""
    import numpy as np

    data = np.array(panel.rows, dtype=float)
    over = np.zeros(data.shape, dtype=bool)
    if not panel.is_activation:
        for i, j in zip(*np.nonzero(np.isinf(data))):
            over[i, j] = overflowed_norm(report, int(panel.steps[j]), data[i, j])
    faulty = np.isinf(data) & ~over
    return data, faulty, over


def _colour_range(data: Any) -> tuple[float, float]:
    """The colour scale: the smallest and largest finite positive value, widened tenfold each way when
    they are equal; 1e-3 to 1 when there is none."""
    import numpy as np

    finite = data[np.isfinite(data) & (data > 0)]
    lo = float(finite.min()) if finite.size else 1e-3
    hi = float(finite.max()) if finite.size else 1.0
    if hi <= lo:
        lo, hi = lo / 10, hi * 10
    return lo, hi


def _paint_cells(plt: Any, ax: Any, data: Any, faulty: Any, over: Any, edges: list[float], rows: int,
                 lo: float, hi: float, log: bool) -> Any:
    """The cells on log colours (linear ones when the values span less than LOG_RANGE): a fault or
    overflowed norm at the top of the scale, zero or below at its bottom, a missing value grey. Returns
    the mesh, for the colour bar."""
    import numpy as np
    from matplotlib.colors import LogNorm, Normalize

    shown = np.where(faulty | over, hi, np.where(data <= 0, lo, data))
    cmap = plt.get_cmap("viridis").with_extremes(bad=MISSING_COLOUR)
    return ax.pcolormesh(edges, np.arange(rows + 1) - 0.5, np.ma.masked_invalid(shown),
                         cmap=cmap, norm=(LogNorm if log else Normalize)(vmin=lo, vmax=hi), shading="flat")


def _mark_cells(plt: Any, ax: Any, data: Any, faulty: Any, over: Any, edges: list[float], steps: list[float],
                rows: int) -> list[Any]:
    """NaN/Inf cells painted in the fault's colour, overflowed norms marked, and the legend handles for
    those and for cells not recorded."""
    import numpy as np
    from matplotlib.patches import Patch

    handles = []
    if faulty.any():  # NaN/Inf cells painted over the scale, in the fault's colour
        mesh_bad = np.ma.masked_where(~faulty, np.ones(data.shape))
        ax.pcolormesh(edges, np.arange(rows + 1) - 0.5, mesh_bad,
                      cmap=plt.get_cmap("Reds").with_extremes(bad=(0, 0, 0, 0)), vmin=0, vmax=1)
        handles.append(Patch(facecolor="darkred", label="NaN/Inf"))
    if over.any():
        ys, xs = np.nonzero(over)
        ax.scatter([steps[i] for i in xs], ys, marker="^", s=30, color=OVERFLOW_COLOUR)
        handles.append(Patch(facecolor=OVERFLOW_COLOUR, label=f"norm {OVERFLOW_NOTE} (gradients finite)"))
    if np.isnan(data).any():
        handles.append(_missing_handle())
    return handles


def _fp16_marks(ax: Any, bar: Any, data: Any, steps: list[float], lo: float, hi: float) -> tuple[str, list[Any]]:
    """Float16's limit on an activation panel: a red line on the colour bar when 65504 is inside its range,
    and an outline on each finite cell above it (float16 would overflow there). Returns the colour bar
    label's addition and the legend handles."""
    import numpy as np
    from matplotlib.patches import Patch

    note = ""
    fp16 = np.isfinite(data) & (data > FP16_MAX)
    if lo <= FP16_MAX <= hi:
        bar.ax.axhline(FP16_MAX, color="red", linewidth=2)
        note = "\nred line: fp16 max 65504"
    elif hi < FP16_MAX:
        note = "\nall below fp16's 65504"
    if not fp16.any():
        return note, []
    ys, xs = np.nonzero(fp16)  # finite, but float16 would overflow here: outline those cells
    ax.scatter([steps[i] for i in xs], ys, marker="s", s=30, facecolors="none", edgecolors="red", linewidths=0.8)
    return note, [Patch(facecolor="none", edgecolor="red", label="above 65504 (float16 overflows)")]


def _frame_panel(ax: Any, names: list[str], limits: tuple[float, float] | None, fault: int | None) -> None:
    """A panel's rows named top to bottom, the shared step range, and the first fault's step as a line."""
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=ROW_FONT)
    ax.set_ylim(len(names) - 0.5, -0.5)
    if limits is not None:
        ax.set_xlim(*limits)
    if fault is not None:
        ax.axvline(fault, color="red", linestyle="--", linewidth=1.0)
