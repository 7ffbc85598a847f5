"""Specimen ``tma_persistent``: a correct kernel in the persistent TMA-descriptor style, plants no cause.

The second public design users bring (issue #41): a persistent grouped GEMM whose grid is the SM
count, whose tiles move through *device-side* tensor descriptors (``tl.make_tensor_descriptor``:
for each expert one over its (N, K) block of the weights and one over its rows of x and of y; the
descriptors live in global scratch memory that Triton asks ``triton.set_allocator``'s allocator
for), with 64-bit offsets and the weights taken flattened to ``(E*N, K)``. ``grouped_gemm_flat(x, w2d, m_sizes)`` is the kernel's
own entry point; ``moe_grouped_gemm(x, w, m_sizes)`` is the three-line wrapper that flattens
``w`` (``--kernel adapter:flat-weights:...`` does the same for a user's kernel with no wrapper).
Written from that design, not as a diff of ``grouped_gemm.py``.

What makes it right, each where a public kernel of this design goes wrong:

* the launch, the scratch allocator and the SM count all take x's device: the launch sits inside
  ``torch.cuda.device(x.device)``, the allocator makes its scratch on ``x.device``, the grid is
  ``get_device_properties(x.device).multi_processor_count``;
* a TMA descriptor needs a 16-byte-aligned base and 16-byte-aligned strides (all but the last,
  which must be 1): an operand that is not (a view a few elements into its storage, a row pitch
  of an odd number of elements, a transposed view) is copied into an aligned buffer first;
* each expert's descriptors span its rows *clamped to M*: the descriptor's shape is what masks
  a TMA load or store, so rows past M are never read or written whatever ``m_sizes`` says, and
  a negative count is no rows. Rows no expert covers (counts summing below M) are left as
  ``torch.empty`` made them, as in the public design: its callers route every row.

It never misbehaves. Under ``TRITON_INTERPRET=1`` it runs on CPU tensors (the interpreter
implements device-side descriptors, triton 3.9; the allocator is not called there): the grid is
4 programs and there is no device to guard. The CPU tier checks it like any kernel.

The two specimens planted in it are one change each: ``tma_unmasked_rows`` (the clamp to M
removed from the kernel) and ``tma_misaligned`` (x handed to its descriptor unchecked).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import triton
import triton.language as tl

from qmoe_doctor.kernels.grouped_gemm import interpreting

#: Interpreter programs: a few walk the persistent tile loop (there are no SMs to count).
_INTERPRETER_PROGRAMS = 4


def _tiles(dtype: torch.dtype) -> dict[str, int]:
    """One config, as the public kernel's non-autotuned path has it. 16-bit: (128 + 128) x 64 x
    2 B x 3 stages = 96 KiB of pipeline buffers (131,096 B of shared memory in all, compiled for
    sm_90 by triton 3.9); float32 (tf32) halves BLOCK_K (163,864 B): both under an H100's 227 KiB."""
    if interpreting():
        return {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 1}
    block_k = 64 if dtype in (torch.bfloat16, torch.float16) else 32
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": block_k, "num_warps": 8, "num_stages": 3}


def moe_grouped_gemm(
    x: torch.Tensor,  # (M, K) rows sorted by expert
    w: torch.Tensor,  # (E, N, K)
    m_sizes: torch.Tensor,  # (E,) rows per expert
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The wrapper a user writes around the flat-weight kernel: w as (E*N, K) (a view where w's
    layout allows one, else a copy: a transposed w has no (E*N, K) view)."""
    e, n, k = w.shape
    return grouped_gemm_flat(x, w.reshape(e * n, k), m_sizes, out_dtype=out_dtype)


def grouped_gemm_flat(
    x: torch.Tensor,  # (M, K) rows sorted by expert
    w2d: torch.Tensor,  # (E*N, K): expert e's (N, K) weight is rows e*N .. e*N + N - 1
    m_sizes: torch.Tensor,  # (E,) int32/int64 rows per expert
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``y[m] = x[m] @ w[e(m)].T`` with w flattened; the kernel's own entry point."""
    return forward(_grouped_gemm_tma_kernel, tma_operand(x), tma_operand(w2d), m_sizes, out_dtype=out_dtype)


# --------------------------------------------------------------------------------------------
# Host side: alignment, device, scratch, grid (shared by the specimens planted in this design)
# --------------------------------------------------------------------------------------------


def tma_ready(t: torch.Tensor) -> bool:
    """A 2-D tensor a TMA descriptor can take as it is: 16-byte-aligned base and row stride,
    contiguous rows."""
    item = t.element_size()
    return t.stride(1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * item) % 16 == 0


def tma_operand(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when a descriptor can take it, else a copy with an aligned base and its row
    pitch rounded up to 16 bytes (the same values; only the layout differs)."""
    if t.dim() != 2:
        raise ValueError(f"expected a 2-D operand, got shape {tuple(t.shape)}")
    if tma_ready(t):
        return t
    rows, cols = t.shape
    per_16_bytes = max(1, 16 // t.element_size())
    pitch = -(-max(cols, 1) // per_16_bytes) * per_16_bytes
    # empty_strided: a fresh allocation (16-byte-aligned base) whose rows start every `pitch`
    aligned = torch.empty_strided((rows, cols), (pitch, 1), dtype=t.dtype, device=t.device)
    return aligned.copy_(t)


def _device_of(t: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
    """``torch.cuda.device(t.device)``: t's device current for the launch (its stream, its
    context); nothing to enter for CPU tensors (the interpreter)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def _scratch_on(device: torch.device) -> Any:
    """The allocator Triton calls at launch for the descriptors' global scratch: on ``device``
    (the operands' device), never on whichever device happens to be current."""

    def alloc(size: int, alignment: int, stream: int | None) -> torch.Tensor:
        return torch.empty(size, device=device, dtype=torch.int8)

    return alloc


def _num_programs(device: torch.device) -> int:
    """The persistent grid: one program per SM of the operands' device."""
    if device.type != "cuda":
        return _INTERPRETER_PROGRAMS
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def forward(
    kernel: Any,  # a @triton.jit function with _grouped_gemm_tma_kernel's parameters
    x: torch.Tensor,  # (M, K), as the kernel's descriptors will see it
    w2d: torch.Tensor,  # (E*N, K), likewise
    m_sizes: torch.Tensor,  # (E,)
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Allocate y on x's device and launch ``kernel`` there. x and w2d go to their descriptors
    as given: callers decide what a descriptor may take (``tma_operand``)."""
    if x.dim() != 2 or w2d.dim() != 2 or m_sizes.dim() != 1:
        raise ValueError(
            f"expected x (M, K), w2d (E*N, K), m_sizes (E,); got {tuple(x.shape)}, {tuple(w2d.shape)}, "
            f"{tuple(m_sizes.shape)}"
        )
    m, k = x.shape
    e = m_sizes.shape[0]
    n = w2d.shape[0] // max(e, 1)
    if e == 0 or w2d.shape != (e * n, k):
        raise ValueError(f"w2d is {tuple(w2d.shape)}: expected (E*N, K) with E={e} (from m_sizes) and K={k}")
    with _device_of(x):
        y = torch.empty((m, n), device=x.device, dtype=out_dtype or x.dtype)
        if m == 0 or n == 0:
            return y
        if k == 0:
            return y.zero_()
        y_out = y if tma_ready(y) else tma_operand(y)  # a row pitch of 16 bytes' multiple to store into
        # PLANTED: the public design's traits, each done right here: descriptors made on the device
        # (their scratch from triton.set_allocator: on x's device), a grid of x's device's SM count
        triton.set_allocator(_scratch_on(x.device))
        programs = _num_programs(x.device)
        kernel[(programs,)](
            x,
            w2d,
            y_out,
            m_sizes,
            m,
            n,
            k,
            e,
            x.stride(0),
            w2d.stride(0),
            y_out.stride(0),
            NUM_PROGRAMS=programs,
            **_tiles(x.dtype),
        )
        if y_out is not y:
            y.copy_(y_out)
    return y


# --------------------------------------------------------------------------------------------
# The kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _grouped_gemm_tma_kernel(
    x_ptr,  # (M, K) rows sorted by expert; 16-byte-aligned base and row stride
    w_ptr,  # (E*N, K) expert weights flattened: expert e is rows e*N ..; 16-byte-aligned rows
    y_ptr,  # (M, N) output; 16-byte-aligned base and row stride
    m_sizes_ptr,  # (E,) int32/int64 rows per expert
    M,
    N,
    K,
    E,
    stride_xm,
    stride_wn,
    stride_ym,
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Persistent grid: program p takes tiles p, p + NUM_PROGRAMS, ... of the expert-major tile
    sequence. Each expert gets three descriptors: its (N, K) block of the weight stack and its
    rows of x and y; a descriptor's shape is the mask of every load and store through it."""
    tile = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)

    tiles_before = 0  # tiles of the experts already walked (the same count in every program)
    row_start = 0  # first row of the current expert
    for expert in range(E):
        m_size = tl.load(m_sizes_ptr + expert).to(tl.int32)
        m_size = tl.minimum(tl.maximum(m_size, 0), M - row_start)  # rows past M do not exist
        if m_size > 0:
            # expert * N * K passes 2**31 at expert 69 for 160 experts of 5120x6144: int64
            w_desc = tl.make_tensor_descriptor(
                w_ptr + tl.cast(expert, tl.int64) * N * stride_wn,
                shape=[N, K],
                strides=[stride_wn, 1],
                block_shape=[BLOCK_N, BLOCK_K],
            )
            # row_start * stride passes 2**31 for M*K > 2**31 (1M tokens x 2048): int64 where formed
            x_desc = tl.make_tensor_descriptor(
                x_ptr + tl.cast(row_start, tl.int64) * stride_xm,
                shape=[m_size, K],
                strides=[stride_xm, 1],
                block_shape=[BLOCK_M, BLOCK_K],
            )
            y_desc = tl.make_tensor_descriptor(
                y_ptr + tl.cast(row_start, tl.int64) * stride_ym,
                shape=[m_size, N],
                strides=[stride_ym, 1],
                block_shape=[BLOCK_M, BLOCK_N],
            )
            num_tiles = tl.cdiv(m_size, BLOCK_M) * num_n_tiles
            while (tile >= tiles_before) & (tile < tiles_before + num_tiles):
                local = tile - tiles_before
                off_m = (local // num_n_tiles) * BLOCK_M
                off_n = (local % num_n_tiles) * BLOCK_N
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    a = x_desc.load([off_m, k0])
                    b = w_desc.load([off_n, k0])
                    acc = tl.dot(a, b.T, acc)
                y_desc.store([off_m, off_n], acc.to(y_ptr.dtype.element_ty))
                tile += NUM_PROGRAMS
            tiles_before += num_tiles
        row_start += m_size
