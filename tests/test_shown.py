"""What a report shows at 80 columns, in Markdown and in plots (issue 21, "What is shown").

Reports come from a real probe run on a sample config (lr_divergence: a verified learning-rate, clipping
and warmup remedy each) and from the fixtures in report_samples.py; plots are checked on matplotlib's
objects, never on pixels.
"""

from __future__ import annotations

import json
import linecache
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from in_process import run_cli
from inloop_helpers import ROOT
from report_samples import probe_nan_report, scan_report
from rich.console import Console
from typer.testing import CliRunner

from nandoctor.findings import Mode, Report
from nandoctor.report import console as console_report
from nandoctor.report import markdown as markdown_report
from nandoctor.report import plots
from nandoctor.report.common import as_float

plt = plots._pyplot()

LIMIT = 240


def test_paddles_ccache_warning_never_reaches_the_terminal(tmp_path: Path) -> None:
    """`nandoctor run` watches a script that imports Paddle: its "No ccache found" notice is filtered (that
    message only), as the CLI's own import of Paddle is."""
    script = tmp_path / "imports.py"
    script.write_text("import warnings\nimport paddle\nwarnings.warn('the script warns too')\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "80"}
    proc = subprocess.run([sys.executable, "-m", "nandoctor", "run", "--", sys.executable, str(script)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=LIMIT, env=env)
    assert "the script warns too" in proc.stderr  # the script's own warnings still show
    assert "No ccache found" not in proc.stderr + proc.stdout


# --- a real report: lr_divergence probed by the CLI ------------------------------------------------------

SAMPLES = ROOT / "sample_configs"


@pytest.fixture(scope="module")
def lr_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Report, str, str]:
    """The probe's own report of lr_divergence (SGD at 0.03 on unstandardised features), read back, with
    what the command printed at 80 columns and the Markdown it wrote."""
    folder = tmp_path_factory.mktemp("lr")
    # in this process (the command's output and files are what count, not a process), from its own folder
    ran = run_cli(["probe", str(SAMPLES / "lr_divergence" / "config.yaml"), "--json", "report.json", "--markdown",
                   "report.md"], folder, {"COLUMNS": "80"}, (SAMPLES,))
    assert ran.returncode == 1, ran.stderr
    report = Report.from_dict(json.loads((folder / "report.json").read_text()))
    assert [r["outcome"] for r in report.remedies[:3]] == ["fixed"] * 3  # lr_x0.1, grad_clip, warmup
    return report, ran.stdout, (folder / "report.md").read_text()


@pytest.fixture(scope="module")
def lr_divergence(lr_run: tuple[Report, str, str]) -> Report:
    return lr_run[0]


def _console(report: Report, width: int = 80) -> str:
    console = Console(width=width, record=True, color_system=None, force_terminal=False)
    console_report.render(report, console)
    return console.export_text()


def test_replay_internals_stay_out_of_the_console(lr_divergence: Report) -> None:
    """The snapshot ring, the replays' budget and timings are nandoctor's figures: JSON only."""
    text = _console(lr_divergence)
    assert "snapshots kept" not in text and " MB" not in text and "budget" not in text
    assert "the fault reproduced in a replay without any change" in " ".join(text.split())  # this stays
    assert lr_divergence.details["snapshots"]["kept_steps"]  # and the JSON still holds the figures


def test_remedies_are_a_list_with_each_change_whole_and_printed_once(lr_divergence: Report) -> None:
    """At 80 columns a table broke `optimizer.lr_s│cheduler` mid-identifier; each change's identifiers now
    stand whole on a line, and each change is printed once (the findings name the verified remedies)."""
    text = _console(lr_divergence)
    lines = text.splitlines()
    for row in lr_divergence.remedies:
        if row["outcome"] != "fixed":
            continue
        code = row["change"].rsplit(" (", 1)[0]
        for token in re.findall(r"[A-Za-z_][\w.]*", code):
            assert any(re.search(rf"(?<![\w.]){re.escape(token)}(?![\w.])", line) for line in lines), token
        assert " ".join(text.split()).count(" ".join(row["change"].split())) == 1, row["change"]
    assert "│" not in text.split("remedies", 1)[1].split("1. ERROR")[0]  # no table rules between the lines
    assert "Verified by replay: lr_x0.1, grad_clip, warmup" in " ".join(text.split())


def test_a_change_that_did_not_help_is_printed_once_too(tmp_path: Path) -> None:
    """sqrt_at_zero: clipping, the lower rate and the warmup do not help; the findings named each of them
    again with its whole change under the remedies that already showed it."""
    from nandoctor.cli import app

    out = tmp_path / "r.json"
    CliRunner().invoke(app, ["probe", str(SAMPLES / "sqrt_at_zero" / "config.yaml"), "--json", str(out), "-q"])
    report = Report.from_dict(json.loads(out.read_text(encoding="utf-8")))
    text = " ".join(_console(report).split())
    helped_not = [r for r in report.remedies if r["outcome"] == "not_fixed"]
    assert helped_not
    for row in helped_not:
        assert text.count(" ".join(row["change"].split())) == 1, row["change"]
    assert "Tried by replay, did not help: " + ", ".join(r["remedy"] for r in helped_not) in text


def test_first_fault_shows_the_text_of_the_source_line(lr_run: tuple[Report, str, str]) -> None:
    report, stdout, _ = lr_run
    path, line = report.details["source"].split(" in ")[0].split(":")
    expected = linecache.getline(str(SAMPLES / "lr_divergence" / path), int(line)).strip()
    assert expected.startswith("return self.out(")
    panel = stdout.split("first fault", 1)[1].split("╰")[0]
    assert expected in panel


def test_field_names_and_dtypes_are_never_cut() -> None:
    """A scan report's fields at 80 columns: every name and dtype whole (a table cut 'attention…')."""
    report = scan_report()
    stats = dict(next(iter(report.details["fields"].values())))
    report.details["fields"]["attention_mask_of_the_decoder"] = dict(stats, dtype="bfloat16")
    report.details["fields"]["position_ids"] = dict(stats, dtype="int64", shape=[[8, 512], [8, 384], [4, 128]])
    for width in (80, 100):
        text = _console(report, width)
        assert "…" not in text.split("data fields", 1)[1]
        for name, field in report.details["fields"].items():
            assert re.search(rf"\b{re.escape(name)}\b", text) and field["dtype"] in text


@pytest.mark.parametrize("mode", [Mode.WATCH, Mode.HAPI, Mode.TRAINER])
def test_in_loop_reports_name_no_exit_status_and_no_flag(mode: Mode) -> None:
    """A watch or callback run ends as the user's own process does: no 'exit status 1', no --markdown."""
    report = probe_nan_report()
    report.run["mode"] = mode.value
    text = " ".join(_console(report).split()).lower()
    assert "exit status" not in text and "--markdown" not in text
    assert "exit status" not in markdown_report.render(report).lower()


def test_no_markdown_footer_when_markdown_was_written(lr_run: tuple[Report, str, str]) -> None:
    _, stdout, _ = lr_run
    assert "--markdown" not in stdout and "Exit status 1" in " ".join(stdout.split())


# --- Markdown ----------------------------------------------------------------------------------------------

def _md_rows(markdown: str, section: str) -> list[list[str]]:
    body = markdown.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in body.splitlines() if line.startswith("|")]


def test_markdown_change_column_is_code(lr_run: tuple[Report, str, str]) -> None:
    report, _, markdown = lr_run
    rows = {row[1]: row for row in _md_rows(markdown, "Remedies")}
    for remedy in report.remedies:
        if remedy["outcome"] == "fixed":
            code = remedy["change"].split("  # ")[0].rsplit(" (", 1)[0].splitlines()[0]
            assert f"`{code}`" in rows[f"`{remedy['remedy']}`"][2], rows[f"`{remedy['remedy']}`"]


def test_markdown_timeline_shows_the_learning_rate(lr_run: tuple[Report, str, str]) -> None:
    report, _, markdown = lr_run
    rows = _md_rows(markdown, "Timeline")
    header = rows[0]
    assert "learning rate" in header
    column = header.index("learning rate")
    lrs = {p.step: p.lr for p in report.timeline}
    assert all(lr is not None for lr in lrs.values())
    for row in rows[2:]:
        step = int(row[0].split("**")[1] if row[0].startswith("**") else row[0])
        assert float(row[column]) == pytest.approx(lrs[step], rel=1e-3)


# --- a finite norm float32 could not hold is not a fault ------------------------------------------------

def _overflowed_report() -> Report:
    """probe_nan_report with the step-30 norm written as Inf by a float32 sum of squares: the watcher ran
    on to step 36 (where the gradients went non-finite), so step 30's gradients were finite."""
    report = probe_nan_report()
    report.timeline[30].grad_norm = float("inf")
    report.details["grad_norms"] = {"parameters": ["w", "b"], "steps": [29, 30, 31],
                                    "values": [[1.0, float("inf"), 3.0], [0.5, 0.7, 0.9]]}
    return report


def test_an_overflowed_norm_is_not_drawn_as_a_fault(drawn: Any) -> None:
    report = _overflowed_report()
    text = _console(report, 120)  # one sparkline cell per step
    norm_line = next(line for line in text.splitlines() if line.startswith("grad norm"))
    assert norm_line.count("✗") == 4 and norm_line.index("▲") == norm_line.index("▁") + 30  # 36-39; 30 apart
    assert "1 overflowed in float32" in " ".join(text.split()) and ", 4 non-finite" in " ".join(text.split())
    row30 = next(r for r in _md_rows(markdown_report.render(report), "Timeline") if r[0] == "30")
    assert row30[2] == "overflowed in float32"
    fig = drawn.loss(report)
    lines = {line.get_label(): list(line.get_xdata()) for ax in fig.axes for line in ax.lines}
    assert 30 not in lines.get("grad norm NaN/Inf", [])
    assert lines["grad norm overflowed in float32 (gradients finite)"] == [30]
    fig = drawn.heat(report)
    texts = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert "NaN/Inf" not in texts and "norm overflowed in float32 (gradients finite)" in texts


# --- plots ----------------------------------------------------------------------------------------------

class _Drawn:
    """The figure a plot function drew, taken before it is closed (the public writers, so the same test
    reads the figures of any version of plots.py)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        self.monkeypatch, self.tmp_path, self.figures = monkeypatch, tmp_path, []
        monkeypatch.setattr(plt, "close", self.figures.append)

    def loss(self, report: Report) -> Any:
        assert plots.plot_loss_and_grad_norm(report, self.tmp_path / "loss.png")
        return self.figures[-1]

    def heat(self, report: Report) -> Any:
        assert plots.plot_activation_heatmap(report, self.tmp_path / "heat.png")
        return self.figures[-1]


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    found = _Drawn(monkeypatch, tmp_path)
    yield found
    monkeypatch.undo()
    for figure in found.figures:
        plt.close(figure)


def test_loss_and_grad_norm_have_their_own_y_axes_on_one_step_axis(lr_divergence: Report, drawn: Any) -> None:
    fig = drawn.loss(lr_divergence)
    owners = {line.get_label(): ax for ax in fig.axes for line in ax.lines}
    loss_ax, norm_ax = owners["loss (left axis)"], owners["global grad norm (right axis)"]
    assert loss_ax is not norm_ax and loss_ax.get_shared_x_axes().joined(loss_ax, norm_ax)
    assert loss_ax.get_yscale() == norm_ax.get_yscale() == "log"
    norms = [n for n in (as_float(p.grad_norm) for p in lr_divergence.timeline) if math.isfinite(n)]
    low, high = norm_ax.get_ylim()
    assert low <= min(norms) and max(norms) <= high  # the norm's own range, not the loss's


def test_heatmap_sits_on_the_real_step_axis_under_the_loss_plot(lr_divergence: Report, drawn: Any) -> None:
    """The probe records activations on some steps only (step 1 is missing here): each cell sits at its
    own step, the fault line at the fault's step, and x range and plotting area match the loss plot's."""
    steps = lr_divergence.details["activation_max"]["steps"]
    assert steps != list(range(len(steps)))  # not every step: positions and steps differ
    loss_fig, heat_fig = drawn.loss(lr_divergence), drawn.heat(lr_divergence)
    loss_ax = loss_fig.axes[0]
    panels = [ax for ax in heat_fig.axes if ax.get_ylabel() in ("layer", "parameter")]
    assert panels
    for ax in panels:
        assert ax.get_xlim() == pytest.approx(loss_ax.get_xlim())
        a, b = ax.get_position(), loss_ax.get_position()
        assert (a.x0, a.x1) == pytest.approx((b.x0, b.x1), abs=1e-6)
        assert any(list(line.get_xdata()) == [16, 16] for line in ax.lines)  # the fault at step 16
    edges = panels[0].collections[0].get_coordinates()[0, :, 0]
    for j, step in enumerate(steps):
        assert edges[j] < step < edges[j + 1]


def _small_activations(missing: bool = False) -> Report:
    report = probe_nan_report()
    values = [[1.0 + 0.1 * s for s in range(10)], [3.0 + 0.5 * s for s in range(10)]]
    if missing:
        values[0][4] = None
    report.details["activation_max"] = {"layers": ["a", "b"], "steps": list(range(10)), "values": values}
    return report


def test_colour_scale_is_the_datas_not_float16s(drawn: Any) -> None:
    """Activations of 1-8: the colours span 1-8 (float16's 65504 on the scale squeezed them into one hue)."""
    ax = drawn.heat(_small_activations()).axes[0]
    norm = (ax.images or ax.collections)[0].norm
    assert norm.vmin == pytest.approx(1.0) and norm.vmax == pytest.approx(7.5)


@pytest.mark.parametrize("build", ["loss", "heat"])
def test_legends_sit_off_the_data(lr_divergence: Report, build: str, drawn: Any) -> None:
    report = _small_activations(missing=True) if build == "heat" else lr_divergence
    fig = drawn.loss(report) if build == "loss" else drawn.heat(report)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = list(fig.legends) + [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert legends
    data_axes = [ax for ax in fig.axes if ax.get_ylabel() in ("layer", "parameter") or ax.lines]
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in data_axes:
            assert not box.overlaps(ax.get_window_extent(renderer)), (build, ax.get_ylabel())


def test_grey_cells_are_explained(drawn: Any) -> None:
    fig = drawn.heat(_small_activations(missing=True))
    texts = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert "not recorded at this step" in texts


def test_a_long_run_keeps_its_fault_in_a_heat_map_of_bounded_width(drawn: Any) -> None:
    """20,000 recorded steps: at most MAX_COLUMNS cells a row (more than the image has pixels), and the
    one NaN/Inf cell still shows."""
    report = probe_nan_report()
    steps = list(range(20_000))
    values = [[1.0 + (s % 7) for s in steps] for _ in range(3)]
    values[1][12_345] = float("nan")
    report.details["activation_max"] = {"layers": ["a", "b", "c"], "steps": steps, "values": values}
    fig = drawn.heat(report)
    mesh = fig.axes[0].collections[0]
    assert mesh.get_coordinates().shape[1] - 1 <= plots.MAX_COLUMNS
    assert "NaN/Inf" in [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert fig.axes[0].get_xlim() == pytest.approx((-0.5, 19_999.5))


def test_timeline_strings_of_a_foreign_report_are_still_made_inert() -> None:
    """The timeline skips the renderer's cleaning round trip for speed; a string in it is still cleaned."""
    report = probe_nan_report()
    report.timeline[3].loss = "\x1b]0;owned\x07\x1b[2J"
    text = _console(report, 120) + markdown_report.render(report)
    assert "\x1b" not in text and "owned" not in text


def test_source_line_of_a_run_is_found_beside_the_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`nandoctor run -- python examples/unmodified_loop.py` names plain_loop.py:N (a module beside the
    script), whatever the working folder."""
    monkeypatch.chdir(tmp_path)
    examples = ROOT / "examples"
    number = next(i for i, line in enumerate((examples / "plain_loop.py").read_text().splitlines(), 1)
                  if "paddle.sqrt(" in line)
    report = probe_nan_report()
    report.run = {"mode": "run", "command_line": f"{sys.executable} {examples / 'unmodified_loop.py'}"}
    report.details["source"] = f"plain_loop.py:{number} in forward"
    expected = linecache.getline(str(examples / "plain_loop.py"), number).strip()
    assert expected.split("#")[0].strip() in " ".join(_console(report, 160).split())


# --- what the pictures say was measured (issue 34, item 13) ----------------------------------------------

def test_a_log_axis_only_for_values_spanning_100x() -> None:
    assert not plots.use_log([0.435, 0.674])  # a loss that moves 1.5x
    assert not plots.use_log([1.0, 99.0]) and plots.use_log([1.0, 100.0])
    assert plots.use_log([1e-3, 5.0, "NaN", None, "Infinity", math.inf])  # non-finite marked apart, not counted
    assert not plots.use_log([-1.0, 1000.0]) and not plots.use_log([]) and not plots.use_log([None])


def _with_losses(losses: list[float], norms: list[float]) -> Report:
    from nandoctor.findings import TimelinePoint

    report = probe_nan_report()
    report.timeline = [TimelinePoint(step=s, loss=a, grad_norm=b) for s, (a, b) in enumerate(zip(losses, norms))]
    return report


def test_a_loss_that_moves_little_is_on_a_linear_axis_of_plain_numbers(drawn: Any) -> None:
    """Each axis by its own range (computed here in float64): a loss from 0.44 to 0.67 on a linear axis with
    plain tick labels; a norm from 1e-2 to 50 on a log axis that says so."""
    losses = [0.44 + 0.23 * abs(math.sin(s)) for s in range(12)]
    norms = [10.0 ** (s / 3.0 - 2) for s in range(12)]  # 0.01 to 46
    assert max(losses) / min(losses) < 100 <= max(norms) / min(norms)
    fig = drawn.loss(_with_losses(losses, norms))
    owners = {line.get_label(): ax for ax in fig.axes for line in ax.lines}
    loss_ax, norm_ax = owners["loss (left axis)"], owners["global grad norm (right axis)"]
    assert loss_ax.get_yscale() == "linear" and loss_ax.get_ylabel() == "loss"
    assert norm_ax.get_yscale() == "log" and norm_ax.get_ylabel() == "global grad norm (log scale)"
    fig.canvas.draw()
    ticks = [t.get_text() for t in loss_ax.get_yticklabels() if t.get_text()]
    assert ticks and all(re.fullmatch(r"[0-9.−-]+", t) for t in ticks), ticks  # no 10^x, no offset


def _grad_cells() -> Report:
    """Per-parameter norms at the first fault's step with a NaN (as the monitor records a NaN gradient:
    inf, or "NaN" in a re-read JSON) and an inf, and cells not recorded (null) before it."""
    report = probe_nan_report()
    fault = report.first_fault.step
    values = [[0.5, 0.6, None, 0.7, math.inf], [0.1, 0.2, 0.3, None, "NaN"]]
    report.details["grad_norms"] = {"parameters": ["w", "b"], "steps": list(range(fault - 4, fault + 1)),
                                    "values": values}
    report.details.pop("activation_max", None)
    return report


def test_non_finite_cells_have_their_own_colour_apart_from_not_recorded(drawn: Any) -> None:
    from matplotlib.colors import to_rgba

    fig = drawn.heat(_grad_cells())
    keys = {t.get_text(): h for legend in fig.legends for t, h in zip(legend.get_texts(), legend.legend_handles)}
    assert {"NaN/Inf", "not recorded at this step"} <= set(keys)
    assert to_rgba(keys["NaN/Inf"].get_facecolor()) != to_rgba(keys["not recorded at this step"].get_facecolor())
    ax = fig.axes[0]
    base, faults = ax.collections[0], ax.collections[1]  # the values, then the NaN/Inf cells painted over them
    not_recorded = np.ma.getmaskarray(base.get_array()).reshape(2, 5)
    painted = ~np.ma.getmaskarray(faults.get_array()).reshape(2, 5)
    assert painted.tolist() == [[False] * 4 + [True], [False] * 4 + [True]]  # the fault's step: inf and NaN
    assert not_recorded.tolist() == [[False, False, True, False, False], [False, False, False, True, False]]
    assert to_rgba(base.get_cmap().get_bad()) == to_rgba(plots.MISSING_COLOUR)


def test_a_nan_gradient_is_recorded_as_non_finite_not_as_missing() -> None:
    """The monitor's per-parameter norms: a NaN gradient is inf (drawn as NaN/Inf), a parameter with no
    gradient this step is NaN (null in the report: not recorded). Truth: the gradients themselves."""
    import paddle

    from nandoctor.engine.monitors import StepMonitor

    paddle.seed(0)
    model = paddle.nn.Sequential(paddle.nn.Linear(4, 3), paddle.nn.Linear(3, 1))
    unused = paddle.nn.Linear(2, 2)
    holder = paddle.nn.LayerList([model, unused])
    x = paddle.to_tensor(np.array([[1.0, np.nan, 0.0, 2.0]], dtype=np.float32))
    model(x).sum().backward()
    truth = [None if p.grad is None else bool(np.isfinite(p.grad.numpy()).all()) for p in holder.parameters()]
    assert truth.count(None) == 2 and False in truth
    stats = StepMonitor(holder).read(paddle.to_tensor(1.0))
    got = stats.grad_sq
    for value, finite in zip(got.tolist(), truth):
        if finite is None:
            assert math.isnan(value)
        elif finite:
            assert math.isfinite(value)
        else:
            assert value == math.inf


def _long_names() -> Report:
    report = probe_nan_report()
    names = ["encoder.layers.11.self_attention.query_key_value.weight", "head.bias",
             "model.backbone.stages.3.blocks.27.mixer.in_proj.lora_B.default.weight.and.some.more.words.to.make"
             ".it.longer.than.any.margin"]
    report.details["grad_norms"] = {"parameters": names, "steps": [0, 1, 2],
                                    "values": [[0.1, 0.2, 0.3], [1.0, 2.0, 3.0], [5.0, 6.0, 7.0]]}
    report.details["activation_max"] = {"layers": ["embed", "blocks.0.attention.output.dense"], "steps": [0, 1, 2],
                                        "values": [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]}
    return report


@pytest.mark.parametrize("build", ["loss", "heat"])
def test_every_label_lies_inside_the_figure(build: str, drawn: Any) -> None:
    """Row labels of any length: the left margin is measured from the longest one (a label too long even
    for the widest margin is shortened in its middle, both ends kept); every text's box lies inside the
    figure, and both figures keep one left edge so their steps line up."""
    report = _long_names()
    fig = drawn.loss(report) if build == "loss" else drawn.heat(report)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    page = fig.bbox
    texts = [t for ax in fig.axes for t in (*ax.get_yticklabels(), *ax.get_xticklabels(), ax.yaxis.label,
                                            ax.xaxis.label, ax.title) if t.get_text() and t.get_visible()]
    texts += [t for legend in fig.legends for t in legend.get_texts()] + list(fig.texts)
    assert len(texts) > 10
    for text in texts:
        box = text.get_window_extent(renderer)
        assert page.x0 <= box.x0 and box.x1 <= page.x1 and page.y0 <= box.y0 and box.y1 <= page.y1, text.get_text()
    left, shown = plots.left_margin(plots.row_names(report))
    assert plots.LEFT < left <= plots.MAX_LEFT
    assert fig.axes[0].get_position().x0 == pytest.approx(left)
    if build == "heat":
        labels = [t.get_text() for ax in fig.axes for t in ax.get_yticklabels()]
        assert "encoder.layers.11.self_attention.query_key_value.weight" in labels  # fits whole
        [cut] = [t for t in labels if "…" in t]
        assert cut.startswith("model.backbone.") and cut.endswith(".margin") and cut in shown


def test_steps_beyond_a_panel_s_records_are_grey_and_keyed(drawn: Any) -> None:
    """The loss was read on 40 steps, the per-layer maps on steps 0-2 only: the rest of each panel is the
    not-recorded grey (named in the key), not a blank that reads as nothing."""
    from matplotlib.colors import to_rgba

    report = _long_names()
    assert len(report.timeline) > 3
    fig = drawn.heat(report)
    assert "not recorded at this step" in [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    panels = [ax for ax in fig.axes if ax.get_ylabel() in ("layer", "parameter")]
    assert panels and all(to_rgba(ax.get_facecolor()) == to_rgba(plots.MISSING_COLOUR) for ax in panels)
    report = _grad_cells()  # recorded on every step of the run: no grey around the cells
    report.timeline = [p for p in report.timeline if p.step in report.details["grad_norms"]["steps"]]
    fig = drawn.heat(report)
    assert to_rgba(fig.axes[0].get_facecolor()) != to_rgba(plots.MISSING_COLOUR)
