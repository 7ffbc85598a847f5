"""Planning ``qmoe-doctor check``: the scans a check of one kernel runs, and what it lints (pure).

Per kernel: the CPU tier (no GPU, Triton interpreter, every condition it can run), then on a GPU
machine the fast subset of the scan (``core.options.GPU_FAST_CONDITIONS`` on the first ordered
pair). Without ``--lint`` the kernel's own source is linted, found without importing it.
"""

from __future__ import annotations

from collections.abc import Sequence

from qmoe_doctor.core.conditions import DEFAULT_CONDITIONS
from qmoe_doctor.core.kernel_ref import KernelRef
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


def default_lint_paths(ref: str) -> tuple[str, ...]:
    """What ``check`` lints for a kernel when no ``--lint`` is given: its source file, found
    without importing it (``KernelRef.source_path``: our kernel, a specimen, a file, a module
    through the import system's finders, an adapter's target); () when it has none to find."""
    try:
        source = KernelRef.parse(ref).source_path()
    except ValueError:  # a malformed reference (KernelRefError): the probes will say so
        return ()
    return (str(source),) if source is not None else ()


def no_lint_note(ref: str) -> str:
    """What a check says when ``default_lint_paths`` found nothing to lint."""
    return f"no lint: the source of {ref} could not be found without importing it"


__all__ = ["default_lint_paths", "no_lint_note", "plan_check", "tier_options"]
