"""The check's verdicts: each probe as CI sees it (pass, fail, skip, error), and each kernel's
exit code from its lint, its tiers and its cells.

=======  ==================================================================================
verdict  when
=======  ==================================================================================
pass     ran and was right; or refused an input its contract excludes, loudly and before launch
         (``rejected``: what it should do; the refused input in the detail); or computed wrong
         values for invalid routing with every access in bounds, cited by a hardening finding
         and by no fault (label ``wrong``, the detail says "hardening": README, exit 0)
fail     wrong, crashed, or correct but slow and cited by a diagnosis (it ran remotely)
skip     did not apply (its reason in the detail); or the CPU tier's interpreter check failed
         (the machine's interpreter, not the kernel: the tier did not run); or ran without a
         failure but its check could not see what the cell claims (``unchecked``, the reason in
         the detail: docs/cells.md), never a pass; or was not run after the kernel hung on the
         canonical inputs; or, on the CPU tier, needs CUDA (not checked there: a GPU runner)
error    the check could not run it: its child did not start, or the kernel did not import
=======  ==================================================================================

A kernel's exit code, most important first: a lint path that could not be read (2), a tier
whose every child failed to start (4), a fault (a diagnosis, an unexplained failing cell, a
lint finding: 1), a probe that could not run (4), no probe of the kernel ran at all (4: every
cell skipped, e.g. a CUDA-only kernel on the CPU tier), healthy. A kernel that cannot be used
(its import died, its baseline cell raised on the canonical inputs) never gets here: the check
stops with exit 2 (``workflows.check``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.records import Condition, ErrorKind, Outcome, Phase, Status
from qmoe_doctor.core.reports import CellResult, LintResult, ScanReport, Tier, TierResult, Verdict
from qmoe_doctor.diagnose.matrix import describe, label_cells

#: Exit codes of a kernel's check, most important first: the overall code is the first of these
#: that any kernel (or the lint section) got.
PRECEDENCE = (ExitCode.USAGE, ExitCode.CHECK_BROKEN, ExitCode.FAULT, ExitCode.HEALTHY)

LOG_CHARS = 4000  # of a failing cell's error text and stderr tail kept for CI logs


def _log(o: Outcome) -> str:
    parts = [p for p in (o.error_message or "", o.stderr_tail) if p]
    text = "\n--- child stderr (tail) ---\n".join(parts) if len(parts) == 2 else "".join(parts)
    return text[-LOG_CHARS:]


def _verdict(o: Outcome, label: str, cited: Mapping[str, str], hardened: Mapping[str, str]) -> Verdict:
    if label == "skipped":
        return "skip"  # did not apply, was not run, or needs CUDA on the CPU tier (not checked)
    if label == "rejected":
        return "pass"  # the kernel refused invalid input loudly: what it should do
    if label == "unchecked":
        return "skip"  # no failure seen, but the check was blind: not a pass (the reason: detail)
    if o.spec.condition is Condition.INTERPRETER_CHECK and o.failed:
        return "skip"  # the machine's interpreter, not the kernel: the tier did not run
    if o.status is Status.ERROR and (o.phase is Phase.SPAWN or o.error_kind is ErrorKind.KERNEL_IMPORT):
        return "error"
    if o.failed and o.probe_id in hardened and o.probe_id not in cited:
        return "pass"  # a hardening finding: wrong values from excluded input, in bounds (exit 0)
    if o.failed or (label == "slow" and o.probe_id in cited):
        return "fail"
    return "pass"


def cell_results(report: ScanReport, tier: Tier) -> tuple[CellResult, ...]:
    """One CellResult per outcome of a scan, with its verdict and, for failures, the cause.
    Groups and names come from the probes' placements ("GPU 0 -> GPU 1", "offsets:padded-rows")."""
    cited: dict[str, str] = {}
    details: dict[str, str] = {}
    for d in report.diagnoses:
        for e in d.evidence:
            cited.setdefault(e.probe_id, d.cause)
            if e.label != "pass":
                details[e.probe_id] = e.detail  # the failing entry comes after the baseline's
    for e in report.unexplained:
        details[e.probe_id] = e.detail
    hardened = {
        e.probe_id: f"hardening finding, not a fault (exit 0): {e.detail}"
        for d in report.hardening
        for e in d.evidence
        if e.label != "pass"
    }
    cells: list[CellResult] = []
    for cell in label_cells(report.outcomes):
        o, label = cell.outcome, cell.label
        verdict = _verdict(o, label, cited, hardened)
        placement = o.spec.placement
        cells.append(
            CellResult(
                probe_id=o.probe_id,
                tier=tier,
                group=placement.label,
                name=placement.cell_name(o.spec.condition),
                label=label,
                verdict=verdict,
                detail=details.get(o.probe_id)
                or (hardened[o.probe_id] if verdict == "pass" and o.probe_id in hardened else "")
                or describe(cell),
                cause=cited.get(o.probe_id) if verdict == "fail" else None,
                wall_s=o.wall_s,
                notes=o.notes,
                log=_log(o) if verdict in ("fail", "error") else "",
            )
        )
    return tuple(cells)


def count_verdicts(cells: Iterable[CellResult]) -> dict[str, int]:
    counts = {"pass": 0, "fail": 0, "skip": 0, "error": 0}
    for c in cells:
        counts[c.verdict] += 1
    return counts


def worst(codes: Iterable[int]) -> ExitCode:
    """The exit code that matters most among several (usage > broken > fault > healthy)."""
    got = {ExitCode(c) for c in codes}
    for code in PRECEDENCE:
        if code in got:
            return code
    return ExitCode.HEALTHY


def judge_kernel(
    lint: LintResult | None, tiers: Sequence[TierResult], cells: Sequence[CellResult], faults: bool
) -> tuple[ExitCode, str]:
    """A kernel's exit code, and why the check could not give an answer when it could not."""
    if lint is not None and lint.errors:
        return ExitCode.USAGE, "; ".join(e.as_line() for e in lint.errors)
    broken = [t for t in tiers if t.spawn_failed]
    if broken:
        return ExitCode.CHECK_BROKEN, (
            f"no probe child of the {', '.join(t.tier for t in broken)} tier could start; "
            f"see the worker logs in {broken[0].log_dir}"
        )
    if faults or (lint is not None and lint.findings):
        return ExitCode.FAULT, ""
    errors = [c for c in cells if c.verdict == "error"]
    if errors:
        return (
            ExitCode.CHECK_BROKEN,
            f"{len(errors)} probe(s) could not run: {errors[0].probe_id}: {errors[0].detail}",
        )
    # the interpreter check runs our own reference kernel: it checks the machine, not the kernel
    kernel_cells = [c for c in cells if not c.name.startswith(Condition.INTERPRETER_CHECK.value)]
    if not any(c.verdict == "pass" for c in kernel_cells):
        reasons = sorted({c.detail for c in kernel_cells if c.verdict == "skip"})
        why = "; ".join(reasons[:3]) if reasons else "no probe was planned for these options"
        return ExitCode.CHECK_BROKEN, f"no probe ran, so nothing was checked: {why}"
    return ExitCode.HEALTHY, ""


__all__ = ["LOG_CHARS", "PRECEDENCE", "cell_results", "count_verdicts", "judge_kernel", "worst"]
