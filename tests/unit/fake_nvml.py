"""A fake ``pynvml`` module for CPU tests: describes GPUs, links and failures in plain data.

Install it with ``monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(...).module())``.
Function names, argument order, return shapes and error codes follow nvidia-ml-py 13.x
(``pynvml.py``): lists for [current, pending] modes, tuples for compute capability and
remapped rows, objects with ``busId`` / ``total`` / ``free`` attributes, ``NVMLError(code)``
with ``.value``.

Events (``qmoe_doctor.machine.xid``): ``nvmlEventSetCreate``, ``nvmlDeviceGetSupportedEventTypes``,
``nvmlDeviceRegisterEvents``, ``nvmlEventSetWait_v2`` (NVML_ERROR_TIMEOUT when nothing is due)
and ``nvmlEventSetFree``, as nvidia-ml-py 13.x spells them; the waited-for record has the
fields of ``c_nvmlEventData_t`` (``device``, ``eventType``, ``eventData`` = the Xid number,
``gpuInstanceId``, ``computeInstanceId``). A GPU's ``xids`` are delivered to the first wait
after its registration; ``FakeNvml.inject_xid`` delivers one later (from another thread: a
scripted fault in the middle of a run). ``FakeGpu.event_types=None`` makes the GPU answer
NVML_ERROR_NOT_SUPPORTED, as GPUs in many VMs do.
"""

from __future__ import annotations

import threading
import time
import types
from collections import deque
from dataclasses import dataclass, field
from typing import Any

GIB = 1024**3

# nvmlReturn_t codes used here (pynvml.NVML_ERROR_*)
UNINITIALIZED = 1
INVALID_ARGUMENT = 2
NOT_SUPPORTED = 3
NO_PERMISSION = 4
NOT_FOUND = 6
DRIVER_NOT_LOADED = 9
TIMEOUT = 10
LIBRARY_NOT_FOUND = 12
FUNCTION_NOT_FOUND = 13
GPU_IS_LOST = 15
UNKNOWN = 999

_MESSAGES = {
    UNINITIALIZED: "Uninitialized",
    INVALID_ARGUMENT: "Invalid Argument",
    NOT_SUPPORTED: "Not Supported",
    NO_PERMISSION: "Insufficient Permissions",
    NOT_FOUND: "Not Found",
    DRIVER_NOT_LOADED: "Driver Not Loaded",
    TIMEOUT: "Timeout",
    LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    FUNCTION_NOT_FOUND: "Function Not Found",
    GPU_IS_LOST: "GPU is lost",
    UNKNOWN: "Unknown Error",
}

# nvmlGpuTopologyLevel_t
TOPO_INTERNAL, TOPO_SINGLE, TOPO_MULTIPLE, TOPO_HOSTBRIDGE, TOPO_NODE, TOPO_SYSTEM = 0, 10, 20, 30, 40, 50
# nvmlGpuP2PStatus_t
P2P_OK, P2P_CNS, P2P_GNS, P2P_TNS, P2P_DRK, P2P_NS, P2P_UNKNOWN = range(7)
# nvmlGpuP2PCapsIndex_t
CAPS_READ, CAPS_WRITE, CAPS_NVLINK = 0, 1, 2
# nvmlNvLinkDeviceType_t
LINK_GPU, LINK_NPU, LINK_SWITCH = 0, 1, 2
# nvmlEventType bits (pynvml.nvmlEventType*)
EVENT_SBE, EVENT_DBE, EVENT_PSTATE, EVENT_XID = 0x1, 0x2, 0x4, 0x8
EVENT_TYPES_DEFAULT = EVENT_SBE | EVENT_DBE | EVENT_PSTATE | EVENT_XID


class NVMLError(Exception):
    """Shape of pynvml.NVMLError: the return code in ``.value``, text from ``str()``."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"NVML Error with code {self.value}")


@dataclass
class FakeLink:
    remote_bus_id: str
    remote_type: int = LINK_GPU
    active: bool = True


@dataclass
class FakeGpu:
    name: str
    uuid: str
    bus_id: str
    cc: tuple[int, int]
    memory_total: int = 80 * GIB
    memory_free: int = 79 * GIB
    mig: tuple[int, int] | None = (0, 0)  # None: MIG not supported on this GPU
    mig_devices: tuple[str, ...] = ()
    ecc: tuple[int, int] | None = (1, 1)
    ecc_uncorrected: tuple[int, int] | None = (0, 0)  # volatile, aggregate; None: not supported
    retired: tuple[int, int] | None = None  # SBE, DBE page counts; None: not supported (Hopper)
    retired_pending: int | None = None
    remapped: tuple[int, int, int, int] | None = (0, 0, 0, 0)  # corr, unc, pending, failure
    links: list[FakeLink] = field(default_factory=list)  # empty: no NVLink at all
    fail: dict[str, int] = field(default_factory=dict)  # function name -> error code it raises
    event_types: int | None = EVENT_TYPES_DEFAULT  # supported event mask; None: NOT_SUPPORTED
    xids: list[int] = field(default_factory=list)  # Xids delivered to the first waits after registration


@dataclass
class _Handle:
    pos: int


@dataclass
class _MigHandle:
    uuid: str


@dataclass
class _Pci:
    busId: str  # pynvml's field name


@dataclass
class _Memory:
    total: int
    free: int
    used: int


@dataclass
class _EventData:
    """c_nvmlEventData_t's fields."""

    device: Any
    eventType: int
    eventData: int
    gpuInstanceId: int = 0xFFFFFFFF  # NVML_GPU_INSTANCE_ID_ANY: not attributable to a MIG instance
    computeInstanceId: int = 0xFFFFFFFF


@dataclass
class _EventSet:
    registered: dict[int, int] = field(default_factory=dict)  # GPU position -> event mask
    pending: deque[_EventData] = field(default_factory=deque)
    freed: bool = False


class FakeNvml:
    """The whole fake machine. ``module()`` builds a fresh module object each call."""

    def __init__(
        self,
        gpus: list[FakeGpu],
        *,
        topology: dict[frozenset[int], int] | None = None,
        p2p: dict[tuple[int, int, int], int] | None = None,
        p2p_default: int = P2P_OK,
        driver: str = "580.95.05",
        cuda: int = 13000,
        init_error: int | None = None,
        count_error: int | None = None,
        handle_errors: dict[int, int] | None = None,
        event_set_error: int | None = None,
        wait_error: int | None = None,
    ) -> None:
        self.gpus = gpus
        self.topology = topology or {}
        self.p2p = p2p or {}
        self.p2p_default = p2p_default
        self.driver = driver
        self.cuda = cuda
        self.init_error = init_error
        self.count_error = count_error
        self.handle_errors = handle_errors or {}
        self.event_set_error = event_set_error  # nvmlEventSetCreate raises it
        self.wait_error = wait_error  # nvmlEventSetWait_v2 raises it (other than TIMEOUT)
        self.initialized = 0
        self.calls: list[str] = []
        self.event_sets: list[_EventSet] = []
        self._events_lock = threading.Lock()

    def inject_xid(self, pos: int, xid: int) -> None:
        """Deliver Xid ``xid`` on GPU ``pos`` to every event set that registered it for Xids."""
        with self._events_lock:
            for es in self.event_sets:
                if not es.freed and es.registered.get(pos, 0) & EVENT_XID:
                    es.pending.append(_EventData(device=_Handle(pos), eventType=EVENT_XID, eventData=xid))

    # -- helpers --------------------------------------------------------------------------
    def _gpu(self, handle: Any, fn: str) -> FakeGpu:
        self.calls.append(fn)
        if not self.initialized:
            raise NVMLError(UNINITIALIZED)
        if not isinstance(handle, _Handle):
            raise NVMLError(INVALID_ARGUMENT)
        gpu = self.gpus[handle.pos]
        if fn in gpu.fail:
            raise NVMLError(gpu.fail[fn])
        return gpu

    def module(self) -> types.ModuleType:
        mod = types.ModuleType("pynvml")
        fake = self
        mod.NVMLError = NVMLError  # type: ignore[attr-defined]
        mod.NVML_NVLINK_MAX_LINKS = 18  # type: ignore[attr-defined]
        mod.NVML_ERROR_NOT_SUPPORTED = NOT_SUPPORTED  # type: ignore[attr-defined]
        mod.NVML_ERROR_NOT_FOUND = NOT_FOUND  # type: ignore[attr-defined]
        mod.NVML_ERROR_FUNCTION_NOT_FOUND = FUNCTION_NOT_FOUND  # type: ignore[attr-defined]
        mod.NVML_ERROR_NO_PERMISSION = NO_PERMISSION  # type: ignore[attr-defined]
        mod.NVML_ERROR_TIMEOUT = TIMEOUT  # type: ignore[attr-defined]
        mod.nvmlEventTypeXidCriticalError = EVENT_XID  # type: ignore[attr-defined]

        def nvmlInit() -> None:
            if fake.init_error is not None:
                raise NVMLError(fake.init_error)
            fake.initialized += 1

        def nvmlShutdown() -> None:
            if not fake.initialized:
                raise NVMLError(UNINITIALIZED)
            fake.initialized -= 1

        def nvmlSystemGetDriverVersion() -> str:
            return fake.driver

        def nvmlSystemGetNVMLVersion() -> str:
            return "13." + fake.driver

        def nvmlSystemGetCudaDriverVersion_v2() -> int:
            return fake.cuda

        def nvmlDeviceGetCount() -> int:
            if fake.count_error is not None:
                raise NVMLError(fake.count_error)
            return len(fake.gpus)

        def nvmlDeviceGetHandleByIndex(index: int) -> _Handle:
            if index in fake.handle_errors:
                raise NVMLError(fake.handle_errors[index])
            if not 0 <= index < len(fake.gpus):
                raise NVMLError(INVALID_ARGUMENT)
            return _Handle(index)

        def nvmlDeviceGetName(h: Any) -> str:
            return fake._gpu(h, "nvmlDeviceGetName").name

        def nvmlDeviceGetUUID(h: Any) -> str:
            if isinstance(h, _MigHandle):
                return h.uuid
            return fake._gpu(h, "nvmlDeviceGetUUID").uuid

        def nvmlDeviceGetPciInfo(h: Any) -> _Pci:
            return _Pci(fake._gpu(h, "nvmlDeviceGetPciInfo").bus_id)

        def nvmlDeviceGetMemoryInfo(h: Any, version: Any = None) -> _Memory:
            g = fake._gpu(h, "nvmlDeviceGetMemoryInfo")
            return _Memory(total=g.memory_total, free=g.memory_free, used=g.memory_total - g.memory_free)

        def nvmlDeviceGetCudaComputeCapability(h: Any) -> tuple[int, int]:
            return fake._gpu(h, "nvmlDeviceGetCudaComputeCapability").cc

        def nvmlDeviceGetMigMode(h: Any) -> list[int]:
            g = fake._gpu(h, "nvmlDeviceGetMigMode")
            if g.mig is None:
                raise NVMLError(NOT_SUPPORTED)
            return list(g.mig)

        def nvmlDeviceGetMaxMigDeviceCount(h: Any) -> int:
            g = fake._gpu(h, "nvmlDeviceGetMaxMigDeviceCount")
            return 7 if g.mig else 0

        def nvmlDeviceGetMigDeviceHandleByIndex(h: Any, index: int) -> _MigHandle:
            g = fake._gpu(h, "nvmlDeviceGetMigDeviceHandleByIndex")
            if index >= len(g.mig_devices):
                raise NVMLError(NOT_FOUND)
            return _MigHandle(g.mig_devices[index])

        def nvmlDeviceGetEccMode(h: Any) -> list[int]:
            g = fake._gpu(h, "nvmlDeviceGetEccMode")
            if g.ecc is None:
                raise NVMLError(NOT_SUPPORTED)
            return list(g.ecc)

        def nvmlDeviceGetTotalEccErrors(h: Any, error_type: int, counter_type: int) -> int:
            g = fake._gpu(h, "nvmlDeviceGetTotalEccErrors")
            assert error_type == 1, "the doctor asks for uncorrected errors"
            if g.ecc_uncorrected is None:
                raise NVMLError(NOT_SUPPORTED)
            return g.ecc_uncorrected[counter_type]

        def nvmlDeviceGetRetiredPages(h: Any, cause: int) -> list[int]:
            g = fake._gpu(h, "nvmlDeviceGetRetiredPages")
            if g.retired is None:
                raise NVMLError(NOT_SUPPORTED)
            return [0x1000 * i for i in range(g.retired[cause])]

        def nvmlDeviceGetRetiredPagesPendingStatus(h: Any) -> int:
            g = fake._gpu(h, "nvmlDeviceGetRetiredPagesPendingStatus")
            if g.retired_pending is None:
                raise NVMLError(NOT_SUPPORTED)
            return g.retired_pending

        def nvmlDeviceGetRemappedRows(h: Any) -> tuple[int, int, int, int]:
            g = fake._gpu(h, "nvmlDeviceGetRemappedRows")
            if g.remapped is None:
                raise NVMLError(NOT_SUPPORTED)
            return g.remapped

        def _link(h: Any, link: int, fn: str) -> FakeLink:
            g = fake._gpu(h, fn)
            if not g.links:
                raise NVMLError(NOT_SUPPORTED)
            if not isinstance(link, int) or not 0 <= link < len(g.links):
                raise NVMLError(INVALID_ARGUMENT)
            return g.links[link]

        def nvmlDeviceGetNvLinkState(h: Any, link: int) -> int:
            return int(_link(h, link, "nvmlDeviceGetNvLinkState").active)

        def nvmlDeviceGetNvLinkRemoteDeviceType(h: Any, link: int) -> int:
            return _link(h, link, "nvmlDeviceGetNvLinkRemoteDeviceType").remote_type

        def nvmlDeviceGetNvLinkRemotePciInfo(h: Any, link: int) -> _Pci:
            return _Pci(_link(h, link, "nvmlDeviceGetNvLinkRemotePciInfo").remote_bus_id)

        def nvmlDeviceGetTopologyCommonAncestor(a: Any, b: Any) -> int:
            fake._gpu(a, "nvmlDeviceGetTopologyCommonAncestor")
            fake._gpu(b, "nvmlDeviceGetTopologyCommonAncestor")
            key = frozenset({a.pos, b.pos})
            if key not in fake.topology:
                raise NVMLError(NOT_SUPPORTED)
            return fake.topology[key]

        def nvmlDeviceGetP2PStatus(a: Any, b: Any, caps: int) -> int:
            fake._gpu(a, "nvmlDeviceGetP2PStatus")
            fake._gpu(b, "nvmlDeviceGetP2PStatus")
            if not isinstance(caps, int):  # the real binding hands this to ctypes
                raise TypeError(f"p2pIndex must be an int, got {caps!r}")
            return fake.p2p.get((a.pos, b.pos, caps), fake.p2p_default)

        def nvmlDeviceGetSupportedEventTypes(h: Any) -> int:
            g = fake._gpu(h, "nvmlDeviceGetSupportedEventTypes")
            if g.event_types is None:
                raise NVMLError(NOT_SUPPORTED)
            return g.event_types

        def nvmlEventSetCreate() -> _EventSet:
            fake.calls.append("nvmlEventSetCreate")
            if not fake.initialized:
                raise NVMLError(UNINITIALIZED)
            if fake.event_set_error is not None:
                raise NVMLError(fake.event_set_error)
            es = _EventSet()
            with fake._events_lock:
                fake.event_sets.append(es)
            return es

        def nvmlDeviceRegisterEvents(h: Any, event_types: int, es: Any) -> None:
            g = fake._gpu(h, "nvmlDeviceRegisterEvents")
            if not isinstance(es, _EventSet) or es.freed:
                raise NVMLError(INVALID_ARGUMENT)
            if g.event_types is None or event_types & ~g.event_types:
                raise NVMLError(NOT_SUPPORTED)
            with fake._events_lock:
                es.registered[h.pos] = es.registered.get(h.pos, 0) | event_types
                if event_types & EVENT_XID:
                    for xid in g.xids:
                        es.pending.append(_EventData(device=_Handle(h.pos), eventType=EVENT_XID, eventData=xid))

        def nvmlEventSetWait_v2(es: Any, timeoutms: int) -> _EventData:
            if not isinstance(es, _EventSet) or es.freed:
                raise NVMLError(INVALID_ARGUMENT)
            if fake.wait_error is not None:
                raise NVMLError(fake.wait_error)
            with fake._events_lock:
                if es.pending:
                    return es.pending.popleft()
            time.sleep(min(timeoutms, 5) / 1000)  # a real wait would block up to timeoutms
            with fake._events_lock:
                if es.pending:
                    return es.pending.popleft()
            raise NVMLError(TIMEOUT)

        def nvmlEventSetFree(es: Any) -> None:
            if not isinstance(es, _EventSet) or es.freed:
                raise NVMLError(INVALID_ARGUMENT)
            es.freed = True

        for fn in (
            nvmlInit,
            nvmlShutdown,
            nvmlSystemGetDriverVersion,
            nvmlSystemGetNVMLVersion,
            nvmlSystemGetCudaDriverVersion_v2,
            nvmlDeviceGetCount,
            nvmlDeviceGetHandleByIndex,
            nvmlDeviceGetName,
            nvmlDeviceGetUUID,
            nvmlDeviceGetPciInfo,
            nvmlDeviceGetMemoryInfo,
            nvmlDeviceGetCudaComputeCapability,
            nvmlDeviceGetMigMode,
            nvmlDeviceGetMaxMigDeviceCount,
            nvmlDeviceGetMigDeviceHandleByIndex,
            nvmlDeviceGetEccMode,
            nvmlDeviceGetTotalEccErrors,
            nvmlDeviceGetRetiredPages,
            nvmlDeviceGetRetiredPagesPendingStatus,
            nvmlDeviceGetRemappedRows,
            nvmlDeviceGetNvLinkState,
            nvmlDeviceGetNvLinkRemoteDeviceType,
            nvmlDeviceGetNvLinkRemotePciInfo,
            nvmlDeviceGetTopologyCommonAncestor,
            nvmlDeviceGetP2PStatus,
            nvmlDeviceGetSupportedEventTypes,
            nvmlEventSetCreate,
            nvmlDeviceRegisterEvents,
            nvmlEventSetWait_v2,
            nvmlEventSetFree,
        ):
            setattr(mod, fn.__name__, fn)
        return mod


# --- machines ---------------------------------------------------------------------------------

H200_UUIDS = (
    "GPU-6a1c9e0b-3f2d-4c55-9a1e-0d4b7e2f1a10",
    "GPU-b83e27f4-91c0-4d2a-8e6f-53a7c19d0b22",
)


def two_h200_nvswitch() -> FakeNvml:
    """Two H200 of an HGX board: 18 NVLinks each, all to NVSwitches (nvidia-smi: NV18)."""

    def h200(i: int, bus: str) -> FakeGpu:
        return FakeGpu(
            name="NVIDIA H200",
            uuid=H200_UUIDS[i],
            bus_id=bus,
            cc=(9, 0),
            memory_total=141 * GIB,
            memory_free=140 * GIB,
            links=[FakeLink(f"00000000:{0xA0 + k % 4:02X}:00.0", LINK_SWITCH) for k in range(18)],
        )

    return FakeNvml(
        [h200(0, "00000000:18:00.0"), h200(1, "00000000:2A:00.0")],
        topology={frozenset({0, 1}): TOPO_NODE},
    )


MIXED_UUIDS = (
    "GPU-0a0a0a0a-1111-4000-8000-000000000000",
    "GPU-0b0b0b0b-2222-4000-8000-000000000000",
    "GPU-0c0c0c0c-3333-4000-8000-000000000000",
    "GPU-0d0d0d0d-4444-4000-8000-000000000000",
)
MIG_UUIDS = (
    "MIG-7f7f7f7f-aaaa-5000-8000-000000000000",
    "MIG-7e7e7e7e-bbbb-5000-8000-000000000000",
)


def four_mixed() -> FakeNvml:
    """Four GPUs of three generations, PCI order 0..3:

    * GPU 0, 1: A100 (8.0), 12 direct NVLinks between them (NV12), one PCIe switch (PIX).
    * GPU 2: H100 PCIe (9.0), MIG on, two MIG instances; NODE to 0 and 1.
    * GPU 3: L4 (8.9), no NVLink, no ECC counters, no MIG support, memory query refused;
      across the NUMA boundary (SYS), P2P not supported by topology.

    FASTEST_FIRST (by compute capability) enumerates 2, 3, 0, 1.
    """
    a100 = dict(name="NVIDIA A100-SXM4-80GB", cc=(8, 0), retired=(0, 0), retired_pending=0)
    gpus = [
        FakeGpu(
            uuid=MIXED_UUIDS[0],
            bus_id="00000000:07:00.0",
            links=[FakeLink("00000000:0F:00.0") for _ in range(12)],
            **a100,  # type: ignore[arg-type]
        ),
        FakeGpu(
            uuid=MIXED_UUIDS[1],
            bus_id="00000000:0F:00.0",
            # one link down, and the remote address in CUDA's 4-digit-domain spelling
            links=[FakeLink("0000:07:00.0") for _ in range(11)] + [FakeLink("0000:07:00.0", active=False)],
            **a100,  # type: ignore[arg-type]
        ),
        FakeGpu(
            name="NVIDIA H100 PCIe",
            uuid=MIXED_UUIDS[2],
            bus_id="00000000:47:00.0",
            cc=(9, 0),
            mig=(1, 1),
            mig_devices=MIG_UUIDS,
        ),
        FakeGpu(
            name="NVIDIA L4",
            uuid=MIXED_UUIDS[3],
            bus_id="00000000:87:00.0",
            cc=(8, 9),
            memory_total=24 * GIB,
            mig=None,
            ecc=(0, 0),
            ecc_uncorrected=None,
            remapped=None,
            fail={"nvmlDeviceGetMemoryInfo": NO_PERMISSION},
        ),
    ]
    topology = {
        frozenset({0, 1}): TOPO_SINGLE,
        frozenset({0, 2}): TOPO_NODE,
        frozenset({1, 2}): TOPO_NODE,
        frozenset({0, 3}): TOPO_SYSTEM,
        frozenset({1, 3}): TOPO_SYSTEM,
        frozenset({2, 3}): TOPO_SYSTEM,
    }
    p2p: dict[tuple[int, int, int], int] = {}
    for a in range(4):
        for b in range(4):
            if a != b and {a, b} != {0, 1}:
                p2p[(a, b, CAPS_NVLINK)] = P2P_NS
            if a != b and 3 in (a, b):
                p2p[(a, b, CAPS_READ)] = P2P_TNS
                p2p[(a, b, CAPS_WRITE)] = P2P_TNS
    return FakeNvml(gpus, topology=topology, p2p=p2p)
