# mypy: allow-untyped-defs, allow-incomplete-defs, allow-untyped-decorators
# (for the two @triton.jit kernels: Triton reads parameter annotations to specialize, so kernel
# parameters stay unannotated, as pyproject.toml's override says of kernels/_details/)
"""The peer to beat: a fixed-tile copy of the public fused-MoE grouped-GEMM design (reference only).

The design most public Qwen3-MoE Triton kernels share (shared/FINDINGS.md, "Measured on one
H100"): a persistent grid of one program per SM; every program walks the experts in order,
reading ``m_sizes`` to find each expert's rows; the tiles of an expert are dealt round-robin
(row tiles fastest, so neighbouring programs share a weight tile); the expert's weights are
found at ``w_ptr + stride_we * expert_idx``; the wrapper allocates its own ``y``; one fixed
tile per launch, pointer loads, no copy engine, no flattened pipeline. ``peer_forward`` (dx is
the same kernel on ``w.transpose(1, 2)``) and ``peer_dw`` (the expert's rows walked in chunks
per dw tile) have that design; ``PEER_TILES`` is the small set its best tile is searched over
(``benchmarks/side_by_side.py`` times each and keeps the fastest: "public design, best fixed
tile").

Two deliberate differences, so that the comparison is of speed alone: the expert offset is
formed in int64 (the public int32 product wraps at the 480B preset's stacks and gives wrong
results there, which is our ``int32-offset-overflow`` cause, not a speed), and it takes strides
(the public wrappers assert contiguity; dx needs the transposed view). Rows past M are not
masked by M (the public design trusts ``m_sizes``): the benchmark gives it valid routing.
Our kernels are in ``kernels/``; nothing imports this outside ``benchmarks/``.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl

__all__ = ["PEER_DW_TILES", "PEER_TILES", "peer_dw", "peer_forward"]

#: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): the forward/dx tiles searched. 128x256x64 is the
#: public design's best on an H200 (349 TFLOP/s at 30b gate_up, 2048 tokens); 4 stages fit the
#: 227 KiB of shared memory of an H100 or H200 block too.
PEER_TILES: tuple[tuple[int, int, int, int, int], ...] = (
    (64, 128, 64, 4, 4),
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
    (128, 256, 64, 8, 4),
)
#: dw tiles (BLOCK_M rows of the reduction per step, BLOCK_N x BLOCK_K of dw): the public dw
#: kernel's best on an H200 was 128x128x128 (109 TFLOP/s; 128x256x64 with 3 stages does not fit).
PEER_DW_TILES: tuple[tuple[int, int, int, int, int], ...] = (
    (64, 128, 64, 4, 4),
    (128, 128, 64, 8, 3),
    (128, 128, 128, 8, 3),
)
#: The CPU smoke run's tile (interpreter).
TINY_TILE = (32, 32, 32, 4, 1)


@triton.jit
def _peer_forward_kernel(
    x_ptr,  # (M, K) rows sorted by expert
    w_ptr,  # (E, N, K) any strides
    y_ptr,  # (M, N)
    m_sizes_ptr,  # (E,)
    E,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ym,
    NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tidx = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    m_end = 0
    processed = 0
    for expert_idx in range(E):
        m_start = m_end
        m_size = tl.load(m_sizes_ptr + expert_idx).to(tl.int32)
        m_end = m_start + m_size
        if m_size > 0:
            num_m_tiles = tl.cdiv(m_size, BLOCK_M)
            tiles = num_m_tiles * num_n_tiles
            while tidx >= processed and tidx < processed + tiles:
                tile = tidx - processed
                tile_m = tile % num_m_tiles  # row tiles fastest: neighbours share a weight tile
                tile_n = tile // num_m_tiles
                offs_m = m_start + tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
                offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
                offs_k = tl.arange(0, BLOCK_K)
                row_ok = offs_m < m_end
                col_ok = offs_n < N
                x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
                # int64 here (the public int32 product wraps at the 480B preset's stacks)
                w_ptrs = (
                    w_ptr
                    + tl.cast(expert_idx, tl.int64) * stride_we
                    + offs_n[None, :] * stride_wn
                    + offs_k[:, None] * stride_wk
                )
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    k_ok = (k0 + offs_k) < K
                    a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                    b = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                    acc = tl.dot(a, b, acc)
                    x_ptrs += BLOCK_K * stride_xk
                    w_ptrs += BLOCK_K * stride_wk
                y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
                tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
                tidx += NUM_SMS
            processed += tiles


@triton.jit
def _peer_dw_kernel(
    dy_ptr,  # (M, N)
    x_ptr,  # (M, K)
    dw_ptr,  # (E, N, K) contiguous
    m_sizes_ptr,
    E,
    N,
    K,
    stride_dym,
    stride_xm,
    NUM_SMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """dw[e] = dy_e.T @ x_e: every expert's (n, k) tiles dealt round-robin; each walks the
    expert's rows BLOCK_M at a time. Empty experts still write their zero tiles."""
    tidx = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    num_k_tiles = tl.cdiv(K, BLOCK_K)
    tiles = num_n_tiles * num_k_tiles
    m_end = 0
    processed = 0
    for expert_idx in range(E):
        m_start = m_end
        m_size = tl.load(m_sizes_ptr + expert_idx).to(tl.int32)
        m_end = m_start + m_size
        while tidx >= processed and tidx < processed + tiles:
            tile = tidx - processed
            offs_n = (tile // num_k_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
            offs_k = (tile % num_k_tiles) * BLOCK_K + tl.arange(0, BLOCK_K)
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for r0 in range(0, m_size, BLOCK_M):
                rows = m_start + r0 + tl.arange(0, BLOCK_M)
                row_ok = rows < m_end
                dy = tl.load(
                    dy_ptr + rows[:, None].to(tl.int64) * stride_dym + offs_n[None, :],
                    mask=row_ok[:, None] & (offs_n < N)[None, :],
                    other=0.0,
                )
                xs = tl.load(
                    x_ptr + rows[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=row_ok[:, None] & (offs_k < K)[None, :],
                    other=0.0,
                )
                acc = tl.dot(tl.trans(dy), xs, acc)
            dw_ptrs = dw_ptr + tl.cast(expert_idx, tl.int64) * N * K + offs_n[:, None] * K + offs_k[None, :]
            tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=(offs_n < N)[:, None] & (offs_k < K)[None, :])
            tidx += NUM_SMS
        processed += tiles


def _num_sms(device: Any) -> int:
    import torch

    if device.type != "cuda":
        return 4  # interpreter: a few programs exercise the walk
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def peer_forward(x: Any, w: Any, m_sizes: Any, tile: tuple[int, int, int, int, int]) -> Any:
    """``y[m] = x[m] @ w[e(m)].T`` the public design's way, one fixed tile: (BM, BN, BK, warps, stages)."""
    import torch

    m, k = x.shape
    e, n, _ = w.shape
    bm, bn, bk, warps, stages = tile
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    sms = _num_sms(x.device)
    with torch.cuda.device(x.device) if x.device.type == "cuda" else _nothing():
        _peer_forward_kernel[(sms,)](
            x, w, y, m_sizes, e, n, k,
            x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), y.stride(0),
            NUM_SMS=sms, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return y


def peer_dw(dy: Any, x: Any, m_sizes: Any, tile: tuple[int, int, int, int, int]) -> Any:
    """``dw[e] = dy_e.T @ x_e`` the public design's way (contiguous rows)."""
    import torch

    m, n = dy.shape
    k = x.shape[1]
    e = m_sizes.shape[0]
    bm, bn, bk, warps, stages = tile
    dw = torch.empty((e, n, k), device=x.device, dtype=x.dtype)
    sms = _num_sms(x.device)
    with torch.cuda.device(x.device) if x.device.type == "cuda" else _nothing():
        _peer_dw_kernel[(sms,)](
            dy, x, dw, m_sizes, e, n, k, dy.stride(0), x.stride(0),
            NUM_SMS=sms, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return dw


def tile_name(tile: tuple[int, int, int, int, int]) -> str:
    bm, bn, bk, warps, stages = tile
    return f"{bm}x{bn}x{bk}-w{warps}-s{stages}"


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
