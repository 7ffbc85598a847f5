"""The allocator snapshot on a CPU: the reduction of ``torch.cuda.memory._snapshot()``'s dict
(``probes/snapshot.py``), its JSON round trip, attribution of an address to a segment, block and
allocating line (``qmoe_doctor.core.allocator``, ``qmoe_doctor.diagnose.attribution``), the
recorder's guards, and run_one's fact.

No CUDA here, so every snapshot below is HAND-MADE: written for this test in the shape torch 2.x
returns (the keys ``probes/snapshot.py`` documents), not recorded from a GPU run. Addresses are
chosen to look like device pointers; the frames name files of this repository.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from qmoe_doctor.core.allocator import AllocatorSnapshot, locate_in_snapshot, read_allocator_snapshot
from qmoe_doctor.core.records import (
    Condition,
    ErrorKind,
    Outcome,
    Phase,
    ProbeSpec,
    Shape,
    Status,
    TensorInfo,
    from_json,
    to_json,
    to_jsonable,
)
from qmoe_doctor.diagnose.attribution import attribute_address, snapshot_sentence
from qmoe_doctor.machine.sanitizer import SanitizerInfo
from qmoe_doctor.probes import run_one
from qmoe_doctor.probes.snapshot import LIBRARY_PARTS, AllocatorRecorder, reduce_snapshot, user_frame
from qmoe_doctor.workflows.repro import CommandResult, confirm_with_sanitizer

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "sanitizer" / "2026-11-22-2xh200-7ada31c"

TORCH_FRAME = {"filename": "/usr/lib/python3/site-packages/torch/cuda/memory.py", "line": 10, "name": "empty"}
TRITON_FRAME = {"filename": "/usr/lib/python3/site-packages/triton/runtime/jit.py", "line": 5, "name": "run"}
CPP_FRAME = {"filename": "??", "line": 0, "name": "c10::cuda::CUDACachingAllocator::malloc"}


def frames(*user: tuple[str, int, str]) -> list[dict[str, Any]]:
    """A stack, innermost first: torch's own frames, then the user frames given."""
    return [CPP_FRAME, TORCH_FRAME] + [{"filename": f, "line": ln, "name": n} for f, ln, n in user]


KERNEL_Y = ("/work/main/kernels/grouped_gemm.py", 57, "moe_grouped_gemm")
MAKE_X = ("/work/main/probes/conditions.py", 97, "make_operands")
TRAP = ("/work/main/probes/conditions.py", 182, "__init__")
SEG0 = 0x7F7CC4800000  # small-pool segment of cuda:0, 2 MiB
SEG1 = 0x7F5A00000000  # large-pool expandable segment of cuda:1, 20 MiB


def hand_made_snapshot() -> dict[str, Any]:
    """HAND-MADE, torch 2.x shape. cuda:0: a 2 MiB small-pool segment holding x (live), a freed
    block where the kernel's y was, a block freed on one stream while another may use it, and
    the free rest (with no ``address`` key: the reducer counts it from the sizes). cuda:1: one
    live block in an expandable segment."""
    y_addr = SEG0 + 0x20000
    return {
        "segments": [
            {
                "device": 0,
                "address": SEG0,
                "total_size": 2 << 20,
                "allocated_size": 0x20000,
                "active_size": 0x20000,
                "requested_size": 0x20000,
                "stream": 0,
                "segment_type": "small",
                "segment_pool_id": (0, 0),
                "is_expandable": False,
                "frames": frames(MAKE_X),
                "blocks": [
                    {
                        "address": SEG0,
                        "size": 0x20000,
                        "requested_size": 0x20000,
                        "state": "active_allocated",
                        "frames": frames(MAKE_X),
                    },
                    {
                        "address": y_addr,
                        "size": 0x20000,
                        "requested_size": 0x20000,
                        "state": "inactive",
                        "frames": [],  # a freed block: its stack is in the history
                    },
                    {
                        "address": SEG0 + 0x40000,
                        "size": 0x10000,
                        "requested_size": 0x10000,
                        "state": "active_awaiting_free",  # the docstring's spelling
                        "frames": frames(TRAP),
                    },
                    {"size": (2 << 20) - 0x50000, "requested_size": 0, "state": "inactive", "frames": []},
                    "not a block",  # malformed: skipped and counted
                ],
            },
            {
                "device": 1,
                "address": SEG1,
                "total_size": 20 << 20,
                "stream": 0x5555AAAA0000,
                "segment_type": "large",
                "is_expandable": True,
                "frames": [],
                "blocks": [
                    {
                        "address": SEG1,
                        "size": 20 << 20,
                        "requested_size": 10 << 20,
                        "state": "active_allocated",
                        "frames": [TRITON_FRAME, TORCH_FRAME],  # no user frame at all
                    }
                ],
            },
            {"device": 0, "address": "bad"},  # malformed: skipped
        ],
        "device_traces": [
            [  # cuda:0, oldest first
                {"action": "segment_alloc", "addr": SEG0, "size": 2 << 20, "stream": 0, "frames": frames(MAKE_X)},
                {"action": "alloc", "addr": SEG0, "size": 0x20000, "stream": 0, "frames": frames(MAKE_X)},
                {"action": "alloc", "addr": y_addr, "size": 0x20000, "stream": 0, "frames": frames(KERNEL_Y)},
                {
                    "action": "free_requested",
                    "addr": y_addr,
                    "size": 0x20000,
                    "stream": 0,
                    "frames": frames(("/work/main/probes/conditions.py", 230, "_call_and_check")),
                },
                {"action": "free_completed", "addr": y_addr, "size": 0x20000, "stream": 0, "frames": []},
                {"action": "alloc", "addr": SEG0 + 0x40000, "size": 0x10000, "stream": 0, "frames": frames(TRAP)},
            ],
            [  # cuda:1
                {"action": "alloc", "addr": SEG1, "size": 10 << 20, "stream": 0x5555AAAA0000, "frames": []},
            ],
        ],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "expandable_segments": False},
    }


def reduced() -> AllocatorSnapshot:
    return reduce_snapshot(hand_made_snapshot())


# ---------------------------------------------------------------------------------------------
# The reduction
# ---------------------------------------------------------------------------------------------


def test_reduction_keeps_segments_blocks_states_streams_and_user_frames() -> None:
    snap = reduced()
    assert snap.taken and not snap.truncated
    assert [(s.device, s.address, s.size, s.pool, s.expandable) for s in snap.segments] == [
        (0, SEG0, 2 << 20, "small", False),
        (1, SEG1, 20 << 20, "large", True),
    ]
    seg0 = snap.segments[0]
    assert [b.state for b in seg0.blocks] == ["active_allocated", "inactive", "active_pending_free", "inactive"]
    # the block without an address key sits where the sizes before it end
    assert seg0.blocks[3].address == SEG0 + 0x50000 and seg0.blocks[3].end == seg0.end
    # innermost user-code frame: torch's and C++ frames skipped
    assert seg0.blocks[0].frame is not None and seg0.blocks[0].frame.render() == "conditions.py:97 in make_operands"
    assert seg0.blocks[1].frame is None
    assert snap.segments[1].stream == 0x5555AAAA0000
    assert snap.segments[1].blocks[0].frame is None  # only library frames
    assert any("2 malformed" in n for n in snap.notes)  # the string block and the bad segment
    y = next(h for h in snap.history if h.address == SEG0 + 0x20000)
    assert y.freed and y.frame is not None and y.frame.name == "moe_grouped_gemm"
    assert y.free_frame is not None and y.free_frame.name == "_call_and_check"
    x = next(h for h in snap.history if h.address == SEG0)
    assert not x.freed
    assert [h.device for h in snap.history].count(1) == 1


def test_user_frame_needs_python_source_outside_the_libraries() -> None:
    assert user_frame([CPP_FRAME, TORCH_FRAME]) is None
    assert user_frame("not a list") is None
    f = user_frame(frames(KERNEL_Y, MAKE_X))
    assert f is not None and f.line == 57
    # the child adds the directories torch and the stdlib were loaded from
    assert user_frame(frames(KERNEL_Y), library_parts=(*LIBRARY_PARTS, "/work/main/kernels/")) is None


def test_reduction_caps_blocks_and_history_and_says_so() -> None:
    snap = reduce_snapshot(hand_made_snapshot(), max_blocks=2, max_history_per_device=1)
    assert snap.truncated
    assert sum(len(s.blocks) for s in snap.segments) == 2
    assert len([h for h in snap.history if h.device == 0]) == 1
    assert snap.history[0].address == SEG0 + 0x40000  # the latest allocation is the one kept
    assert any("cut to 2 blocks" in n for n in snap.notes)


def test_reduction_of_an_empty_or_odd_snapshot_does_not_raise() -> None:
    assert reduce_snapshot({}).segments == ()
    odd = reduce_snapshot({"segments": "nope", "device_traces": [None, ["x"]]})
    assert odd.taken and odd.segments == () and odd.history == ()
    assert any("no segment list" in n for n in odd.notes)


def test_the_fact_round_trips_through_json() -> None:
    snap = reduced()
    fact = json.loads(json.dumps(to_jsonable(snap)))
    assert read_allocator_snapshot(fact) == snap
    assert read_allocator_snapshot(None) is None
    assert read_allocator_snapshot({"taken": "yes", "segments": 3}) is None


# ---------------------------------------------------------------------------------------------
# Attribution from the snapshot
# ---------------------------------------------------------------------------------------------


def test_an_address_in_a_freed_block_names_its_segment_and_allocating_line() -> None:
    snap = reduced()
    address = SEG0 + 0x20000 + 1024
    place = locate_in_snapshot(address, snap)
    assert place is not None and place.device == 0 and place.block is not None
    assert place.block.state == "inactive" and place.allocation is not None
    text = snapshot_sentence(place)
    assert text.startswith(
        f"inside a freed block (131,072 bytes at 0x{SEG0 + 0x20000:x}, byte 1,024 of it) of segment "
        f"0x{SEG0:x} (2,097,152 bytes, small pool, stream 0x0) on cuda:0"
    )
    assert "allocated at grouped_gemm.py:57 in moe_grouped_gemm and freed since" in text
    assert "(at conditions.py:230 in _call_and_check)" in text


def test_a_live_block_names_its_own_allocator_and_is_not_called_freed() -> None:
    text = snapshot_sentence(locate_in_snapshot(SEG0 + 8, reduced()))  # type: ignore[arg-type]
    assert "inside a live block" in text and "allocated at conditions.py:97 in make_operands" in text
    assert "freed" not in text


def test_an_address_in_the_free_rest_falls_back_to_the_segments_line() -> None:
    text = snapshot_sentence(locate_in_snapshot(SEG0 + 0x60000, reduced()))  # type: ignore[arg-type]
    assert "inside a freed block" in text
    assert "no recorded allocation covers it, the segment was reserved at conditions.py:97" in text


def test_an_address_outside_every_segment_is_placed_nowhere() -> None:
    assert locate_in_snapshot(SEG0 - 1, reduced()) is None
    assert locate_in_snapshot(SEG1 + (20 << 20), reduced()) is None


def test_attribution_adds_the_allocators_word_to_the_tensor_placement() -> None:
    x = TensorInfo(
        name="x", device="cuda:0", data_ptr=SEG0, nbytes=0x20000, shape=(256, 256), strides=(256, 1), dtype="bfloat16"
    )
    address = SEG0 + 0x20000 + 16  # 16 bytes after x: the freed y
    a = attribute_address(address, {"cuda:0": [x]}, access="write of 16 bytes", snapshot=reduced())
    assert a.sentences[0].startswith("write 16 bytes after the 131,072-byte region of x (256 x 256 bf16) on cuda:0")
    assert a.allocator is not None and a.allocator.block is not None
    assert a.sentences[-1].startswith(f"Allocator: 0x{address:x} is inside a freed block")
    outside = attribute_address(SEG0 - 4096, {"cuda:0": [x]}, snapshot=reduced())
    assert outside.allocator is None and "lies in no segment" in outside.sentences[-1]
    untaken = attribute_address(address, {"cuda:0": [x]}, snapshot=AllocatorSnapshot(taken=False, reason="off"))
    assert not any(s.startswith("Allocator") for s in untaken.sentences)


# ---------------------------------------------------------------------------------------------
# The repro confirmation reads the fact (plumbing: a recorded memcheck log, a hand-made fact)
# ---------------------------------------------------------------------------------------------


def test_the_sanitizer_confirmation_uses_a_snapshot_when_the_run_has_one(tmp_path: Path) -> None:
    """The real memcheck run turns the caching allocator off, so its fact says ``taken: false``;
    this checks that a run which does carry a snapshot gets its addresses placed by it. The log
    and tensors are our recorded H200 run; the snapshot fact is HAND-MADE around its y."""
    y = 0x7F7CC49A0000  # the allocation memcheck measured against in the recorded log
    fact = to_jsonable(
        reduce_snapshot(
            {
                "segments": [
                    {
                        "device": 0,
                        "address": y,
                        "total_size": 2 << 20,
                        "stream": 0,
                        "segment_type": "small",
                        "frames": [],
                        "blocks": [
                            {"address": y, "size": 131072, "state": "inactive", "frames": []},
                            {"address": y + 131072, "size": (2 << 20) - 131072, "state": "inactive", "frames": []},
                        ],
                    }
                ],
                "device_traces": [
                    [
                        {"action": "alloc", "addr": y, "size": 131072, "stream": 0, "frames": frames(KERNEL_Y)},
                        {"action": "alloc", "addr": y + 131072, "size": 512, "stream": 0, "frames": frames(TRAP)},
                        {"action": "free_completed", "addr": y + 131072, "size": 512, "stream": 0, "frames": []},
                    ]
                ],
            }
        )
    )
    recorded = from_json(Outcome, (RECORDED / "memcheck-unmasked-overrouted-nocache.stdout").read_text().splitlines()[-1])
    sanitized = dataclasses.replace(recorded, facts={**recorded.facts, "allocator_snapshot": fact})

    def run(argv: Sequence[str], env: Mapping[str, str], timeout_s: float) -> CommandResult:
        log = Path(argv[list(argv).index("--log-file") + 1])
        log.write_text((RECORDED / "memcheck-unmasked-overrouted-nocache.log").read_text())
        return CommandResult(returncode=0, stdout="QMOE-OUTCOME " + to_json(sanitized) + "\n", stderr="", wall_s=6.0)

    target = Outcome(
        probe_id="GPU 0/over-routed",
        spec=sanitized.spec,
        status=Status.ERROR,
        phase=Phase.SYNC,
        error_kind=ErrorKind.ILLEGAL_ADDRESS,
    )
    c = confirm_with_sanitizer(
        target,
        SanitizerInfo(path="/opt/cuda/bin/compute-sanitizer", version="2025.3.1.0", found_via="PATH"),
        base_env={},
        gpu_of_ordinal={0: 0, 1: 1},
        log_dir=tmp_path,
        runner=run,
        watch_xid=None,
    )
    assert c.status == "confirmed"
    first = c.attributions[0]
    assert "Allocator: 0x7f7cc49c0000 is inside a freed block (1,966,080 bytes at 0x7f7cc49c0000" in first
    assert "allocated at conditions.py:182 in __init__ and freed since" in first  # the trap's canary
    assert c.xid is None and c.xid_evidence == ()


# ---------------------------------------------------------------------------------------------
# The recorder's guards, and run_one's fact
# ---------------------------------------------------------------------------------------------


def spec(cond: Condition = Condition.SINGLE, device: int | None = 0, current: int | None = 0) -> ProbeSpec:
    return ProbeSpec(
        probe_id="t", kernel="builtin", condition=cond, device=device, current=current, shape=Shape(m=8, e=2, n=8, k=8)
    )


@pytest.mark.parametrize(
    ("s", "environ", "words"),
    [
        (spec(), {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}, "caching allocator is off"),
        (spec(Condition.UNTOUCHED, device=1, current=0), {}, "untouched"),
        (spec(device=None, current=None), {}, "CPU probe"),
    ],
)
def test_the_recorder_says_why_it_records_nothing(s: ProbeSpec, environ: dict[str, str], words: str) -> None:
    rec = AllocatorRecorder(s, environ=environ)
    rec.start()
    snap = rec.finish()
    assert not snap.taken and words in snap.reason


class _FakeMemory:
    """Stands for torch.cuda.memory: records the calls, returns the hand-made snapshot."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[dict[str, Any]] = []
        self.fail = fail

    def _record_memory_history(self, enabled: Any = "all", **kw: Any) -> None:
        self.calls.append({"enabled": enabled, **kw})

    def _snapshot(self) -> dict[str, Any]:
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return hand_made_snapshot()


def test_the_recorder_records_and_reduces_with_the_private_api(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    mem = _FakeMemory()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory", mem)
    rec = AllocatorRecorder(spec(), environ={}, max_entries=123)
    rec.start()
    snap = rec.finish()
    assert snap.taken and len(snap.segments) == 2
    assert mem.calls[0] == {"enabled": "all", "context": "all", "stacks": "python", "max_entries": 123}
    assert mem.calls[-1] == {"enabled": None}  # turned off again


def test_the_recorder_survives_a_failing_or_missing_api(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory", _FakeMemory(fail=True))
    rec = AllocatorRecorder(spec(), environ={})
    rec.start()
    snap = rec.finish()
    assert not snap.taken and "illegal memory access" in snap.reason
    monkeypatch.setattr(torch.cuda, "memory", object())
    rec = AllocatorRecorder(spec(), environ={})
    rec.start()
    assert "_record_memory_history" in rec.finish().reason


def test_run_one_writes_the_outcome_then_again_with_the_snapshot(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    s = spec()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory", _FakeMemory())
    monkeypatch.setattr(
        run_one, "run_outcome", lambda sp: Outcome(probe_id=sp.probe_id, spec=sp, status=Status.PASS, phase=Phase.DONE)
    )
    monkeypatch.delenv("PYTORCH_NO_CUDA_MEMORY_CACHING", raising=False)
    monkeypatch.setattr(run_one.faulthandler, "enable", lambda **kw: None)  # capsys has no fileno
    assert run_one.main([to_json(s)]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(run_one.OUTCOME_PREFIX)]
    assert len(lines) == 2
    first, last = (from_json(Outcome, ln.removeprefix(run_one.OUTCOME_PREFIX)) for ln in lines)
    assert "allocator_snapshot" not in first.facts
    snap = read_allocator_snapshot(last.facts["allocator_snapshot"])
    assert snap is not None and snap.taken and len(snap.segments) == 2


def test_run_one_on_a_cpu_probe_says_why_there_is_no_snapshot() -> None:
    s = ProbeSpec(
        probe_id="CPU/single", kernel="builtin", condition=Condition.SINGLE, shape=Shape(m=16, e=2, n=8, k=8, dtype="float32")
    )
    o = from_json(Outcome, run_one.run(s))
    assert o.status is Status.PASS
    snap = read_allocator_snapshot(o.facts["allocator_snapshot"])
    assert snap is not None and not snap.taken and "CPU probe" in snap.reason
    assert any(n.startswith("no allocator snapshot: ") for n in o.notes)
