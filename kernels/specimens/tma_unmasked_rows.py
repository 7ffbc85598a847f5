"""Specimen ``tma_unmasked_rows``: plants ``invalid-routing``, in the persistent TMA-descriptor style.

``tma_persistent`` (the correct twin: device-side descriptors, scratch from ``triton.set_allocator``,
a persistent grid of the SM count, 64-bit row offsets, w flattened to ``(E*N, K)``) with one line
gone: the clamp of each expert's row count to ``[0, M - row_start]``. Each expert's x and y
descriptors then span the rows ``m_sizes`` claims, and a descriptor's shape is the only row mask
a TMA load or store has: the tiles read and write exactly those rows, inside or past x and y.

When it misbehaves: only when ``m_sizes`` does not describe x's rows:

* it sums past M (the scan's over-routed cell): the last expert's y descriptor reaches past the
  end of ``y`` and its TMA stores write the extra rows there (its x descriptor reads past ``x``).
  Inside a pooled segment nothing faults (the probe's guard rows after its ``y`` show the
  write); a store that leaves mapped memory ends the program. On an H100, the public kernel of
  this design over-routed by 64 rows died with ``CUDA error: an illegal instruction was
  encountered`` (715: how a TMA store past the end surfaces), later calls with ``unspecified
  launch failure``; memcheck without the caching allocator placed the writes past the output
  (FINDINGS.md, 2026-12-06);
* it holds a -1 sentinel (the negative-sizes cell): that expert is skipped but the row cursor
  steps back one row, so the next expert's descriptors start one row early and its tiles
  overwrite the last row of the expert before it (wrong rows inside ``y``, nothing outside).

With counts that are non-negative and sum to M it is identical to ``tma_persistent``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qmoe_doctor.kernels.specimens.tma_persistent import forward, tma_operand


def moe_grouped_gemm(
    x: torch.Tensor,  # (M, K) rows sorted by expert
    w: torch.Tensor,  # (E, N, K)
    m_sizes: torch.Tensor,  # (E,) rows per expert
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The wrapper: w as (E*N, K) (a view where w's layout allows one, else a copy)."""
    e, n, k = w.shape
    return grouped_gemm_flat(x, w.reshape(e * n, k), m_sizes, out_dtype=out_dtype)


def grouped_gemm_flat(
    x: torch.Tensor,  # (M, K) rows sorted by expert
    w2d: torch.Tensor,  # (E*N, K)
    m_sizes: torch.Tensor,  # (E,) rows per expert; trusted
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    return forward(
        _grouped_gemm_tma_kernel_unmasked, tma_operand(x), tma_operand(w2d), m_sizes, out_dtype=out_dtype
    )


# A copy of tma_persistent._grouped_gemm_tma_kernel; only the PLANTED line (the m_size clamp) differs.
@triton.jit
def _grouped_gemm_tma_kernel_unmasked(
    x_ptr,  # (M, K) rows sorted by expert; 16-byte-aligned base and row stride
    w_ptr,  # (E*N, K) expert weights flattened: expert e is rows e*N ..; 16-byte-aligned rows
    y_ptr,  # (M, N) output; 16-byte-aligned base and row stride
    m_sizes_ptr,  # (E,) int32/int64 rows per expert; trusted as loaded (the fault)
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
        # PLANTED: m_size is trusted as loaded; tma_persistent.py clamps it to [0, M - row_start]
        # here, and the descriptors' shape is the only row mask a TMA load or store has
        m_size = tl.load(m_sizes_ptr + expert).to(tl.int32)
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
