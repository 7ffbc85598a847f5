"""Specimen ``running_row_mask``: plants ``invalid-routing``, in the style of the public kernels.

The public fused-MoE forward design (FINDINGS.md, "Measured on one H100 ... 2026-11-25"): the
wrapper allocates its own ``y = torch.empty((M, N))``; a persistent grid walks the experts,
keeping a running row count ``m_end += m_size``, and each tile masks its rows by that running
count (``rows < m_end``), never by M. Rows no expert covers are never written (its callers
route every row). Written from that design, not as a diff of ``grouped_gemm.py``.

What it does wrong: the row mask comes from the routing alone. With counts that are
non-negative and sum to M it is right.

When it misbehaves: only when ``m_sizes`` does not describe x's rows:

* it sums past M (the scan's over-routed cell): the last expert's tiles read rows past the end
  of ``x`` and write rows past the end of its own ``y``. On a GPU the caching allocator hides the
  stray write inside a pooled segment (0 memcheck errors with caching on, measured on H100);
  the probe's guard rows around the output it allocates show it, and so does compute-sanitizer
  with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1``;
* it holds a -1 sentinel (the negative-sizes cell): the running count steps back one row, so
  every later expert's rows shift by one inside ``y`` and its last row is never written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qmoe_doctor.kernels.grouped_gemm import check_operands, device_guard, interpreting, num_sms

# One tile config, as the public kernel's non-autotuned path has it (its autotuning is planted
# in the ``autotuned`` specimen). float32 fits: (64 + 128) * 64 * 4 B * 3 stages = 144 KiB.
_BLOCK_M, _BLOCK_N, _BLOCK_K = (32, 32, 32) if interpreting() else (64, 128, 64)
_NUM_WARPS, _NUM_STAGES = (4, 1) if interpreting() else (4, 3)


def moe_grouped_gemm(
    x: torch.Tensor,  # (M, K) rows sorted by expert
    w: torch.Tensor,  # (E, N, K)
    m_sizes: torch.Tensor,  # (E,) rows per expert
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    check_operands(x, w, m_sizes)
    m, k = x.shape
    e, n, _ = w.shape
    with device_guard(x.device):
        # its own output, sized by x's rows: the kernel decides which rows it writes
        y = torch.empty((m, n), device=x.device, dtype=out_dtype or x.dtype)
        if m == 0 or n == 0:
            return y
        if k == 0:
            return y.zero_()
        programs = num_sms(x.device.index or 0) if x.device.type == "cuda" else 4
        _moe_forward_kernel[(programs,)](
            x,
            w,
            y,
            m_sizes,
            n,
            k,
            e,
            x.stride(0),
            x.stride(1),
            w.stride(0),
            w.stride(1),
            w.stride(2),
            y.stride(0),
            y.stride(1),
            NUM_PROGRAMS=programs,
            BLOCK_M=_BLOCK_M,
            BLOCK_N=_BLOCK_N,
            BLOCK_K=_BLOCK_K,
            num_warps=_NUM_WARPS,
            num_stages=_NUM_STAGES,
        )
    return y


@triton.jit
def _moe_forward_kernel(
    x_ptr,  # (M, K) rows sorted by expert
    w_ptr,  # (E, N, K) expert weights, any strides
    y_ptr,  # (M, N) output, allocated by the wrapper; rows written as the routing says
    m_sizes_ptr,  # (E,) int32/int64 rows per expert
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
):
    """Persistent grid: program p takes tiles p, p + NUM_PROGRAMS, ... of the expert-major tile
    sequence (the public design's ``processed_tiles`` walk)."""
    tidx = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)

    processed_tiles = 0  # tiles of the experts already walked (same count in every program)
    m_end = 0  # the running row count: one past the current expert's last row
    for expert in range(E):
        m_start = m_end
        # PLANTED: the count is used as loaded and the rows are masked by the running count
        # m_end only; grouped_gemm.py clamps it to [0, M - row_start], so no row past M exists
        m_size = tl.load(m_sizes_ptr + expert).to(tl.int32)
        m_end = m_start + m_size
        if m_size > 0:
            num_tiles = tl.cdiv(m_size, BLOCK_M) * num_n_tiles
            while (tidx >= processed_tiles) & (tidx < processed_tiles + num_tiles):
                tile = tidx - processed_tiles
                tile_m = tile // num_n_tiles
                tile_n = tile % num_n_tiles
                rows = m_start + tile_m * BLOCK_M + offs_m
                row_mask = rows < m_end
                cols = tile_n * BLOCK_N + offs_n
                col_mask = cols < N
                # rows * stride_xm passes 2**31 for M*K > 2**31: int64 where the product is formed
                x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk
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
                y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :] * stride_yn
                tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])
                tidx += NUM_PROGRAMS
            processed_tiles += num_tiles
