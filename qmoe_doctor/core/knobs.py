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
# `qmoe-doctor run -- COMMAND` sets these for the command; the launch monitor reads them in every
# Python process it starts (``qmoe_doctor.monitor``; the bootstrap spells the first and last
# itself, at start-up, and a test checks they agree).
#: The folder every monitored process writes its record into. The monitor stays off without it.
QMOE_RUN_DIR = "QMOE_DOCTOR_RUN_DIR"
#: Launches each process keeps (the ring written with its record): `run --ring N`.
QMOE_RUN_RING = "QMOE_DOCTOR_RUN_RING"
#: "1": raise at the first cross-device launch instead of warning (`run --strict`, for CI).
QMOE_RUN_STRICT = "QMOE_DOCTOR_RUN_STRICT"
#: Launches of each kernel whose call site is taken (a frame walk); every flagged launch has one.
QMOE_RUN_CALL_SITES = "QMOE_DOCTOR_RUN_CALL_SITES"
#: The folder holding the qmoe_doctor package that started the run, for a command whose
#: interpreter cannot import it (another venv's python).
QMOE_RUN_HOME = "QMOE_DOCTOR_RUN_HOME"
#: Compare passes (`run --compare`): launches of each kernel whose tensors are fingerprinted
#: before and after the launch (``core.fingerprints``); unset or "0": none (a plain run).
QMOE_RUN_PRINTS = "QMOE_DOCTOR_RUN_PRINTS"
# The child side reads these (kernels, probes; both may import core), through the functions below.
#: Escape hatch: a config table file used instead of the one chosen for the device (a tuning
#: run measures its own table before it is committed or installed; a user pins one for a CI).
#: ``kernels/tuning.py`` reads it per shape; a path to no file is a ConfigTableError naming it.
QMOE_CONFIG_TABLE = "QMOE_CONFIG_TABLE"
#: Where this user's tuned config tables live instead of the platform cache folder (a shared
#: cluster home that must not fill up, a read-only home in a container).
QMOE_CACHE_DIR = "QMOE_DOCTOR_CACHE_DIR"
#: "0" launches every kernel through Triton's ``JITFunction.run``, as on the first call of each
#: shape, instead of the compiled kernel's launcher (``kernels/launch.py``): for a Triton whose
#: launcher API moved, or to compare the two paths' host time.
QMOE_LEAN_LAUNCH = "QMOE_DOCTOR_LEAN_LAUNCH"
# The ep parallel mode's block (``probes/parallel/modes.py``, docs/parallel.md): escape hatches
# from the measured defaults, to compare the dispatches and transports on a new host.
#: Micro-batches of the block (default 1: two were measured slower on 2x H200, 18.7 against
#: 12.8 ms per step; more than one means the all-to-all dispatch).
QMOE_EP_MICRO_BATCHES = "QMOE_EP_MICRO_BATCHES"
#: ``auto`` (the default: the measured choice), or one of EP_DISPATCHES.
QMOE_EP_DISPATCH = "QMOE_EP_DISPATCH"
#: ``auto`` (the default: symmetric memory within one host), or one of EP_TRANSPORTS.
QMOE_EP_TRANSPORT = "QMOE_EP_TRANSPORT"
#: "a2a": each token to the ranks owning its experts (NCCL all-to-all); "gather": every token to
#: every rank by pushes that overlap the experts (probes/parallel/ep_gather.py).
EP_DISPATCHES = ("a2a", "gather")
#: The gather dispatch's exchanges: symmetric-memory pushes, or collectives (probes/parallel/ep_gather.py).
EP_TRANSPORTS = ("symm", "collective")

# --- variables of other tools that qmoe-doctor sets or reads ---
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
CUDA_DEVICE_ORDER = "CUDA_DEVICE_ORDER"
CUDA_LAUNCH_BLOCKING = "CUDA_LAUNCH_BLOCKING"
TRITON_INTERPRET = "TRITON_INTERPRET"  # run Triton kernels on the CPU (the no-GPU tier)
TRITON_DEBUG = "TRITON_DEBUG"  # turns on device_assert and Triton's int32 overflow check
TRITON_CACHE_DIR = "TRITON_CACHE_DIR"
#: "1": Triton keeps autotune results on disk, in TRITON_CACHE_DIR (scan --autotune cached)
TRITON_CACHE_AUTOTUNING = "TRITON_CACHE_AUTOTUNING"
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
#: The launch monitor's defaults: the ring (the last launches a process keeps: 256 measured within
#: noise on the MoE block's training step), call sites per kernel, and how often a running
#: process rewrites its record (what a hard crash leaves).
DEFAULT_RUN_RING = 256
DEFAULT_RUN_CALL_SITES = 8
RUN_FLUSH_INTERVAL_S = 5.0


def compute_sanitizer(environ: Mapping[str, str] | None = None) -> str | None:
    """$QMOE_DOCTOR_COMPUTE_SANITIZER: the compute-sanitizer binary the user named, or None.
    Raises ValueError when it names no executable file: a command that will run the sanitizer
    says so before its work starts, not as "not found" at the end (the finder in
    ``machine.sanitizer`` never falls back to another binary when the variable is set)."""
    raw = (os.environ if environ is None else environ).get(QMOE_SANITIZER, "").strip()
    if not raw:
        return None
    if not os.path.exists(raw):
        raise ValueError(f"{QMOE_SANITIZER}={_shown(raw)}: no such file (unset it to search PATH and CUDA_HOME)")
    if not os.path.isfile(raw):
        raise ValueError(f"{QMOE_SANITIZER}={_shown(raw)}: not a file")
    if not os.access(raw, os.X_OK):
        raise ValueError(f"{QMOE_SANITIZER}={_shown(raw)}: the file is not executable")
    return raw


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
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 9:
        raise ValueError(f"{QMOE_RESULT_FD}={_shown(raw)} is not a file descriptor number")
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


def _shown(raw: str) -> str:
    """A variable's value as an error quotes it: repr, cut when long."""
    return repr(raw) if len(raw) <= 60 else repr(raw[:60]) + f"... ({len(raw)} characters)"


def _int_var(name: str, default: int, environ: Mapping[str, str] | None) -> int:
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    if not raw:
        return default
    # ASCII digits: str.isdigit() also takes '²', which int() refuses with a message naming nothing
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 9:
        raise ValueError(f"{name}={_shown(raw)} is not a whole number (at most 9 digits)")
    return int(raw)


def run_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """$QMOE_DOCTOR_RUN_DIR: where the launch monitor writes its record, or None (monitor off)."""
    raw = (os.environ if environ is None else environ).get(QMOE_RUN_DIR, "").strip()
    return raw or None


def run_ring(environ: Mapping[str, str] | None = None) -> int:
    """$QMOE_DOCTOR_RUN_RING: launches each monitored process keeps. Raises ValueError."""
    return _int_var(QMOE_RUN_RING, DEFAULT_RUN_RING, environ)


def run_call_sites(environ: Mapping[str, str] | None = None) -> int:
    """$QMOE_DOCTOR_RUN_CALL_SITES: launches of each kernel with a call site. Raises ValueError."""
    return _int_var(QMOE_RUN_CALL_SITES, DEFAULT_RUN_CALL_SITES, environ)


def run_prints(environ: Mapping[str, str] | None = None) -> int:
    """$QMOE_DOCTOR_RUN_PRINTS: launches of each kernel a compare pass fingerprints (0: not a
    compare pass). Raises ValueError."""
    return _int_var(QMOE_RUN_PRINTS, 0, environ)


def run_strict(environ: Mapping[str, str] | None = None) -> bool:
    """$QMOE_DOCTOR_RUN_STRICT: "1" raises at the first cross-device launch; "0" or unset warns.
    Raises ValueError for any other value ("yes", "true"): read as off, it would silently ignore
    what the user meant."""
    raw = (os.environ if environ is None else environ).get(QMOE_RUN_STRICT, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{QMOE_RUN_STRICT}={_shown(raw)}: give 1 (strict) or 0")
    return raw == "1"


def config_table(environ: Mapping[str, str] | None = None) -> str | None:
    """$QMOE_CONFIG_TABLE: the config table file to use instead of the device's, or None. What it
    names is checked where the table is read (``kernels/tuning.py``: ConfigTableError naming it)."""
    raw = (os.environ if environ is None else environ).get(QMOE_CONFIG_TABLE, "").strip()
    return raw or None


def cache_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """$QMOE_DOCTOR_CACHE_DIR: this user's cache folder instead of the platform's, or None
    (``core.launch_configs.user_cache_dir`` gives the platform's)."""
    raw = (os.environ if environ is None else environ).get(QMOE_CACHE_DIR, "").strip()
    return raw or None


def lean_launch(environ: Mapping[str, str] | None = None) -> bool:
    """$QMOE_DOCTOR_LEAN_LAUNCH: "0" sends every launch through ``JITFunction.run``; "1" or unset
    keeps the lean path. Raises ValueError for any other value (a "false" read as on would
    silently time the path the user meant to turn off)."""
    raw = (os.environ if environ is None else environ).get(QMOE_LEAN_LAUNCH, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(f"{QMOE_LEAN_LAUNCH}={_shown(raw)}: give 0 (every launch through JITFunction.run) or 1")
    return raw != "0"


def ep_micro_batches(environ: Mapping[str, str] | None = None) -> int:
    """$QMOE_EP_MICRO_BATCHES: micro-batches of the ep mode's block, default 1. Raises ValueError."""
    count = _int_var(QMOE_EP_MICRO_BATCHES, 1, environ)
    if count < 1:
        raise ValueError(f"{QMOE_EP_MICRO_BATCHES}={count}: give a positive whole number")
    return count


def ep_dispatch(environ: Mapping[str, str] | None = None) -> str:
    """$QMOE_EP_DISPATCH: "auto" (unset) or one of EP_DISPATCHES. Raises ValueError."""
    return _choice(QMOE_EP_DISPATCH, EP_DISPATCHES, environ)


def ep_transport(environ: Mapping[str, str] | None = None) -> str:
    """$QMOE_EP_TRANSPORT: "auto" (unset) or one of EP_TRANSPORTS. Raises ValueError."""
    return _choice(QMOE_EP_TRANSPORT, EP_TRANSPORTS, environ)


def _choice(name: str, choices: tuple[str, ...], environ: Mapping[str, str] | None) -> str:
    raw = (os.environ if environ is None else environ).get(name, "").strip() or "auto"
    if raw != "auto" and raw not in choices:
        raise ValueError(f"{name}={_shown(raw)}: give auto or one of {', '.join(choices)}")
    return raw
