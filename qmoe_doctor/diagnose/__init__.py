"""Diagnosis: outcomes and logs in, causes out. Pure functions over records, no I/O.

    matrix.py          outcomes as cells (group x condition x variant) with their labels
    baseline.py        the canonical-input cells: a kernel that cannot be used, one the CPU tier
                       cannot run, a hang that ends a session, what a refusal needs
    scan_rules.py      one rule per cause over the matrix; what no rule accounts for is reported
    parallel_rules.py  the per-rank rules of the parallel modes
    repro_rules.py     the repro ladder's stop rule, verdict and sanitizer decision
    check_verdicts.py  a check's cells as pass / fail / skip / error, and its exit code
    blind_spots.py, followups.py   cells that could not see what they check, and what settles them
    launch_rules.py, run_findings.py   the launch monitor's device checks and the run's conclusions
    sanitizer_log.py, traceback.py, device_assert.py, log_lines.py, xid.py   parsers of what
                       tools print
    attribution.py     an address placed against the tensors a probe or a program recorded
    explain.py         a saved log or traceback: what it shows and which causes fit

A cause is named only from differential evidence: a baseline passes and exactly one condition
flips the outcome. Imports ``core`` only.
"""
