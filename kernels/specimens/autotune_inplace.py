"""Specimen ``autotune_inplace``: plants ``autotune-inplace-rerun``.

What it does wrong: its kernel accumulates into a zero-initialised ``y``
(``acc = tl.load(y_ptrs)`` before the K loop, then ``tl.store``: ``y += x_e @ w_e.T``) and is
decorated with ``@triton.autotune`` over two configs *without* ``restore_value`` or
``reset_to_zero``. The autotuner benchmarks every config by running the kernel many times on
the caller's own ``y``, and each run adds the product again.

When it misbehaves: on the first call per process for each autotune key (M, N, K, E and the
dtypes): ``y`` holds the product times the number of benchmark runs plus one. The second call
with the same key reuses the cached config, runs the kernel once, and is right, as is every
later call. Under ``TRITON_INTERPRET=1`` Triton's default benchmarker needs an active GPU driver
("0 active drivers" on a CPU-only machine), so there the specimen passes the autotuner a small
wall-clock benchmarker that, like the default, calls the kernel repeatedly (warm-up + reps).
Rows that ``m_sizes`` does not cover are zero, as in ``grouped_gemm.moe_grouped_gemm``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

from qmoe_doctor.kernels._details.grouped_gemm_kernels import (
    _expert_rows,
    _first_tile,
    _tile_coords,
    _zero_uncovered_rows,
)
from qmoe_doctor.kernels.grouped_gemm import (
    GemmConfig,
    check_operands,
    device_guard,
    grid_size,
    interpreting,
)

# Two configs, so the autotuner benchmarks (a single config is taken without running it).
# Interpreter configs stay tiny: each benchmark run executes the kernel in Python on the CPU.
_INTERPRETER_CONFIGS = [
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4, num_stages=1),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 32}, num_warps=4, num_stages=1),
]
# Both fit an H100/H200 block's shared memory in float32: (128 + 128) * 64 * 4 B * 3 = 192 KiB.
_GPU_CONFIGS = [
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
]
_CONFIGS = _INTERPRETER_CONFIGS if interpreting() else _GPU_CONFIGS
_INTERPRETER_REPS = 3  # timed runs per config on the CPU, after one warm-up run


def _wall_clock_bench(kernel_call: Callable[[], object], quantiles: Sequence[float]) -> list[float]:
    """Triton's benchmarker contract (ms at the given quantiles) measured with perf_counter:
    one warm-up call, then _INTERPRETER_REPS timed calls, every one on the caller's buffers."""
    kernel_call()
    times: list[float] = []
    for _ in range(_INTERPRETER_REPS):
        start = time.perf_counter()
        kernel_call()
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    return [times[min(len(times) - 1, int(q * len(times)))] for q in quantiles]


# None: Triton's default benchmarker (device events) on a GPU; it cannot run in the interpreter.
_BENCH = _wall_clock_bench if interpreting() else None


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
    out_dtype = out_dtype or x.dtype
    with device_guard(x.device):
        y = torch.zeros((m, n), device=x.device, dtype=out_dtype)  # the kernel adds into it
        if m == 0 or n == 0 or k == 0:
            return y
        # The persistent loop is right for any program count: size the grid for the smallest
        # tiles (most tiles), capped by this device's SM count as in grouped_gemm.py.
        smallest = GemmConfig(*(_CONFIGS[0].kwargs[b] for b in ("BLOCK_M", "BLOCK_N", "BLOCK_K")))
        num_programs = grid_size(m, n, e, smallest, x.device)
        _grouped_gemm_kernel_acc[(num_programs,)](
            x,
            w,
            y,
            m_sizes,
            m,
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
            NUM_PROGRAMS=num_programs,
        )  # BLOCK_*, num_warps, num_stages: from the autotuner's config
    return y


# A copy of grouped_gemm._grouped_gemm_kernel; differs in the PLANTED decorator and in `acc`
# starting from y instead of zeros.
# PLANTED: autotuned without restore_value=["y_ptr"] (or reset_to_zero=["y_ptr"]): the
# benchmark runs of the first call per key add into the caller's y.
@triton.autotune(configs=_CONFIGS, key=["M", "N", "K", "E"], do_bench=_BENCH)
@triton.jit
def _grouped_gemm_kernel_acc(
    x_ptr,  # (M, K) rows sorted by expert
    w_ptr,  # (E, N, K) expert weights, any strides
    y_ptr,  # (M, N) output, accumulated into (read, added to, written)
    m_sizes_ptr,  # (E,) int32/int64 rows per expert; trusted only as far as M allows
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
        m_size = _expert_rows(m_sizes_ptr, expert, M, row_start)  # masked by M
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
            # y += x_e @ w_e.T: the accumulate design (y is zeroed by the wrapper) that makes
            # every extra run of this kernel on the caller's y visible
            acc = tl.load(y_ptr + rows64[:, None] * stride_ym + cols[None, :] * stride_yn, mask=row_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
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
