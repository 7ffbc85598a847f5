"""Xid evidence on a CPU: the kernel log's ``NVRM: Xid`` lines, NVML's Xid events through the fake
NVML (tests/unit/fake_nvml.py: a scripted Xid 31, GPUs that answer NotSupported, no driver),
the sentences that place an Xid 31 address, and the repro's sanitizer step watching a run.

The kernel-log lines below are written for these tests after the formats in public reports
(NVIDIA/open-gpu-kernel-modules #363, #1030; doitsujin/dxvk #1027, #1799), with our H200s' PCI
locations and our recorded tensors' addresses: they are not recordings of our machines.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest
from fake_nvml import (
    DRIVER_NOT_LOADED,
    GPU_IS_LOST,
    NO_PERMISSION,
    NOT_SUPPORTED,
    FakeNvml,
    two_h200_nvswitch,
)

from qmoe_doctor.core.allocator import AllocatorSnapshot, AllocBlock, AllocHistory, AllocSegment
from qmoe_doctor.core.records import (
    ErrorKind,
    Outcome,
    Phase,
    Status,
    TensorInfo,
    from_json,
    from_jsonable,
    to_json,
    to_jsonable,
)
from qmoe_doctor.core.reports import SanitizerConfirmation
from qmoe_doctor.core.xid import (
    KernelXid,
    XidEvent,
    XidReport,
    new_kernel_lines,
    parse_kernel_xid_lines,
    pci_key,
)
from qmoe_doctor.diagnose.xid import place_fault_address, xid_evidence
from qmoe_doctor.machine.sanitizer import SanitizerInfo
from qmoe_doctor.machine.xid import XidWatcher
from qmoe_doctor.workflows.repro import CommandResult, confirm_with_sanitizer

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "sanitizer" / "2026-11-22-2xh200-7ada31c"
X_ADDR = 0x7F7CC4800200  # x of the recorded over-routed run, on cuda:0 (GPU 0)

# a dmesg excerpt: two unrelated older lines, then what a cross-GPU read on GPU 1 would print
KERNEL_LOG = """\
[    2.329368] NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  580.95.05
[  365.969676] NVRM: GPU at PCI:0000:2a:00: GPU-b83e27f4-91c0-4d2a-8e6f-53a7c19d0b22
[  365.969680] NVRM: GPU Board Serial Number: 0
[  365.969681] NVRM: Xid (PCI:0000:2a:00): 31, pid=4242, name=python3, channel 0x00000010, intr 00000000. \
MMU Fault: ENGINE GRAPHICS GPC3 GPCCLIENT_T1_5 faulted @ 0x7f7c_c4800000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ
[  365.969901] NVRM: Xid (PCI:0000:2a:00): 43, pid=4242, name=python3, channel 00000010
Nov 29 11:28:11 zeus kernel: NVRM: Xid (PCI:0000:c1:00): 31, Ch 0000003b, intr 00000000. MMU Fault: ENGINE HOST0 \
HUBCLIENT_HOST_CPU faulted @ 0x1_0c3c0000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_WRITE
[Mon Nov 29 11:28:12 2021] NVRM: Xid (PCI:0000:18:00): 13, Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address
garbage NVRM: Xid (PCI:zz): 31, nonsense
"""


# ---------------------------------------------------------------------------------------------
# The kernel log
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("00000000:18:00.0", "0000:18:00"),  # NVML
        ("0000:2A:00.0", "0000:2a:00"),  # CUDA
        ("0000:2a:00", "0000:2a:00"),  # the kernel log
        ("18:00.0", "0000:18:00"),
        ("not a bus id", None),
    ],
)
def test_pci_key_spells_every_form_alike(text: str, key: str | None) -> None:
    assert pci_key(text) == key


def test_kernel_xid_lines_are_parsed_with_their_fault_details() -> None:
    lines = parse_kernel_xid_lines(KERNEL_LOG, gpu_of_pci={"00000000:18:00.0": 0, "00000000:2A:00.0": 1})
    assert [(x.pci, x.xid) for x in lines] == [
        ("0000:2a:00", 31),
        ("0000:2a:00", 43),
        ("0000:c1:00", 31),
        ("0000:18:00", 13),
    ]
    mmu = lines[0]
    assert (mmu.gpu_index, mmu.pid, mmu.process) == (1, 4242, "python3")
    assert mmu.uuid == "GPU-b83e27f4-91c0-4d2a-8e6f-53a7c19d0b22"
    assert mmu.address == 0x7F7CC4800000  # "0x7f7c_c4800000": the underscore only groups digits
    assert (mmu.engine, mmu.fault_type, mmu.access_type) == (
        "GRAPHICS GPC3 GPCCLIENT_T1_5",
        "FAULT_PDE",
        "ACCESS_TYPE_VIRT_READ",
    )
    assert mmu.access == "read" and mmu.uptime_s == pytest.approx(365.969681)
    old = lines[2]  # a release without pid/name, under a syslog prefix
    assert old.pid is None and old.gpu_index is None and old.stamp == "Nov 29 11:28:11"
    assert old.address == 0x10C3C0000 and old.access == "write"
    sm = lines[3]
    assert sm.address is None and sm.gpu_index == 0 and "Out Of Range Address" in sm.text
    assert sm.stamp == "Mon Nov 29 11:28:12 2021"


def test_only_lines_new_since_the_run_started_count() -> None:
    before = KERNEL_LOG.split("[  365.969681]")[0]
    fresh = new_kernel_lines(before, KERNEL_LOG)
    assert [x.xid for x in fresh] == [31, 43, 31, 13]
    assert new_kernel_lines(KERNEL_LOG, KERNEL_LOG) == []
    # the same line printed once more after the run is new once
    again = KERNEL_LOG + KERNEL_LOG.splitlines()[4] + "\n"
    assert [x.xid for x in new_kernel_lines(KERNEL_LOG, again)] == [43]


def test_parsing_odd_text_never_raises() -> None:
    assert parse_kernel_xid_lines("") == []
    assert parse_kernel_xid_lines("NVRM: Xid (PCI:0000:01:00): 31 MMU Fault: faulted @ 0xzz") != []


# ---------------------------------------------------------------------------------------------
# NVML events through the fake
# ---------------------------------------------------------------------------------------------


def watcher(fake: FakeNvml, gpus: Sequence[int] = (0, 1), **kw: object) -> XidWatcher:
    return XidWatcher(gpus, nvml=fake.module(), kernel_log=None, settle_s=0, poll_ms=5, **kw)  # type: ignore[arg-type]


def test_a_scripted_xid_31_is_collected_with_its_gpu() -> None:
    fake = two_h200_nvswitch()
    fake.gpus[1].xids = [31]
    with watcher(fake) as w:
        pass
    r = w.report()
    assert r.unavailable is None and r.watched == (0, 1)
    assert [(e.gpu_index, e.xid, e.event_data) for e in r.events] == [(1, 31, 31)]
    assert r.status == "watched GPU 0, GPU 1" and r.xids == (31,)
    assert fake.initialized == 0  # NVML shut down again
    assert all(es.freed for es in fake.event_sets)


def test_an_xid_during_the_run_is_caught() -> None:
    fake = two_h200_nvswitch()
    with watcher(fake) as w:
        fake.inject_xid(0, 31)  # the fault, in the middle of the watched block
        fake.inject_xid(0, 43)
    assert [(e.gpu_index, e.xid) for e in w.report().events] == [(0, 31), (0, 43)]


def test_an_xid_arriving_from_another_thread_while_the_run_goes_on_is_caught() -> None:
    fake = two_h200_nvswitch()
    with watcher(fake) as w:
        t = threading.Timer(0.02, fake.inject_xid, args=(1, 31))
        t.start()
        t.join()
        time.sleep(0.05)  # the run goes on a little
    assert [(e.gpu_index, e.xid) for e in w.report().events] == [(1, 31)]


def test_events_not_supported_make_the_watcher_unavailable_never_raising() -> None:
    fake = two_h200_nvswitch()
    for g in fake.gpus:
        g.event_types = None  # NVML_ERROR_NOT_SUPPORTED, as in many VMs
    with watcher(fake) as w:
        fake.inject_xid(1, 31)  # nobody registered: not delivered
    r = w.report()
    assert r.watched == () and r.events == ()
    assert r.status.startswith("unavailable: GPU 0: Xid events not supported")
    assert "GPU 1" in (r.unavailable or "")
    assert fake.initialized == 0


@pytest.mark.parametrize(("code", "words"), [(NOT_SUPPORTED, "not supported"), (NO_PERMISSION, "not permitted")])
def test_one_gpu_refusing_registration_leaves_the_other_watched(code: int, words: str) -> None:
    fake = two_h200_nvswitch()
    fake.gpus[1].fail["nvmlDeviceRegisterEvents"] = code
    fake.gpus[0].xids = [31]
    with watcher(fake) as w:
        pass
    r = w.report()
    assert r.unavailable is None and r.watched == (0,)
    assert any(n.startswith("GPU 1: Xid events") and words in n for n in r.notes)
    assert [e.gpu_index for e in r.events] == [0]


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: FakeNvml(two_h200_nvswitch().gpus, init_error=DRIVER_NOT_LOADED), "NVML could not start"),
        (lambda: FakeNvml(two_h200_nvswitch().gpus, event_set_error=NOT_SUPPORTED), "cannot create an event set"),
        (lambda: FakeNvml(two_h200_nvswitch().gpus, handle_errors={0: GPU_IS_LOST, 1: GPU_IS_LOST}), "cannot open"),
    ],
)
def test_nvml_trouble_is_a_reason_not_an_exception(make: Callable[[], FakeNvml], words: str) -> None:
    with watcher(make()) as w:
        pass
    assert words in (w.report().unavailable or "")


def test_a_failing_wait_is_noted_and_stops_listening() -> None:
    fake = FakeNvml(two_h200_nvswitch().gpus, wait_error=GPU_IS_LOST)
    with watcher(fake) as w:
        pass
    r = w.report()
    assert r.unavailable is None and any("wait failed" in n and "GPU is lost" in n for n in r.notes)


def test_without_pynvml_the_watcher_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    with XidWatcher([0], kernel_log=None, settle_s=0) as w:
        pass
    assert "cannot be imported" in (w.report().unavailable or "")


def test_nothing_to_watch() -> None:
    with XidWatcher([], kernel_log=None) as w:
        pass
    assert w.report().unavailable == "no GPU to watch"


def test_the_kernel_log_is_read_before_and_after_and_kept_to_the_watched_gpus() -> None:
    before = KERNEL_LOG.split("[  365.969681]")[0]
    reads = iter([(before, ""), (KERNEL_LOG, "")])
    fake = two_h200_nvswitch()
    with XidWatcher([1], nvml=fake.module(), kernel_log=lambda: next(reads), settle_s=0, poll_ms=5) as w:
        pass
    lines = w.report().kernel_lines
    assert [(x.xid, x.gpu_index) for x in lines] == [(31, 1), (43, 1)]  # GPU 0's and others' left out


@pytest.mark.parametrize(
    "reader",
    [lambda: (None, "dmesg exited with status 1: Operation not permitted"), lambda: 1 / 0],
)
def test_an_unreadable_kernel_log_is_a_reason(reader: Callable[[], tuple[str | None, str]]) -> None:
    with XidWatcher([0], nvml=two_h200_nvswitch().module(), kernel_log=reader, settle_s=0, poll_ms=5) as w:
        pass
    r = w.report()
    assert r.kernel_log is not None and r.kernel_lines == ()
    assert r.unavailable is None  # NVML still watched


def test_the_report_round_trips_through_json() -> None:
    fake = two_h200_nvswitch()
    fake.gpus[1].xids = [31]
    before = KERNEL_LOG.split("[  365.969681]")[0]
    reads = iter([(before, ""), (KERNEL_LOG, "")])
    with XidWatcher([0, 1], nvml=fake.module(), kernel_log=lambda: next(reads), settle_s=0, poll_ms=5) as w:
        pass
    r = w.report()
    assert r.events and r.kernel_lines
    back = from_jsonable(XidReport, json.loads(json.dumps(dataclasses.asdict(r))))
    assert back == r


# ---------------------------------------------------------------------------------------------
# Evidence: an Xid 31 address placed against every device's tensors
# ---------------------------------------------------------------------------------------------

X = TensorInfo(
    name="x", device="cuda:0", data_ptr=X_ADDR, nbytes=131072, shape=(256, 256), strides=(256, 1), dtype="bfloat16"
)
W1 = TensorInfo(
    name="w", device="cuda:1", data_ptr=0x7F5A00000000, nbytes=1 << 20, shape=(8, 256, 256),
    strides=(65536, 256, 1), dtype="bfloat16",
)
TABLES = {"cuda:0": [X], "cuda:1": [W1]}
DEVICES = {0: "cuda:0", 1: "cuda:1"}


def mmu_line(gpu: int, address: int) -> KernelXid:
    return KernelXid(
        pci="0000:2a:00", xid=31, text="...", raw="...", gpu_index=gpu, address=address,
        fault_type="FAULT_PDE", access_type="ACCESS_TYPE_VIRT_READ",
    )


def test_an_xid_31_on_one_gpu_inside_another_gpus_tensor_is_a_cross_gpu_dereference() -> None:
    said = place_fault_address(mmu_line(1, 0x7F7CC4800000), TABLES, device_of_gpu=DEVICES)
    assert said[0] == (
        "the faulting page 0x7f7cc4800000 holds part of x (256 x 256 bf16) on cuda:0 (GPU 0) (which starts 512 bytes into the page)"
    )
    assert said[1].startswith("the MMU of cuda:1 (GPU 1) faulted on memory of cuda:0 (GPU 0)")


def test_an_xid_31_inside_the_faulting_gpus_own_tensor_points_at_unmapped_memory() -> None:
    said = place_fault_address(mmu_line(0, X_ADDR + 4096), TABLES, device_of_gpu=DEVICES)
    assert "belongs to a tensor of cuda:0 (GPU 0) itself" in said[-1]


def test_an_xid_31_address_near_no_tensor_says_how_far_and_the_allocator_places_it() -> None:
    snap = AllocatorSnapshot(
        taken=True,
        segments=(
            AllocSegment(
                device=0, address=0x7F7CC4A00000, size=2 << 20, stream=0, pool="small",
                blocks=(AllocBlock(address=0x7F7CC4A00000, size=2 << 20, state="inactive"),),
            ),
        ),
        history=(AllocHistory(device=0, address=0x7F7CC4A00000, size=4096, stream=0, freed=True),),
    )
    said = place_fault_address(mmu_line(1, 0x7F7CC4A00000), TABLES, device_of_gpu=DEVICES, snapshot=snap)
    assert said[0].startswith("read ") and "after the 131,072-byte region of x (256 x 256 bf16) on cuda:0" in said[0]
    assert said[-1].startswith("Allocator: 0x7f7cc4a00000 is inside a freed block")


def test_evidence_folds_nvml_events_and_says_what_is_missing() -> None:
    r = XidReport(
        gpus=(0, 1),
        watched=(0, 1),
        events=(
            XidEvent(gpu_index=1, xid=31, event_data=31, time=1.0),
            XidEvent(gpu_index=1, xid=31, event_data=31, time=2.0),
        ),
        kernel_log="dmesg exited with status 1: Operation not permitted",
    )
    said = xid_evidence(r, TABLES, device_of_gpu=DEVICES)
    assert said[0].startswith("NVML: Xid 31 (GPU memory page fault: an MMU fault) on GPU 1 (cuda:1) during the run, 2 times")
    assert "NVML gives no address: the kernel log's Xid 31 line has it (dmesg exited" in said[0]
    assert said[-1] == "kernel log: not read (dmesg exited with status 1: Operation not permitted)."
    quiet = xid_evidence(XidReport(gpus=(0,), watched=(0,)))
    assert quiet == ("NVML Xid events: none on GPU 0 during the run.",)
    off = xid_evidence(XidReport(gpus=(0,), unavailable="GPU 0: Xid events not supported (Not Supported)"))
    assert off == ("NVML Xid events: unavailable: GPU 0: Xid events not supported (Not Supported).",)


# ---------------------------------------------------------------------------------------------
# The repro's sanitizer step watches its run
# ---------------------------------------------------------------------------------------------

INFO = SanitizerInfo(path="/opt/cuda/bin/compute-sanitizer", version="2025.3.1.0", found_via="PATH")


def test_the_sanitizer_confirmation_carries_the_runs_xids_with_the_address_placed(tmp_path: Path) -> None:
    """A synthetic cross-GPU fault: during the (recorded) memcheck run, NVML delivers Xid 31 on
    GPU 1 and the kernel log gains the line of a read of x's page, x living on cuda:0."""
    fake = two_h200_nvswitch()
    log_text = {"now": KERNEL_LOG.split("[  365.969681]")[0]}
    recorded = from_json(Outcome, (RECORDED / "memcheck-unmasked-overrouted-nocache.stdout").read_text().splitlines()[-1])
    calls: list[Sequence[str]] = []

    def run(argv: Sequence[str], env: Mapping[str, str], timeout_s: float) -> CommandResult:
        calls.append(argv)
        Path(argv[list(argv).index("--log-file") + 1]).write_text(
            (RECORDED / "memcheck-unmasked-overrouted-nocache.log").read_text()
        )
        fake.inject_xid(1, 31)  # the fault, while the sanitized probe runs
        log_text["now"] = KERNEL_LOG
        return CommandResult(returncode=0, stdout="QMOE-OUTCOME " + to_json(recorded) + "\n", stderr="", wall_s=6.0)

    watch = functools.partial(
        XidWatcher, nvml=fake.module(), kernel_log=lambda: (log_text["now"], ""), settle_s=0, poll_ms=5
    )
    target = Outcome(
        probe_id="0->1/no-peer", spec=recorded.spec, status=Status.ERROR, phase=Phase.SYNC,
        error_kind=ErrorKind.ILLEGAL_ADDRESS,
    )
    c = confirm_with_sanitizer(
        target, INFO, base_env={}, gpu_of_ordinal={0: 0, 1: 1}, log_dir=tmp_path, runner=run, watch_xid=watch
    )
    assert c.status == "confirmed" and len(calls) == 1
    assert c.xid is not None and [(e.gpu_index, e.xid) for e in c.xid.events] == [(1, 31)]
    assert [(k.xid, k.gpu_index) for k in c.xid.kernel_lines] == [(31, 1), (43, 1), (13, 0)]  # both GPUs watched
    text = " ".join(c.xid_evidence)
    assert "NVML: Xid 31 (GPU memory page fault: an MMU fault) on GPU 1 (cuda:1) during the run." in text
    assert "kernel log: Xid 31 (GPU memory page fault: an MMU fault) on GPU 1, pid 4242 (python3): read fault" in text
    assert "the faulting page 0x7f7cc4800000 holds part of x (256 x 256 bf16) on cuda:0 (GPU 0)" in text
    assert "the MMU of cuda:1 (GPU 1) faulted on memory of cuda:0 (GPU 0)" in text
    # as the repro report's JSON holds it (``report_json`` -> ``sanitizer``), and back
    back = from_jsonable(SanitizerConfirmation, json.loads(json.dumps(to_jsonable(c))))
    assert back.xid == c.xid and back.xid_evidence == c.xid_evidence


def test_the_sanitizer_step_without_nvml_still_confirms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    recorded = (RECORDED / "memcheck-builtin-clean.stdout").read_text().splitlines()[-1]

    def run(argv: Sequence[str], env: Mapping[str, str], timeout_s: float) -> CommandResult:
        Path(argv[list(argv).index("--log-file") + 1]).write_text((RECORDED / "memcheck-builtin-clean.log").read_text())
        return CommandResult(returncode=0, stdout="QMOE-OUTCOME " + recorded + "\n", stderr="", wall_s=5.0)

    target = from_json(Outcome, recorded)
    target = dataclasses.replace(target, status=Status.ERROR, error_kind=ErrorKind.ILLEGAL_ADDRESS)
    c = confirm_with_sanitizer(
        target, INFO, base_env={}, gpu_of_ordinal={0: 0}, log_dir=tmp_path, runner=run,
        watch_xid=functools.partial(XidWatcher, kernel_log=None, settle_s=0),
    )
    assert c.status == "clean"
    assert c.xid is not None and "cannot be imported" in (c.xid.unavailable or "")
    assert c.xid_evidence[-1].startswith("NVML Xid events: unavailable: pynvml")
