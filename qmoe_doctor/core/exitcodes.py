"""Exit codes, declared once. Stable: CI scripts depend on them (documented in README.md)."""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    HEALTHY = 0  # every probe that ran passed (or only explained "works by accident" cells)
    FAULT = 1  # at least one fault was diagnosed (or, for lint, a finding was reported)
    USAGE = 2  # bad command line: unknown GPU index, kernel that does not import, bad option
    TOO_FEW_GPUS = 3  # fewer GPUs than --require-gpus asked for
    CHECK_BROKEN = 4  # the check itself could not run (no python in a child, NVML broken, ...)
