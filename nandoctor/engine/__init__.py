"""The training engine every way in drives: the step and the loop primitive, per-step detection (the watcher,
its monitors and warnings), snapshots, the batch tape, replays, rollback, op guards and the tensor checker."""
