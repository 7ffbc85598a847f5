"""The slot through which a launch that bypasses Triton's ``JITFunction.run`` is still watched.

Our kernels' lean launch path (``kernels/launch.py``) calls a plan's compiled launcher directly
after its first launch, so a launch monitor that wraps ``JITFunction.run`` (``qmoe-doctor run``'s,
``qmoe_doctor.monitor``) would not see those launches. Rather than give the lean path up while it
is watched (about 40 us per launch of Triton's own path), the lean path hands each launch to the
observer in this slot, which makes the launch itself::

    observer = launch_observer.observer
    if observer is None:
        launcher(*call)
    else:
        observer(kernel, grid, device, stream, names, values, launcher, call)

``kernel`` the ``JITFunction``; ``grid`` three dimensions; ``device`` the CUDA ordinal the
launch runs on (the lean path launches inside that device's guard, on its current stream
``stream``); ``names`` and ``values`` the kernel parameters that take tensors (a tensor, or a
tensor descriptor with its ``base``) and what this launch passes there (every other argument is
fixed by the plan: no tensor hides in them); ``launcher(*call)`` is the launch. The observer
must make it exactly once and let what it raises through; it may raise before making it (a
``--strict`` stop).

Here, in the shared vocabulary, because the kernels may import only ``core`` and the monitor
must not be imported by them. Stdlib only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol


class LaunchObserver(Protocol):
    def __call__(
        self,
        kernel: Any,
        grid: tuple[int, int, int],
        device: int,
        stream: int,
        names: Sequence[str],
        values: Sequence[Any],
        launcher: Callable[..., Any],
        call: tuple[Any, ...],
    ) -> Any: ...


#: The observer of lean launches; None: nobody watches (the lean path calls the launcher).
observer: LaunchObserver | None = None
#: The attribute, true, on the monitor's wrapper of ``JITFunction.run``: a ``run`` so marked is
#: watched through this slot too, so the lean path stays on under it (any other wrapper of
#: ``run``, a profiler's, must see every launch: the lean path steps aside for it).
WRAPPER_MARK = "__qmoe_doctor_monitor__"


def install(new: LaunchObserver | None) -> LaunchObserver | None:
    """Put ``new`` in the slot (None empties it); the observer it held before."""
    global observer
    previous, observer = observer, new
    return previous


__all__ = ["WRAPPER_MARK", "LaunchObserver", "install", "observer"]
