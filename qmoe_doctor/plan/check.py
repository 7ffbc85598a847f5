"""Planning ``qmoe-doctor check``: the scans a check of one kernel runs, and what it lints (pure).

Per kernel: the CPU tier (no GPU, Triton interpreter, every condition it can run), then on a GPU
machine the fast subset of the scan (``core.options.GPU_FAST_CONDITIONS`` on the first ordered
pair). Without ``--lint`` the lint starts from the kernel's own function, found without
importing it (``lint_entry``), and follows what it reaches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qmoe_doctor.core.conditions import DEFAULT_CONDITIONS
from qmoe_doctor.core.kernel_ref import KernelRef, RefKind
from qmoe_doctor.core.options import GPU_FAST_CONDITIONS, CheckOptions, ScanOptions
from qmoe_doctor.core.reports import Tier
from qmoe_doctor.plan.scan import PlannedGpu, ScanPlan, plan_scan


def tier_options(tier: Tier, opts: CheckOptions) -> ScanOptions:
    if opts.conditions is not None:
        conditions = opts.conditions
    else:
        conditions = DEFAULT_CONDITIONS if tier == "cpu" else GPU_FAST_CONDITIONS
    return ScanOptions(
        preset=opts.preset,
        rows=opts.rows,
        conditions=conditions,
        timeout_s=opts.timeout_s,
        max_pairs=opts.max_pairs if tier == "gpu" else None,
        autotune=opts.autotune,
    )


def plan_check(
    kernel: str, gpus: Sequence[PlannedGpu], opts: CheckOptions | None = None
) -> tuple[tuple[Tier, ScanPlan], ...]:
    """The scans a check of ``kernel`` runs: the CPU tier (unless disabled), then the GPU
    subset when GPUs are given."""
    opts = opts or CheckOptions()
    plans: list[tuple[Tier, ScanPlan]] = []
    if opts.cpu_tier:
        plans.append(("cpu", plan_scan(kernel, [], tier_options("cpu", opts))))
    if gpus:
        plans.append(("gpu", plan_scan(kernel, gpus, tier_options("gpu", opts))))
    return tuple(plans)


@dataclass(frozen=True, slots=True, kw_only=True)
class LintEntry:
    """Where the lint of a kernel starts: its source file and function, and the folders its
    absolute imports are looked up in first (a ``file.py:function`` reference's own folder: the
    probe child puts it first on ``sys.path``)."""

    source: str
    function: str
    search: tuple[str, ...] = ()


def lint_entry(ref: str) -> LintEntry | None:
    """The kernel's source file and function (``KernelRef.source_path``, ``function_name``),
    found without importing it; None when there is no source to find."""
    try:
        parsed = KernelRef.parse(ref)
        source = parsed.source_path()
    except ValueError:  # a malformed reference (KernelRefError): the probes will say so
        return None
    if source is None:
        return None
    target = parsed.target if parsed.kind is RefKind.ADAPTER and parsed.target is not None else parsed
    search = (str(source.resolve().parent),) if target.kind is RefKind.FILE else ()
    return LintEntry(source=str(source), function=parsed.function_name(), search=search)


def default_lint_paths(ref: str) -> tuple[str, ...]:
    """What ``check`` lints for a kernel when no ``--lint`` is given: its source file, found
    without importing it (``KernelRef.source_path``: our kernel, a specimen, a file, a module
    through the import system's finders, an adapter's target); () when it has none to find.
    The lint starts there and follows what the kernel's function reaches (``lint_entry``)."""
    entry = lint_entry(ref)
    return (entry.source,) if entry is not None else ()


def no_lint_note(ref: str) -> str:
    """What a check says when ``lint_entry`` found nothing to lint."""
    return f"no lint: the source of {ref} could not be found without importing it"


__all__ = ["LintEntry", "default_lint_paths", "lint_entry", "no_lint_note", "plan_check", "tier_options"]
