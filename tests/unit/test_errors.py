"""errors.py: failure texts CUDA, PyTorch and Triton really print, and what each is classified as."""

from __future__ import annotations

import signal

import pytest

from qmoe_doctor.core.error_kind import (
    classify_error,
    classify_exit,
    describe_exit,
    exception_type_in,
    pointer_arg_index,
)
from qmoe_doctor.core.records import ErrorKind

# (exception type as the worker records it, message, expected kind, what the row covers)
CASES = [
    (
        "ValueError",
        "Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)",
        ErrorKind.POINTER_INACCESSIBLE,
        "FINDINGS: launch on a device without peer access; a ValueError, but not bad input",
    ),
    (
        "RuntimeError",
        "Triton Error [CUDA]: an illegal memory access was encountered",
        ErrorKind.ILLEGAL_ADDRESS,
        "FINDINGS: inside Triton's driver.py under CUDA_LAUNCH_BLOCKING=1",
    ),
    (
        "torch.AcceleratorError",
        "CUDA error: an illegal memory access was encountered\n"
        "Search for `cudaErrorIllegalAddress' in https://docs.nvidia.com/cuda/cuda-runtime-api/"
        "group__CUDART__TYPES.html for more information.\n"
        "CUDA kernel errors might be asynchronously reported at some other API call, so the "
        "stacktrace below might be incorrect.",
        ErrorKind.ILLEGAL_ADDRESS,
        "FINDINGS: async, at the next synchronize",
    ),
    (
        None,
        "cudaErrorIllegalAddress",
        ErrorKind.ILLEGAL_ADDRESS,
        "runtime enum name alone",
    ),
    (
        "RuntimeError",
        "CUDA error: misaligned address",
        ErrorKind.MISALIGNED_ADDRESS,
        "misaligned global access: a sticky CUDA error of its own kind",
    ),
    (
        "RuntimeError",
        "CUDA error: device-side assert triggered\nCompile with `TORCH_USE_CUDA_DSA` to enable "
        "device-side assertions.",
        ErrorKind.DEVICE_ASSERT,
        "device assert, as torch reports it",
    ),
    (
        None,
        "grouped_gemm.py:88: _grouped_gemm_kernel: block: [3,0,0], thread: [64,0,0] "
        "Assertion `int32 overflow detected for operation mul` failed.",
        ErrorKind.DEVICE_ASSERT,
        "FINDINGS: TRITON_DEBUG=1 int32 overflow check, on stderr",
    ),
    (
        "AssertionError",
        "Assertion 'int32 overflow detected for operation mul' failed",
        ErrorKind.DEVICE_ASSERT,
        "device assert text wins over the host AssertionError type",
    ),
    (
        "triton.runtime.errors.OutOfResources",
        "out of resource: shared memory, Required: 245760, Hardware limit: 232448. Reducing block "
        "sizes or `num_stages` may help.",
        ErrorKind.OUT_OF_RESOURCES,
        "FINDINGS: dw tile 128x256x64, 3 stages on an H200",
    ),
    (
        "OutOfResources",
        "",
        ErrorKind.OUT_OF_RESOURCES,
        "type name alone",
    ),
    (
        "RuntimeError",
        "CUDA error: too many resources requested for launch",
        ErrorKind.OUT_OF_RESOURCES,
        "registers exhausted by a launch config",
    ),
    (
        "torch.OutOfMemoryError",
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB "
        "of which 1.05 GiB is free.",
        ErrorKind.OOM,
        "FINDINGS: caching allocator OOM",
    ),
    (
        "torch.cuda.OutOfMemoryError",
        "",
        ErrorKind.OOM,
        "type name alone (old alias)",
    ),
    (
        "RuntimeError",
        "CUDA error: out of memory",
        ErrorKind.OOM,
        "OOM from a raw CUDA call",
    ),
    (
        "RuntimeError",
        "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cuda:1!",
        ErrorKind.DEVICE_MISMATCH,
        "FINDINGS: aten device check",
    ),
    (
        "RuntimeError",
        "Expected tensor for argument #1 'input' to have the same device as tensor for argument "
        "#2 'weight'; but device 0 does not equal 1 (while checking arguments for cudnn_convolution)",
        ErrorKind.DEVICE_MISMATCH,
        "older aten device check",
    ),
    (
        "RuntimeError",
        "Triton Error [CUDA]: invalid resource handle",
        ErrorKind.INVALID_HANDLE,
        "stream or module of another device's context",
    ),
    (
        "ModuleNotFoundError",
        "No module named 'my_moe'",
        ErrorKind.KERNEL_IMPORT,
        "--kernel module:function names a missing module",
    ),
    (
        "qmoe_doctor.probes.loader.KernelResolutionError",
        "my_moe has no attribute 'grouped_gemm'",
        ErrorKind.KERNEL_IMPORT,
        "the loader's own error",
    ),
    (
        "ImportError",
        "cannot import name 'grouped_gemm' from 'my_moe'",
        ErrorKind.KERNEL_IMPORT,
        "import of a missing name",
    ),
    (
        "ValueError",
        "K must be a multiple of 16, got 100",
        ErrorKind.BAD_INPUT,
        "a kernel wrapper's argument check",
    ),
    (
        "TypeError",
        "grouped_gemm() got an unexpected keyword argument 'm_sizes'",
        ErrorKind.BAD_INPUT,
        "signature mismatch",
    ),
    (
        "AssertionError",
        "x must be contiguous",
        ErrorKind.BAD_INPUT,
        "host-side assert in a wrapper",
    ),
    (
        "RuntimeError",
        "mat1 and mat2 shapes cannot be multiplied (16x32 and 64x8)",
        ErrorKind.OTHER,
        "anything else",
    ),
    (
        "triton.compiler.errors.CompilationError",
        "at 12:4: def kernel(...): ...",
        ErrorKind.OTHER,
        "compile error",
    ),
    (
        None,
        'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n'
        "ValueError: K must be a multiple of 16",
        ErrorKind.BAD_INPUT,
        "type inferred from a traceback when not given",
    ),
]


@pytest.mark.parametrize(
    ("error_type", "message", "expected"),
    [c[:3] for c in CASES],
    ids=[c[3] for c in CASES],
)
def test_classify_error(error_type: str | None, message: str, expected: ErrorKind) -> None:
    assert classify_error(error_type, message) is expected


def test_case_insensitive() -> None:
    assert classify_error(None, "AN ILLEGAL MEMORY ACCESS WAS ENCOUNTERED") is ErrorKind.ILLEGAL_ADDRESS
    assert classify_error(None, "pointer argument (at 3) cannot be accessed from triton") is (
        ErrorKind.POINTER_INACCESSIBLE
    )


def test_illegal_address_wins_over_an_assert_it_caused() -> None:
    # A kernel that read garbage sizes and then tripped an assert: the sticky fault is what matters.
    text = "CUDA error: an illegal memory access was encountered\nAssertion `x` failed."
    assert classify_error("RuntimeError", text) is ErrorKind.ILLEGAL_ADDRESS


@pytest.mark.parametrize(
    ("message", "index"),
    [
        ("ValueError: Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)", 0),
        ("Pointer argument (at 12) cannot be accessed from Triton (cpu tensor?)", 12),
        ("an illegal memory access was encountered", None),
    ],
)
def test_pointer_arg_index(message: str, index: int | None) -> None:
    assert pointer_arg_index(message) == index


EXIT_CASES = [
    (-int(signal.SIGSEGV), "Fatal Python error: Segmentation fault\n\nCurrent thread ...", ErrorKind.SIGNAL),
    (-int(signal.SIGKILL), "", ErrorKind.SIGNAL),
    (
        -int(signal.SIGABRT),
        "grouped_gemm.py:88: block: [0,0,0], thread: [0,0,0] Assertion `int32 overflow detected for "
        "operation mul` failed.\nterminate called after throwing an instance of 'c10::Error'",
        ErrorKind.DEVICE_ASSERT,
    ),
    (3, "RuntimeError: CUDA error: an illegal memory access was encountered", ErrorKind.ILLEGAL_ADDRESS),
    (
        1,
        "Traceback (most recent call last):\nModuleNotFoundError: No module named 'torch'",
        ErrorKind.KERNEL_IMPORT,
    ),
    (1, "some library gave up", ErrorKind.OTHER),
    (0, "", ErrorKind.OTHER),
]


@pytest.mark.parametrize(("returncode", "tail", "expected"), EXIT_CASES)
def test_classify_exit(returncode: int, tail: str, expected: ErrorKind) -> None:
    assert classify_exit(returncode, tail) is expected


def test_exception_type_in() -> None:
    text = "Traceback ...\nValueError: first\nDuring handling ...\ntorch.AcceleratorError: CUDA error: x"
    assert exception_type_in(text) == "AcceleratorError"
    assert exception_type_in("nothing here") is None


def test_describe_exit() -> None:
    assert describe_exit(-11) == "killed by SIGSEGV (signal 11)"
    assert describe_exit(3) == "exited with status 3"
    assert describe_exit(-200) == "killed by an unknown signal (signal 200)"
