"""Static lint for the multi-GPU faults of fused MoE Triton kernels (``qmoe-doctor lint``, and
the lint section of ``check``). This module is the face: it re-exports; the work is below.

Sources are read with :mod:`ast` only: never imported, never executed (a kernel module imports
torch and triton, and the parent side never does). Each rule names a cause of
:mod:`qmoe_doctor.core.causes`; a finding says where, what and how to fix it::

    lint_paths(["kernels/"]) --> LintReport(findings=(LintFinding, ...), errors=(LintError, ...),
                                            skipped=(LintSkip, ...))

The package, in the order a run goes through it:

    findings.py   rule ids and their text (RULES); the records a run returns
    source.py     finding, reading (bounded, special files refused) and parsing the files
    nodes.py      small questions about one AST node (dotted name, argument, message text)
    module.py     one parsed file: imports, parents, constants, its Triton kernels
    devices.py    what a device guard is; where a device or stream comes from
    project.py    every file of the run: cross-file kernels, every launch form, the call graph,
                  guards through callers, the findings sink (ignore comments, dedup, order)
    reach.py      what a kernel's function reaches: the files ``check`` and ``scan`` lint
    rules/        one module per rule (``check(project, module)``) and the table that runs them;
                  ``rules/int32_offset.py`` is the int32 data flow over a jit function
    run.py        lint_paths / lint_reached / lint_source: source -> project -> rules -> LintReport

Files of one run are one project: kernels and launch helpers imported from another linted
file are recognised, and imported files found next to a linted one are read (not reported) for
that. ``lint_reached(file, function)`` (what ``check`` and ``scan`` run for a kernel) lints, as
one project, every file the function reaches through its calls and imports, and keeps the
findings in the code it reaches. Test functions and ``if __name__ == "__main__":`` blocks make their own tensors on the
current device, so the device rules stay silent there. A finding is silenced by a
``# qmoe-doctor: ignore`` (or ``ignore[rule,...]``) comment on its line.

Imports only :mod:`qmoe_doctor.core` (layer contract in pyproject.toml).
"""

from __future__ import annotations

from qmoe_doctor.lint.findings import (
    RULES,
    LintError,
    LintFinding,
    LintReport,
    LintSkip,
    Rule,
    RuleInfo,
    parse_rules,
)
from qmoe_doctor.lint.module import MAX_KERNEL_NESTING
from qmoe_doctor.lint.reach import MAX_REACH_DEPTH, MAX_REACH_FILES
from qmoe_doctor.lint.run import lint_paths, lint_reached, lint_source
from qmoe_doctor.lint.source import MAX_SOURCE_BYTES, iter_python_files

__all__ = [
    "MAX_KERNEL_NESTING",
    "MAX_REACH_DEPTH",
    "MAX_REACH_FILES",
    "MAX_SOURCE_BYTES",
    "RULES",
    "LintError",
    "LintFinding",
    "LintReport",
    "LintSkip",
    "Rule",
    "RuleInfo",
    "iter_python_files",
    "lint_paths",
    "lint_reached",
    "lint_source",
    "parse_rules",
]
