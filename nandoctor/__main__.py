"""`python -m nandoctor` and the `nandoctor` script: the same CLI.

A plain `nandoctor run` command line (entry.plain_run_args) is run without importing typer (~45 ms of CPU
of a parent that only supervises the script); everything else goes to typer's CLI (cli.py).
"""

from __future__ import annotations

import sys


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["run"]:
        from nandoctor import entry

        plain = entry.plain_run_args(args[1:])
        if plain is not None:
            sys.exit(entry.run_status(**plain))
    from nandoctor.cli import app

    app(prog_name="nandoctor")


if __name__ == "__main__":
    main()
