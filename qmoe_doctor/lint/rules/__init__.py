"""The rules, one module each, and the table that runs them.

Each rule module has ``check(project, module)``, which reports through ``project.add``. Every
rule keeps its near-misses silent: false positives matter as much as misses. A rule names a
cause of :mod:`qmoe_doctor.core.causes` (``findings.RULES``).

* ``unguarded-launch``: a Triton launch outside a device guard (followed up to its callers).
* ``int32-offset``: global index x outer stride formed in int32 inside ``@triton.jit``.
* ``cached-device-property``: properties of the current device cached for every device.
* ``stream-without-device``: a stream of the current device (or the null stream) for a launch.
* ``default-device-alloc``: ``device="cuda"`` outside a guard in a kernel wrapper.
* ``autotune-inplace``: an autotuned in-place or accumulating kernel with nothing restored.
* ``current-device-property``: the current device's properties, read outside a guard, size a
  launch (its persistent grid, a constexpr).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from qmoe_doctor.lint.findings import LintFinding, Rule
from qmoe_doctor.lint.module import Module
from qmoe_doctor.lint.project import Project
from qmoe_doctor.lint.rules import (
    autotune_inplace,
    cached_device_property,
    current_device_property,
    default_device_alloc,
    int32_offset,
    stream_without_device,
    unguarded_launch,
)

Check = Callable[[Project, Module], None]

CHECKS: dict[Rule, Check] = {
    Rule.UNGUARDED_LAUNCH: unguarded_launch.check,
    Rule.INT32_OFFSET: int32_offset.check,
    Rule.CACHED_DEVICE_PROPERTY: cached_device_property.check,
    Rule.STREAM_WITHOUT_DEVICE: stream_without_device.check,
    Rule.DEFAULT_DEVICE_ALLOC: default_device_alloc.check,
    Rule.AUTOTUNE_INPLACE: autotune_inplace.check,
    Rule.CURRENT_DEVICE_PROPERTY: current_device_property.check,
}


def run_rules(project: Project, rules: Sequence[Rule]) -> tuple[LintFinding, ...]:
    """Every rule over every module (context included: a finding there is dropped, but the
    analysis may pass through it), module by module; the project's findings."""
    for m in project.modules:
        for rule in rules:
            CHECKS[rule](project, m)
    return project.findings()


__all__ = ["CHECKS", "Check", "run_rules"]
