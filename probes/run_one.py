"""Run one probe in this process: ``python -m qmoe_doctor.probes.run_one SPEC_JSON``.

For runs under compute-sanitizer (``qmoe-doctor repro`` confirms an access fault this way): the
sanitizer wraps this one process, so the probe runs here, not in a worker. The Outcome is the
last stdout line that starts with ``OUTCOME_PREFIX`` (program output may come before it); the
exit status is 0 whenever that line was written, whatever the probe's status.

The probes register the kernel's operands (x, w, m_sizes). A write past the output is the
commonest bad access, so this entry also registers every tensor the kernel returns, as
``y#1``, ``y#2``, ... in call order: the parent can then attribute an address past y.

With the caching allocator on, the run is recorded (``probes/snapshot.py``): the allocator's
segments and blocks after the probe, and the Python line that allocated each, go into the
outcome fact ``allocator_snapshot``. ``main`` writes the Outcome line first without it and then
again with it, so that a snapshot taken in a context a fault has poisoned can lose nothing but
itself (the parent reads the last Outcome line).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import sys
from collections.abc import Callable
from typing import Any

from qmoe_doctor.core.records import (
    OUTCOME_PREFIX,
    Outcome,
    ProbeSpec,
    TensorInfo,
    from_json,
    to_json,
    to_jsonable,
)
from qmoe_doctor.probes.context import ProbeContext
from qmoe_doctor.probes.snapshot import AllocatorRecorder
from qmoe_doctor.probes.worker import execute

#: Outputs registered at most (a timing loop calls the kernel many times).
MAX_OUTPUTS = 16
#: The outcome fact holding the allocator's map (``qmoe_doctor.diagnose.sanitizer_log.AllocatorSnapshot``).
SNAPSHOT_FACT = "allocator_snapshot"


def _recording(kernel: Callable[..., Any], spec: ProbeSpec, seen: list[TensorInfo]) -> Callable[..., Any]:
    scratch = ProbeContext(spec)  # only its add_tensor (duck-typed, no torch needed)

    def call(*args: Any, **kwargs: Any) -> Any:
        y = kernel(*args, **kwargs)
        if len(seen) < MAX_OUTPUTS and hasattr(y, "data_ptr") and hasattr(y, "element_size"):
            info = scratch.add_tensor(f"y#{len(seen) + 1}", y)
            if all(
                (t.device, t.data_ptr, t.nbytes) != (info.device, info.data_ptr, info.nbytes) for t in seen
            ):
                seen.append(info)
        return y

    return call


def run_outcome(spec: ProbeSpec) -> Outcome:
    """The probe's Outcome, with the kernel's outputs added to its tensors."""
    outputs: list[TensorInfo] = []
    if not spec.condition.is_selftest:
        from qmoe_doctor.probes import conditions  # imports torch and triton
        from qmoe_doctor.probes.loader import KernelFn, load_kernel

        real = conditions.kernel_loader

        def load_recording(ref: str) -> KernelFn:
            return _recording(load_kernel(ref), spec, outputs)

        conditions.kernel_loader = load_recording  # this process runs this one probe only
        try:
            outcome, _ = execute(spec)
        finally:
            conditions.kernel_loader = real
    else:
        outcome, _ = execute(spec)
    if outputs:
        outcome = dataclasses.replace(outcome, tensors=outcome.tensors + tuple(outputs))
    return outcome


def _recorder(spec: ProbeSpec) -> AllocatorRecorder | None:
    return None if spec.condition.is_selftest else AllocatorRecorder(spec)


def _with_snapshot(outcome: Outcome, recorder: AllocatorRecorder) -> Outcome:
    snap = recorder.finish()
    notes = outcome.notes if snap.taken else (*outcome.notes, f"no allocator snapshot: {snap.reason}")
    return dataclasses.replace(
        outcome, facts={**outcome.facts, SNAPSHOT_FACT: to_jsonable(snap)}, notes=notes
    )


def run(spec: ProbeSpec) -> str:
    """The probe's Outcome as one JSON line: the kernel's outputs among its tensors, the
    allocator snapshot among its facts (self-tests get none)."""
    recorder = _recorder(spec)
    if recorder is not None:
        recorder.start()
    outcome = run_outcome(spec)
    if recorder is not None:
        outcome = _with_snapshot(outcome, recorder)
    return to_json(outcome)


def _write(outcome: Outcome) -> None:
    sys.stdout.write(OUTCOME_PREFIX + to_json(outcome) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    faulthandler.enable(all_threads=True)
    if len(argv) != 1:
        sys.stderr.write("usage: python -m qmoe_doctor.probes.run_one '<ProbeSpec JSON>'\n")
        return 2
    spec = from_json(ProbeSpec, argv[0])
    recorder = _recorder(spec)
    if recorder is not None:
        recorder.start()
    outcome = run_outcome(spec)
    _write(outcome)  # stands if taking the snapshot kills the process
    if recorder is not None:
        _write(_with_snapshot(outcome, recorder))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
