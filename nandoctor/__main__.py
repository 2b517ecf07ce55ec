"""`python -m nandoctor` runs the same CLI as the `nandoctor` script."""

from nandoctor.cli import app

app(prog_name="nandoctor")
