"""What a probe is handed in the child: its spec, and where to write breadcrumbs and findings.

The context imports nothing heavy: tensors are read by duck typing (``add_tensor`` never
imports torch), so self-test children run without torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from qmoe_doctor.core.records import Phase, ProbeSpec, TensorInfo

#: Writes one protocol message (a JSON-able dict) to the parent, flushed. Set by the worker.
Emit = Callable[[dict[str, Any]], None]


def _plain(value: Any) -> Any:
    """A JSON-able copy of a fact value: containers kept, scalars from tensors/numpy unwrapped,
    anything else as its ``str``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_plain(v) for v in value]
    item = getattr(value, "item", None)  # 0-d tensors and numpy scalars
    if callable(item):
        try:
            return _plain(item())
        except (TypeError, ValueError, RuntimeError):
            pass
    return str(value)


class ProbeContext:
    """Handed to every probe. Write a breadcrumb before each phase (``ctx.crumb(Phase.LAUNCH)``)
    so that a crash is attributed to the phase it happened in; record observations with
    ``fact``, remarks with ``note`` and the operands with ``add_tensor``."""

    def __init__(self, spec: ProbeSpec, emit: Emit | None = None) -> None:
        self.spec = spec
        self._emit = emit
        self._phase = Phase.SPAWN
        self._facts: dict[str, Any] = {}
        self._notes: list[str] = []
        self._tensors: list[TensorInfo] = []
        # the exception that last escaped a call of the kernel under test (``kernel_call.watch``):
        # the worker tells the kernel's own raise from the probe's by identity
        self.call_error: BaseException | None = None

    @property
    def phase(self) -> Phase:
        """The last phase a breadcrumb was written for (SPAWN before the first one)."""
        return self._phase

    @property
    def facts(self) -> dict[str, Any]:
        return dict(self._facts)

    @property
    def notes(self) -> tuple[str, ...]:
        return tuple(self._notes)

    @property
    def tensors(self) -> tuple[TensorInfo, ...]:
        return tuple(self._tensors)

    def crumb(self, phase: Phase, step: str = "") -> None:
        """Record that the probe is entering ``phase``; the parent sees it at once. ``step``
        names a part of the phase the parent must tell apart ("kernel": the import of the
        kernel under test, after the probe's own imports)."""
        self._phase = Phase(phase)
        if self._emit is not None:
            message: dict[str, Any] = {
                "type": "crumb",
                "probe_id": self.spec.probe_id,
                "phase": self._phase.value,
                "t": time.time(),
            }
            if step:
                message["step"] = step
            self._emit(message)

    def fact(self, key: str, value: Any) -> None:
        """A condition-specific observation (``peer_access``, ``current_device``, ...)."""
        self._facts[str(key)] = _plain(value)

    def note(self, text: str) -> None:
        """A human-readable remark (what was set up, why a cell was skipped)."""
        self._notes.append(str(text))

    def add_tensor(self, name: str, tensor: Any) -> TensorInfo:
        """Record an operand handed to the kernel, so that a faulting address can be attributed.

        ``nbytes`` is ``numel * element_size`` (the view's span as the kernel sees it), not the
        size of the underlying storage.
        """
        info = TensorInfo(
            name=name,
            device=str(tensor.device),
            data_ptr=int(tensor.data_ptr()),
            nbytes=int(tensor.numel()) * int(tensor.element_size()),
            shape=tuple(int(s) for s in tensor.shape),
            strides=tuple(int(s) for s in tensor.stride()),
            dtype=str(tensor.dtype).removeprefix("torch."),
        )
        self._tensors.append(info)
        return info


__all__ = ["Emit", "ProbeContext"]
