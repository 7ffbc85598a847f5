"""Backward of the grouped GEMM, and the autograd function that ties forward and backward.

With ``y[m] = x[m] @ w[e(m)].T`` (rows sorted by expert, see ``grouped_gemm``):

* ``dx[m] = dy[m] @ w[e(m)]``: the forward kernel on ``w.transpose(1, 2)`` (it takes strides);
* ``dw[e] = dy_e.T @ x_e``: a Triton kernel of its own. Program p of a persistent grid takes
  tiles p, p + NUM_PROGRAMS, ... of the (expert, n-tile, k-tile) sequence and, for each, walks
  that expert's rows in BLOCK_M chunks. The rows of each expert come from an exclusive cumsum of
  ``m_sizes`` made on x's device inside the device guard, clamped to M exactly as the forward
  clamps them, so a wrong ``m_sizes`` can never read outside dy or x. Empty experts give zero dw.
  Variants, chosen per shape by the measured config table (``kernels/tuning.py``): copy-engine
  (TMA) loads, one flattened loop, and the *resident* kernel (``-rN`` / ``-rxN`` configs), which
  keeps one operand of an expert in registers while it walks every tile of the other
  (``_grouped_gemm_dw_resident_kernel``).

``moe_fused_linear(x, w, m_sizes)`` is the autograd function (no gradient for ``m_sizes``).
Each kernel has its slow, obvious twin: ``moe_grouped_gemm_dx_torch``, ``moe_grouped_gemm_dw_torch``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import triton
import triton.language as tl

from qmoe_doctor.kernels.dw_overlap import (
    dw_overlap_plan,
    dw_overlap_smem_bytes,
    launch_dw_overlap,
    overlap_halves,
)
from qmoe_doctor.kernels.grouped_gemm import (
    GemmConfig,
    _clamped_sizes,
    _tma_ready,
    capability,
    check_routing_sizes,
    device_guard,
    interpreting,
    moe_grouped_gemm,
    moe_grouped_gemm_torch,
    persistent_sms,
    reserved_sms,
    sm_reserve,
    smem_limit,
    tensor_descriptor_class,
)

__all__ = [
    "GroupedGemm",
    "check_dw_operands",
    "deferred_weight_grads",
    "dw_grid_size",
    "dw_tma_plan",
    "launch_grouped_gemm_dw",
    "moe_fused_linear",
    "moe_grouped_gemm_dw",
    "moe_grouped_gemm_dw_torch",
    "moe_grouped_gemm_dx",
    "moe_grouped_gemm_dx_torch",
    "pick_dw_config",
    "row_bounds",
    "row_bounds_torch",
]


class GroupedGemm(Protocol):
    """The seam for a forward kernel: the signature of ``moe_grouped_gemm``."""

    def __call__(self, x: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor, /) -> torch.Tensor: ...


_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# --------------------------------------------------------------------------------------------
# dx: the forward kernel on the transposed weights.
# --------------------------------------------------------------------------------------------


def _check_dx_shapes(dy: torch.Tensor, w: torch.Tensor) -> None:
    # checked here so the message speaks of dy and w, not of the transposed view the kernel sees
    if isinstance(dy, torch.Tensor) and isinstance(w, torch.Tensor) and dy.dim() == 2 and w.dim() == 3:
        if dy.shape[1] != w.shape[1]:
            raise ValueError(
                f"dy has N={dy.shape[1]} columns but w is (E, N, K)={tuple(w.shape)}: N must match"
            )


def moe_grouped_gemm_dx(
    dy: torch.Tensor,
    w: torch.Tensor,
    m_sizes: torch.Tensor,
    *,
    check_routing: bool = False,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """``dx[m] = dy[m] @ w[e(m)]``: dy (M, N), w (E, N, K), m_sizes (E,) -> dx (M, K).

    Rows ``m_sizes`` does not cover are zero; the device guard, buffers and masking are the
    forward's (it is the forward kernel on ``w.transpose(1, 2)``).
    """
    _check_dx_shapes(dy, w)
    w_t = w.transpose(1, 2) if isinstance(w, torch.Tensor) and w.dim() == 3 else w
    return moe_grouped_gemm(dy, w_t, m_sizes, check_routing=check_routing, config=config)


def moe_grouped_gemm_dx_torch(
    dy: torch.Tensor,
    w: torch.Tensor,
    m_sizes: torch.Tensor,
    *,
    check_routing: bool = False,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """The slow, obvious twin of ``moe_grouped_gemm_dx``."""
    _check_dx_shapes(dy, w)
    return moe_grouped_gemm_torch(dy, w.transpose(1, 2), m_sizes, check_routing=check_routing, config=config)


# --------------------------------------------------------------------------------------------
# dw: its own kernel.
# --------------------------------------------------------------------------------------------


def check_dw_operands(dy: torch.Tensor, x: torch.Tensor, m_sizes: torch.Tensor) -> None:
    """Validate shapes, dtypes and devices of a dw call (no synchronization)."""
    for name, t in (("dy", dy), ("x", x), ("m_sizes", m_sizes)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dy.dim() != 2:
        raise ValueError(f"dy must be 2-D (M, N), got shape {tuple(dy.shape)}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (M, K), got shape {tuple(x.shape)}")
    if m_sizes.dim() != 1:
        raise ValueError(f"m_sizes must be 1-D (E,), got shape {tuple(m_sizes.shape)}")
    if dy.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"dy must be bfloat16, float16 or float32, got {dy.dtype}")
    if x.dtype != dy.dtype:
        raise TypeError(f"x has dtype {x.dtype} but dy has {dy.dtype}; they must match")
    if m_sizes.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"m_sizes must be int32 or int64, got {m_sizes.dtype}")
    if dy.shape[0] != x.shape[0]:
        raise ValueError(f"dy has M={dy.shape[0]} rows but x has M={x.shape[0]}: they must match")
    devices = {t.device for t in (dy, x, m_sizes)}
    if len(devices) > 1:
        placed = ", ".join(f"{n} on {t.device}" for n, t in (("dy", dy), ("x", x), ("m_sizes", m_sizes)))
        raise ValueError(f"operands are on different devices ({placed}); move them to one device")
    if dy.device.type == "cpu" and not interpreting():
        raise ValueError(
            "dy is a CPU tensor: the Triton kernel needs CUDA tensors "
            "(or TRITON_INTERPRET=1 to run it on the CPU); use moe_grouped_gemm_dw_torch for CPU"
        )
    if dy.device.type not in ("cuda", "cpu"):
        raise ValueError(f"dy is on {dy.device}; only CUDA devices are supported")


def row_bounds(m_sizes: torch.Tensor, m: int) -> torch.Tensor:
    """(E + 1,) int64 on m_sizes' device: expert e owns rows [bounds[e], bounds[e + 1]).

    The same clamping as the forward's tile walk: negative counts are 0, nothing passes M
    (``min(cumsum, M)``). int64: the cumsum of int32 counts can pass 2**31. No synchronization.
    One small Triton launch (``_row_bounds_kernel``): the six torch ops of ``row_bounds_torch``
    cost 56 us of host time per dw call on an H200 host (run 44), a third of the whole call.
    """
    e = m_sizes.shape[0]
    on_triton = m_sizes.device.type == "cuda" or (interpreting() and m_sizes.device.type == "cpu")
    if not on_triton or e > _BOUNDS_MAX_EXPERTS:
        return row_bounds_torch(m_sizes, m)
    with device_guard(m_sizes.device):
        bounds = torch.empty(e + 1, dtype=torch.int64, device=m_sizes.device)
        _row_bounds_kernel[(1,)](
            m_sizes, bounds, e, m, BLOCK_E=triton.next_power_of_2(max(e, 1)), num_warps=4
        )
    return bounds


def row_bounds_torch(m_sizes: torch.Tensor, m: int) -> torch.Tensor:
    """``row_bounds`` in torch ops: its twin, and its path for more than 16384 experts."""
    ends = torch.cumsum(m_sizes.to(torch.int64).clamp_min(0), dim=0).clamp_max(m)
    return torch.cat([ends.new_zeros(1), ends])


_BOUNDS_MAX_EXPERTS = 16384  # one program holds every count


@triton.jit
def _row_bounds_kernel(sizes_ptr, bounds_ptr, E, M, BLOCK_E: tl.constexpr):
    """bounds[0] = 0, bounds[e + 1] = min(sum(max(sizes[: e + 1], 0)), M), summed in int64."""
    offs = tl.arange(0, BLOCK_E)
    live = offs < E
    sizes = tl.maximum(tl.load(sizes_ptr + offs, mask=live, other=0).to(tl.int64), 0)
    ends = tl.minimum(tl.cumsum(sizes, 0), M)
    tl.store(bounds_ptr + 1 + offs, ends, mask=live)
    tl.store(bounds_ptr + offs, tl.zeros_like(ends), mask=offs == 0)


def _dw_smem_bytes(cfg: GemmConfig, itemsize: int) -> int:
    if cfg.overlap:
        return dw_overlap_smem_bytes(
            cfg.block_m, cfg.block_n, cfg.block_k, cfg.overlap, cfg.num_stages, itemsize
        )
    if cfg.resident:
        # per stage: the streamed operand's tile for every resident chunk; once: the resident
        # operand's chunks and a dw tile
        rows = cfg.resident * cfg.block_m
        stream, res = (cfg.block_n, cfg.block_k) if cfg.resident_x else (cfg.block_k, cfg.block_n)
        return (rows * stream * cfg.num_stages + rows * res + cfg.block_n * cfg.block_k) * itemsize
    # per stage: one dy tile (BLOCK_M, BLOCK_N) and one x tile (BLOCK_M, BLOCK_K)
    return (cfg.block_n + cfg.block_k) * cfg.block_m * itemsize * cfg.num_stages


def pick_dw_config(
    n: int, k: int, device: torch.device, dtype: torch.dtype, *, avg_rows: float = 128.0
) -> GemmConfig:
    """dw tile: block_n x block_k of dw, block_m rows of reduction per step.

    The measured table (``kernels/tuning.py``) on the devices it was measured for, a built-in
    rule elsewhere; pruned against this device's shared memory (128x256x64 with 3 stages asks
    245760 B on an H200, which has 232448 B: a launch-config fault).
    """
    if device.type != "cuda":
        return GemmConfig(32, 32, 32, num_warps=4, num_stages=1)  # interpreter: small and quick
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _pick_dw_config(n, k, index, dtype, round(avg_rows, 1))


@functools.lru_cache(maxsize=4096)
def _pick_dw_config(n: int, k: int, index: int, dtype: torch.dtype, avg_rows: float) -> GemmConfig:
    from qmoe_doctor.kernels import tuning

    cfg = tuning.lookup("dw", avg_rows, n, k, capability(index))
    if cfg is None:
        if n >= 128 and k >= 128:
            cfg = GemmConfig(64, 128, 128, num_warps=8, num_stages=3)
        else:
            cfg = GemmConfig(64, 64, 64, num_warps=4, num_stages=3)
    return _fit_dw(cfg, index, dtype)


def _fit_dw(cfg: GemmConfig, index: int, dtype: torch.dtype) -> GemmConfig:
    """``cfg`` with fewer stages until its shared memory fits device ``index``."""
    limit = smem_limit(index)
    itemsize = torch.empty((), dtype=dtype).element_size()
    while cfg.num_stages > 1 and _dw_smem_bytes(cfg, itemsize) > limit:
        cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    return cfg


def dw_grid_size(e: int, n: int, k: int, cfg: GemmConfig, device: torch.device) -> int:
    """Programs of the persistent dw grid: at most one per SM of *this* device, never more
    than the E * n-tiles * k-tiles there are (E * n-tiles work items for the resident kernel,
    E * k-tiles with x resident)."""
    n_tiles, k_tiles = triton.cdiv(n, cfg.block_n), triton.cdiv(k, cfg.block_k)
    if cfg.overlap:
        tiles = e * n_tiles
    elif cfg.resident:
        tiles = e * (k_tiles if cfg.resident_x else n_tiles)
    else:
        tiles = e * n_tiles * k_tiles
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return max(1, min(persistent_sms(index) * max(1, cfg.programs_per_sm), tiles))
    return max(1, min(4, tiles))  # interpreter: a few programs exercise the tile walk


@triton.jit
def _grouped_gemm_dw_kernel(
    dy_ptr,  # (M, N) output gradient, rows sorted by expert
    x_ptr,  # (M, K) forward input, rows sorted by expert
    dw_ptr,  # (E, N, K) weight gradient, every element written
    bounds_ptr,  # (E + 1,) int64 row bounds: expert e owns rows [bounds[e], bounds[e + 1])
    M,
    N,
    K,
    E,
    stride_dym,
    stride_dyn,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Persistent grid: program p takes tiles p, p + NUM_PROGRAMS, ... of the
    (expert, n-tile, k-tile) sequence and reduces that expert's rows in BLOCK_M chunks."""
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    num_k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_expert = num_n_tiles * num_k_tiles
    num_tiles = E * tiles_per_expert
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)

    tile = pid
    while tile < num_tiles:
        expert = tile // tiles_per_expert
        local = tile % tiles_per_expert
        tile_n = local // num_k_tiles
        tile_k = local % num_k_tiles
        cols_n = tile_n * BLOCK_N + offs_n
        cols_k = tile_k * BLOCK_K + offs_k
        n_mask = cols_n < N
        k_mask = cols_k < K
        # bounds are int64 and clamped to M by the host; clamp again so that a bad bounds
        # buffer still cannot move the reads outside dy and x
        row_start = tl.minimum(tl.maximum(tl.load(bounds_ptr + expert), 0), M)
        row_end = tl.minimum(tl.maximum(tl.load(bounds_ptr + expert + 1), row_start), M)
        rows_in_expert = (row_end - row_start).to(tl.int32)  # <= M

        # row_start * stride_xm passes 2**31 for M*K > 2**31: row_start is int64 (bounds), so
        # the product is formed in int64; within a chunk, offs_m * stride stays small
        # dy tile read transposed: (BLOCK_N, BLOCK_M)
        dy_ptrs = (
            dy_ptr + row_start * stride_dym + offs_m[None, :] * stride_dym + cols_n[:, None] * stride_dyn
        )
        x_ptrs = x_ptr + row_start * stride_xm + offs_m[:, None] * stride_xm + cols_k[None, :] * stride_xk
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        # a counted `for` (not a while on row bounds) so that Triton software-pipelines it
        for chunk in range(0, tl.cdiv(rows_in_expert, BLOCK_M)):
            row_mask = (chunk * BLOCK_M + offs_m) < rows_in_expert
            a = tl.load(dy_ptrs, mask=n_mask[:, None] & row_mask[None, :], other=0.0)
            b = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
            dy_ptrs += BLOCK_M * stride_dym
            x_ptrs += BLOCK_M * stride_xm

        # expert * stride_we passes 2**31 at expert 69 for 160 experts of 5120x6144
        dw_ptrs = (
            dw_ptr
            + tl.cast(expert, tl.int64) * stride_we
            + cols_n[:, None] * stride_wn
            + cols_k[None, :] * stride_wk
        )
        tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=n_mask[:, None] & k_mask[None, :])
        tile += NUM_PROGRAMS


def _dw_sizes(dy: torch.Tensor, x: torch.Tensor, dw: torch.Tensor) -> tuple[int, ...]:
    """M, N, K, E and the seven strides, in the order every dw kernel takes them."""
    return (
        dy.shape[0],
        dy.shape[1],
        x.shape[1],
        dw.shape[0],
        dy.stride(0),
        dy.stride(1),
        x.stride(0),
        x.stride(1),
        dw.stride(0),
        dw.stride(1),
        dw.stride(2),
    )


def _launch_options(cfg: GemmConfig) -> dict[str, int]:
    """The tile sizes and launch options of ``cfg`` as Triton keywords."""
    return {
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
    }


def launch_grouped_gemm_dw(
    dy: torch.Tensor,
    x: torch.Tensor,
    dw: torch.Tensor,
    bounds: torch.Tensor,
    cfg: GemmConfig,
    num_programs: int,
) -> None:
    """Launch on the current device and stream. Callers hold the device guard.

    dy (M, N), x (M, K), dw (E, N, K) any strides, bounds (E + 1,) int64 from ``row_bounds``.
    """
    _grouped_gemm_dw_kernel[(num_programs,)](
        dy, x, dw, bounds, *_dw_sizes(dy, x, dw), NUM_PROGRAMS=num_programs, **_launch_options(cfg)
    )


@triton.jit
def _grouped_gemm_dw_tma_kernel(
    dy_desc,  # (M, N) block (BLOCK_M, BLOCK_N)
    x_desc,  # (M, K) block (BLOCK_M, BLOCK_K)
    dw_desc,  # (E * N, K) block (BLOCK_N, BLOCK_K) when DW_TMA (the host checks N % BLOCK_N == 0)
    dy_ptr,
    x_ptr,
    dw_ptr,
    bounds_ptr,
    M,
    N,
    K,
    E,
    stride_dym,
    stride_dyn,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    NUM_PROGRAMS,  # runtime: one compiled kernel serves every grid size
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DW_TMA: tl.constexpr,
):
    """``_grouped_gemm_dw_kernel`` with the expert's whole BLOCK_M-row chunks loaded by the
    copy engine and its last partial chunk by masked pointer loads (a descriptor cannot stop
    at the expert's last row, and rows of the next expert must not enter this sum; loading that
    chunk as a whole box and masking it afterwards measured 7% slower on an H200, run 14)."""
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    num_k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_expert = num_n_tiles * num_k_tiles
    num_tiles = E * tiles_per_expert
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)

    tile = pid
    while tile < num_tiles:
        expert = tile // tiles_per_expert
        local = tile % tiles_per_expert
        tile_n = local // num_k_tiles
        tile_k = local % num_k_tiles
        n0 = tile_n * BLOCK_N
        k0 = tile_k * BLOCK_K
        cols_n = n0 + offs_n
        cols_k = k0 + offs_k
        n_mask = cols_n < N
        k_mask = cols_k < K
        row_start = tl.minimum(tl.maximum(tl.load(bounds_ptr + expert), 0), M)
        row_end = tl.minimum(tl.maximum(tl.load(bounds_ptr + expert + 1), row_start), M)
        rows_in_expert = (row_end - row_start).to(tl.int32)
        first = row_start.to(tl.int32)  # < M < 2**31: a descriptor coordinate
        full_chunks = rows_in_expert // BLOCK_M
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for chunk in range(0, full_chunks):
            a = dy_desc.load([first + chunk * BLOCK_M, n0])  # (BLOCK_M, BLOCK_N)
            b = x_desc.load([first + chunk * BLOCK_M, k0])  # (BLOCK_M, BLOCK_K)
            acc = tl.dot(a.T, b, acc)
        tail = full_chunks * BLOCK_M
        if tail < rows_in_expert:
            rows = tl.cast(row_start + tail, tl.int64)  # rows * stride passes 2**31 for M*K > 2**31
            row_mask = (tail + offs_m) < rows_in_expert
            dy_ptrs = dy_ptr + rows * stride_dym + offs_m[None, :] * stride_dym + cols_n[:, None] * stride_dyn
            x_ptrs = x_ptr + rows * stride_xm + offs_m[:, None] * stride_xm + cols_k[None, :] * stride_xk
            a_t = tl.load(dy_ptrs, mask=n_mask[:, None] & row_mask[None, :], other=0.0)
            b_t = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
            acc = tl.dot(a_t, b_t, acc)
        out = acc.to(dw_ptr.dtype.element_ty)
        if DW_TMA:
            # a descriptor coordinate is an element index (int32 by definition, < E * N); the
            # copy engine forms the 64-bit address
            dw_desc.store([expert * N + n0, k0], out)  # qmoe-doctor: ignore[int32-offset]
        else:
            dw_ptrs = (
                dw_ptr
                + tl.cast(expert, tl.int64) * stride_we
                + cols_n[:, None] * stride_wn
                + cols_k[None, :] * stride_wk
            )
            tl.store(dw_ptrs, out, mask=n_mask[:, None] & k_mask[None, :])
        tile += NUM_PROGRAMS


# fmt: off
@triton.jit
def _dw_store_tile(dw_desc, dw_ptr, acc, expert, n0, k0, N, K, stride_we, stride_wn, stride_wk,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DW_TMA: tl.constexpr, X_RES: tl.constexpr):
    """Store one (BLOCK_N, BLOCK_K) tile of dw[expert] at (n0, k0) from ``acc`` (fp32; (BLOCK_K,
    BLOCK_N) when X_RES, transposed here): by the copy engine when the host made a descriptor
    (N % BLOCK_N == 0), else by masked pointer stores."""
    out = acc.to(dw_ptr.dtype.element_ty)
    if X_RES:
        out = out.T
    if DW_TMA:
        # a descriptor coordinate is an element index (int32 by definition, < E * N); the
        # copy engine forms the 64-bit address
        dw_desc.store([expert * N + n0, k0], out)  # qmoe-doctor: ignore[int32-offset]
    else:
        cols_n = n0 + tl.arange(0, BLOCK_N)
        cols_k = k0 + tl.arange(0, BLOCK_K)
        dw_ptrs = (
            dw_ptr
            + tl.cast(expert, tl.int64) * stride_we  # passes 2**31 for large stacks
            + cols_n[:, None] * stride_wn
            + cols_k[None, :] * stride_wk
        )
        tl.store(dw_ptrs, out, mask=(cols_n < N)[:, None] & (cols_k < K)[None, :])


@triton.jit
def _dw_chunk_start(chunk, rows, BLOCK_M: tl.constexpr):
    """First row of chunk ``chunk`` relative to the expert's first row: chunk * BLOCK_M, but the
    last chunk ends exactly at the expert's last row (it starts earlier and overlaps the one
    before; for an expert under BLOCK_M rows it starts before the expert, even before row 0,
    where the copy engine reads zeros). No chunk ever reaches past the expert's last row, so
    rows no expert covers (garbage after the routed rows) are never read."""
    return tl.minimum(chunk * BLOCK_M, rows - BLOCK_M)


@triton.jit
def _dw_chunk_a(desc, first, rows, chunk, c0, BLOCK_M: tl.constexpr):
    """One chunk of the resident operand (dy, or x when X_RES), transposed to the MMA's register
    operand (width, BLOCK_M), with the rows this chunk must not count set to zero: rows an
    earlier chunk already counted (the overlap of the shifted last chunk) and rows before the
    expert. Only this operand is masked; the streamed one (from shared memory) sees 0 * value
    for those rows, and those rows are all inside dy and x (another expert's rows or the copy
    engine's zeros), never rows no expert covers."""
    rel = _dw_chunk_start(chunk, rows, BLOCK_M)
    a = desc.load([first + rel, c0])  # (BLOCK_M, width)
    own = rel + tl.arange(0, BLOCK_M)  # row index within the expert; < 0 before it
    keep = own >= chunk * BLOCK_M  # not counted by an earlier chunk, not before the expert
    return tl.where(keep[None, :], a.T, 0.0)


@triton.jit
def _dw_resident_dots(desc, a, r, s0, CHUNKS: tl.constexpr):
    """One dw tile (transposed when x is resident) from the resident chunks ``a`` and the streamed
    operand's rows ``r`` (tuples of CHUNKS) at column s0."""
    acc = tl.dot(a[0], desc.load([r[0], s0]))
    for c in tl.static_range(1, CHUNKS):
        acc = tl.dot(a[c], desc.load([r[c], s0]), acc)
    return acc


@triton.jit
def _dw_resident_item(res_desc, stream_desc, dw_desc, dw_ptr, first, rows, expert, c0, N, K, stride_we, stride_wn,
                      stride_wk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      CHUNKS: tl.constexpr, DW_TMA: tl.constexpr, X_RES: tl.constexpr):
    """The dw tiles of one work item for an expert of CHUNKS row chunks: its resident operand's
    columns c0.. (dy^T at n0 = c0; x^T at k0 = c0 when X_RES) are loaded ONCE into registers, then
    the loop walks the other operand's column tiles, streaming only that operand and storing each
    finished dw tile (one pipelined loop of uniform length)."""
    a = (_dw_chunk_a(res_desc, first, rows, 0, c0, BLOCK_M),)
    r = (first + _dw_chunk_start(0, rows, BLOCK_M),)
    for c in tl.static_range(1, CHUNKS):
        a = a + (_dw_chunk_a(res_desc, first, rows, c, c0, BLOCK_M),)
        r = r + (first + _dw_chunk_start(c, rows, BLOCK_M),)
    # x resident: walk the N tiles, dw tile (n0, k0) = (s0, c0); dy resident: the K tiles, (c0, s0)
    for t in range(0, tl.cdiv(N, BLOCK_N) if X_RES else tl.cdiv(K, BLOCK_K)):
        s0 = t * (BLOCK_N if X_RES else BLOCK_K)
        acc = _dw_resident_dots(stream_desc, a, r, s0, CHUNKS)
        _dw_store_tile(dw_desc, dw_ptr, acc, expert, s0 if X_RES else c0, c0 if X_RES else s0, N, K, stride_we,
                       stride_wn, stride_wk, BLOCK_N, BLOCK_K, DW_TMA, X_RES)

@triton.jit
def _dw_resident_dispatch(res_desc, stream_desc, dw_desc, dw_ptr, first, rows, chunks, expert, c0, N, K, stride_we,
                          stride_wn, stride_wk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          MAX_CHUNKS: tl.constexpr, DW_TMA: tl.constexpr, X_RES: tl.constexpr):
    """``_dw_resident_item`` specialised for the expert's chunk count (1 <= chunks <=
    MAX_CHUNKS), so that an expert loads and multiplies only the chunks it has; the compiled
    paths stop at MAX_CHUNKS (a constexpr: ``static_range`` unrolls), and with them the
    registers they hold."""
    for c in tl.static_range(1, MAX_CHUNKS + 1):
        if chunks == c:
            _dw_resident_item(res_desc, stream_desc, dw_desc, dw_ptr, first, rows, expert, c0, N, K, stride_we,
                              stride_wn, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, c, DW_TMA, X_RES)
# fmt: on


@triton.jit
def _grouped_gemm_dw_resident_kernel(
    dy_desc,  # (M, N) block (BLOCK_M, BLOCK_N)
    x_desc,  # (M, K) block (BLOCK_M, BLOCK_K)
    dw_desc,  # (E * N, K) block (BLOCK_N, BLOCK_K) when DW_TMA
    dw_ptr,
    bounds_ptr,
    M,
    N,
    K,
    E,
    stride_we,
    stride_wn,
    stride_wk,
    NUM_PROGRAMS,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MAX_CHUNKS: tl.constexpr,  # 1..6: experts of up to MAX_CHUNKS * BLOCK_M rows keep their operand resident
    DW_TMA: tl.constexpr,
    X_RES: tl.constexpr,  # x resident, dy streamed (else dy resident, x streamed)
):
    """dw with one operand resident: program p takes work items p, p + NUM_PROGRAMS, ... of the
    (expert, n-tile) sequence (the (expert, k-tile) sequence when X_RES); for each,
    ``_dw_resident_item`` holds that expert's dy^T columns (x^T columns) in registers and walks
    every K tile (N tile) of dw, so the resident operand is read once instead of once per tile,
    and the loop pipelines the streamed operand's loads and the dw stores like a plain GEMM's
    main loop. Experts with more rows than MAX_CHUNKS chunks re-load the resident operand for
    every tile; empty experts store zeros. Every row chunk is a whole copy-engine box (the last
    one shifted back to end at the expert's last row, see ``_dw_chunk_a``): no masked pointer
    loads. X_RES suits a dw with few K tiles and many N tiles (the down projection)."""
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    num_k_tiles = tl.cdiv(K, BLOCK_K)
    if X_RES:
        per_expert = num_k_tiles
        res_desc = x_desc
        stream_desc = dy_desc
    else:
        per_expert = num_n_tiles
        res_desc = dy_desc
        stream_desc = x_desc
    for item in range(pid, E * per_expert, NUM_PROGRAMS):
        expert = item // per_expert
        c0 = (item % per_expert) * (BLOCK_K if X_RES else BLOCK_N)
        # bounds are int64 and clamped to M by the host; clamp again so that a bad bounds
        # buffer still cannot move the reads outside dy and x
        row_start = tl.minimum(tl.maximum(tl.load(bounds_ptr + expert), 0), M)
        row_end = tl.minimum(tl.maximum(tl.load(bounds_ptr + expert + 1), row_start), M)
        rows = (row_end - row_start).to(tl.int32)
        first = row_start.to(tl.int32)  # < M < 2**31: a descriptor coordinate
        chunks = tl.cdiv(rows, BLOCK_M)
        if chunks == 0:
            zero = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for t in range(0, num_n_tiles if X_RES else num_k_tiles):
                n0 = t * BLOCK_N if X_RES else c0
                k0 = c0 if X_RES else t * BLOCK_K
                _dw_store_tile(
                    dw_desc, dw_ptr, zero, expert, n0, k0, N, K, stride_we, stride_wn, stride_wk,
                    BLOCK_N, BLOCK_K, DW_TMA, False,
                )  # fmt: skip
        elif chunks <= MAX_CHUNKS:
            _dw_resident_dispatch(
                res_desc, stream_desc, dw_desc, dw_ptr, first, rows, chunks, expert, c0, N, K,
                stride_we, stride_wn, stride_wk, BLOCK_M, BLOCK_N, BLOCK_K, MAX_CHUNKS, DW_TMA, X_RES,
            )  # fmt: skip
        else:
            for t in range(0, num_n_tiles if X_RES else num_k_tiles):
                s0 = t * (BLOCK_N if X_RES else BLOCK_K)
                acc = tl.zeros((BLOCK_K, BLOCK_N) if X_RES else (BLOCK_N, BLOCK_K), dtype=tl.float32)
                for chunk in range(0, chunks):
                    a = _dw_chunk_a(res_desc, first, rows, chunk, c0, BLOCK_M)
                    b = stream_desc.load([first + _dw_chunk_start(chunk, rows, BLOCK_M), s0])
                    acc = tl.dot(a, b, acc)
                _dw_store_tile(
                    dw_desc, dw_ptr, acc, expert, s0 if X_RES else c0, c0 if X_RES else s0, N, K,
                    stride_we, stride_wn, stride_wk, BLOCK_N, BLOCK_K, DW_TMA, X_RES,
                )  # fmt: skip


def overlap_fallback(cfg: GemmConfig) -> GemmConfig:
    """Where the Gluon kernel of an ``-ovN`` config cannot run (no Hopper GPU, no Gluon, the
    interpreter, N not a multiple of the item, unaligned operands): the resident Triton kernel
    of the same tiles (a paired item's one tile: 128 wide) and chunk count (at most 6, the
    Triton kernel's largest)."""
    tile = cfg.block_n // overlap_halves(cfg.block_n)
    return dataclasses.replace(
        cfg, block_n=tile, overlap=0, resident=min(cfg.overlap, 6), resident_x=False, tma=True
    )


def dw_tma_plan(
    dy: torch.Tensor, x: torch.Tensor, dw: torch.Tensor, cfg: GemmConfig
) -> tuple[Any, Any, Any] | None:
    """(dy_desc, x_desc, dw_desc or None) for the TMA dw kernel, or None for the pointer kernel."""
    TensorDescriptor = tensor_descriptor_class(x, cfg)
    if TensorDescriptor is None:
        return None
    item = x.element_size()
    m, n = dy.shape
    k = x.shape[1]
    e = dw.shape[0]
    for t in (dy, x):
        if t.stride(1) != 1 or (t.stride(0) * item) % 16 or not _tma_ready(t):
            return None
    dy_desc = TensorDescriptor(dy, [m, n], [dy.stride(0), 1], [cfg.block_m, cfg.block_n])
    x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [cfg.block_m, cfg.block_k])
    dw_desc = None
    if (
        dw.stride(2) == 1
        and dw.stride(0) == n * dw.stride(1)
        and (dw.stride(1) * dw.element_size()) % 16 == 0
        and _tma_ready(dw)
        and n % cfg.block_n == 0
    ):
        dw_desc = TensorDescriptor(dw, [e * n, k], [dw.stride(1), 1], [cfg.block_n, cfg.block_k])
    return dy_desc, x_desc, dw_desc


def launch_grouped_gemm_dw_tma(
    plan: tuple[Any, Any, Any],
    dy: torch.Tensor,
    x: torch.Tensor,
    dw: torch.Tensor,
    bounds: torch.Tensor,
    cfg: GemmConfig,
    num_programs: int,
) -> None:
    """Launch the TMA dw kernel, or the resident one when ``cfg.resident``, on the current device
    and stream. Callers hold the device guard."""
    dy_desc, x_desc, dw_desc = plan
    if cfg.resident:
        _grouped_gemm_dw_resident_kernel[(num_programs,)](
            dy_desc,
            x_desc,
            dw_desc,
            dw,
            bounds,
            dy.shape[0],
            dy.shape[1],
            x.shape[1],
            dw.shape[0],
            dw.stride(0),
            dw.stride(1),
            dw.stride(2),
            num_programs,
            MAX_CHUNKS=cfg.resident,
            DW_TMA=dw_desc is not None,
            X_RES=cfg.resident_x,
            **_launch_options(cfg),
        )
        return
    _grouped_gemm_dw_tma_kernel[(num_programs,)](
        dy_desc,
        x_desc,
        dw_desc,
        dy,
        x,
        dw,
        bounds,
        *_dw_sizes(dy, x, dw),
        NUM_PROGRAMS=num_programs,
        DW_TMA=dw_desc is not None,
        **_launch_options(cfg),
    )


@triton.jit
def _grouped_gemm_dw_flat_kernel(
    dy_ptr,
    x_ptr,
    dw_ptr,
    bounds_ptr,
    M,
    N,
    K,
    E,
    stride_dym,
    stride_dyn,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    NUM_PROGRAMS,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    E_POW2: tl.constexpr,  # a power of two >= E
):
    """``_grouped_gemm_dw_kernel``'s tiles, walked as ONE loop over this program's (tile, row
    chunk) pairs: each tile has only cdiv(rows of its expert, BLOCK_M) chunks (about two for
    128 rows per expert), so a loop per tile spends its time filling and draining the software
    pipeline; flattened, the next tile's loads are in flight during this tile's store. An
    empty expert's tile takes one all-masked chunk and stores zeros."""
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    num_k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_expert = num_n_tiles * num_k_tiles
    offs_e = tl.arange(0, E_POW2)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)

    in_range = offs_e < E
    lo = tl.load(bounds_ptr + offs_e, mask=in_range, other=0)
    hi = tl.load(bounds_ptr + offs_e + 1, mask=in_range, other=0)
    lo = tl.minimum(tl.maximum(lo, 0), M)  # clamped again, as in the unflattened kernel
    hi = tl.minimum(tl.maximum(hi, lo), M)
    rows = (hi - lo).to(tl.int32)
    chunks = tl.maximum(tl.cdiv(rows, BLOCK_M), 1)
    # tiles of expert e this program owns: p + j * NUM_PROGRAMS in [e * TPE, (e + 1) * TPE)
    below_hi = (tl.maximum((offs_e + 1) * tiles_per_expert - pid, 0) + NUM_PROGRAMS - 1) // NUM_PROGRAMS
    below_lo = (tl.maximum(offs_e * tiles_per_expert - pid, 0) + NUM_PROGRAMS - 1) // NUM_PROGRAMS
    my_steps = tl.sum(tl.where(in_range, (below_hi - below_lo) * chunks, 0), 0)

    tile = pid - NUM_PROGRAMS
    chunk = 0
    expert = 0
    n0 = 0
    k0 = 0
    row_start = tl.zeros((), dtype=tl.int64)
    rows_in_expert = 0
    last_chunk = 0
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for _ in range(0, my_steps):
        if chunk == 0:
            tile += NUM_PROGRAMS
            expert = tile // tiles_per_expert
            local = tile % tiles_per_expert
            n0 = (local // num_k_tiles) * BLOCK_N
            k0 = (local % num_k_tiles) * BLOCK_K
            here = offs_e == expert
            row_start = tl.sum(tl.where(here, lo, 0), 0)
            rows_in_expert = tl.sum(tl.where(here, rows, 0), 0)
            last_chunk = tl.sum(tl.where(here, chunks, 0), 0) - 1
        cols_n = n0 + offs_n
        cols_k = k0 + offs_k
        n_mask = cols_n < N
        k_mask = cols_k < K
        r = chunk * BLOCK_M
        row_mask = (r + offs_m) < rows_in_expert
        first = row_start + r  # int64: first * stride passes 2**31 for M*K > 2**31
        dy_ptrs = dy_ptr + first * stride_dym + offs_m[None, :] * stride_dym + cols_n[:, None] * stride_dyn
        x_ptrs = x_ptr + first * stride_xm + offs_m[:, None] * stride_xm + cols_k[None, :] * stride_xk
        a = tl.load(dy_ptrs, mask=n_mask[:, None] & row_mask[None, :], other=0.0)
        b = tl.load(x_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        if chunk == last_chunk:
            dw_ptrs = (
                dw_ptr
                + tl.cast(expert, tl.int64) * stride_we
                + cols_n[:, None] * stride_wn
                + cols_k[None, :] * stride_wk
            )
            tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=n_mask[:, None] & k_mask[None, :])
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            chunk = 0
        else:
            chunk += 1


def launch_grouped_gemm_dw_flat(
    dy: torch.Tensor,
    x: torch.Tensor,
    dw: torch.Tensor,
    bounds: torch.Tensor,
    cfg: GemmConfig,
    num_programs: int,
) -> None:
    """Launch the flattened dw kernel on the current device and stream. Callers hold the guard."""
    _grouped_gemm_dw_flat_kernel[(num_programs,)](
        dy,
        x,
        dw,
        bounds,
        *_dw_sizes(dy, x, dw),
        num_programs,
        E_POW2=triton.next_power_of_2(dw.shape[0]),
        **_launch_options(cfg),
    )


def moe_grouped_gemm_dw(
    dy: torch.Tensor,
    x: torch.Tensor,
    m_sizes: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    check_routing: bool = False,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """``dw[e] = dy_e.T @ x_e``: dy (M, N), x (M, K), m_sizes (E,) -> dw (E, N, K).

    Every element of dw is written (empty experts give zeros). ``check_routing=True`` also
    verifies ``m_sizes`` (no negatives, sums to M); it synchronizes: off by default.
    """
    check_dw_operands(dy, x, m_sizes)
    m, n = dy.shape
    k = x.shape[1]
    e = m_sizes.shape[0]
    if check_routing:
        check_routing_sizes(m_sizes, m)
    out_dtype = out_dtype or x.dtype
    with device_guard(x.device):
        dw = torch.empty((e, n, k), device=x.device, dtype=out_dtype)
        if dw.numel() == 0:
            return dw
        if m == 0:
            return dw.zero_()
        bounds = row_bounds(m_sizes, m)  # on x.device, inside the guard: the current stream
        cfg = config or pick_dw_config(n, k, x.device, x.dtype, avg_rows=m / max(1, e))
        if cfg.overlap:
            overlap_plan = dw_overlap_plan(dy, x, dw, cfg)
            if overlap_plan is not None:
                launch_dw_overlap(overlap_plan, dy, x, dw, bounds, cfg, dw_grid_size(e, n, k, cfg, x.device))
                return dw
            cfg = overlap_fallback(cfg)
            if x.device.type == "cuda":  # the Triton kernel of the same tiles may need more
                cfg = _fit_dw(
                    cfg,
                    x.device.index if x.device.index is not None else torch.cuda.current_device(),
                    x.dtype,
                )
        programs = dw_grid_size(e, n, k, cfg, x.device)
        plan = None if cfg.flat else dw_tma_plan(dy, x, dw, cfg)
        if cfg.flat:
            launch_grouped_gemm_dw_flat(dy, x, dw, bounds, cfg, programs)
        elif plan is not None:
            launch_grouped_gemm_dw_tma(plan, dy, x, dw, bounds, cfg, programs)
        else:
            launch_grouped_gemm_dw(dy, x, dw, bounds, cfg, programs)
    return dw


def moe_grouped_gemm_dw_torch(
    dy: torch.Tensor,
    x: torch.Tensor,
    m_sizes: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    check_routing: bool = False,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """The slow, obvious twin: a loop over experts in float32 (float64 for float64 operands),
    same clamping of m_sizes."""
    del config  # accepted for signature parity
    m = dy.shape[0]
    if check_routing:
        check_routing_sizes(m_sizes, m)
    e = m_sizes.shape[0]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    dw = torch.zeros((e, dy.shape[1], x.shape[1]), device=x.device, dtype=acc)
    row = 0
    for expert, size in enumerate(_clamped_sizes(m_sizes, m)):
        if size:
            dw[expert] = dy[row : row + size].to(acc).T @ x[row : row + size].to(acc)
        row += size
    return dw.to(out_dtype or x.dtype)


# --------------------------------------------------------------------------------------------
# Autograd.
# --------------------------------------------------------------------------------------------


class _MoEFusedLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor, kernel: GroupedGemm
    ) -> torch.Tensor:
        ctx.save_for_backward(x, w, m_sizes)
        ctx.sm_reserve = sm_reserve()  # the backward runs on autograd's thread: carry it over
        return kernel(x, w, m_sizes)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w, m_sizes = ctx.saved_tensors
        reserve = ctx.sm_reserve
        with reserved_sms(reserve):
            dx = moe_grouped_gemm_dx(dy.to(w.dtype), w, m_sizes) if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:
            return dx, None, None, None
        if _DEFERRED:  # the caller runs the weight gradient later (``deferred_weight_grads``)
            dy_x = dy.to(x.dtype)

            def weight_grad() -> tuple[torch.Tensor, torch.Tensor]:
                with reserved_sms(reserve):
                    return w, moe_grouped_gemm_dw(dy_x, x, m_sizes)

            _DEFERRED[-1].append(weight_grad)
            return dx, None, None, None
        with reserved_sms(reserve):
            dw = moe_grouped_gemm_dw(dy.to(x.dtype), x, m_sizes)
        return dx, dw, None, None


# Weight gradients left for later: while a list is open, ``moe_fused_linear``'s backward computes
# the input gradient only and appends a closure for the weight's. Process-wide (autograd may run
# the backward on its own thread), innermost list first.
_DEFERRED: list[list[Callable[[], tuple[torch.Tensor, torch.Tensor]]]] = []


@contextlib.contextmanager
def deferred_weight_grads() -> Iterator[list[Callable[[], tuple[torch.Tensor, torch.Tensor]]]]:
    """Within this block the backward of ``moe_fused_linear`` returns no weight gradient; it
    appends to the yielded list a closure that computes it, returning ``(weight, dw)``, for the
    caller to run (and add into ``weight.grad``) when it chooses: expert parallelism sends the
    input gradients on their way first and computes the weight gradients while they travel."""
    pending: list[Callable[[], tuple[torch.Tensor, torch.Tensor]]] = []
    _DEFERRED.append(pending)
    try:
        yield pending
    finally:
        del _DEFERRED[next(i for i, item in enumerate(_DEFERRED) if item is pending)]


def moe_fused_linear(
    x: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor, *, kernel: GroupedGemm = moe_grouped_gemm
) -> torch.Tensor:
    """Differentiable ``y[m] = x[m] @ w[e(m)].T``: forward by ``kernel`` (ours by default, or
    any kernel of the same signature the doctor wants to exercise), backward by our dx and dw
    kernels. No gradient for ``m_sizes``."""
    result: torch.Tensor = _MoEFusedLinear.apply(x, w, m_sizes, kernel)
    return result
