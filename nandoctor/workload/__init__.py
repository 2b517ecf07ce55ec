"""The user's training workload: built from a spec (build.py: model, loader, loss function and optimizer), and
what the engine reads of any workload (plan.py). The package itself loads nothing, so that a watched
process (`nandoctor run`, `nandoctor.watch`) that needs only the plan and the path helpers of entrypoints.py
does not load the spec's parser (~9 ms a start).
"""
