"""The command line: typer only. Options -> one core call -> render -> exit status.

Exit status (the contract): 0 when the report holds no error finding, 1 when it does, 2 for a bad
command line or a spec that cannot be loaded, 3 for nandoctor's own bug, 130/143 when Ctrl-C/SIGTERM
stopped the run. Every NandoctorError becomes one message on stderr and exit 2, no traceback for a
mistake the user made, and so do two set-up problems that arrive as plain exceptions (entry.py's funnel):
Paddle not installed, and an OSError on a path the user gave. Any other exception is ours: one message
naming the issue tracker, the traceback in a file. `--json -` puts the JSON on standard output and the
report for people on standard error. The funnel and `nandoctor run` itself are in entry.py, which a plain
`run` command line reaches without typer (`python -m nandoctor`, the `nandoctor` script: __main__.py).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Annotated, Any, Callable, NoReturn, Optional

import typer
from rich.console import Console

from nandoctor import entry
from nandoctor.errors import NandoctorError, PaddleMissing, paddle_installed
from nandoctor.version import __version__


def _plain_params(params: list[Any]) -> list[Any]:
    """Flags take no value: no `<bool>` after them in the help (typer shows one by default); an argument
    is named by its metavar (CONFIG), so no `<path>` type beside it either."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
        elif isinstance(param, typer.core.TyperArgument):
            param.type = copy.copy(param.type)  # a copy: click shares one type object between parameters
            param.type.get_metavar = lambda *args, **kwargs: ""
    return params


class _Command(typer.core.TyperCommand):
    """A usage line as people write it (`nandoctor probe [OPTIONS] CONFIG`), and no `<bool>` on flags."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        return [piece.replace("{", "").replace("}", "") for piece in super().collect_usage_pieces(ctx)]

    def get_params(self, ctx: Any) -> list[Any]:
        return _plain_params(super().get_params(ctx))


class _Group(typer.core.TyperGroup):
    def get_params(self, ctx: Any) -> list[Any]:
        return _plain_params(super().get_params(ctx))


app = typer.Typer(
    help="Find where a PaddlePaddle training run first goes NaN or Inf, and what to change.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=_Group,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"nandoctor {__version__}")
        raise typer.Exit(0)


@app.callback()
def main(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print nandoctor's version and exit.")] = False,
) -> None:
    """Find where a PaddlePaddle training run first goes NaN or Inf, and what to change."""

ConfigArg = Annotated[Path, typer.Argument(help="The nandoctor YAML spec naming your model, data, loss and optimizer.",
                                           show_default=False, metavar="CONFIG")]
JsonOpt = Annotated[Optional[Path], typer.Option("--json", metavar="PATH", help="Also write the report as JSON to "
                                                 "this file; `--json -` writes it to standard output (and the "
                                                 "report for people to standard error).")]
MarkdownOpt = Annotated[Optional[Path], typer.Option("--markdown", metavar="PATH", help="Also write the report as "
                                                     "Markdown (for bug tickets) to this file.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="Print only the verdict line, no progress bar.")]
BundleOpt = Annotated[Optional[Path], typer.Option("--bundle", metavar="DIR", help="Write a self-contained folder for "
                                                   "a bug ticket: report.md, report.json, the offending batch, "
                                                   "reproduce.py, plots.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace an existing --bundle folder.")]
NoCodeOpt = Annotated[bool, typer.Option("--no-code", help="Leave your source files out of the --bundle folder "
                                         "(code/ and reproduce.py's imports of it).")]


def _console(*outputs: Path | None) -> Console:
    """Where the report for people goes: standard output, unless `--json -` (or `--markdown -`) took it."""
    return entry.console_for(*outputs)


def _fail(err: NandoctorError) -> typer.Exit:
    return typer.Exit(entry.fail(err))


def _internal(exc: BaseException, near: Path | None) -> typer.Exit:
    """nandoctor's own bug: one message asking to report it, the traceback in a file, exit 3."""
    return typer.Exit(entry.internal(exc, near))


def _exit_with(call: Callable[[], int], paths: dict[str, Path | None], near: Path | None) -> NoReturn:
    """The one error funnel of every command (entry.exit_status), as typer's exit."""
    raise typer.Exit(entry.exit_status(call, paths, near))


def _run(command: str, config: Path, **options: Any) -> NoReturn:
    """One call into the core for scan and probe."""
    from nandoctor.app import run_command

    json_path, markdown_path = options.get("json_path"), options.get("markdown_path")
    _exit_with(lambda: run_command(command, config, _console(json_path, markdown_path), **options),
               {"spec": config, "--json": json_path, "--markdown": markdown_path, "--bundle": options.get("bundle")},
               json_path or markdown_path)


@app.command(cls=_Command)
def scan(
    config: ConfigArg,
    batches: Annotated[Optional[int], typer.Option("--batches", min=1, metavar="N", help="Stop after this many batches "
                                                   "(default: the whole loader).")] = None,
    json_path: JsonOpt = None,
    markdown_path: MarkdownOpt = None,
    bundle: BundleOpt = None,
    force: ForceOpt = False,
    no_code: NoCodeOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Check the data (NaN/Inf, ranges, outliers, labels, sequence lengths) and the parameters before training."""
    _run("scan", config, json_path=json_path, markdown_path=markdown_path, bundle=bundle, force=force,
         no_code=no_code, quiet=quiet, batches=batches)


@app.command(cls=_Command)
def probe(
    config: ConfigArg,
    steps: Annotated[Optional[int], typer.Option("--steps", min=1, metavar="N", help="Training steps to run "
                                                 "(default: probe.steps in the spec, else 200).")] = None,
    seed: Annotated[Optional[int], typer.Option("--seed", min=0, metavar="SEED",
                                                help="Random seed (default: probe.seed, else 0).")] = None,
    device: Annotated[Optional[str], typer.Option("--device", metavar="DEVICE", help="auto, cpu, gpu or gpu:N "
                                                  "(default: probe.device, else auto).")] = None,
    no_try_fixes: Annotated[bool, typer.Option("--no-try-fixes", help="After a fault, do not replay the candidate "
                                               "remedies (on by default).")] = False,
    fix_steps: Annotated[int, typer.Option("--fix-steps", min=1, metavar="M", help="Replay each remedy to the "
                                           "fault step + M steps (bounded in time).")] = 20,
    json_path: JsonOpt = None,
    markdown_path: MarkdownOpt = None,
    bundle: BundleOpt = None,
    force: ForceOpt = False,
    no_code: NoCodeOpt = False,
    quiet: QuietOpt = False,
    nproc: Annotated[int, typer.Option("--nproc", min=1, metavar="N", help="Train with N processes through "
                                       "paddle.distributed.launch (DataParallel); the report names the first "
                                       "faulting rank.")] = 1,
    resume: Annotated[Optional[Path], typer.Option("--resume", metavar="DIR", help="Start from a PaddleNLP or "
                                                   "PaddleFormers Trainer checkpoint-N folder (its weights, "
                                                   "optimizer and scheduler), at its global_step; --steps counts "
                                                   "the steps after it.")] = None,
) -> None:
    """Run a short instrumented training run and name the first op, layer, parameter and sample to go NaN/Inf."""
    _run("probe", config, json_path=json_path, markdown_path=markdown_path, bundle=bundle, force=force,
         no_code=no_code, quiet=quiet, steps=steps, seed=seed, device=device, try_fixes=not no_try_fixes,
         fix_steps=fix_steps, nproc=nproc, resume=resume)


@app.command(cls=_Command, context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
def run(
    command: Annotated[list[str], typer.Argument(metavar="COMMAND", help="Your training command, unchanged, "
                                                 "after --: `nandoctor run -- python train.py --lr 3e-4`.",
                                                 show_default=False)],
    json_path: JsonOpt = None,
    markdown_path: MarkdownOpt = None,
    bundle: Annotated[Optional[Path], typer.Option("--bundle", metavar="DIR", help="Write the report folder "
                                                   "(report.md, report.json, the offending batch, the model's "
                                                   "state before the step, plots) to DIR.")] = None,
    keep_going: Annotated[bool, typer.Option("--keep-going", help="Let the script run on after the report "
                                             "(default: stop it at the first fault).")] = False,
    force: ForceOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Run your unmodified training script with the probe's watcher attached; report the first NaN/Inf step."""
    # (`python -m nandoctor run` and the `nandoctor` script read a plain command line in entry.py, without typer)
    raise typer.Exit(entry.run_status(list(command), json_path=json_path, markdown_path=markdown_path, bundle=bundle,
                                      keep_going=keep_going, force=force, quiet=quiet))


@app.command(cls=_Command)
def report(
    report_json: Annotated[Path, typer.Argument(metavar="REPORT", help="A report.json written by `nandoctor "
                                                "scan/probe --json` or a bundle.", show_default=False)],
    markdown_path: MarkdownOpt = None,
) -> None:
    """Re-render a saved JSON report in the terminal (or as Markdown with --markdown)."""
    from nandoctor.app import rerender

    # (a report that loads but breaks a renderer is our bug)
    _exit_with(lambda: rerender(report_json, _console(markdown_path), markdown_path=markdown_path),
               {"report": report_json, "--markdown": markdown_path}, markdown_path)


@app.command(cls=_Command)
def env() -> None:
    """Print the environment a bug ticket needs: nandoctor, Paddle, Python, OS, device, CUDA and GPUs."""
    from nandoctor.env import collect
    from nandoctor.report.console import render_environment

    try:
        render_environment(collect(), _console())
    except Exception as exc:  # noqa: BLE001 - no user code runs here: any failure is ours
        raise _internal(exc, None) from None
    if not paddle_installed():  # the table says "not importable"; this says what to do about it
        raise _fail(PaddleMissing())


if __name__ == "__main__":  # pragma: no cover
    app()
