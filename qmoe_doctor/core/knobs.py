"""Environment variables and defaults, declared once by name. Each escape hatch says why."""

from __future__ import annotations

import os

# --- variables qmoe-doctor reads ---
#: Where warm workers write their logs and scan artifacts (default: a temp dir per run).
QMOE_WORKDIR = "QMOE_DOCTOR_WORKDIR"
#: Per-probe timeout in seconds. Escape hatch: cold Triton caches on slow disks compile slowly.
QMOE_PROBE_TIMEOUT = "QMOE_DOCTOR_PROBE_TIMEOUT"
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
DEFAULT_PROBE_TIMEOUT_S = 180.0  # first probe of a worker compiles; 5-8 s measured on H200
SLOW_FACTOR = 3.0  # a correct cell this many times slower than the guarded baseline is "slow"


def probe_timeout_s() -> float:
    raw = os.environ.get(QMOE_PROBE_TIMEOUT)
    if not raw:
        return DEFAULT_PROBE_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{QMOE_PROBE_TIMEOUT}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{QMOE_PROBE_TIMEOUT} must be positive, got {value}")
    return value
