"""The GPU inventory, learned from NVML (which creates no CUDA context), and GPU selection.

Three numberings meet here; keeping them apart is the point of this module:

* **NVML index** (what ``nvidia-smi`` prints, what ``--gpus`` takes): PCI bus id order.
* **CUDA ordinal in the user's process**: CUDA's enumeration order (``CUDA_DEVICE_ORDER``,
  default FASTEST_FIRST), filtered and reordered by ``CUDA_VISIBLE_DEVICES``. Integer entries
  of ``CUDA_VISIBLE_DEVICES`` count in *CUDA's* order, not nvidia-smi's.
* **CUDA ordinal inside a probe child**: the parent sets ``CUDA_VISIBLE_DEVICES`` to the
  selected GPUs' UUIDs in ``--gpus`` order, so ``cuda:i`` is the i-th selected GPU.

GPUs are matched between CUDA and NVML by UUID or PCI bus id, never by index.
NVML failures (no driver, no library) give an inventory of zero GPUs with ``nvml_error``
set; they never raise to the caller.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from qmoe_doctor.core import knobs
from qmoe_doctor.core.compat import StrEnum
from qmoe_doctor.core.records import SCHEMA_VERSION


class LinkKind(StrEnum):
    """How two GPUs reach each other, named as ``nvidia-smi topo -m`` names it, nearest first."""

    SELF = "X"
    NVLINK = "NV"  # a bonded set of NVLinks (rendered NV<count>), direct or through NVSwitch
    PIX = "PIX"  # at most one PCIe bridge
    PXB = "PXB"  # several PCIe bridges, no host bridge
    PHB = "PHB"  # a PCIe host bridge (typically the CPU)
    NODE = "NODE"  # the interconnect between host bridges within one NUMA node
    SYS = "SYS"  # the SMP interconnect between NUMA nodes (QPI/UPI/xGMI)
    UNKNOWN = "?"  # NVML could not say


class P2PStatus(StrEnum):
    """``nvmlDeviceGetP2PStatus`` results (``nvidia-smi topo -p2p`` codes in ``short``)."""

    OK = "ok"
    CHIPSET_NOT_SUPPORTED = "chipset-not-supported"
    GPU_NOT_SUPPORTED = "gpu-not-supported"
    TOPOLOGY_NOT_SUPPORTED = "topology-not-supported"
    DISABLED_BY_REGKEY = "disabled-by-regkey"
    NOT_SUPPORTED = "not-supported"
    UNKNOWN = "unknown"

    @property
    def short(self) -> str:
        return _P2P_SHORT[self]


_P2P_SHORT = {
    P2PStatus.OK: "OK",
    P2PStatus.CHIPSET_NOT_SUPPORTED: "CNS",
    P2PStatus.GPU_NOT_SUPPORTED: "GNS",
    P2PStatus.TOPOLOGY_NOT_SUPPORTED: "TNS",
    P2PStatus.DISABLED_BY_REGKEY: "DRK",
    P2PStatus.NOT_SUPPORTED: "NS",
    P2PStatus.UNKNOWN: "U",
}

# nvmlGpuP2PStatus_t values, in enum order.
_P2P_BY_CODE = (
    P2PStatus.OK,
    P2PStatus.CHIPSET_NOT_SUPPORTED,
    P2PStatus.GPU_NOT_SUPPORTED,
    P2PStatus.TOPOLOGY_NOT_SUPPORTED,
    P2PStatus.DISABLED_BY_REGKEY,
    P2PStatus.NOT_SUPPORTED,
    P2PStatus.UNKNOWN,
)

# nvmlGpuP2PCapsIndex_t. Spelled out because nvidia-ml-py 13.x defines
# ``NVML_P2P_CAPS_INDEX_READ = 0,`` (a tuple, trailing comma), which ctypes rejects.
_P2P_READ, _P2P_WRITE, _P2P_NVLINK = 0, 1, 2

# nvmlGpuTopologyLevel_t -> nvidia-smi label. INTERNAL is two GPUs on one board (K80-style),
# which sit behind one on-board PCIe switch.
_TOPOLOGY_LEVEL = {
    0: LinkKind.PIX,
    10: LinkKind.PIX,
    20: LinkKind.PXB,
    30: LinkKind.PHB,
    40: LinkKind.NODE,
    50: LinkKind.SYS,
}

# NVML return codes that mean "this GPU / driver has no such thing", not a failure.
_NVML_NOT_SUPPORTED = 3
_NVML_NOT_FOUND = 6
_NVML_FUNCTION_NOT_FOUND = 13
_ABSENT_CODES = frozenset({_NVML_NOT_SUPPORTED, _NVML_NOT_FOUND, _NVML_FUNCTION_NOT_FOUND})

_NVLINK_DEVICE_GPU = 0
_NVLINK_DEVICE_SWITCH = 2


class DeviceOrder(StrEnum):
    """``CUDA_DEVICE_ORDER`` values CUDA understands."""

    FASTEST_FIRST = "FASTEST_FIRST"  # the default: CUDA guesses the fastest GPU and puts it first
    PCI_BUS_ID = "PCI_BUS_ID"  # the order nvidia-smi and NVML use


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuInfo:
    """One physical GPU as NVML sees it. ``None`` means NVML does not support the query here."""

    index: int  # NVML index (nvidia-smi's), the number --gpus takes
    name: str
    uuid: str  # "GPU-..."; what probe children are pinned by
    pci_bus_id: str  # as NVML spells it, e.g. "00000000:18:00.0"
    memory_total: int | None = None  # bytes
    memory_free: int | None = None  # bytes
    compute_capability: tuple[int, int] | None = None
    mig_current: bool | None = None
    mig_pending: bool | None = None  # differs from current until the GPU is reset
    mig_devices: tuple[str, ...] = ()  # "MIG-..." UUIDs of its MIG instances
    ecc_current: bool | None = None
    ecc_pending: bool | None = None
    ecc_volatile_uncorrected: int | None = None  # since the last driver load
    ecc_aggregate_uncorrected: int | None = None  # over the GPU's lifetime
    retired_pages_sbe: int | None = None  # pages retired for multiple single-bit errors
    retired_pages_dbe: int | None = None  # pages retired for double-bit errors
    retired_pages_pending: bool | None = None  # a retirement waits for the next driver load
    remapped_rows_correctable: int | None = None  # row remapping (A100 and newer)
    remapped_rows_uncorrectable: int | None = None
    remap_pending: bool | None = None  # a remap waits for a GPU reset
    remap_failure: bool | None = None  # a remap failed: the GPU should be serviced
    query_errors: tuple[str, ...] = ()  # NVML queries that failed for a reason other than support

    @property
    def cc_text(self) -> str:
        return "?" if self.compute_capability is None else "{}.{}".format(*self.compute_capability)

    def describe(self) -> str:
        """``GPU 3 (NVIDIA H200, 00000000:18:00.0)``."""
        return f"GPU {self.index} ({self.name}, {self.pci_bus_id})"


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuPair:
    """How GPU ``a`` reaches GPU ``b`` (NVML indices, a != b). The link is symmetric; the P2P
    status is per direction (``a`` accessing ``b``'s memory)."""

    a: int
    b: int
    link: LinkKind
    nvlinks: int = 0  # active NVLinks between the two, direct plus through NVSwitch
    via_nvswitch: bool = False
    pcie: LinkKind | None = None  # PCIe common ancestor, also where NVLink connects them
    p2p_read: P2PStatus | None = None  # None: NVML could not tell
    p2p_write: P2PStatus | None = None
    p2p_nvlink: P2PStatus | None = None

    @property
    def label(self) -> str:
        """The ``nvidia-smi topo -m`` cell: ``NV18``, ``PIX``, ``SYS``, ..."""
        return f"NV{self.nvlinks}" if self.link is LinkKind.NVLINK else self.link.value


@dataclass(frozen=True, slots=True, kw_only=True)
class CudaOrdinal:
    """``cuda:<ordinal>`` in a process started with this environment is NVML GPU ``nvml_index``."""

    ordinal: int
    nvml_index: int
    uuid: str  # the GPU's UUID, or the MIG instance's when ``mig``
    mig: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class Inventory:
    """Everything the doctor knows about the machine before it starts a probe."""

    schema_version: int = SCHEMA_VERSION
    gpus: tuple[GpuInfo, ...] = ()
    pairs: tuple[GpuPair, ...] = ()  # every ordered pair (a, b), a != b
    driver_version: str | None = None
    cuda_driver_version: str | None = None  # highest CUDA the driver supports, e.g. "13.0"
    nvml_version: str | None = None
    nvml_py_version: str | None = None  # the nvidia-ml-py distribution
    torch_version: str | None = None  # from package metadata; torch is never imported here
    triton_version: str | None = None
    python_version: str = ""
    platform: str = ""
    cuda_visible_devices: str | None = None  # raw value; None when unset
    cuda_device_order: str | None = None  # raw value; None when unset
    device_order: DeviceOrder = DeviceOrder.FASTEST_FIRST  # the order CUDA uses
    cuda_ordinals: tuple[CudaOrdinal, ...] = ()  # the user's cuda:i -> NVML GPU (predicted)
    warnings: tuple[str, ...] = ()
    nvml_error: str | None = None  # why there are no GPUs, when NVML could not be used

    def gpu(self, index: int) -> GpuInfo:
        for gpu in self.gpus:
            if gpu.index == index:
                return gpu
        raise KeyError(f"no GPU with NVML index {index}")

    def pair(self, a: int, b: int) -> GpuPair | None:
        for pair in self.pairs:
            if pair.a == a and pair.b == b:
                return pair
        return None


class GpuSelectionError(ValueError):
    """A ``--gpus`` value that names no usable set of GPUs. The message says what exists."""


# --------------------------------------------------------------------------------------------
# Collection


def collect_inventory(*, environ: Mapping[str, str] | None = None) -> Inventory:
    """Read the GPUs, links, P2P status and versions from NVML and package metadata.

    ``environ`` (default ``os.environ``) supplies CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER
    for the ordinal mapping. Never raises for NVML trouble: see ``Inventory.nvml_error``.
    """
    env = os.environ if environ is None else environ
    base = _base_inventory(env)
    try:
        nvml = importlib.import_module("pynvml")
    except ImportError as exc:
        return replace(base, nvml_error=f"pynvml (the nvidia-ml-py package) cannot be imported: {exc}")
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError (no library, no driver), OSError from ctypes
        return replace(base, nvml_error=f"NVML could not start: {_nvml_text(exc)}")
    try:
        return _collect(nvml, base)
    except (nvml.NVMLError, OSError) as exc:
        return replace(base, nvml_error=f"NVML failed while listing GPUs: {_nvml_text(exc)}")
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:  # shutting down a library that half-failed is best effort
            pass


def _base_inventory(env: Mapping[str, str]) -> Inventory:
    order, order_warnings = _device_order(env.get(knobs.CUDA_DEVICE_ORDER))
    return Inventory(
        torch_version=_dist_version("torch"),
        triton_version=_dist_version("triton", "pytorch-triton"),
        nvml_py_version=_dist_version("nvidia-ml-py"),
        python_version=platform.python_version(),
        platform=f"{sys.platform} {platform.machine()}",
        cuda_visible_devices=env.get(knobs.CUDA_VISIBLE_DEVICES),
        cuda_device_order=env.get(knobs.CUDA_DEVICE_ORDER),
        device_order=order,
        warnings=order_warnings,
    )


def _collect(nvml: Any, base: Inventory) -> Inventory:
    query = _Query(nvml)
    sys_errors: list[str] = []
    driver = query(sys_errors, "driver version", "nvmlSystemGetDriverVersion")
    nvml_version = query(sys_errors, "NVML version", "nvmlSystemGetNVMLVersion")
    cuda_raw = query(sys_errors, "CUDA driver version", "nvmlSystemGetCudaDriverVersion_v2")
    if cuda_raw is None:
        cuda_raw = query(sys_errors, "CUDA driver version", "nvmlSystemGetCudaDriverVersion")

    count = int(nvml.nvmlDeviceGetCount())
    warnings = list(base.warnings)
    handles: list[Any] = []
    gpus: list[GpuInfo] = []
    for index in range(count):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except nvml.NVMLError as exc:
            warnings.append(f"GPU {index}: NVML cannot open it ({_nvml_text(exc)}); left out")
            continue
        handles.append(handle)
        gpus.append(_read_gpu(query, index, handle))

    pairs = _read_pairs(nvml, query, gpus, handles) if len(gpus) > 1 else ()
    ordinals, ordinal_warnings = map_cuda_ordinals(
        gpus, visible=base.cuda_visible_devices, order=base.device_order
    )
    warnings += ordinal_warnings
    warnings += _health_warnings(gpus, pairs)
    warnings += [f"NVML: {e}" for e in sys_errors]
    return replace(
        base,
        gpus=tuple(gpus),
        pairs=pairs,
        driver_version=None if driver is None else _text(driver),
        cuda_driver_version=None if cuda_raw is None else _cuda_version_text(int(cuda_raw)),
        nvml_version=None if nvml_version is None else _text(nvml_version),
        cuda_ordinals=ordinals,
        warnings=tuple(warnings),
    )


class _Query:
    """Calls one NVML function; "not supported here" gives None, other failures are noted."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml

    def __call__(self, errors: list[str], what: str, fn_name: str, *args: Any) -> Any:
        fn = getattr(self.nvml, fn_name, None)
        if fn is None:  # older nvidia-ml-py without this binding
            return None
        try:
            return fn(*args)
        except self.nvml.NVMLError as exc:
            if getattr(exc, "value", None) not in _ABSENT_CODES:
                errors.append(f"{what}: {_nvml_text(exc)}")
            return None


def _read_gpu(query: _Query, index: int, handle: Any) -> GpuInfo:
    errors: list[str] = []
    name = query(errors, "name", "nvmlDeviceGetName", handle)
    uuid = query(errors, "UUID", "nvmlDeviceGetUUID", handle)
    pci = query(errors, "PCI info", "nvmlDeviceGetPciInfo", handle)
    memory = query(errors, "memory", "nvmlDeviceGetMemoryInfo", handle)
    cc = query(errors, "compute capability", "nvmlDeviceGetCudaComputeCapability", handle)
    mig = query(errors, "MIG mode", "nvmlDeviceGetMigMode", handle)
    ecc = query(errors, "ECC mode", "nvmlDeviceGetEccMode", handle)
    # NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1; NVML_VOLATILE_ECC = 0, NVML_AGGREGATE_ECC = 1
    ecc_vol = query(errors, "ECC volatile count", "nvmlDeviceGetTotalEccErrors", handle, 1, 0)
    ecc_agg = query(errors, "ECC aggregate count", "nvmlDeviceGetTotalEccErrors", handle, 1, 1)
    # NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0, ..._DOUBLE_BIT_ECC_ERROR = 1
    sbe = query(errors, "retired pages (SBE)", "nvmlDeviceGetRetiredPages", handle, 0)
    dbe = query(errors, "retired pages (DBE)", "nvmlDeviceGetRetiredPages", handle, 1)
    retire_pending = query(errors, "retired pages pending", "nvmlDeviceGetRetiredPagesPendingStatus", handle)
    remap = query(errors, "remapped rows", "nvmlDeviceGetRemappedRows", handle)

    mig_devices: tuple[str, ...] = ()
    if mig is not None and bool(mig[0]):
        mig_devices = _read_mig_devices(query, errors, handle)
    return GpuInfo(
        index=index,
        name="unknown" if name is None else _text(name),
        uuid="" if uuid is None else _text(uuid),
        pci_bus_id="" if pci is None else _text(pci.busId),
        memory_total=None if memory is None else int(memory.total),
        memory_free=None if memory is None else int(memory.free),
        compute_capability=None if cc is None else (int(cc[0]), int(cc[1])),
        mig_current=None if mig is None else bool(mig[0]),
        mig_pending=None if mig is None else bool(mig[1]),
        mig_devices=mig_devices,
        ecc_current=None if ecc is None else bool(ecc[0]),
        ecc_pending=None if ecc is None else bool(ecc[1]),
        ecc_volatile_uncorrected=None if ecc_vol is None else int(ecc_vol),
        ecc_aggregate_uncorrected=None if ecc_agg is None else int(ecc_agg),
        retired_pages_sbe=None if sbe is None else len(sbe),
        retired_pages_dbe=None if dbe is None else len(dbe),
        retired_pages_pending=None if retire_pending is None else bool(retire_pending),
        remapped_rows_correctable=None if remap is None else int(remap[0]),
        remapped_rows_uncorrectable=None if remap is None else int(remap[1]),
        remap_pending=None if remap is None else bool(remap[2]),
        remap_failure=None if remap is None else bool(remap[3]),
        query_errors=tuple(errors),
    )


def _read_mig_devices(query: _Query, errors: list[str], handle: Any) -> tuple[str, ...]:
    count = query(errors, "MIG device count", "nvmlDeviceGetMaxMigDeviceCount", handle)
    uuids: list[str] = []
    for slot in range(int(count or 0)):
        mig_handle = query(errors, "MIG device", "nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
        if mig_handle is None:  # empty slot (NVML_ERROR_NOT_FOUND)
            continue
        uuid = query(errors, "MIG device UUID", "nvmlDeviceGetUUID", mig_handle)
        if uuid is not None:
            uuids.append(_text(uuid))
    return tuple(uuids)


def _read_pairs(nvml: Any, query: _Query, gpus: list[GpuInfo], handles: list[Any]) -> tuple[GpuPair, ...]:
    by_bus = {_bus_key(g.pci_bus_id): pos for pos, g in enumerate(gpus) if g.pci_bus_id}
    direct = [[0] * len(gpus) for _ in gpus]
    switch_links = [0] * len(gpus)
    for pos, handle in enumerate(handles):
        for remote_pos, kind in _nvlinks(nvml, handle, by_bus):
            if kind == _NVLINK_DEVICE_SWITCH:
                switch_links[pos] += 1
            elif remote_pos is not None:
                direct[pos][remote_pos] += 1

    pcie: dict[tuple[int, int], LinkKind | None] = {}
    for i in range(len(gpus)):
        for j in range(i + 1, len(gpus)):
            level = query([], "topology", "nvmlDeviceGetTopologyCommonAncestor", handles[i], handles[j])
            ancestor = None if level is None else _TOPOLOGY_LEVEL.get(int(level), LinkKind.UNKNOWN)
            pcie[(i, j)] = pcie[(j, i)] = ancestor

    pairs: list[GpuPair] = []
    for i, gi in enumerate(gpus):
        for j, gj in enumerate(gpus):
            if i == j:
                continue
            # Each side counts its own links; they agree unless a link is half up. Take the
            # larger, as nvidia-smi shows the bonded set.
            n_direct = max(direct[i][j], direct[j][i])
            n_switch = min(switch_links[i], switch_links[j])
            nvlinks = n_direct + n_switch
            pcie_kind = pcie[(i, j)]
            link = LinkKind.NVLINK if nvlinks else (pcie_kind or LinkKind.UNKNOWN)
            pairs.append(
                GpuPair(
                    a=gi.index,
                    b=gj.index,
                    link=link,
                    nvlinks=nvlinks,
                    via_nvswitch=n_switch > 0,
                    pcie=pcie_kind,
                    p2p_read=_p2p(query, handles[i], handles[j], _P2P_READ),
                    p2p_write=_p2p(query, handles[i], handles[j], _P2P_WRITE),
                    p2p_nvlink=_p2p(query, handles[i], handles[j], _P2P_NVLINK),
                )
            )
    return tuple(pairs)


def _nvlinks(nvml: Any, handle: Any, by_bus: Mapping[tuple[Any, ...], int]) -> list[tuple[int | None, int]]:
    """(position of the remote GPU or None, remote device type) for each active NVLink."""
    links: list[tuple[int | None, int]] = []
    max_links = int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))
    for link in range(max_links):
        try:
            active = nvml.nvmlDeviceGetNvLinkState(handle, link)
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) in _ABSENT_CODES and link == 0:
                break  # no NVLink on this GPU at all
            continue  # this link number does not exist here (invalid argument)
        except AttributeError:
            break
        if not active:
            continue
        try:
            kind = int(nvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link))
        except (nvml.NVMLError, AttributeError):
            kind = _NVLINK_DEVICE_GPU  # drivers before 460 cannot say; GPU-to-GPU then
        if kind == _NVLINK_DEVICE_SWITCH:
            links.append((None, kind))
            continue
        if kind != _NVLINK_DEVICE_GPU:
            continue  # IBM NPU: a CPU link
        try:
            remote = nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)
        except nvml.NVMLError:
            continue
        links.append((by_bus.get(_bus_key(_text(remote.busId))), kind))
    return links


def _p2p(query: _Query, a: Any, b: Any, caps_index: int) -> P2PStatus | None:
    code = query([], "P2P status", "nvmlDeviceGetP2PStatus", a, b, caps_index)
    if code is None:
        return None
    code = int(code)
    return _P2P_BY_CODE[code] if 0 <= code < len(_P2P_BY_CODE) else P2PStatus.UNKNOWN


def _health_warnings(gpus: Sequence[GpuInfo], pairs: Sequence[GpuPair]) -> list[str]:
    out: list[str] = []
    for g in gpus:
        tag = f"GPU {g.index} ({g.name})"
        if g.mig_current:
            out.append(
                f"{tag} has MIG mode on: CUDA sees its MIG instances, not the whole GPU, so "
                "whole-GPU probes cannot run on it"
            )
        if g.mig_pending is not None and g.mig_current is not None and g.mig_pending != g.mig_current:
            out.append(f"{tag}: a MIG mode change is pending until the GPU is reset")
        if g.ecc_volatile_uncorrected:
            out.append(
                f"{tag} reports {g.ecc_volatile_uncorrected} uncorrectable ECC error(s) since the "
                "driver loaded: a memory fault on this GPU may be hardware, not the kernel"
            )
        if g.remap_failure:
            out.append(f"{tag}: a row remapping failed; the GPU needs service")
        if g.remap_pending or g.retired_pages_pending:
            out.append(f"{tag}: retired memory waits for a GPU reset to take effect")
        if not g.uuid:
            out.append(f"{tag}: NVML gave no UUID; probes cannot be pinned to it")
        for err in g.query_errors:
            out.append(f"{tag}: NVML {err}")
    no_p2p: list[str] = []
    for p in pairs:
        if p.p2p_read is None or p.p2p_read is P2PStatus.OK:
            continue
        back = next((q for q in pairs if (q.a, q.b) == (p.b, p.a)), None)
        if back is not None and back.p2p_read is p.p2p_read:
            if p.a < p.b:
                no_p2p.append(f"{p.a}<->{p.b} ({p.p2p_read.value})")
        else:
            no_p2p.append(f"{p.a}->{p.b} ({p.p2p_read.value})")
    if no_p2p:
        out.append(
            "no P2P read access between GPUs " + ", ".join(no_p2p) + ": a kernel on one GPU "
            "cannot read the other's memory directly there"
        )
    return out


# --------------------------------------------------------------------------------------------
# CUDA ordinals


def _device_order(raw: str | None) -> tuple[DeviceOrder, tuple[str, ...]]:
    if raw is None or raw == "":
        return DeviceOrder.FASTEST_FIRST, ()
    try:
        return DeviceOrder(raw), ()
    except ValueError:
        return DeviceOrder.FASTEST_FIRST, (
            f"CUDA_DEVICE_ORDER={raw!r} is not FASTEST_FIRST or PCI_BUS_ID; CUDA falls back to FASTEST_FIRST",
        )


def cuda_enumeration_order(gpus: Sequence[GpuInfo], order: DeviceOrder) -> tuple[GpuInfo, ...]:
    """The order CUDA enumerates these GPUs in before CUDA_VISIBLE_DEVICES applies.

    PCI_BUS_ID is exact. FASTEST_FIRST is CUDA's own guess; it is predicted here from compute
    capability (higher first), ties in PCI bus id order, which is what CUDA does for GPUs of
    one generation.
    """
    by_bus = sorted(gpus, key=lambda g: _bus_key(g.pci_bus_id))
    if order is DeviceOrder.PCI_BUS_ID:
        return tuple(by_bus)
    return tuple(sorted(by_bus, key=lambda g: tuple(-v for v in (g.compute_capability or (0, 0)))))


def parse_visible_devices(text: str) -> list[int] | list[str]:
    """Read CUDA_VISIBLE_DEVICES the way the CUDA driver does (as torch.cuda mirrors it).

    Integers are read like strtoul ("1gpu2" is 1); a negative or unreadable entry ends the
    list; a repeated entry makes the whole list empty. A list starting "GPU-" or "MIG-" is a
    list of UUIDs (or unique prefixes) and ends at the first entry without that prefix.
    """
    entries = text.split(",")
    first = entries[0].strip()
    for prefix in ("GPU-", "MIG-"):
        if first.startswith(prefix):
            uuids: list[str] = []
            for entry in entries:
                entry = entry.strip()
                if entry in uuids:
                    return []
                if not entry.startswith(prefix):
                    break
                uuids.append(entry)
            return uuids
    ordinals: list[int] = []
    for entry in entries:
        value = _strtol(entry.strip())
        if value is None or value < 0:
            break
        if value in ordinals:
            return []
        ordinals.append(value)
    return ordinals


def _strtol(text: str) -> int | None:
    match = re.match(r"[+-]?\d+", text)
    return None if match is None else int(match.group(0))


def map_cuda_ordinals(
    gpus: Sequence[GpuInfo], *, visible: str | None, order: DeviceOrder
) -> tuple[tuple[CudaOrdinal, ...], tuple[str, ...]]:
    """Predict ``cuda:i`` -> NVML GPU for a process started with this environment.

    Returns the mapping and warnings: entries CUDA drops, and CUDA ordinals that do not follow
    nvidia-smi's order (the ``device-order-mismatch`` cause).
    """
    enumerated = cuda_enumeration_order(gpus, order)
    pci_order = cuda_enumeration_order(gpus, DeviceOrder.PCI_BUS_ID)
    fastest_reorders = [g.index for g in enumerated] != [g.index for g in pci_order]
    if visible is None:
        ordinals = [CudaOrdinal(ordinal=i, nvml_index=g.index, uuid=g.uuid) for i, g in enumerate(enumerated)]
        warnings: list[str] = []
    else:
        ordinals, warnings = _apply_visible(gpus, enumerated, visible, fastest_reorders)

    indices = [o.nvml_index for o in ordinals]
    if any(b <= a for a, b in zip(indices, indices[1:], strict=False)):
        mapping = ", ".join(f"cuda:{o.ordinal} is GPU {o.nvml_index}" for o in ordinals)
        causes: list[str] = []
        if fastest_reorders:
            causes.append(
                "CUDA_DEVICE_ORDER is FASTEST_FIRST, the default; order predicted from compute capability"
            )
        if visible is not None:
            causes.append(f"CUDA_VISIBLE_DEVICES={visible!r} lists them in another order")
        warnings.append(
            f"CUDA's device order differs from nvidia-smi's: {mapping} ({'; '.join(causes)}). "
            "Set CUDA_DEVICE_ORDER=PCI_BUS_ID so cuda:i follows nvidia-smi; qmoe-doctor's probes "
            "pin GPUs by UUID and are not affected"
        )
    return tuple(ordinals), tuple(warnings)


def _apply_visible(
    gpus: Sequence[GpuInfo], enumerated: Sequence[GpuInfo], visible: str, fastest_reorders: bool
) -> tuple[list[CudaOrdinal], list[str]]:
    shown = f"CUDA_VISIBLE_DEVICES={visible!r}"
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    parsed = parse_visible_devices(visible)
    if not parsed:
        if visible.strip() in ("", "-1"):
            why = "it hides every GPU"
        elif len(entries) != len(set(entries)) or _repeats_as_ints(entries):
            why = "an entry is repeated, which empties the list"
        else:
            why = f"its first entry {entries[0]!r} names no GPU"
        return [], [f"{shown}: CUDA sees no GPU ({why})"]

    ordinals: list[CudaOrdinal] = []
    warnings: list[str] = []
    stopped = False
    for value in parsed:
        if isinstance(value, int):
            if value >= len(enumerated):
                warnings.append(
                    f"{shown}: there is no CUDA device {value} ({len(enumerated)} GPU(s)); CUDA "
                    "ignores it and every entry after it"
                )
                stopped = True
                break
            g = enumerated[value]
            ordinals.append(CudaOrdinal(ordinal=len(ordinals), nvml_index=g.index, uuid=g.uuid))
            continue
        hit = _match_uuid(gpus, value)
        if hit is None:
            warnings.append(
                f"{shown}: {value!r} matches no GPU, or several; CUDA ignores it and every entry after it"
            )
            stopped = True
            break
        g, full, is_mig = hit
        if any(o.uuid == full for o in ordinals):
            return [], [f"{shown}: {value!r} names a device already listed; CUDA sees no GPU"]
        ordinals.append(CudaOrdinal(ordinal=len(ordinals), nvml_index=g.index, uuid=full, mig=is_mig))
    if isinstance(parsed[0], int) and fastest_reorders:
        warnings.append(
            f"{shown} counts in CUDA's FASTEST_FIRST order, not nvidia-smi's: entry 0 is the GPU CUDA "
            "thinks fastest"
        )
    if not stopped and len(parsed) < len(entries):
        warnings.append(
            f"{shown}: CUDA stops reading at {entries[len(parsed)]!r}; the entries from there on are ignored"
        )
    return ordinals, warnings


def _repeats_as_ints(entries: Sequence[str]) -> bool:
    values = [_strtol(e) for e in entries]
    ints = [v for v in values if v is not None]
    return len(ints) != len(set(ints))


def _match_uuid(gpus: Sequence[GpuInfo], candidate: str) -> tuple[GpuInfo, str, bool] | None:
    """The unique GPU (or MIG instance) whose UUID starts with ``candidate``."""
    hits: list[tuple[GpuInfo, str, bool]] = []
    for g in gpus:
        if g.uuid and g.uuid.startswith(candidate):
            hits.append((g, g.uuid, False))
        hits.extend((g, m, True) for m in g.mig_devices if m.startswith(candidate))
    return hits[0] if len(hits) == 1 else None


# --------------------------------------------------------------------------------------------
# Selection and probe children


#: A GPU index has a few digits; a longer run of digits is refused before int() reads it.
_MAX_INDEX_DIGITS = 6


def _shown(text: str, limit: int = 60) -> str:
    """``repr(text)``, cut to ``limit`` characters: a --gpus value is echoed, not a 5 kB one."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} characters)"


def parse_gpu_spec(spec: str | None) -> tuple[int, ...] | None:
    """The NVML indices ``--gpus`` names, in the order given; None for every GPU (``all``, or
    not given). Checked whatever the machine has: ``a``, ``-1``, ``0-1``, ``0.5`` and ``0,,1``
    are refused on a machine without GPUs too. Raises GpuSelectionError."""
    if spec is None or spec.strip().lower() == "all":
        return None
    text = spec.strip()
    parts = [p.strip() for p in text.split(",")]
    if not text or any(not p for p in parts):
        raise GpuSelectionError(
            f"--gpus {_shown(spec)} is malformed: give NVML indices separated by commas (e.g. --gpus 0,1) or 'all'"
        )
    indices: list[int] = []
    for part in parts:
        # ASCII digits only: str.isdigit() also takes '²' (int() refuses it) and '١' (int()
        # reads it as 1), and a number of thousands of digits is refused by int() itself.
        if not (part.isascii() and part.isdigit()) or len(part) > _MAX_INDEX_DIGITS:
            raise GpuSelectionError(
                f"--gpus {_shown(spec)}: {_shown(part)} is not a GPU index; give NVML indices as "
                "nvidia-smi prints them (e.g. --gpus 0,1) or 'all'"
            )
        value = int(part)
        if value in indices:
            raise GpuSelectionError(f"--gpus {_shown(spec)} names GPU {value} twice")
        indices.append(value)
    return tuple(indices)


def select_gpus(inv: Inventory, spec: str | None) -> tuple[GpuInfo, ...]:
    """The GPUs ``--gpus`` names, in the order given. ``spec`` is NVML indices as nvidia-smi
    prints them ("0,1"), "all", or None (all GPUs). Raises GpuSelectionError."""
    indices = parse_gpu_spec(spec)
    if indices is None:
        return inv.gpus
    if not inv.gpus:
        why = f" ({inv.nvml_error})" if inv.nvml_error else ""
        raise GpuSelectionError(f"--gpus {_shown(str(spec))}: this machine has no GPU that NVML can see{why}")
    known = {g.index: g for g in inv.gpus}
    missing = [i for i in indices if i not in known]
    if missing:
        listing = "; ".join(g.describe() for g in inv.gpus)
        names = ", ".join(str(i) for i in missing)
        raise GpuSelectionError(
            f"--gpus {_shown(str(spec))}: no GPU {names}. This machine has {len(inv.gpus)}: {listing}"
        )
    return tuple(known[i] for i in indices)


def subset_inventory(inv: Inventory, gpus: Sequence[GpuInfo]) -> Inventory:
    """The inventory restricted to these GPUs and the pairs among them (for ``env --gpus``).
    Warnings about the GPUs left out are dropped; the rest (environment, ordinals) stay."""
    keep = {g.index for g in gpus}
    kept_gpus = tuple(g for g in inv.gpus if g.index in keep)
    kept_pairs = tuple(p for p in inv.pairs if p.a in keep and p.b in keep)
    about_gpus = set(_health_warnings(inv.gpus, inv.pairs))
    warnings = [w for w in inv.warnings if w not in about_gpus]
    return replace(
        inv,
        gpus=kept_gpus,
        pairs=kept_pairs,
        warnings=tuple(warnings + _health_warnings(kept_gpus, kept_pairs)),
    )


def child_cuda_env(gpus: Sequence[GpuInfo]) -> dict[str, str]:
    """Environment for a probe child: ``cuda:i`` inside it is ``gpus[i]``.

    UUIDs, not indices, so neither CUDA_DEVICE_ORDER nor the parent's own CUDA_VISIBLE_DEVICES
    can shuffle them; an empty selection hides every GPU (the CPU tier).
    """
    blank = [g.index for g in gpus if not g.uuid]
    if blank:
        raise GpuSelectionError(f"GPU {blank[0]} has no UUID from NVML; a probe cannot be pinned to it")
    return {
        knobs.CUDA_VISIBLE_DEVICES: ",".join(g.uuid for g in gpus),
        knobs.CUDA_DEVICE_ORDER: DeviceOrder.PCI_BUS_ID.value,
    }


def probe_ordinal(gpus: Sequence[GpuInfo], nvml_index: int) -> int:
    """The CUDA ordinal NVML GPU ``nvml_index`` has inside probe children."""
    for ordinal, g in enumerate(gpus):
        if g.index == nvml_index:
            return ordinal
    raise GpuSelectionError(f"GPU {nvml_index} is not among the selected GPUs")


def describe_probe_mapping(gpus: Sequence[GpuInfo]) -> tuple[str, ...]:
    """One line per selected GPU: ``GPU 3 (NVML) -> cuda:1 in probes``."""
    return tuple(f"GPU {g.index} (NVML) -> cuda:{i} in probes" for i, g in enumerate(gpus))


# --------------------------------------------------------------------------------------------
# Small helpers


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _nvml_text(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:  # pynvml's __str__ calls into the library, which may be missing
        text = ""
    return text or type(exc).__name__


def _cuda_version_text(raw: int) -> str:
    """NVML's integer CUDA version (13000, 12040) as "13.0", "12.4"."""
    return f"{raw // 1000}.{(raw % 1000) // 10}"


def _bus_key(bus_id: str) -> tuple[Any, ...]:
    """Comparable PCI address; NVML writes 8 domain digits, CUDA and NVLink info sometimes 4."""
    match = re.fullmatch(r"(?:([0-9a-fA-F]+):)?([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-7])", bus_id.strip())
    if match is None:
        return (1, bus_id)
    domain, bus, device, function = match.groups()
    return (0, int(domain or "0", 16), int(bus, 16), int(device, 16), int(function))


def _dist_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
