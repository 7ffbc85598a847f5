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

from qmoe_doctor.core.records import ErrorKind

# Ordered: the first pattern that matches names the kind. A message can carry several fragments
# (``RuntimeError: CUDA error: device-side assert triggered`` after a stderr line
# ``Assertion `...` failed``); the order says which one wins.
_TEXT_PATTERNS: tuple[tuple[ErrorKind, re.Pattern[str]], ...] = (
    # torch.AcceleratorError: CUDA error: an illegal memory access was encountered
    # RuntimeError: Triton Error [CUDA]: an illegal memory access was encountered
    # cudaErrorIllegalAddress / CUDA_ERROR_ILLEGAL_ADDRESS (driver and runtime enum names)
    # "misaligned address" (cudaErrorMisalignedAddress) is the same fault class: a global access
    # the MMU refused, sticky for the context.
    # "CUDA error: unspecified launch failure" (cudaErrorLaunchFailure) is what a kernel that
    # memcheck stopped at a bad access reports (recorded under compute-sanitizer 2025.3 on H200:
    # tests/fixtures/sanitizer/2026-11-22-2xh200-7ada31c/memcheck-unmasked-overrouted-nocache.stdout).
    (
        ErrorKind.ILLEGAL_ADDRESS,
        re.compile(
            r"illegal memory access|cudaErrorIllegalAddress|CUDA_ERROR_ILLEGAL_ADDRESS"
            r"|misaligned address|cudaErrorMisalignedAddress|CUDA_ERROR_MISALIGNED_ADDRESS"
            r"|unspecified launch failure|cudaErrorLaunchFailure|CUDA_ERROR_LAUNCH_FAILED",
            re.IGNORECASE,
        ),
    ),
    # RuntimeError: CUDA error: device-side assert triggered
    # <file>.py:<line>: <kernel>: block: [..], thread: [..] Assertion `int32 overflow detected for
    #   operation mul` failed.   (TRITON_DEBUG=1, printed by the device on stderr)
    # cudaErrorAssert / CUDA_ERROR_ASSERT
    (
        ErrorKind.DEVICE_ASSERT,
        re.compile(
            # "device-side assert triggered", never torch's boilerplate "Compile with
            # `TORCH_USE_CUDA_DSA` to enable device-side assertions." that follows every CUDA error
            r"device-side assert triggered|cudaErrorAssert\b|CUDA_ERROR_ASSERT\b"
            r"|int32 overflow detected|Assertion [`'\"].*[`'\"] failed",
            re.IGNORECASE,
        ),
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
    # fault of a running kernel) is matched above and never reaches this.
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
    "classify_error",
    "classify_exit",
    "describe_exit",
    "exception_type_in",
    "match_text",
    "pointer_arg_index",
]
