"""Shared vocabulary: records, reports, the cause and specimen catalogues, declared constants.

Stdlib only, and nothing else of ours: both sides (the parent and the child processes, the launch
monitor inside a user's program) import it, so nothing here may pull in torch, triton, rich or a
layer above. Records are frozen dataclasses that round-trip through JSON with ``schema_version``.

    records.py        ProbeSpec (+ Placement), Outcome, Diagnosis, Evidence; Condition, Status, ...
    reports.py        what each command produced: ScanReport, CheckReport, ReproReport, ...
    kernel_ref.py     KernelRef: the one --kernel grammar (parse; validate in the parent)
    options.py        what a command was asked to do (ScanOptions, CheckOptions, ...)
    conditions.py     the scan's conditions as sets and in run order
    causes.py         the cause catalogue (mechanism, fix, public evidence)
    specimens.py      the specimen registry (which planted fault, which verdict)
    knobs.py          environment variables and defaults, declared and read here only
    exitcodes.py, tolerances.py, launch_configs.py, shapes.py   declared once, each with its reason
    inputs.py         the one bounded reader for every input the doctor reads
    events.py         progress events and ``Interrupted`` (a run ended by a signal)
    ...               the records of one concern each (allocator, xid, launches, bench, audit)
"""
