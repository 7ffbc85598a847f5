"""Report writers: records in, files out (JSON, JUnit XML, standalone repro scripts, plots).

    json.py                      the versioned JSON document; atomic writes
    junit.py, run_junit.py       JUnit XML for CI servers (check, run)
    repro_script.py              a standalone script that reproduces one diagnosed cell
    parallel_script.py           a torchrun script per rank-level diagnosis
    plot.py                      the benchmark plot (the optional ``plot`` extra)

Imports ``core`` only; the terminal renderers live in ``cli/render``.
"""
