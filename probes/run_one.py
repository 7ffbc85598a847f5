"""Run one probe in this process: ``python -m qmoe_doctor.probes.run_one SPEC_JSON``.

For runs under compute-sanitizer (``qmoe-doctor repro`` confirms an access fault this way): the
sanitizer wraps this one process, so the probe runs here, not in a worker. The Outcome is the
last stdout line that starts with ``OUTCOME_PREFIX`` (program output may come before it); the
exit status is 0 whenever that line was written, whatever the probe's status.

The probes register the kernel's operands (x, w, m_sizes). A write past the output is the
commonest bad access, so this entry also registers every tensor the kernel returns, as
``y#1``, ``y#2``, ... in call order: the parent can then attribute an address past y.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import sys
from collections.abc import Callable
from typing import Any

from qmoe_doctor.probes.context import ProbeContext
from qmoe_doctor.probes.worker import execute
from qmoe_doctor.records import ProbeSpec, TensorInfo, from_json, to_json

#: Marks the Outcome line on stdout.
OUTCOME_PREFIX = "QMOE-OUTCOME "
#: Outputs registered at most (a timing loop calls the kernel many times).
MAX_OUTPUTS = 16


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


def run(spec: ProbeSpec) -> str:
    """The probe's Outcome as one JSON line, with the kernel's outputs added to its tensors."""
    outputs: list[TensorInfo] = []
    if not spec.condition.is_selftest:
        from qmoe_doctor.probes import conditions  # imports torch and triton
        from qmoe_doctor.probes.loader import load_kernel

        real = conditions.load_kernel

        def load_recording(ref: str) -> Callable[..., Any]:
            return _recording(load_kernel(ref), spec, outputs)

        conditions.load_kernel = load_recording  # this process runs this one probe only
        try:
            outcome, _ = execute(spec)
        finally:
            conditions.load_kernel = real
    else:
        outcome, _ = execute(spec)
    if outputs:
        outcome = dataclasses.replace(outcome, tensors=outcome.tensors + tuple(outputs))
    return to_json(outcome)


def main(argv: list[str]) -> int:
    faulthandler.enable(all_threads=True)
    if len(argv) != 1:
        sys.stderr.write("usage: python -m qmoe_doctor.probes.run_one '<ProbeSpec JSON>'\n")
        return 2
    spec = from_json(ProbeSpec, argv[0])
    line = run(spec)
    sys.stdout.write(OUTCOME_PREFIX + line + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
