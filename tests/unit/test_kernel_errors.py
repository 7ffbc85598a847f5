"""Every argument error of the kernels: the exception type and a message naming the argument.

All of these raise before a launch, so they run without a GPU; mixed devices use a CPU tensor
beside a 'meta' tensor (a real second device is in tests/gpu).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from qmoe_doctor.kernels import backward, grouped_gemm
from qmoe_doctor.kernels.backward import (
    moe_grouped_gemm_dw,
    moe_grouped_gemm_dw_torch,
    moe_grouped_gemm_dx,
    moe_grouped_gemm_dx_torch,
)
from qmoe_doctor.kernels.grouped_gemm import moe_grouped_gemm, moe_grouped_gemm_torch
from qmoe_doctor.kernels.routing import sort_by_expert, sort_by_expert_torch

M, E, N, K = 12, 3, 8, 16


def _sizes(dtype: torch.dtype = torch.int32, device: str = "cpu") -> torch.Tensor:
    return torch.tensor([4, 4, 4], dtype=dtype, device=device)


def _strided_sizes() -> torch.Tensor:
    """m_sizes as a column of a routing table: a view with stride 2 (the kernels read stride 1)."""
    return torch.tensor([[4, 99], [4, 99], [4, 99]], dtype=torch.int32)[:, 0]


# Each row: (edge, call, exception, message regex). The calls build their own operands.
Call = Callable[[], object]

FORWARD_ERRORS: list[tuple[str, Call, type[Exception], str]] = [
    ("x-not-a-tensor", lambda: moe_grouped_gemm([[1.0]], torch.randn(E, N, K), _sizes()), TypeError, "x must be a torch.Tensor"),
    ("x-3d", lambda: moe_grouped_gemm(torch.randn(1, M, K), torch.randn(E, N, K), _sizes()), ValueError, r"x must be 2-D \(M, K\)"),
    ("w-2d", lambda: moe_grouped_gemm(torch.randn(M, K), torch.randn(N, K), _sizes()), ValueError, r"w must be 3-D \(E, N, K\)"),
    ("k-mismatch", lambda: moe_grouped_gemm(torch.randn(M, K + 1), torch.randn(E, N, K), _sizes()), ValueError, "K must match"),
    ("x-int-dtype", lambda: moe_grouped_gemm(torch.ones(M, K, dtype=torch.int32), torch.randn(E, N, K), _sizes()), TypeError, "x must be bfloat16, float16 or float32"),
    ("dtype-mismatch", lambda: moe_grouped_gemm(torch.randn(M, K), torch.randn(E, N, K).half(), _sizes()), TypeError, "w has dtype torch.float16 but x has torch.float32"),
    ("m-sizes-wrong-length", lambda: moe_grouped_gemm(torch.randn(M, K), torch.randn(E, N, K), torch.tensor([6, 6], dtype=torch.int32)), ValueError, "m_sizes has 2 entries but w has E=3"),
    ("m-sizes-float", lambda: moe_grouped_gemm(torch.randn(M, K), torch.randn(E, N, K), _sizes().float()), TypeError, "m_sizes must be int32 or int64"),
    ("m-sizes-2d", lambda: moe_grouped_gemm(torch.randn(M, K), torch.randn(E, N, K), _sizes()[None]), ValueError, r"m_sizes must be 1-D \(E,\)"),
    ("m-sizes-strided", lambda: moe_grouped_gemm(torch.randn(M, K), torch.randn(E, N, K), _strided_sizes()), ValueError, r"m_sizes must be contiguous \(stride 1\), got a view with stride 2"),
    ("mixed-devices-cpu-x-meta-w", lambda: moe_grouped_gemm(torch.randn(M, K), torch.randn(E, N, K, device="meta"), _sizes()), ValueError, "different devices.*w on meta"),
    ("all-on-meta", lambda: moe_grouped_gemm(torch.randn(M, K, device="meta"), torch.randn(E, N, K, device="meta"), _sizes(device="meta")), ValueError, "only CUDA devices"),
    ("negative-sizes-checked", lambda: moe_grouped_gemm(torch.randn(M, K), torch.randn(E, N, K), torch.tensor([-1, 9, 4]), check_routing=True), ValueError, r"negative counts at experts \[0\]"),
    ("sum-past-m-checked", lambda: moe_grouped_gemm(torch.randn(M, K), torch.randn(E, N, K), torch.tensor([4, 4, 5]), check_routing=True), ValueError, "sums to 13 but x has M=12"),
    ("sum-under-m-checked", lambda: moe_grouped_gemm(torch.randn(M, K), torch.randn(E, N, K), torch.tensor([4, 4, 3]), check_routing=True), ValueError, "sums to 11 but x has M=12"),
    ("twin-sum-checked", lambda: moe_grouped_gemm_torch(torch.randn(M, K), torch.randn(E, N, K), torch.tensor([4, 4, 3]), check_routing=True), ValueError, "sums to 11"),
]

DX_ERRORS: list[tuple[str, Call, type[Exception], str]] = [
    ("n-mismatch", lambda: moe_grouped_gemm_dx(torch.randn(M, N + 1), torch.randn(E, N, K), _sizes()), ValueError, r"dy has N=9 columns but w is \(E, N, K\)"),
    ("twin-n-mismatch", lambda: moe_grouped_gemm_dx_torch(torch.randn(M, N + 1), torch.randn(E, N, K), _sizes()), ValueError, "N must match"),
    ("dy-3d", lambda: moe_grouped_gemm_dx(torch.randn(1, M, N), torch.randn(E, N, K), _sizes()), ValueError, r"must be 2-D"),
    ("dtype-mismatch", lambda: moe_grouped_gemm_dx(torch.randn(M, N), torch.randn(E, N, K).half(), _sizes()), TypeError, "w has dtype torch.float16"),
    ("m-sizes-wrong-length", lambda: moe_grouped_gemm_dx(torch.randn(M, N), torch.randn(E, N, K), _sizes()[:2]), ValueError, "m_sizes has 2 entries"),
    ("m-sizes-strided", lambda: moe_grouped_gemm_dx(torch.randn(M, N), torch.randn(E, N, K), _strided_sizes()), ValueError, "m_sizes must be contiguous"),
    ("mixed-devices", lambda: moe_grouped_gemm_dx(torch.randn(M, N), torch.randn(E, N, K, device="meta"), _sizes()), ValueError, "different devices"),
    ("negative-sizes-checked", lambda: moe_grouped_gemm_dx(torch.randn(M, N), torch.randn(E, N, K), torch.tensor([8, -1, 5]), check_routing=True), ValueError, "negative counts"),
    ("sum-checked", lambda: moe_grouped_gemm_dx(torch.randn(M, N), torch.randn(E, N, K), torch.tensor([8, 1, 5]), check_routing=True), ValueError, "sums to 14 but x has M=12"),
]

DW_ERRORS: list[tuple[str, Call, type[Exception], str]] = [
    ("dy-not-a-tensor", lambda: moe_grouped_gemm_dw(None, torch.randn(M, K), _sizes()), TypeError, "dy must be a torch.Tensor"),
    ("dy-1d", lambda: moe_grouped_gemm_dw(torch.randn(M), torch.randn(M, K), _sizes()), ValueError, r"dy must be 2-D \(M, N\)"),
    ("x-3d", lambda: moe_grouped_gemm_dw(torch.randn(M, N), torch.randn(1, M, K), _sizes()), ValueError, r"x must be 2-D \(M, K\)"),
    ("m-mismatch", lambda: moe_grouped_gemm_dw(torch.randn(M, N), torch.randn(M + 1, K), _sizes()), ValueError, "dy has M=12 rows but x has M=13"),
    ("dtype-mismatch", lambda: moe_grouped_gemm_dw(torch.randn(M, N), torch.randn(M, K).half(), _sizes()), TypeError, "x has dtype torch.float16 but dy has torch.float32"),
    ("dy-float64", lambda: moe_grouped_gemm_dw(torch.randn(M, N).double(), torch.randn(M, K).double(), _sizes()), TypeError, "dy must be bfloat16, float16 or float32"),
    ("m-sizes-float", lambda: moe_grouped_gemm_dw(torch.randn(M, N), torch.randn(M, K), _sizes().float()), TypeError, "m_sizes must be int32 or int64"),
    ("m-sizes-2d", lambda: moe_grouped_gemm_dw(torch.randn(M, N), torch.randn(M, K), _sizes()[None]), ValueError, r"m_sizes must be 1-D"),
    ("m-sizes-strided", lambda: moe_grouped_gemm_dw(torch.randn(M, N), torch.randn(M, K), _strided_sizes()), ValueError, "m_sizes must be contiguous"),
    ("mixed-devices-meta-sizes", lambda: moe_grouped_gemm_dw(torch.randn(M, N), torch.randn(M, K), _sizes(device="meta")), ValueError, "different devices.*m_sizes on meta"),
    ("all-on-meta", lambda: moe_grouped_gemm_dw(torch.randn(M, N, device="meta"), torch.randn(M, K, device="meta"), _sizes(device="meta")), ValueError, "only CUDA devices"),
    ("negative-sizes-checked", lambda: moe_grouped_gemm_dw(torch.randn(M, N), torch.randn(M, K), torch.tensor([-3, 10, 5]), check_routing=True), ValueError, r"negative counts at experts \[0\]"),
    ("sum-past-m-checked", lambda: moe_grouped_gemm_dw(torch.randn(M, N), torch.randn(M, K), torch.tensor([9, 9, 9]), check_routing=True), ValueError, "sums to 27 but x has M=12"),
    ("twin-negative-checked", lambda: moe_grouped_gemm_dw_torch(torch.randn(M, N), torch.randn(M, K), torch.tensor([-3, 10, 5]), check_routing=True), ValueError, "negative counts"),
]

ROUTING_ERRORS: list[tuple[str, Call, type[Exception], str]] = [
    ("ids-not-a-tensor", lambda: sort_by_expert([[0, 1]], 2), TypeError, "topk_ids must be a torch.Tensor"),
    ("ids-1d", lambda: sort_by_expert(torch.tensor([0, 1]), 2), ValueError, r"topk_ids must be 2-D \(T, k\)"),
    ("ids-float", lambda: sort_by_expert(torch.tensor([[0.0, 1.0]]), 2), TypeError, "topk_ids must be int32 or int64"),
    ("zero-experts", lambda: sort_by_expert(torch.tensor([[0]]), 0), ValueError, "num_experts must be a positive int"),
    ("id-past-e-checked", lambda: sort_by_expert(torch.tensor([[0, 2]]), 2, check=True), ValueError, r"outside \[0, 2\)"),
    ("sentinel-checked", lambda: sort_by_expert(torch.tensor([[-1, 0]]), 2, check=True), ValueError, r"\[0, 0\]=-1"),
    ("twin-id-past-e-checked", lambda: sort_by_expert_torch(torch.tensor([[0, 2]]), 2, check=True), ValueError, "outside"),
]


def _rows(table: list[tuple[str, Call, type[Exception], str]]) -> list[object]:
    return [pytest.param(call, exc, msg, id=edge) for edge, call, exc, msg in table]


@pytest.mark.parametrize("call, exc, msg", _rows(FORWARD_ERRORS))
def test_forward_errors(call: Call, exc: type[Exception], msg: str) -> None:
    with pytest.raises(exc, match=msg):
        call()


@pytest.mark.parametrize("call, exc, msg", _rows(DX_ERRORS))
def test_dx_errors(call: Call, exc: type[Exception], msg: str) -> None:
    with pytest.raises(exc, match=msg):
        call()


@pytest.mark.parametrize("call, exc, msg", _rows(DW_ERRORS))
def test_dw_errors(call: Call, exc: type[Exception], msg: str) -> None:
    with pytest.raises(exc, match=msg):
        call()


@pytest.mark.parametrize("call, exc, msg", _rows(ROUTING_ERRORS))
def test_routing_errors(call: Call, exc: type[Exception], msg: str) -> None:
    with pytest.raises(exc, match=msg):
        call()


@pytest.mark.parametrize(
    "call, arg",
    [
        pytest.param(lambda: moe_grouped_gemm(torch.randn(M, K), torch.randn(E, N, K), _sizes()), "x", id="forward"),
        pytest.param(lambda: moe_grouped_gemm_dx(torch.randn(M, N), torch.randn(E, N, K), _sizes()), "x", id="dx"),
        pytest.param(lambda: moe_grouped_gemm_dw(torch.randn(M, N), torch.randn(M, K), _sizes()), "dy", id="dw"),
    ],
)
def test_cpu_tensor_without_interpreter(monkeypatch: pytest.MonkeyPatch, call: Call, arg: str) -> None:
    """On the CUDA path (no TRITON_INTERPRET), a CPU tensor is refused before any launch."""
    monkeypatch.setattr(grouped_gemm, "interpreting", lambda: False)
    monkeypatch.setattr(backward, "interpreting", lambda: False)
    with pytest.raises(ValueError, match=f"{arg} is a CPU tensor: the Triton kernel needs CUDA tensors"):
        call()


def test_twins_run_on_cpu_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """The message above sends users to the twins: they must work there."""
    monkeypatch.setattr(grouped_gemm, "interpreting", lambda: False)
    monkeypatch.setattr(backward, "interpreting", lambda: False)
    x, w, dy = torch.randn(M, K), torch.randn(E, N, K), torch.randn(M, N)
    assert moe_grouped_gemm_torch(x, w, _sizes()).shape == (M, N)
    assert moe_grouped_gemm_dx_torch(dy, w, _sizes()).shape == (M, K)
    assert moe_grouped_gemm_dw_torch(dy, x, _sizes()).shape == (E, N, K)


# --- the torch:grouped_mm control refusing an input (recorded on an H100 80GB, torch 2.11) ---------


def test_torch_argument_check_before_any_launch_is_bad_input_not_a_fault() -> None:
    """``torch._grouped_mm`` on x and w that start one element into their buffers raised this,
    before any launch, in the storage-offset-1 cell (H100 80GB HBM3, torch 2.11.0+cu130,
    2026-11-25). An input refusal, like a wrapper's ValueError; CUDA's "misaligned address" of a
    running kernel stays a fault."""
    from qmoe_doctor.core.error_kind import classify_error
    from qmoe_doctor.core.records import ErrorKind

    recorded = "expected data_ptr to be aligned to 16 bytes"
    assert classify_error("RuntimeError", recorded) is ErrorKind.BAD_INPUT
    assert classify_error("RuntimeError", "CUDA error: misaligned address") is ErrorKind.MISALIGNED_ADDRESS
    assert classify_error("RuntimeError", "expected scalar type BFloat16 but found Float") is ErrorKind.OTHER


def test_a_raise_inside_the_loaders_control_is_the_kernels_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """The control's body (probes/loader.py) is the kernel under test: a refusal raised by the op it
    calls is the kernel's contract, not the doctor's probe code failing."""
    import contextlib
    import functools

    import torch

    from qmoe_doctor.probes import kernel_call, loader

    # a C-level callable that raises, as torch._grouped_mm's TORCH_CHECK does: the traceback's
    # last Python frame is then the control's own line in loader.py
    monkeypatch.setattr(torch, "_grouped_mm", functools.partial(torch.Tensor.item, torch.ones(2)))
    monkeypatch.setattr(torch.cuda, "device", lambda _device: contextlib.nullcontext())
    x, w, m = torch.ones(4, 8), torch.ones(2, 8, 8), torch.tensor([2, 2], dtype=torch.int32)
    with pytest.raises(TypeError) as raised:
        loader.torch_grouped_mm(x, w, m)
    where, site, _source = kernel_call.raise_origin(raised.value)
    assert where == "kernel" and site is not None and site.startswith("loader.py:")


def test_a_contiguous_copy_of_strided_sizes_is_read_right() -> None:
    """What the refusal tells the caller to do works, and a one-expert view (any stride) passes."""
    sizes = _strided_sizes().contiguous()
    x, w, dy = torch.randn(M, K), torch.randn(E, N, K), torch.randn(M, N)
    ref = moe_grouped_gemm_torch(x.double(), w.double(), sizes)
    assert (moe_grouped_gemm(x, w, sizes).double() - ref).abs().max() < 1e-3
    one = torch.tensor([[M, 0]], dtype=torch.int32)[:, 0]  # shape (1,), stride 2
    w1 = torch.randn(1, N, K)
    assert (moe_grouped_gemm(x, w1, one).double() - moe_grouped_gemm_torch(x.double(), w1.double(), one)).abs().max() < 1e-3
    assert moe_grouped_gemm_dw(dy, x, one).shape == (1, N, K)
