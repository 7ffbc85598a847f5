"""Benchmarks (scripts, not installed): run `python -m benchmarks.bench_kernels --help`."""
