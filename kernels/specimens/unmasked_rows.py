"""Specimen ``unmasked_rows``: plants ``invalid-routing``.

What it does wrong: the kernel trusts ``m_sizes``: the clamp of each expert's row count to
``[0, M - row_start]`` is gone, so row masks come from the routing alone, never from M.

When it misbehaves: only when ``m_sizes`` does not describe x's rows:

* it sums past M: the last experts' tiles read rows past the end of ``x`` and write rows past
  the end of ``y``. On a GPU the caching allocator usually hides it (the rows land inside a
  pooled segment: no error, neighbouring tensors corrupted); under the CPU interpreter there is
  no bounds check at all;
* it holds a negative count (a -1 sentinel for dropped tokens): the row cursor walks backwards,
  so every later expert's rows shift by one and rows of other experts are overwritten.

With counts that are non-negative and sum to at most M it is identical to
``grouped_gemm.moe_grouped_gemm``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qmoe_doctor.kernels._details.grouped_gemm_kernels import (
    _first_tile,
    _tile_coords,
    _zero_uncovered_rows,
)
from qmoe_doctor.kernels.specimens._common import guarded_forward


def moe_grouped_gemm(
    x: torch.Tensor,  # (M, K) rows sorted by expert
    w: torch.Tensor,  # (E, N, K)
    m_sizes: torch.Tensor,  # (E,) rows per expert
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    return guarded_forward(_grouped_gemm_kernel_unmasked, x, w, m_sizes, out_dtype=out_dtype)


# A copy of grouped_gemm._grouped_gemm_kernel; only the PLANTED line (the m_size clamp) differs.
@triton.jit
def _grouped_gemm_kernel_unmasked(
    x_ptr,  # (M, K) rows sorted by expert
    w_ptr,  # (E, N, K) expert weights, any strides
    y_ptr,  # (M, N) output
    m_sizes_ptr,  # (E,) int32/int64 rows per expert; trusted blindly (the fault)
    M,
    N,
    K,
    E,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ym,
    stride_yn,
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROWS_FIRST: tl.constexpr = False,
):
    """Persistent grid: program p takes tiles p, p + NUM_PROGRAMS, ... of the expert-major
    tile sequence; after the experts, rows no expert covers are written as zeros. Within an
    expert the column tiles come fastest (neighbouring programs share an x tile), or with
    ROWS_FIRST the row tiles (neighbouring programs share a w tile, the larger operand: an
    expert's row tiles then run in the same round of the programs, not one round apart)."""
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)

    tiles_before = 0  # tiles of the experts already walked (same count in every program)
    row_start = 0  # first row of the current expert
    for expert in range(E):
        # PLANTED: m_size is trusted as loaded; grouped_gemm.py clamps it to
        # [0, M - row_start] here (_expert_rows), so rows past M are never read or written
        m_size = tl.load(m_sizes_ptr + expert).to(tl.int32)
        num_m_tiles = tl.cdiv(m_size, BLOCK_M)
        num_tiles = num_m_tiles * num_n_tiles
        tile = _first_tile(pid, tiles_before, NUM_PROGRAMS)  # this expert's first tile of this program
        while tile < tiles_before + num_tiles:
            local = tile - tiles_before
            tile_m, tile_n = _tile_coords(local, num_m_tiles, num_n_tiles, ROWS_FIRST)
            first_row = row_start + tile_m * BLOCK_M
            rows = first_row + offs_m
            row_mask = rows < (row_start + m_size)
            cols = tile_n * BLOCK_N + offs_n
            col_mask = cols < N
            # row * stride_xm passes 2**31 for M*K > 2**31: int64 rows, as a vector. An int64
            # tile base plus int32 in-tile offsets (the form of the TMA and flattened kernels)
            # held 255 registers here and spilled at 128x256x64-w8 (Triton 3.6, H200); this
            # form 224-228 and no spill, -0.2 to +2.2% at the 2048-token points (2026-11-28)
            rows64 = rows.to(tl.int64)
            x_ptrs = x_ptr + rows64[:, None] * stride_xm + offs_k[None, :] * stride_xk
            # expert * stride_we passes 2**31 at expert 69 for 160 experts of 5120x6144
            w_ptrs = (
                w_ptr
                + tl.cast(expert, tl.int64) * stride_we
                + cols[None, :] * stride_wn
                + offs_k[:, None] * stride_wk
            )
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k_mask = (k0 + offs_k) < K
                a = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                b = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
                acc = tl.dot(a, b, acc)
                x_ptrs += BLOCK_K * stride_xk
                w_ptrs += BLOCK_K * stride_wk
            # y's pointers formed after the K loop, not held through it (row * stride_ym passes
            # 2**31 for M*N > 2**31, 1M tokens x 2048: int64 rows)
            y_ptrs = y_ptr + rows64[:, None] * stride_ym + cols[None, :] * stride_yn
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])
            tile += NUM_PROGRAMS
        tiles_before += num_tiles
        row_start += m_size
    _zero_uncovered_rows(y_ptr, M, N, row_start, tiles_before, stride_ym, stride_yn, NUM_PROGRAMS, BLOCK_M, BLOCK_N)
