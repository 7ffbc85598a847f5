"""Environment variables and defaults, declared once by name. Each escape hatch says why."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

# --- variables qmoe-doctor reads: only here, through the functions at the end of this module ---
#: Path of the compute-sanitizer binary when it is not on PATH or under CUDA_HOME.
QMOE_SANITIZER = "QMOE_DOCTOR_COMPUTE_SANITIZER"
#: Python interpreter for probe children. Escape hatch: the kernel under test lives in another venv.
QMOE_CHILD_PYTHON = "QMOE_DOCTOR_CHILD_PYTHON"
#: Set by the parent for each probe child: the pipe fd the child writes protocol lines to (kept
#: apart from stdout/stderr, which libraries print to and which go to the worker's log).
QMOE_RESULT_FD = "QMOE_DOCTOR_RESULT_FD"

# --- variables of other tools that qmoe-doctor sets or reads ---
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
CUDA_DEVICE_ORDER = "CUDA_DEVICE_ORDER"
CUDA_LAUNCH_BLOCKING = "CUDA_LAUNCH_BLOCKING"
TRITON_INTERPRET = "TRITON_INTERPRET"  # run Triton kernels on the CPU (the no-GPU tier)
TRITON_DEBUG = "TRITON_DEBUG"  # turns on device_assert and Triton's int32 overflow check
TRITON_CACHE_DIR = "TRITON_CACHE_DIR"
PYTORCH_NO_CUDA_MEMORY_CACHING = "PYTORCH_NO_CUDA_MEMORY_CACHING"  # the allocator hides OOB
# NVLink multicast must stay off on shared hosts (it can take the GPUs out of service):
# children inherit these and we never unset them.
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

# --- defaults ---
#: Seconds one probe may take, its child's start-up included when it needs a new one (start-up:
#: import torch and triton, create the CUDA context, 4.6-7.8 s measured on an H200 with warm
#: caches; the first probe of a worker also compiles the kernel).
DEFAULT_PROBE_TIMEOUT_S = 180.0
SLOW_FACTOR = 3.0  # a correct cell this many times slower than the guarded baseline is "slow"


def compute_sanitizer(environ: Mapping[str, str] | None = None) -> str | None:
    """$QMOE_DOCTOR_COMPUTE_SANITIZER: the compute-sanitizer binary the user named, or None."""
    raw = (os.environ if environ is None else environ).get(QMOE_SANITIZER, "").strip()
    return raw or None


def child_python() -> str | None:
    """$QMOE_DOCTOR_CHILD_PYTHON: the interpreter for probe children, or None (use this one)."""
    raw = os.environ.get(QMOE_CHILD_PYTHON, "").strip()
    return raw or None


def result_fd() -> int | None:
    """$QMOE_DOCTOR_RESULT_FD in a probe worker: the fd of its protocol pipe, or None (run by
    hand: the protocol goes to stdout). Raises ValueError for anything but a descriptor number."""
    raw = os.environ.get(QMOE_RESULT_FD, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise ValueError(f"{QMOE_RESULT_FD}={raw!r} is not a file descriptor number")
    return int(raw)


def pin_gpus(uuids: Iterable[str]) -> dict[str, str]:
    """The environment that makes a child see exactly these GPUs, in this order, as cuda:0,
    cuda:1, ...: the one builder of the pin, for every command that starts a child.

    UUIDs, not indices, so neither CUDA_DEVICE_ORDER nor the parent's own CUDA_VISIBLE_DEVICES can
    shuffle them; no UUID at all hides every GPU (the CPU tier). Raises ValueError for a blank
    UUID (NVML gave none): an index in its place would name another GPU in another order."""
    chosen = list(uuids)
    if any(not u.strip() for u in chosen):
        raise ValueError("a GPU without a UUID cannot be pinned")
    return {CUDA_VISIBLE_DEVICES: ",".join(chosen), CUDA_DEVICE_ORDER: "PCI_BUS_ID"}
