"""The harness behind `benchmarks/run.py`: workloads, timed child processes, in-process workers, table."""
