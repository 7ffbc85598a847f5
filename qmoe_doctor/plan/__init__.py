"""Planning: what a command asked for, turned into probes. Pure functions, no I/O.

    scan.py         ScanOptions + GPUs -> sessions of ProbeSpecs (least process state first)
    pair_rounds.py  ordered GPU pairs in rounds of disjoint pairs (run at the same time)
    check.py        the CI check's tiers (CPU tier, fast GPU subset) and its lint targets
    repro.py        the repro ladder: the pipeline, then the condition cells that shrink it
    parallel.py     the parallel modes' launches (torchrun or one process), and what cannot fit

Every ProbeSpec carries its Placement (report group, GPUs, rank, variant): nobody parses probe
ids. Imports ``core`` only.
"""
