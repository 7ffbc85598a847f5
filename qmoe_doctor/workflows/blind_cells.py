"""The scan's follow-up of blind invalid-routing cells on a GPU: one memcheck run each.

An over-routed or negative-sizes cell whose canary could not follow the kernel's own output
cannot see a write past ``y`` (``diagnose/blind_spots.py``). On a GPU the scan re-runs that
one small probe alone under compute-sanitizer memcheck with the caching allocator off
(``workflows.repro.confirm_with_sanitizer``: seconds at the cell's size) and folds the answer
into the cell (``diagnose/followups.py``): errors make it a fault, a clean run a checked cell;
without a sanitizer the cell stays ``unchecked`` and says why. The scan calls
``settle_blind_cells`` once per session, on that session's outcomes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from qmoe_doctor.core import knobs
from qmoe_doctor.core.records import Outcome
from qmoe_doctor.diagnose.followups import needs_memcheck, verdict_of, with_memcheck
from qmoe_doctor.machine.sanitizer import SanitizerInfo

#: Runs one outcome's probe under memcheck: ``confirm_with_sanitizer``'s signature (tests pass
#: a fake).
Confirm = Callable[..., Any]

NO_SANITIZER = (
    f"compute-sanitizer was not found (${knobs.QMOE_SANITIZER}, PATH, $CUDA_HOME/bin, "
    f"/usr/local/cuda*/bin); install the CUDA toolkit's compute-sanitizer or set "
    f"${knobs.QMOE_SANITIZER} to confirm this cell"
)


def settle_blind_cells(
    outcomes: Sequence[Outcome],
    *,
    base_env: Mapping[str, str],
    gpu_of_ordinal: Mapping[int, int],
    log_dir: Path,
    sanitizer: SanitizerInfo | None,
    confirm: Confirm | None = None,
) -> list[Outcome]:
    """``outcomes`` with every blind invalid-routing cell (``needs_memcheck``) settled by a
    memcheck run, in order; the others unchanged. ``sanitizer``: what
    ``machine.sanitizer.find_compute_sanitizer`` found (None: nothing)."""
    if confirm is None:
        from qmoe_doctor.workflows.repro import confirm_with_sanitizer

        confirm = confirm_with_sanitizer
    settled: list[Outcome] = []
    for outcome in outcomes:
        if not needs_memcheck(outcome):
            settled.append(outcome)
            continue
        if sanitizer is None:
            settled.append(with_memcheck(outcome, "unavailable", NO_SANITIZER))
            continue
        found = confirm(outcome, sanitizer, base_env=base_env, gpu_of_ordinal=gpu_of_ordinal, log_dir=log_dir)
        settled.append(
            with_memcheck(
                outcome,
                verdict_of(str(found.status), found.errors),
                str(found.reason),
                first_error=found.first_error,
                touched=found.touched,
                log_path=found.log_path,
            )
        )
    return settled


__all__ = ["NO_SANITIZER", "settle_blind_cells"]
