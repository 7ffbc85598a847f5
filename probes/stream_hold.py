"""Hold the current CUDA stream for a wall-clock time (child side; imports torch): the stream-order
probes queue a producer behind the hold, so it is still pending when the kernel under test is
called, and the pipeline probe stands a layer's other work for it.

``torch.cuda._sleep(cycles)`` spins on ``clock64``, a counter of the SM the spin runs on; the
counters of different SMs bear no relation, and a block that preemption moves to another SM
reads the new SM's counter (CUDA C++ Programming Guide, ``clock64``). On a card other processes
share, such a spin can end much later than asked, or at once. Measured on one H100 (2026-12-06,
torch 2.11) with four pytest processes sharing the card: the side-stream specimen test, whose
producer waits behind two 1 s holds, took 107 s (the whole GPU suite) and 43 s (the specimen tests
alone) with ``torch.cuda._sleep``, 7.2 s with this hold, and 7-9 s alone with either. Here one
thread spins on ``%globaltimer``, the GPU's nanosecond clock, which every SM reads alike.

Without Triton's ``globaltimer``, the hold is ``torch.cuda._sleep`` at ``FALLBACK_HZ``
(``hold_kind()`` says which one holds).
"""

from __future__ import annotations

import torch

__all__ = ["FALLBACK_HZ", "hold_kind", "hold_stream"]

#: cycles a second for the ``torch.cuda._sleep`` fallback: an H100's and H200's top SM clock
FALLBACK_HZ = 1.98e9

try:
    import triton
    from triton.language.extra.cuda import globaltimer
except ImportError:  # no Triton, or one without the register
    _hold = None
else:

    @triton.jit
    def _hold(ns):  # type: ignore[no-untyped-def]
        """One thread spins until the GPU's nanosecond clock has moved ``ns``."""
        start = globaltimer()
        now = start
        while now - start < ns:
            now = globaltimer()


def hold_kind() -> str:
    """What holds the stream here: ``"globaltimer"`` or ``"torch.cuda._sleep"``."""
    return "globaltimer" if _hold is not None else "torch.cuda._sleep"


def hold_stream(seconds: float) -> None:
    """Queue ``seconds`` of waiting on the current stream of the current CUDA device (nothing for
    ``seconds <= 0``). Returns at once: the host does not wait for the hold."""
    if seconds <= 0:
        return
    if _hold is None:
        torch.cuda._sleep(int(seconds * FALLBACK_HZ))
        return
    _hold[(1,)](int(seconds * 1e9), num_warps=1)
