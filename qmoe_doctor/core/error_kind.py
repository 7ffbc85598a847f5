"""Classify how a probe failed, from an exception's type and text or a dead child's exit.

The classifier matches robust fragments of the messages CUDA, PyTorch and Triton really print,
case-insensitively, in a fixed order: CUDA runtime errors first (they poison the context and their
text is wrapped by many exception types), then launch-time checks, then exception types. Each
pattern cites the message it comes from; FINDINGS.md quotes the measured ones.

Pure text functions: no torch, no CUDA, safe in the parent.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

from qmoe_doctor.core.records import ErrorKind


@dataclass(frozen=True, slots=True, kw_only=True)
class CudaError:
    """One sticky CUDA error (``records.CUDA_ERROR_KINDS``) as CUDA names it: its number, the
    runtime's and the driver's enum names, and the text cudaGetErrorString / cuGetErrorString
    give (the same for both, CUDA runtime and driver API references, "Error types")."""

    kind: ErrorKind
    code: int
    runtime: str  # cudaErrorIllegalAddress
    driver: str  # CUDA_ERROR_ILLEGAL_ADDRESS
    text: str | None  # "an illegal memory access was encountered"; None: not quoted here
    more: tuple[str, ...] = ()  # further fragments (regular expressions) that name it

    @property
    def pattern(self) -> re.Pattern[str]:
        parts = [rf"\b{self.runtime}\b", rf"\b{self.driver}\b", *self.more]
        if self.text is not None:
            parts.insert(0, re.escape(self.text))
        return re.compile("|".join(parts), re.IGNORECASE)


# Each sticky CUDA error is matched three ways: the text (torch 2.11 prints
# ``torch.AcceleratorError: CUDA error: <text>`` and a line ``Search for `cudaError<Name>' in
# https://docs.nvidia.com/...``, as the recordings under tests/fixtures show; Triton's launcher
# prints ``RuntimeError: Triton Error [CUDA]: <text>``, cuGetErrorString's text), the runtime
# enum name and the driver's (cuda-python, CuPy, compute-sanitizer's "Program hit
# cudaErrorLaunchFailure (error 719) due to ..."). In match order: a message can carry several
# (a process that met an illegal instruction reports "unspecified launch failure" at its later
# calls; ``Assertion `...` failed`` lines precede "device-side assert triggered"), so the
# hardware's own faults come first, then the specific kernel faults, then the device-side
# assert, then the generic "unspecified launch failure" and the watchdog's timeout, which other
# faults leave behind.
CUDA_ERRORS: tuple[CudaError, ...] = (
    # CUDA error: uncorrectable ECC error encountered (the GPU's memory; Xid 48)
    CudaError(
        kind=ErrorKind.ECC_UNCORRECTABLE,
        code=214,
        runtime="cudaErrorECCUncorrectable",
        driver="CUDA_ERROR_ECC_UNCORRECTABLE",
        text="uncorrectable ECC error encountered",
    ),
    # CUDA 12.8+: "an exception occurred on the device that is now contained by the GPU's error
    # containment capability" (certain invalid accesses of peer GPU memory over NVLink); its
    # printed text is not quoted here: matched by its enum names
    CudaError(
        kind=ErrorKind.ERROR_CONTAINED,
        code=226,
        runtime="cudaErrorContained",
        driver="CUDA_ERROR_CONTAINED",
        text=None,
    ),
    # torch.AcceleratorError: CUDA error: an illegal memory access was encountered
    # RuntimeError: Triton Error [CUDA]: an illegal memory access was encountered
    # (both recorded: tests/fixtures/tracebacks, FINDINGS.md)
    CudaError(
        kind=ErrorKind.ILLEGAL_ADDRESS,
        code=700,
        runtime="cudaErrorIllegalAddress",
        driver="CUDA_ERROR_ILLEGAL_ADDRESS",
        text="an illegal memory access was encountered",
        # older wrappings: "cuda runtime error (77) : an illegal memory access was encountered"
        more=("illegal memory access",),
    ),
    # CUDA error: misaligned address: a load or store on an address its width does not divide;
    # measured on an H100 as the end of a TMA-descriptor kernel given x two bytes into its
    # storage (FINDINGS.md, 2026-12-06)
    CudaError(
        kind=ErrorKind.MISALIGNED_ADDRESS,
        code=716,
        runtime="cudaErrorMisalignedAddress",
        driver="CUDA_ERROR_MISALIGNED_ADDRESS",
        text="misaligned address",
    ),
    # CUDA error: an illegal instruction was encountered: measured on an H100 as the end of a
    # persistent TMA-descriptor grouped GEMM over-routed by 64 rows (FINDINGS.md, 2026-12-06); a
    # TMA copy at an offset that is not 16-byte aligned ends the same way (Triton's gluon tutorial
    # 09-tma-gather-scatter.py). Never the bare "Illegal instruction": that is SIGILL's name
    # (faulthandler's "Fatal Python error: Illegal instruction", the shell's "Illegal instruction
    # (core dumped)"), a fault of the CPU.
    CudaError(
        kind=ErrorKind.ILLEGAL_INSTRUCTION,
        code=715,
        runtime="cudaErrorIllegalInstruction",
        driver="CUDA_ERROR_ILLEGAL_INSTRUCTION",
        text="an illegal instruction was encountered",
    ),
    # CUDA error: operation not supported on global/shared address space
    CudaError(
        kind=ErrorKind.INVALID_ADDRESS_SPACE,
        code=717,
        runtime="cudaErrorInvalidAddressSpace",
        driver="CUDA_ERROR_INVALID_ADDRESS_SPACE",
        text="operation not supported on global/shared address space",
    ),
    # CUDA error: invalid program counter
    CudaError(
        kind=ErrorKind.INVALID_PC,
        code=718,
        runtime="cudaErrorInvalidPc",
        driver="CUDA_ERROR_INVALID_PC",
        text="invalid program counter",
    ),
    # CUDA error: hardware stack error (the call stack corrupt or past its size limit)
    CudaError(
        kind=ErrorKind.HARDWARE_STACK_ERROR,
        code=714,
        runtime="cudaErrorHardwareStackError",
        driver="CUDA_ERROR_HARDWARE_STACK_ERROR",
        text="hardware stack error",
    ),
    # RuntimeError: CUDA error: device-side assert triggered
    # <file>.py:<line>: <kernel>: block: [..], thread: [..] Assertion `int32 overflow detected for
    #   operation mul` failed.   (TRITON_DEBUG=1, printed by the device on stderr)
    CudaError(
        kind=ErrorKind.DEVICE_ASSERT,
        code=710,
        runtime="cudaErrorAssert",
        driver="CUDA_ERROR_ASSERT",
        # "device-side assert triggered", never torch's boilerplate "Compile with
        # `TORCH_USE_CUDA_DSA` to enable device-side assertions." that follows every CUDA error
        text="device-side assert triggered",
        more=(r"int32 overflow detected", r"Assertion [`'\"].*[`'\"] failed"),
    ),
    # CUDA error: unspecified launch failure: what a kernel that memcheck stopped at a bad access
    # reports (recorded under compute-sanitizer 2025.3 on H200: tests/fixtures/sanitizer/
    # 2026-11-22-2xh200-7ada31c/memcheck-unmasked-overrouted-nocache.stdout), and what the calls
    # after an illegal instruction report (FINDINGS.md, 2026-12-06)
    CudaError(
        kind=ErrorKind.LAUNCH_FAILURE,
        code=719,
        runtime="cudaErrorLaunchFailure",
        driver="CUDA_ERROR_LAUNCH_FAILED",
        text="unspecified launch failure",
    ),
    # CUDA error: the launch timed out and was terminated (the display watchdog, Xid 8)
    CudaError(
        kind=ErrorKind.LAUNCH_TIMEOUT,
        code=702,
        runtime="cudaErrorLaunchTimeout",
        driver="CUDA_ERROR_LAUNCH_TIMEOUT",
        text="the launch timed out and was terminated",
    ),
)
CUDA_ERROR_OF: dict[ErrorKind, CudaError] = {e.kind: e for e in CUDA_ERRORS}

# Ordered: the first pattern that matches names the kind. The sticky CUDA errors first (they
# poison the context and their text is wrapped by many exception types), then launch-time
# checks, then resources and memory.
_TEXT_PATTERNS: tuple[tuple[ErrorKind, re.Pattern[str]], ...] = (
    *((e.kind, e.pattern) for e in CUDA_ERRORS),
    # triton.runtime.interpreter.InterpreterError: AssertionError('base must be 16-byte aligned')
    # ('stride must be 16-byte aligned', 'block offset start must be 16-byte aligned'; the host-side
    # triton.tools.tensor_descriptor says 'strides must ...'): under TRITON_INTERPRET=1 the
    # interpreter checks a tensor descriptor where a GPU's TMA faults with 716 (triton 3.9,
    # runtime/interpreter.py; seen on the CPU tier with specimen:tma_misaligned's offset cell)
    (
        ErrorKind.MISALIGNED_ADDRESS,
        re.compile(r"\b(?:base|strides?|block offset start) must be 16-byte aligned", re.IGNORECASE),
    ),
    # ValueError: Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)
    # (Triton's launcher checks every pointer argument with cuPointerGetAttribute; raised when the
    # current device's context cannot see the allocation: no peer access, or a CPU tensor)
    (
        ErrorKind.POINTER_INACCESSIBLE,
        re.compile(r"Pointer argument \(at \d+\) cannot be accessed from Triton", re.IGNORECASE),
    ),
    # RuntimeError: Expected all tensors to be on the same device, but found at least two devices,
    #   cuda:0 and cuda:1!
    # RuntimeError: Expected tensor for argument #1 'x' to have the same device as tensor for
    #   argument #2 'w'; but device 0 does not equal 1 (older aten checks)
    (
        ErrorKind.DEVICE_MISMATCH,
        re.compile(
            r"Expected all tensors to be on the same device|to have the same device as",
            re.IGNORECASE,
        ),
    ),
    # RuntimeError: Triton Error [CUDA]: invalid resource handle
    # RuntimeError: CUDA error: invalid resource handle  (a stream/event/module from another
    # device's context; cudaErrorInvalidResourceHandle / CUDA_ERROR_INVALID_HANDLE)
    (
        ErrorKind.INVALID_HANDLE,
        re.compile(
            r"invalid resource handle|cudaErrorInvalidResourceHandle|CUDA_ERROR_INVALID_HANDLE",
            re.IGNORECASE,
        ),
    ),
    # triton.runtime.errors.OutOfResources: out of resource: shared memory, Required: 245760,
    #   Hardware limit: 232448. Reducing block sizes or `num_stages` may help.
    # CUDA error: too many resources requested for launch  (registers; cudaErrorLaunchOutOfResources)
    (
        ErrorKind.OUT_OF_RESOURCES,
        re.compile(
            r"out of resource|OutOfResources|too many resources requested for launch"
            r"|cudaErrorLaunchOutOfResources|CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
            re.IGNORECASE,
        ),
    ),
    # RuntimeError: expected data_ptr to be aligned to 16 bytes
    # (torch._grouped_mm's argument check, a TORCH_CHECK raised before any launch: recorded on an
    # H100 80GB, torch 2.11, for x and w that start one element into their buffers.) An input the
    # op refuses, like a ValueError from a Python wrapper; CUDA's own "misaligned address" (a
    # fault of a running kernel, ``misaligned-address``) is matched above and never reaches this.
    (
        ErrorKind.BAD_INPUT,
        re.compile(r"\bexpected \w+ to be aligned to \d+ bytes", re.IGNORECASE),
    ),
    # torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total
    #   capacity of 139.81 GiB of which ...
    # RuntimeError: CUDA error: out of memory  (cudaErrorMemoryAllocation / CUDA_ERROR_OUT_OF_MEMORY)
    (
        ErrorKind.OOM,
        re.compile(
            r"CUDA out of memory|CUDA error: out of memory|cudaErrorMemoryAllocation"
            r"|CUDA_ERROR_OUT_OF_MEMORY",
            re.IGNORECASE,
        ),
    ),
    # The process has no CUDA to give (the CPU tier, CUDA_VISIBLE_DEVICES=""): the call asked for a
    # device that is not there. Raised before anything ran, by the library, whatever the kernel's
    # inputs:
    # AssertionError: Torch not compiled with CUDA enabled  (a CPU build; torch/cuda/__init__.py,
    #   _lazy_init, torch 2.13)
    # RuntimeError: Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU
    #   and installed a driver from http://www.nvidia.com/Download/index.aspx
    # RuntimeError: No CUDA GPUs are available
    # RuntimeError: CUDA driver initialization failed, you might not have a CUDA gpu.
    #   (a CUDA build with no driver / no visible GPU: c10/cuda/CUDAFunctions.cpp, device_count_impl
    #   and device_count_ensure_non_zero)
    # RuntimeError: 0 active drivers ([]). There should only be one.  (triton.runtime.driver.active
    #   with no GPU, interpreter on or off: triton/runtime/driver.py, _create_driver, triton 3.9)
    # AssertionError: libcuda.so cannot found!  (triton/backends/nvidia/driver.py, libcuda_dirs)
    (
        ErrorKind.NEEDS_CUDA,
        re.compile(
            r"Torch not compiled with CUDA enabled|Found no NVIDIA driver on your system"
            r"|No CUDA GPUs are available|CUDA driver initialization failed"
            r"|\b0 active drivers\b|libcuda\.so cannot found",
            re.IGNORECASE,
        ),
    ),
)

# Exception type names (the last dotted component), checked after the text patterns.
_OOM_TYPES = frozenset({"OutOfMemoryError"})  # torch.OutOfMemoryError, torch.cuda.OutOfMemoryError
_RESOURCE_TYPES = frozenset({"OutOfResources"})  # triton.runtime.errors.OutOfResources
# The kernel under test could not be imported or resolved. KernelResolutionError is what the probe
# loader raises for "module:function" / "file.py:function" specs that name nothing callable.
_IMPORT_TYPES = frozenset({"ImportError", "ModuleNotFoundError", "KernelResolutionError"})
# A kernel wrapper's own argument checks: ``raise ValueError("K must be a multiple of 16")``,
# ``TypeError`` for a wrong dtype, or a host-side ``assert x.is_contiguous()``. Device asserts are
# caught above by their text, before this.
_BAD_INPUT_TYPES = frozenset({"ValueError", "TypeError", "AssertionError"})

# The last "SomeError: ..." line of a traceback: names the exception when only text is known.
_TRACEBACK_TYPE = re.compile(
    r"^(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*(?:Error|Exception|Exit|OutOfResources))\b(?::|$)",
    re.MULTILINE,
)

# at most 6 digits: a kernel has fewer arguments than that, and int() of a pasted 5,000-digit run
# raises (Python caps integer string conversion)
_POINTER_ARG = re.compile(r"Pointer argument \(at (\d{1,6})\) cannot be accessed from Triton", re.IGNORECASE)


def _short_type(error_type: str | None) -> str | None:
    if not error_type:
        return None
    return error_type.strip().rsplit(".", 1)[-1]


def match_text(text: str) -> ErrorKind | None:
    """The kind a CUDA / PyTorch / Triton error text names, or None when no pattern matches."""
    for kind, pattern in _TEXT_PATTERNS:
        if pattern.search(text):
            return kind
    return None


def cuda_error_kind(text: str) -> ErrorKind | None:
    """The sticky CUDA error ``text`` names (``records.CUDA_ERROR_KINDS``), or None. Only the
    CUDA errors' own texts count: the interpreter's "base must be 16-byte aligned", which
    ``match_text`` also reads as a misaligned address, is an assertion on the CPU, no CUDA error."""
    return next((e.kind for e in CUDA_ERRORS if e.pattern.search(text)), None)


def legacy_error_kind(kind: ErrorKind | None, text: str) -> ErrorKind | None:
    """COMPAT, applied only when reading a record: before each sticky CUDA error had a kind of
    its own, "misaligned address" and "unspecified launch failure" were read as
    ``illegal-address`` and "an illegal instruction was encountered" (with the rest of the
    list) as ``other``. Such a record's kind is read again from its text; any other kind, and
    every kind this classifier writes, comes back unchanged."""
    if kind in (ErrorKind.ILLEGAL_ADDRESS, ErrorKind.OTHER) and text:
        found = cuda_error_kind(text)
        if found is not None:
            return found
    return kind


def exception_type_in(text: str) -> str | None:
    """The exception type named by the last traceback-style ``Type: message`` line, if any."""
    names = _TRACEBACK_TYPE.findall(text)
    return str(names[-1]) if names else None


def classify_error(error_type: str | None, message: str) -> ErrorKind:
    """Classify an exception from its type name (``"torch.AcceleratorError"`` or bare
    ``"AcceleratorError"``; None to infer it from a traceback in ``message``) and its text."""
    kind = match_text(message)
    if kind is not None:
        return kind
    name = _short_type(error_type) or exception_type_in(message)
    if name is None:
        return ErrorKind.OTHER
    if name in _OOM_TYPES:
        return ErrorKind.OOM
    if name in _RESOURCE_TYPES:
        return ErrorKind.OUT_OF_RESOURCES
    if name in _IMPORT_TYPES:
        return ErrorKind.KERNEL_IMPORT
    if name in _BAD_INPUT_TYPES:
        return ErrorKind.BAD_INPUT
    return ErrorKind.OTHER


def classify_exit(returncode: int, stderr_tail: str) -> ErrorKind:
    """Classify a child that died without writing an outcome.

    A CUDA error in its output names the kind (an uncaught ``device-side assert`` ends in
    SIGABRT, an illegal access printed before ``os._exit``); otherwise a signal death
    (negative return code) is SIGNAL, and a non-zero exit is classified from the last traceback
    in the output, else OTHER.
    """
    kind = match_text(stderr_tail)
    if kind is not None:
        return kind
    if returncode < 0:
        return ErrorKind.SIGNAL
    if returncode == 0:
        return ErrorKind.OTHER
    return classify_error(None, stderr_tail)


def pointer_arg_index(message: str) -> int | None:
    """N of Triton's ``Pointer argument (at N) cannot be accessed from Triton (cpu tensor?)``:
    the position of the offending argument in the kernel's signature."""
    found = _POINTER_ARG.search(message)
    return int(found.group(1)) if found else None


def describe_exit(returncode: int) -> str:
    """``killed by SIGSEGV (signal 11)`` or ``exited with status 3``."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "an unknown signal"
        return f"killed by {name} (signal {-returncode})"
    return f"exited with status {returncode}"


__all__ = [
    "CUDA_ERRORS",
    "CUDA_ERROR_OF",
    "CudaError",
    "classify_error",
    "classify_exit",
    "describe_exit",
    "cuda_error_kind",
    "exception_type_in",
    "legacy_error_kind",
    "match_text",
    "pointer_arg_index",
]
