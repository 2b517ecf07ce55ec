"""`nandoctor run -- COMMAND`: the in-loop watcher attached to an unmodified training script.

runner.py (the parent: environment, subprocess, exit status, outputs) and runtime.py (the child: the
seams in Paddle); site/sitecustomize.py is what puts the second into the first's subprocess.
"""
