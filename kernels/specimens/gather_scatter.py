"""Specimen ``gather_scatter``: correct; the gather/scatter-indices style. It plants no cause.

The design of the routing-plus-ragged-matmul libraries, written here from its description: a
routing step (:func:`route`) turns the router's ``topk_ids`` (T, k) into

* ``hist`` (E,) int32: the slots each local expert gets (a histogram per expert);
* ``gather_indx`` (T*k,) int32: sorted position -> flat slot id ``t*k + j``, the slots of expert 0
  first, then expert 1, ...; -1 past the routed rows (slots routed nowhere: a -1 id, an id
  outside [0, E), an ``expert_map`` entry of -1 or outside [0, E));
* ``scatter_indx`` (T*k,) int32: flat slot id -> its sorted position, -1 for a slot routed nowhere.

A persistent ragged matmul (:func:`_ragged_kernel`) walks the experts of ``hist``: each tile of
an expert's rows gathers its slots' token rows of ``hidden_states`` (slot // k, the slot ids masked
to [0, T*k)) and writes its rows of ``y (T*k, N)`` in sorted order; the weighted reduction comes
after, in torch: ``out[t] = sum_j topk_weights[t, j] * y[scatter_indx[t*k + j]]`` over the slots
with a position (the ``routed`` protocol, ``qmoe_doctor.core.kernel_ref.Protocol``). The grid is the
SM count of the operands' device (``grouped_gemm.num_sms``, keyed by device index) or 4 programs
under the interpreter; the slot ids are int64 where they meet a stride; the launch is inside the
operands' device guard. ``ragged_moe.route`` is the routing step and ``routing=`` takes one.

It never misbehaves: every routed cell passes. The specimens ``gather_unchecked_ids``,
``gather_past_t`` and ``gather_sms_device0`` each plant one fault in it.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from qmoe_doctor.kernels.grouped_gemm import device_guard, num_sms
from qmoe_doctor.kernels.routed import check_routed_operands

#: BLOCK_M, BLOCK_N, BLOCK_K, warps, stages (interpreter: small and quick).
INTERPRETER_TILE = (16, 32, 32, 4, 1)
GPU_TILE = (64, 128, 64, 4, 3)

Routing = dict[str, torch.Tensor]


def tile_of(device: torch.device) -> tuple[int, int, int, int, int]:
    return GPU_TILE if device.type == "cuda" else INTERPRETER_TILE


def mapped_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """(T*k,) int64: ``expert_map[topk_ids]`` (the ids themselves without a map), -1 for an id
    outside the map. Not checked against the local expert count: the routing step does that."""
    ids = topk_ids.reshape(-1).to(torch.int64)
    if expert_map is None:
        return ids
    n_global = int(expert_map.shape[0])
    if n_global == 0:
        return torch.full_like(ids, -1)
    inside = (ids >= 0) & (ids < n_global)
    return torch.where(inside, expert_map.to(torch.int64)[ids.clamp(0, n_global - 1)], -1)


def positions(key: torch.Tensor, routed: torch.Tensor, hist: torch.Tensor) -> Routing:
    """gather_indx and scatter_indx from each slot's sort key (its expert, E or more for a slot
    routed nowhere) and whether it is routed; ``hist`` passes through."""
    num_slots = key.shape[0]
    order = torch.argsort(key, stable=True)
    sorted_pos = torch.arange(num_slots, device=key.device)
    gather_indx = torch.where(sorted_pos < hist.sum(), order, -1).to(torch.int32)
    scatter = torch.empty(num_slots, dtype=torch.int64, device=key.device)
    scatter[order] = sorted_pos
    scatter_indx = torch.where(routed, scatter, -1).to(torch.int32)
    return {"hist": hist, "gather_indx": gather_indx, "scatter_indx": scatter_indx}


def route(
    topk_ids: torch.Tensor,  # (T, k)
    topk_weights: torch.Tensor | None,  # (T, k): applied after the matmul, not here
    num_experts: int,  # E: local experts
    expert_map: torch.Tensor | None = None,  # (E_global,) global id -> local id, -1 elsewhere
) -> Routing:
    """The routing step (the module docstring), on the ids' device, no synchronization."""
    del topk_weights
    local = mapped_ids(topk_ids, expert_map)
    routed = (local >= 0) & (local < num_experts)
    key = torch.where(routed, local, num_experts)  # slots routed nowhere sort after every expert
    counts = torch.zeros(num_experts + 1, dtype=torch.int32, device=key.device)
    counts.index_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    return positions(key, routed, counts[:num_experts])


@triton.jit
def _ragged_kernel(
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
            slot_mask = row_mask & (slots >= 0) & (slots < num_slots)
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


def launch(
    kernel: Any,  # a @triton.jit function with _ragged_kernel's parameters
    hidden_states: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    routing: Routing,
    top_k: int,
    programs: int,
) -> None:
    """The persistent grid of ``programs`` over hist's experts. Callers hold the device guard."""
    block_m, block_n, block_k, warps, stages = tile_of(hidden_states.device)
    kernel[(programs,)](
        hidden_states,
        w,
        y,
        routing["hist"],
        routing["gather_indx"],
        w.shape[1],
        hidden_states.shape[1],
        routing["hist"].shape[0],
        y.shape[0],
        top_k,
        hidden_states.stride(0),
        hidden_states.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        y.stride(0),
        y.stride(1),
        NUM_PROGRAMS=programs,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )


def programs_for(device: torch.device, tiles: int) -> int:
    """The persistent grid: one program per SM of the operands' device, at most one per tile."""
    sms = (
        num_sms(device.index if device.index is not None else torch.cuda.current_device())
        if device.type == "cuda"
        else 4
    )
    return max(1, min(sms, tiles))


def combine(
    y: torch.Tensor, routing: Routing, topk_weights: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """out (T, N): each slot's row of y (by scatter_indx) times its weight, summed per token."""
    tokens, k = topk_weights.shape
    num_slots = y.shape[0]
    scatter = routing["scatter_indx"].to(torch.int64)
    has_row = (scatter >= 0) & (scatter < num_slots)
    rows = y.index_select(0, scatter.clamp(0, max(num_slots - 1, 0))).float()
    rows = torch.where(has_row[:, None], rows, 0.0) * topk_weights.reshape(-1, 1).float()
    out = torch.empty((tokens, y.shape[1]), dtype=out_dtype, device=y.device)
    return out.copy_(rows.view(tokens, k, -1).sum(dim=1))


def forward(
    kernel: Any,
    router: Any,  # route(topk_ids, topk_weights, num_experts, expert_map) -> Routing
    hidden_states: torch.Tensor,
    w: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_map: torch.Tensor | None,
    routing: Routing | None,
    out_dtype: torch.dtype | None,
    programs: Any = programs_for,  # (device, tiles) -> the persistent grid
) -> torch.Tensor:
    """The correct wrapper: routing, the ragged matmul on ``kernel``, the weighted reduction."""
    check_routed_operands(hidden_states, w, topk_ids, topk_weights, expert_map)
    tokens, k = topk_ids.shape
    num_slots = tokens * k
    dev = hidden_states.device
    with device_guard(dev):
        # PLANTED: the public design's traits, each done right here: a routing step of its own
        # (ids masked by E, -1 for dropped slots), gathered slot ids masked by T*k, a persistent
        # grid of the operands' device, the weighted reduction after the ragged matmul
        if routing is None:
            routing = router(topk_ids, topk_weights, w.shape[0], expert_map)
        y = torch.empty((num_slots, w.shape[1]), dtype=hidden_states.dtype, device=dev)
        block_m, block_n = tile_of(dev)[:2]
        experts = routing["hist"].shape[0]
        tiles = (triton.cdiv(num_slots, block_m) + experts) * triton.cdiv(w.shape[1], block_n)
        if num_slots and w.shape[1]:
            launch(kernel, hidden_states, w, y, routing, k, programs(dev, tiles))
        return combine(y, routing, topk_weights, out_dtype or hidden_states.dtype)


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
    """``out (T, N)``: each token's slots reduced with their weights."""
    return forward(
        _ragged_kernel, route, hidden_states, w, topk_ids, topk_weights, expert_map, routing, out_dtype
    )


ragged_moe.route = route  # type: ignore[attr-defined]
