"""The segment-sum kernels of ``kernels/combine.py`` (forward, and the combine's backward)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _segment_sum_kernel(
    rows_ptr,
    order_ptr,
    starts_ptr,
    w_ptr,
    out_ptr,
    H,
    stride_r,
    stride_o,
    HAS_W: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    seg = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    lo = tl.load(starts_ptr + seg)
    hi = tl.load(starts_ptr + seg + 1)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in range(lo, hi):
        row = tl.cast(tl.load(order_ptr + j), tl.int64)  # row * stride passes 2**31 for R*H > 2**31
        x = tl.load(rows_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            x = x * tl.load(w_ptr + j).to(tl.float32)
        acc += x
    tl.store(out_ptr + tl.cast(seg, tl.int64) * stride_o + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combine_backward_kernel(
    grad_ptr,  # (S, H) gradient of the segment sums
    rows_ptr,  # (R, H) the forward's rows (for the weights' gradient)
    order_ptr,
    starts_ptr,
    w_ptr,
    grad_rows_ptr,  # (R, H) out: w[j] * grad[segment of j] at row order[j]
    grad_w_ptr,  # (L,) out: dot(rows[order[j]], grad[segment of j])
    H,
    stride_g,
    stride_r,
    BLOCK_H: tl.constexpr,
):
    seg = tl.program_id(0)
    lo = tl.load(starts_ptr + seg)
    hi = tl.load(starts_ptr + seg + 1)
    g_row = grad_ptr + tl.cast(seg, tl.int64) * stride_g
    for j in range(lo, hi):
        row = tl.cast(tl.load(order_ptr + j), tl.int64)
        w = tl.load(w_ptr + j).to(tl.float32)
        dot = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            cols = h0 + tl.arange(0, BLOCK_H)
            mask = cols < H
            g = tl.load(g_row + cols, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(rows_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(
                grad_rows_ptr + row * stride_r + cols, (w * g).to(grad_rows_ptr.dtype.element_ty), mask=mask
            )
            dot += x * g
        tl.store(grad_w_ptr + j, tl.sum(dot, 0).to(grad_w_ptr.dtype.element_ty))
