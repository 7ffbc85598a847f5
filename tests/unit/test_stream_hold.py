"""The stream hold of the stream-order probes (``probes/stream_hold.py``): what it launches, its
fallback, and the spin built for sm_90 on this CPU. On a GPU: tests/gpu/test_probes_gpu.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

from qmoe_doctor.probes import stream_hold


class _Recorder:
    """Stands for the Triton kernel: records each launch's grid, arguments and options."""

    def __init__(self) -> None:
        self.launches: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    def __getitem__(self, grid: Any) -> Any:
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def test_the_spin_is_launched_on_one_thread_for_the_nanoseconds_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    spin = _Recorder()
    monkeypatch.setattr(stream_hold, "_hold", spin)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: pytest.fail("the fallback ran"))
    stream_hold.hold_stream(0.2)
    stream_hold.hold_stream(0.01)
    assert spin.launches == [((1,), (200_000_000,), {"num_warps": 1}), ((1,), (10_000_000,), {"num_warps": 1})]
    assert stream_hold.hold_kind() == "globaltimer"


@pytest.mark.parametrize("seconds", [0, -1.0])
def test_no_time_holds_nothing(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    spin = _Recorder()
    monkeypatch.setattr(stream_hold, "_hold", spin)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: pytest.fail("the fallback ran"))
    stream_hold.hold_stream(seconds)
    assert spin.launches == []


def test_without_the_spin_torch_sleeps_at_the_fallback_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[int] = []
    monkeypatch.setattr(stream_hold, "_hold", None)
    monkeypatch.setattr(torch.cuda, "_sleep", slept.append)
    stream_hold.hold_stream(0.2)
    assert slept == [int(0.2 * stream_hold.FALLBACK_HZ)]
    assert stream_hold.hold_kind() == "torch.cuda._sleep"


_SM90 = textwrap.dedent(
    """
    import json, re
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from qmoe_doctor.probes import stream_hold
    source = ASTSource(stream_hold._hold, {"ns": "i64"}, constexprs={})
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1}).asm["ptx"]
    lines = [line.strip() for line in ptx.splitlines()]
    reads = [i for i, line in enumerate(lines) if "%globaltimer" in line]
    back = [i for i, line in enumerate(lines) if re.match(r"@%p\\d+ bra", line)]
    print(json.dumps({"reads": reads, "branches": back, "clock64": "%clock64" in ptx}))
    """
)


def test_the_spin_reads_the_global_timer_in_its_loop_on_sm90() -> None:
    if stream_hold._hold is None:
        pytest.skip("this Triton has no globaltimer")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiler, not the interpreter
    done = subprocess.run([sys.executable, "-c", _SM90], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert not got["clock64"]  # never the SM's own counter
    # one read before the loop (the start), one inside it, and a branch back past that read
    assert len(got["reads"]) == 2, got
    assert any(b > got["reads"][1] for b in got["branches"]), got
