"""One engine per command: plan -> isolate -> diagnose -> report record. No typer, no rich.

    scan.py, check.py, repro.py, parallel.py, bench.py, run.py   the engines
    blind_cells.py   the scan's follow-up that settles cells that could not see
    explain.py, lint.py   thin: read the input, call the analysis

A workflow returns a record of ``core.reports``; the CLI renders it and picks the exit code.
"""
