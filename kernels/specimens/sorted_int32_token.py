"""Specimen ``sorted_int32_token``: plants ``int32-offset-overflow`` through gathered slot ids.

What it does wrong: the correct ``sorted_ids`` kernel without the int64 cast of the slot ids it
loads from ``sorted_token_ids`` (int32). ``slot * stride_om`` (each slot's output row) and
``slot // k * stride_hm`` are then formed in int32: the gathered id reaches T*k, so the output
rows wrap once T*k*N passes 2**31 elements, far earlier than any weight offset (1M tokens of
top-8 at N = 256; a rows layout sorted by expert of the same size wraps at the same row, but its
kernels form the row offset in int64).

When it misbehaves: only in the gathered-int32 cell (GPU: 4 GiB of rows): the rows past row
8,388,608 land 4 GiB before ``out`` (an illegal address, or silently another tensor) and are
never written where they belong. Every other cell passes; on the CPU tier nothing can show it
(the cell needs a GPU), and ``lint`` may name the int32 product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qmoe_doctor.kernels.specimens.sorted_ids import Routing, align, forward


@triton.jit
def _sorted_moe_kernel_int32(
    hidden_ptr,  # (T, H) token rows
    w_ptr,  # (E, N, H) local experts
    out_ptr,  # (T*k, N) one row per slot
    sorted_ids_ptr,  # (P,) int32 flat slot ids grouped by expert, num_slots in the padding
    expert_ids_ptr,  # (P // BLOCK_M,) int32 local expert of each block, -1: routed nowhere
    num_post_ptr,  # (1,) int32 num_tokens_post_padded
    N,
    H,
    num_slots,  # T*k
    top_k,
    stride_hm,
    stride_hk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n_tiles
    pid_n = pid % num_n_tiles
    if pid_m * BLOCK_M >= tl.load(num_post_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    # PLANTED: slot ids stay int32: slot * stride_om wraps once T*k*N passes 2**31
    slots = tl.load(sorted_ids_ptr + offs_m)
    slot_mask = (slots >= 0) & (slots < num_slots)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    out_ptrs = out_ptr + slots[:, None] * stride_om + cols[None, :] * stride_on
    out_mask = slot_mask[:, None] & col_mask[None, :]
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    if expert < 0:  # a block of slots routed nowhere: their rows are zero
        tl.store(out_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty), mask=out_mask)
        return
    offs_k = tl.arange(0, BLOCK_K)
    tokens = slots // top_k
    h_ptrs = hidden_ptr + tokens[:, None] * stride_hm + offs_k[None, :] * stride_hk
    w_ptrs = w_ptr + expert * stride_we + cols[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_mask = (k0 + offs_k) < H
        a = tl.load(h_ptrs, mask=slot_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        h_ptrs += BLOCK_K * stride_hk
        w_ptrs += BLOCK_K * stride_wk
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def fused_moe(
    hidden_states: torch.Tensor,  # (T, H)
    w: torch.Tensor,  # (E, N, H)
    topk_ids: torch.Tensor,  # (T, k)
    topk_weights: torch.Tensor,  # (T, k): not applied (one unweighted row per slot)
    expert_map: torch.Tensor | None = None,  # (E_global,) global id -> local id, -1 elsewhere
    *,
    routing: Routing | None = None,  # an alignment of these ids (align's dict); None: made here
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``sorted_ids.fused_moe`` with int32 slot offsets."""
    return forward(
        _sorted_moe_kernel_int32, hidden_states, w, topk_ids, topk_weights, expert_map, routing, out_dtype
    )


fused_moe.route = align  # type: ignore[attr-defined]
