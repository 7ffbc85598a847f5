"""The probes' own GPU helpers on one GPU (run on a GPU machine; skipped without one)."""

from __future__ import annotations

import pytest
import torch

from qmoe_doctor.probes.stream_hold import hold_kind, hold_stream

pytestmark = pytest.mark.gpu


def test_hold_keeps_a_producer_queued_for_the_time_asked() -> None:
    """What the stream-order probes rely on: a producer queued behind the hold is still pending
    when the host moves on, and runs after the time asked (measured on the stream itself)."""
    assert hold_kind() == "globaltimer"  # Triton is on every GPU machine we run
    hold_stream(0.001)  # built before anything is timed
    torch.cuda.synchronize()
    src = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    x = torch.zeros_like(src)
    start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    hold_stream(0.2)
    x.copy_(src)  # the producer
    done.record()
    assert not done.query()  # still queued behind the hold
    done.synchronize()
    assert start.elapsed_time(done) >= 200.0  # ms: the hold ran its whole time
    assert torch.equal(x, src)
