"""`nandoctor run -- COMMAND`: the in-loop watcher attached to an unmodified training script.

runner.py is the parent (environment, subprocess, exit status, outputs); runtime.py the child's session
(model, loss, batch and optimizer found, a Doctor driven); seams.py the patches on Paddle's classes;
site/sitecustomize.py is what loads the child side into the command's Python processes.
"""
