"""Specimen ``gather_past_t``: plants ``invalid-routing`` (gather indices trusted).

What it does wrong: the correct ``gather_scatter`` ragged matmul masks each row by its expert's
row range only, never its gathered slot id by [0, T*k): the id is trusted to name a slot, and
``slot // k`` a token of ``hidden_states``. A gather table from another batch, a stale or
recycled one, or one whose padding is not -1 names tokens past T.

When it misbehaves: only in the gather-past-t cell, which hands the kernel its own routing with
one gather index naming token T + 1: the kernel reads that row past ``hidden_states`` (a NaN
guard row in the probe: the slot's row and its token's output come out NaN, a read outside the
kernel's tensors, the fault). Its own routing names only real slots (and -1 past the routed
rows, which the row range excludes), so every other cell passes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qmoe_doctor.kernels.specimens.gather_scatter import Routing, forward, route


@triton.jit
def _ragged_kernel_past_t(
    hidden_ptr,  # (T, H) token rows
    w_ptr,  # (E, N, H) local experts
    y_ptr,  # (T*k, N) one row per routed slot, in sorted order
    hist_ptr,  # (E,) int32 slots per expert
    gather_ptr,  # (T*k,) int32 sorted position -> flat slot id, -1 past the routed rows
    N,
    H,
    E,  # the experts hist counts
    num_slots,  # T*k
    top_k,
    stride_hm,
    stride_hk,
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
    """Persistent: program p takes tiles p, p + NUM_PROGRAMS, ... of the expert-major tile
    sequence of hist's rows (the row count clamped to the gather table)."""
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    tiles_before = 0
    row_start = 0
    for expert in range(E):
        count = tl.load(hist_ptr + expert)
        count = tl.minimum(tl.maximum(count, 0), tl.maximum(num_slots - row_start, 0))
        num_tiles = tl.cdiv(count, BLOCK_M) * num_n_tiles
        tile = tiles_before + (pid - tiles_before % NUM_PROGRAMS + NUM_PROGRAMS) % NUM_PROGRAMS
        while tile < tiles_before + num_tiles:
            local = tile - tiles_before
            rows = row_start + (local // num_n_tiles) * BLOCK_M + offs_m
            row_mask = rows < row_start + count
            cols = (local % num_n_tiles) * BLOCK_N + offs_n
            col_mask = cols < N
            # slot // k * stride_hm: int64 slot ids (the gathered rows reach T*k)
            slots = tl.load(gather_ptr + rows, mask=row_mask, other=-1).to(tl.int64)
            # PLANTED: slots masked by the row range alone, not by [0, T*k): a gather index
            # past T*k reads a token row past hidden_states
            slot_mask = row_mask
            tokens = slots // top_k
            h_ptrs = hidden_ptr + tokens[:, None] * stride_hm + offs_k[None, :] * stride_hk
            w_ptrs = (
                w_ptr
                + tl.cast(expert, tl.int64) * stride_we
                + cols[None, :] * stride_wn
                + offs_k[:, None] * stride_wk
            )
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, H, BLOCK_K):
                k_mask = (k0 + offs_k) < H
                a = tl.load(h_ptrs, mask=slot_mask[:, None] & k_mask[None, :], other=0.0)
                b = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
                acc = tl.dot(a, b, acc)
                h_ptrs += BLOCK_K * stride_hk
                w_ptrs += BLOCK_K * stride_wk
            y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :] * stride_yn
            tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])
            tile += NUM_PROGRAMS
        tiles_before += num_tiles
        row_start += count


def ragged_moe(
    hidden_states: torch.Tensor,  # (T, H)
    w: torch.Tensor,  # (E, N, H)
    topk_ids: torch.Tensor,  # (T, k)
    topk_weights: torch.Tensor,  # (T, k)
    expert_map: torch.Tensor | None = None,  # (E_global,) global id -> local id, -1 elsewhere
    *,
    routing: Routing | None = None,  # a routing of these ids (route's dict); None: made here
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``gather_scatter.ragged_moe`` with gather indices trusted."""
    return forward(
        _ragged_kernel_past_t, route, hidden_states, w, topk_ids, topk_weights, expert_map, routing, out_dtype
    )


ragged_moe.route = route  # type: ignore[attr-defined]
