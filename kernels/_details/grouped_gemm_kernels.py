"""The grouped GEMM's kernels (launched by ``kernels/grouped_gemm.py``, which says what each
guarantees): the pointer kernel, the Hopper kernel (tiles loaded by the bulk tensor copy engine,
TMA), its form with an expert's tail rows fused into the expert's last full row tile, and the
flattened kernel (one loop over each program's (tile, k-step) pairs)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile_coords(local, num_m_tiles, num_n_tiles, ROWS_FIRST: tl.constexpr):
    """(row tile, column tile) of an expert's ``local``-th tile: column tiles fastest, or with
    ROWS_FIRST row tiles fastest."""
    if ROWS_FIRST:
        return local % num_m_tiles, local // num_m_tiles
    return local // num_n_tiles, local % num_n_tiles


@triton.jit
def _expert_rows(m_sizes_ptr, expert, M, row_start):
    """Rows of ``expert``, whose rows start at ``row_start``, as every kernel here reads them:
    masked by M, so a negative count is 0 and a count past the last row stops at M. Clamped in
    the loaded width, then narrowed: an int64 count past 2**31 (a stale value in a recycled
    block) would otherwise truncate to an arbitrary int32."""
    m_size = tl.load(m_sizes_ptr + expert)
    return tl.minimum(tl.maximum(m_size, 0), tl.maximum(M - row_start, 0)).to(tl.int32)


@triton.jit
def _first_tile(pid, tiles_before, NUM_PROGRAMS):
    """The first tile at or past ``tiles_before`` that program ``pid`` takes: tile t of the
    expert-major sequence is program t % NUM_PROGRAMS's (the round robin of every kernel here)."""
    return tiles_before + (pid - tiles_before % NUM_PROGRAMS + NUM_PROGRAMS) % NUM_PROGRAMS


@triton.jit
def _grouped_gemm_kernel(
    x_ptr,  # (M, K) rows sorted by expert
    w_ptr,  # (E, N, K) expert weights, any strides
    y_ptr,  # (M, N) output
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
        m_size = _expert_rows(m_sizes_ptr, expert, M, row_start)
        num_m_tiles = tl.cdiv(m_size, BLOCK_M)
        num_tiles = num_m_tiles * num_n_tiles
        tile = _first_tile(pid, tiles_before, NUM_PROGRAMS)
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
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
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


@triton.jit
def _store_rows(
    y_ptr, out, first_row, n0, row_end, N, stride_ym, stride_yn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """Masked store of an output tile: rows below row_end, columns below N."""
    offs_m = tl.arange(0, BLOCK_M)
    cols = n0 + tl.arange(0, BLOCK_N)
    y_ptrs = (
        y_ptr
        + tl.cast(first_row, tl.int64) * stride_ym
        + offs_m[:, None] * stride_ym
        + cols[None, :] * stride_yn
    )
    mask = ((first_row + offs_m) < row_end)[:, None] & (cols < N)[None, :]
    tl.store(y_ptrs, out, mask=mask)


@triton.jit
def _zero_uncovered_rows(
    y_ptr, M, N, row_start, tiles_before, stride_ym, stride_yn, NUM_PROGRAMS, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """After the experts' tiles (``tiles_before`` of them, ending at row ``row_start``): zeros in
    the rows no expert covers, row_start..M, as further tiles of the same round-robin. Its own
    loop after the experts', not a branch in their tile loop: an A/B on one H200 (2026-11-28)
    had the pointer kernel 2.4-5.3% faster so at four of five 2048-token points; another H200
    showed no change."""
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    num_tiles = tl.cdiv(tl.maximum(M - row_start, 0), BLOCK_M) * num_n_tiles
    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=y_ptr.dtype.element_ty)
    tile = _first_tile(pid, tiles_before, NUM_PROGRAMS)
    while tile < tiles_before + num_tiles:
        local = tile - tiles_before
        # int64 rows as a vector (as in ``_grouped_gemm_kernel``: ``_store_rows``'s tile-base
        # form here held the pointer kernel 9 registers above its tile loop's count)
        rows = row_start + (local // num_n_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (local % num_n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :] * stride_yn
        tl.store(y_ptrs, zeros, mask=(rows < M)[:, None] & (cols < N)[None, :])
        tile += NUM_PROGRAMS


@triton.jit
def _tma_tile_product(
    x_desc, w_desc, first_row, n0, w_row0, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, W_KN: tl.constexpr
):
    """One output tile's K loop by descriptor loads: x rows from ``first_row``, the expert's
    weight from row ``w_row0`` of w's 2-D view (column ``n0``), float32 accumulator. A
    ``triton.jit`` call is inlined, so the loop is pipelined in each kernel that calls it."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = x_desc.load([first_row, k0])
        if W_KN:
            b = w_desc.load([w_row0 + k0, n0])
            acc = tl.dot(a, b, acc)
        else:
            b = w_desc.load([w_row0 + n0, k0])
            acc = tl.dot(a, b.T, acc)
    return acc


@triton.jit
def _grouped_gemm_tma_kernel(
    x_desc,  # (M, K) block (BLOCK_M, BLOCK_K); rows past M read as zeros
    w_desc,  # 2-D view of w: (E * N, K) block (BLOCK_N, BLOCK_K), or W_KN: (E * K, N) block (BLOCK_K, BLOCK_N)
    y_ptr,
    y_desc,  # (M, N) block (BLOCK_M, BLOCK_N) when Y_TMA: full row tiles are stored through it
    m_sizes_ptr,
    M,
    N,
    K,
    E,
    W_ROWS,  # rows of one expert in the 2-D view of w (N, or K for W_KN)
    stride_ym,
    stride_yn,
    NUM_PROGRAMS,  # runtime: one compiled kernel serves every grid size
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_KN: tl.constexpr,
    Y_TMA: tl.constexpr,
    ROWS_FIRST: tl.constexpr = False,
):
    """``_grouped_gemm_kernel``'s tile walk with descriptor loads. Descriptor coordinates are
    element indices (the copy engine forms the 64-bit address), so nothing here can wrap.
    x rows past the expert's last row are read (they belong to the next expert) but only feed
    output rows that are never stored; a w tile past the expert's N rows only feeds masked
    columns; in the W_KN view the host allows only K % BLOCK_K == 0, so no tile crosses an
    expert along the reduction."""
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)

    tiles_before = 0
    row_start = 0
    for expert in range(E):
        m_size = _expert_rows(m_sizes_ptr, expert, M, row_start)
        num_m_tiles = tl.cdiv(m_size, BLOCK_M)
        num_tiles = num_m_tiles * num_n_tiles
        tile = _first_tile(pid, tiles_before, NUM_PROGRAMS)
        while tile < tiles_before + num_tiles:
            local = tile - tiles_before
            tile_m, tile_n = _tile_coords(local, num_m_tiles, num_n_tiles, ROWS_FIRST)
            first_row = row_start + tile_m * BLOCK_M
            n0 = tile_n * BLOCK_N
            acc = _tma_tile_product(x_desc, w_desc, first_row, n0, expert * W_ROWS, K, BLOCK_M, BLOCK_N, BLOCK_K, W_KN)
            out = acc.to(y_ptr.dtype.element_ty)
            row_end = row_start + m_size
            if Y_TMA:
                if first_row + BLOCK_M <= row_end:
                    y_desc.store([first_row, n0], out)  # a full row tile; columns past N are clipped
                else:
                    _store_rows(y_ptr, out, first_row, n0, row_end, N, stride_ym, stride_yn, BLOCK_M, BLOCK_N)
            else:
                _store_rows(y_ptr, out, first_row, n0, row_end, N, stride_ym, stride_yn, BLOCK_M, BLOCK_N)
            tile += NUM_PROGRAMS
        tiles_before += num_tiles
        row_start += m_size
    _zero_uncovered_rows(y_ptr, M, N, row_start, tiles_before, stride_ym, stride_yn, NUM_PROGRAMS, BLOCK_M, BLOCK_N)


@triton.jit
def _grouped_gemm_tail_kernel(
    x_desc,  # (M, K) block (BLOCK_M, BLOCK_K)
    xt_desc,  # the same x, block (TAIL, BLOCK_K): an expert's tail rows
    w_desc,  # as in _grouped_gemm_tma_kernel
    y_ptr,
    m_sizes_ptr,
    M,
    N,
    K,
    E,
    W_ROWS,
    stride_ym,
    stride_yn,
    NUM_PROGRAMS,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TAIL: tl.constexpr,
    W_KN: tl.constexpr,
    ROWS_FIRST: tl.constexpr = False,
):
    """``_grouped_gemm_tma_kernel``'s tile walk, where an expert of ``q * BLOCK_M + r`` rows
    with q >= 1 and 0 < r <= TAIL has q row tiles, not q + 1: its last full row tile also
    computes the r tail rows from the same weight tile (one pass of that tile through L2, not
    two; under random routing about half the experts of a 2048-token batch end so). The tail's
    product is formed transposed, w tile times x tail (a TAIL-wide MMA: Hopper's smallest
    instruction has 64 rows, its N can be 8 to 256). The tile with a tail runs its own K loop,
    so the others pay nothing for it. Stores by pointer, masked by the expert's last row (a
    descriptor store here held 64 KiB of shared memory beside the 4-stage pipeline). x rows
    past the expert's last row are read (the next expert's, or zeros past M) and never stored."""
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)

    tiles_before = 0
    row_start = 0
    for expert in range(E):
        m_size = _expert_rows(m_sizes_ptr, expert, M, row_start)
        full = m_size // BLOCK_M
        rest = m_size - full * BLOCK_M
        fused = (full > 0) & (rest > 0) & (rest <= TAIL)
        num_m_tiles = tl.where(fused, full, tl.cdiv(m_size, BLOCK_M))
        num_tiles = num_m_tiles * num_n_tiles
        row_end = row_start + m_size
        tile = _first_tile(pid, tiles_before, NUM_PROGRAMS)
        while tile < tiles_before + num_tiles:
            local = tile - tiles_before
            tile_m, tile_n = _tile_coords(local, num_m_tiles, num_n_tiles, ROWS_FIRST)
            first_row = row_start + tile_m * BLOCK_M
            n0 = tile_n * BLOCK_N
            if (fused & (tile_m == num_m_tiles - 1)) == 0:
                acc = _tma_tile_product(x_desc, w_desc, first_row, n0, expert * W_ROWS, K, BLOCK_M, BLOCK_N, BLOCK_K, W_KN)
                out = acc.to(y_ptr.dtype.element_ty)
                _store_rows(y_ptr, out, first_row, n0, row_end, N, stride_ym, stride_yn, BLOCK_M, BLOCK_N)
            else:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                acc_t = tl.zeros((BLOCK_N, TAIL), dtype=tl.float32)  # the tail's y, transposed
                for k0 in range(0, K, BLOCK_K):
                    a = x_desc.load([first_row, k0])
                    at = xt_desc.load([first_row + BLOCK_M, k0])
                    if W_KN:
                        b = w_desc.load([expert * W_ROWS + k0, n0])
                        acc = tl.dot(a, b, acc)
                        acc_t = tl.dot(b.T, at.T, acc_t)
                    else:
                        b = w_desc.load([expert * W_ROWS + n0, k0])
                        acc = tl.dot(a, b.T, acc)
                        acc_t = tl.dot(b, at.T, acc_t)
                tail = acc_t.T.to(y_ptr.dtype.element_ty)
                _store_rows(y_ptr, tail, first_row + BLOCK_M, n0, row_end, N, stride_ym, stride_yn, TAIL, BLOCK_N)
                out = acc.to(y_ptr.dtype.element_ty)
                _store_rows(y_ptr, out, first_row, n0, row_end, N, stride_ym, stride_yn, BLOCK_M, BLOCK_N)
            tile += NUM_PROGRAMS
        tiles_before += num_tiles
        row_start += m_size
    _zero_uncovered_rows(y_ptr, M, N, row_start, tiles_before, stride_ym, stride_yn, NUM_PROGRAMS, BLOCK_M, BLOCK_N)


@triton.jit
def _grouped_gemm_flat_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    m_sizes_ptr,
    x_desc,  # USE_TMA: as in _grouped_gemm_tma_kernel; otherwise unused
    w_desc,
    xt_desc,  # TAIL: x with blocks of (TAIL, BLOCK_K), as in _grouped_gemm_tail_kernel; else None
    M,
    N,
    K,
    E,
    W_ROWS,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ym,
    stride_yn,
    NUM_PROGRAMS,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    E_POW2: tl.constexpr,  # a power of two > E: one slot per expert and one for uncovered rows
    USE_TMA: tl.constexpr,
    W_KN: tl.constexpr,
    ROWS_FIRST: tl.constexpr = False,
    TAIL: tl.constexpr = 0,
):
    """The same tiles as ``_grouped_gemm_kernel`` (expert-major, round-robin over programs), walked
    as ONE loop over this program's (tile, k-step) pairs. Expert row bounds come from a
    vector prefix sum of the clamped counts (negative counts are 0, nothing passes M: the
    bounds of the sequential walk); slot E holds the rows no expert covers, written as zeros
    whatever x holds there (its w loads are masked off, or past the last expert where the
    descriptor reads zeros, and its product is replaced by zeros before the store: a NaN or inf
    in an unrouted row of x would otherwise reach y).

    With TAIL (USE_TMA only) an expert's last 1..TAIL rows past a full row tile ride with that
    tile, as in ``_grouped_gemm_tail_kernel``: every k-step also multiplies the TAIL rows after
    the tile (a TAIL-wide MMA, w tile times x tail, transposed), so the loop stays one pipelined
    loop; only the expert's last full tile stores them."""
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    offs_e = tl.arange(0, E_POW2)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)

    sizes = tl.load(m_sizes_ptr + offs_e, mask=offs_e < E, other=0)
    sizes = tl.minimum(tl.maximum(sizes, 0), M).to(tl.int64)  # clamp in the loaded width first
    incl = tl.cumsum(sizes, 0)
    ends = tl.minimum(incl, M).to(tl.int32)
    starts = tl.minimum(incl - sizes, M).to(tl.int32)
    covered = tl.max(ends, 0)
    starts = tl.where(offs_e == E, covered, starts)
    ends = tl.where(offs_e == E, M, ends)
    rows = tl.where(offs_e <= E, ends - starts, 0)
    if TAIL > 0:
        full = rows // BLOCK_M
        rest = rows - full * BLOCK_M
        fused = (offs_e < E) & (full > 0) & (rest > 0) & (rest <= TAIL)
        tiles = tl.where(fused, full, tl.cdiv(rows, BLOCK_M)) * num_n_tiles
    else:
        tiles = tl.cdiv(rows, BLOCK_M) * num_n_tiles
    tile_incl = tl.cumsum(tiles, 0)
    tile_excl = tile_incl - tiles
    total_tiles = tl.sum(tiles, 0)
    my_tiles = (tl.maximum(total_tiles - pid, 0) + NUM_PROGRAMS - 1) // NUM_PROGRAMS

    tile = pid - NUM_PROGRAMS
    ki = k_tiles - 1
    expert = 0
    first_row = 0
    row_end = 0
    n0 = 0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if TAIL > 0:
        acc_t = tl.zeros((BLOCK_N, TAIL), dtype=tl.float32)  # the tail's y, transposed
        with_tail = 0
    for _ in range(0, my_tiles * k_tiles):
        ki = tl.where(ki == k_tiles - 1, 0, ki + 1)
        if ki == 0:
            tile += NUM_PROGRAMS
            expert = tl.sum((tile_incl <= tile).to(tl.int32), 0)
            here = offs_e == expert
            local = tile - tl.sum(tl.where(here, tile_excl, 0), 0)
            num_m_tiles = tl.sum(tl.where(here, tiles, 0), 0) // num_n_tiles
            tile_m, tile_n = _tile_coords(local, num_m_tiles, num_n_tiles, ROWS_FIRST)
            first_row = tl.sum(tl.where(here, starts, 0), 0) + tile_m * BLOCK_M
            row_end = tl.sum(tl.where(here, ends, 0), 0)
            n0 = tile_n * BLOCK_N
            if TAIL > 0:
                with_tail = tl.sum(tl.where(here & fused, 1, 0), 0) * (tile_m == num_m_tiles - 1).to(tl.int32)
        k0 = ki * BLOCK_K
        if USE_TMA:
            a = x_desc.load([first_row, k0])
            if W_KN:
                b = w_desc.load([expert * W_ROWS + k0, n0])
                acc = tl.dot(a, b, acc)
                if TAIL > 0:
                    acc_t = tl.dot(b.T, xt_desc.load([first_row + BLOCK_M, k0]).T, acc_t)
            else:
                b = w_desc.load([expert * W_ROWS + n0, k0])
                acc = tl.dot(a, b.T, acc)
                if TAIL > 0:
                    acc_t = tl.dot(b, xt_desc.load([first_row + BLOCK_M, k0]).T, acc_t)
        else:
            ks = k0 + offs_k
            k_mask = ks < K
            cols = n0 + offs_n
            x_ptrs = (
                x_ptr
                + tl.cast(first_row, tl.int64) * stride_xm  # passes 2**31 for M*K > 2**31
                + offs_m[:, None] * stride_xm
                + ks[None, :] * stride_xk
            )
            w_ptrs = (
                w_ptr
                + tl.cast(expert, tl.int64) * stride_we  # passes 2**31 for large stacks
                + cols[None, :] * stride_wn
                + ks[:, None] * stride_wk
            )
            a = tl.load(x_ptrs, mask=((first_row + offs_m) < row_end)[:, None] & k_mask[None, :], other=0.0)
            col_ok = (cols < N) & (tl.zeros((BLOCK_N,), dtype=tl.int32) + expert < E)  # slot E: no w
            b = tl.load(w_ptrs, mask=k_mask[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
        if ki == k_tiles - 1:
            # slot E's rows are no expert's: zeros, whatever x holds there (0 * NaN is NaN)
            acc = tl.where(expert < E, acc, 0.0)
            if TAIL > 0:
                if with_tail != 0:
                    tail = acc_t.T.to(y_ptr.dtype.element_ty)
                    _store_rows(y_ptr, tail, first_row + BLOCK_M, n0, row_end, N, stride_ym, stride_yn, TAIL, BLOCK_N)
                acc_t = tl.zeros((BLOCK_N, TAIL), dtype=tl.float32)
            _store_rows(
                y_ptr,
                acc.to(y_ptr.dtype.element_ty),
                first_row,
                n0,
                row_end,
                N,
                stride_ym,
                stride_yn,
                BLOCK_M,
                BLOCK_N,
            )
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
