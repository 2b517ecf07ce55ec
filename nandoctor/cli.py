"""The command line: typer only. Options -> one core call -> render -> exit status.

Exit status (the contract): 0 when the report holds no error finding, 1 when it does, 2 for a bad
command line or a spec that cannot be loaded. Every NandoctorError becomes one message on stderr and
exit 2; no traceback for a mistake the user made.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Annotated, Any, NoReturn, Optional

import typer
from rich.console import Console

from nandoctor.errors import NandoctorError

# Paddle's import warns about a missing ccache (a build tool for C++ extensions) on every machine without
# one: noise under a diagnosis, and nothing the user needs to act on.
warnings.filterwarnings("ignore", message=".*ccache.*")

app = typer.Typer(
    help="Find where a PaddlePaddle training run first goes NaN or Inf, and what to change.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

ConfigArg = Annotated[Path, typer.Argument(help="The nandoctor YAML spec naming your model, data, loss and optimizer.",
                                           show_default=False)]
JsonOpt = Annotated[Optional[Path], typer.Option("--json", help="Also write the report as JSON to this file.")]
MarkdownOpt = Annotated[Optional[Path], typer.Option("--markdown", help="Also write the report as Markdown "
                                                     "(for bug tickets) to this file.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Print only the verdict line, no progress bar.")]
BundleOpt = Annotated[Optional[Path], typer.Option("--bundle", help="Write a self-contained folder for a bug ticket: "
                                                   "report.md, report.json, the offending batch, reproduce.py, plots.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace an existing --bundle folder.")]


def _console() -> Console:
    return Console(stderr=False, highlight=False)


def _fail(err: NandoctorError) -> typer.Exit:
    Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]nandoctor:[/] {err}", markup=True)
    return typer.Exit(err.exit_code)


def _run(command: str, config: Path, **options: Any) -> NoReturn:
    """One call into the core for scan and probe; its exit status, or 2 with one message for our errors."""
    from nandoctor.run import run_command

    try:
        code = run_command(command, config, _console(), **options)
    except NandoctorError as err:
        raise _fail(err) from None
    raise typer.Exit(code)


@app.command()
def scan(
    config: ConfigArg,
    batches: Annotated[Optional[int], typer.Option("--batches", min=1, help="Stop after this many batches "
                                                   "(default: the whole loader).")] = None,
    json_path: JsonOpt = None,
    markdown_path: MarkdownOpt = None,
    bundle: BundleOpt = None,
    force: ForceOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Check the data (NaN/Inf, ranges, outliers, labels, sequence lengths) and the parameters before training."""
    _run("scan", config, json_path=json_path, markdown_path=markdown_path, bundle=bundle, force=force, quiet=quiet,
         batches=batches)


@app.command()
def probe(
    config: ConfigArg,
    steps: Annotated[Optional[int], typer.Option("--steps", min=1, help="Training steps to run "
                                                 "(default: probe.steps in the spec, else 200).")] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", min=0, help="Random seed (default: probe.seed, else 0).")
                    ] = None,
    device: Annotated[Optional[str], typer.Option("--device", help="auto, cpu, gpu or gpu:N "
                                                  "(default: probe.device, else auto).")] = None,
    json_path: JsonOpt = None,
    markdown_path: MarkdownOpt = None,
    bundle: BundleOpt = None,
    force: ForceOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Run a short instrumented training run and name the first op, layer, parameter and sample to go NaN/Inf."""
    _run("probe", config, json_path=json_path, markdown_path=markdown_path, bundle=bundle, force=force, quiet=quiet,
         steps=steps, seed=seed, device=device)


@app.command()
def report(
    report_json: Annotated[Path, typer.Argument(help="A report.json written by `nandoctor scan/probe --json` or a "
                                                "bundle.", show_default=False)],
    markdown_path: MarkdownOpt = None,
) -> None:
    """Re-render a saved JSON report in the terminal (or as Markdown with --markdown)."""
    from nandoctor.run import rerender

    try:
        code = rerender(report_json, _console(), markdown_path=markdown_path)
    except NandoctorError as err:
        raise _fail(err) from None
    raise typer.Exit(code)


@app.command()
def env() -> None:
    """Print the environment a bug ticket needs: nandoctor, Paddle, Python, OS, device, CUDA and GPUs."""
    from nandoctor.env import collect
    from nandoctor.report.console import render_environment

    render_environment(collect(), _console())


if __name__ == "__main__":  # pragma: no cover
    app()
