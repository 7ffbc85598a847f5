"""Specimen ``sorted_ids``: correct; the sorted-token-ids-per-block style. It plants no cause.

The design of the inference servers' fused MoE, written here from its description: an
alignment step (:func:`align`) turns the router's ``topk_ids`` (T, k) into

* ``sorted_token_ids`` (P,) int32: the flat slot ids ``t*k + j`` grouped by local expert, each
  expert's group padded to a multiple of BLOCK_M with the id ``T*k`` (no slot);
* ``expert_ids`` (P // BLOCK_M,) int32: the local expert of each block of BLOCK_M positions, -1
  for a block of slots routed nowhere (a -1 id, an id outside [0, E), an ``expert_map`` entry of
  -1 or outside [0, E): they get a bucket of their own, after the experts);
* ``num_tokens_post_padded`` (1,) int32: the positions the blocks fill (a device tensor; never
  read on the host).

P, the buffer, is the bound every alignment fits in (``T*k + (E + 1) * (BLOCK_M - 1)`` rounded up
to BLOCK_M), known without reading a count. The kernel (:func:`_sorted_moe_kernel`) runs one
program per (block, column tile) of that buffer: a block at or past ``num_tokens_post_padded``
returns at once, a block of expert -1 writes zeros, every other gathers its slots' token rows of
``hidden_states`` (slot // k) and writes each slot's row of ``out (T*k, N)``, unweighted: the
``routed-rows`` protocol (``qmoe_doctor.core.kernel_ref.Protocol``). Slot ids are int64 where they
meet a stride; ids and map entries are masked by E in the alignment; the grid comes from the
buffer, never from the count. ``fused_moe.route`` is the alignment and ``routing=`` takes one, so
the routed cells can hand the kernel its own alignment with one entry lying.

It never misbehaves: every routed cell passes (ids past E, -1 slots, an expert map with -1 and
with entries past the local count, a padded count past its buffer, the gathered int32 boundary).
The specimens ``sorted_padded_count``, ``sorted_minus_one`` and ``sorted_int32_token`` each plant
one fault in it.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from qmoe_doctor.kernels.grouped_gemm import device_guard
from qmoe_doctor.kernels.routed import check_routed_operands, local_expert_ids

#: BLOCK_M, BLOCK_N, BLOCK_K, warps, stages: under the interpreter small (quick), on a GPU the
#: public design's common small-batch tile.
INTERPRETER_TILE = (16, 32, 32, 4, 1)
GPU_TILE = (64, 64, 32, 4, 3)

Routing = dict[str, torch.Tensor]


def tile_of(device: torch.device) -> tuple[int, int, int, int, int]:
    return GPU_TILE if device.type == "cuda" else INTERPRETER_TILE


def align(
    topk_ids: torch.Tensor,  # (T, k) expert of each slot (global ids with expert_map)
    topk_weights: torch.Tensor | None,  # (T, k): not used by the alignment
    num_experts: int,  # E: local experts
    expert_map: torch.Tensor | None = None,  # (E_global,) global id -> local id, -1 elsewhere
) -> Routing:
    """The alignment of ``topk_ids`` to blocks of BLOCK_M positions (the module docstring), on
    the ids' device, no synchronization."""
    del topk_weights
    dev = topk_ids.device
    block_m = tile_of(dev)[0]
    num_slots = topk_ids.numel()
    e = num_experts
    # -1 for every slot routed to no local expert (ids and map entries masked by E)
    local = local_expert_ids(topk_ids, expert_map, e).reshape(-1)
    bucket = torch.where(local >= 0, local, e)  # bucket E: the slots routed nowhere
    counts = torch.zeros(e + 1, dtype=torch.int64, device=dev).index_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    # every bucket pads by at most BLOCK_M - 1: the buffer's size, known on the host
    capacity = triton.cdiv(num_slots + (e + 1) * (block_m - 1), block_m) * block_m
    order = torch.argsort(bucket, stable=True)
    in_bucket = bucket[order]
    rank = torch.arange(num_slots, device=dev) - (torch.cumsum(counts, 0) - counts)[in_bucket]
    sorted_token_ids = torch.full((capacity,), num_slots, dtype=torch.int32, device=dev)
    sorted_token_ids[(ends - padded)[in_bucket] + rank] = order.to(torch.int32)
    block_bucket = torch.searchsorted(ends, torch.arange(0, capacity, block_m, device=dev), right=True)
    expert_ids = torch.where(block_bucket < e, block_bucket, -1).to(torch.int32)
    return {
        "sorted_token_ids": sorted_token_ids,
        "expert_ids": expert_ids,
        "num_tokens_post_padded": ends[-1:].to(torch.int32),
    }


@triton.jit
def _sorted_moe_kernel(
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
    # slot * stride_om passes 2**31 once T*k*N does (1M tokens x top-8 x N=256): int64 slot ids
    slots = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
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


def launch(
    kernel: Any,  # a @triton.jit function with _sorted_moe_kernel's parameters
    hidden_states: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    routing: Routing,
    top_k: int,
    blocks: int,
) -> None:
    """``blocks`` blocks of BLOCK_M positions, every column tile of each. Callers hold the device
    guard."""
    block_m, block_n, block_k, warps, stages = tile_of(hidden_states.device)
    n = w.shape[1]
    grid = (blocks * triton.cdiv(n, block_n),)
    if grid[0] == 0:
        return
    kernel[grid](
        hidden_states,
        w,
        out,
        routing["sorted_token_ids"],
        routing["expert_ids"],
        routing["num_tokens_post_padded"],
        n,
        hidden_states.shape[1],
        out.shape[0],
        top_k,
        hidden_states.stride(0),
        hidden_states.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        out.stride(0),
        out.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )


def forward(
    kernel: Any,
    hidden_states: torch.Tensor,
    w: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_map: torch.Tensor | None,
    routing: Routing | None,
    out_dtype: torch.dtype | None,
) -> torch.Tensor:
    """The correct wrapper, launching ``kernel`` over the buffer's blocks."""
    check_routed_operands(hidden_states, w, topk_ids, topk_weights, expert_map)
    tokens, k = topk_ids.shape
    with device_guard(hidden_states.device):
        # PLANTED: the public design's traits, each done right here: an alignment of its own (ids
        # and map entries masked by E), blocks of expert -1 written as zeros, the grid from the
        # padded buffer (num_tokens_post_padded only ends blocks early), int64 slot ids
        if routing is None:
            routing = align(topk_ids, topk_weights, w.shape[0], expert_map)
        out = torch.empty(
            (tokens * k, w.shape[1]), dtype=out_dtype or hidden_states.dtype, device=hidden_states.device
        )
        blocks = (
            routing["sorted_token_ids"].shape[0] // tile_of(hidden_states.device)[0]
        )  # the buffer, not the count
        launch(kernel, hidden_states, w, out, routing, k, blocks)
    return out


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
    """``out (T*k, N)``: row t*k + j is slot (t, j)'s product, zero for a slot routed nowhere."""
    return forward(
        _sorted_moe_kernel, hidden_states, w, topk_ids, topk_weights, expert_map, routing, out_dtype
    )


fused_moe.route = align  # type: ignore[attr-defined]
