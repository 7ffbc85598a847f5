"""The backward's kernels (launched by ``kernels/backward.py``): the row bounds of the experts,
and dw in its four forms (pointer, TMA, resident, flattened), each of which can also sum the
experts' row bounds from m_sizes itself (``SIZES``: no bounds launch before it)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _row_bounds_kernel(sizes_ptr, bounds_ptr, E, M, BLOCK_E: tl.constexpr):
    """bounds[0] = 0, bounds[e + 1] = min(sum(max(sizes[: e + 1], 0)), M), summed in int64."""
    offs = tl.arange(0, BLOCK_E)
    live = offs < E
    sizes = tl.maximum(tl.load(sizes_ptr + offs, mask=live, other=0).to(tl.int64), 0)
    ends = tl.minimum(tl.cumsum(sizes, 0), M)
    tl.store(bounds_ptr + 1 + offs, ends, mask=live)
    tl.store(bounds_ptr + offs, tl.zeros_like(ends), mask=offs == 0)


@triton.jit
def _bounds_vector(rows_ptr, E, M, SIZES: tl.constexpr, E_POW2: tl.constexpr):
    """With SIZES (``rows_ptr`` is m_sizes): every expert's row bounds, packed one int64 per
    expert as first_row * 2**32 + end_row (both in [0, M], int32), from the prefix sum of the
    counts clamped as the forward's tile walk clamps them (negative counts are 0, nothing passes
    M). Computed once per program, before its tiles: no launch before the kernel's. Without
    SIZES a placeholder (the tiles load the (E + 1,) bounds of ``row_bounds``)."""
    offs = tl.arange(0, E_POW2)
    if SIZES:
        sizes = tl.load(rows_ptr + offs, mask=offs < E, other=0)
        sizes = tl.minimum(tl.maximum(sizes, 0), M).to(tl.int64)  # clamp in the loaded width first
        incl = tl.cumsum(sizes, 0)  # int64: the clamped counts' sum can pass 2**31
        packed = tl.minimum(incl - sizes, M) * 4294967296 + tl.minimum(incl, M)
    else:
        packed = tl.zeros((E_POW2,), dtype=tl.int64)
    return packed


@triton.jit
def _expert_rows(rows_ptr, expert, M, packed, SIZES: tl.constexpr, E_POW2: tl.constexpr):
    """Rows [start, end) of ``expert`` (int64, 0 <= start <= end <= M): from ``_bounds_vector``'s
    packed bounds (one reduction), or without SIZES from the (E + 1,) int64 bounds of
    ``row_bounds``, clamped again so that a bad buffer still cannot move the reads outside dy
    and x."""
    if SIZES:
        mine = tl.sum(tl.where(tl.arange(0, E_POW2) == expert, packed, 0), 0)
        row_start = mine >> 32
        row_end = mine & 4294967295
    else:
        row_start = tl.minimum(tl.maximum(tl.load(rows_ptr + expert), 0), M)
        row_end = tl.minimum(tl.maximum(tl.load(rows_ptr + expert + 1), row_start), M)
    return row_start, row_end


@triton.jit
def _grouped_gemm_dw_kernel(
    dy_ptr,  # (M, N) output gradient, rows sorted by expert
    x_ptr,  # (M, K) forward input, rows sorted by expert
    dw_ptr,  # (E, N, K) weight gradient, every element written
    rows_ptr,  # (E,) m_sizes when SIZES, else (E + 1,) int64 row bounds (``_expert_rows``)
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
    SIZES: tl.constexpr = False,
    E_POW2: tl.constexpr = 1,  # with SIZES: a power of two >= E
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

    packed = _bounds_vector(rows_ptr, E, M, SIZES, E_POW2)
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
        row_start, row_end = _expert_rows(rows_ptr, expert, M, packed, SIZES, E_POW2)
        rows_in_expert = (row_end - row_start).to(tl.int32)  # <= M

        # row * stride_xm passes 2**31 for M*K > 2**31: an int64 row vector (``_expert_rows``
        # returns int64; the cast says so here). As a vector, not as an int64 base plus int32
        # in-chunk offsets: with Triton 3.6 on an H200 that form held 218 registers at
        # 64x128x64-w4-s3, this one 140, and ran 3.9% slower at 30B gate_up, 2048 tokens (the
        # TMA and flattened dw kernels' pointer loads measured no better this way: kept as they were)
        # dy tile read transposed: (BLOCK_N, BLOCK_M)
        rows = tl.cast(row_start, tl.int64) + offs_m
        dy_ptrs = dy_ptr + rows[None, :] * stride_dym + cols_n[:, None] * stride_dyn
        x_ptrs = x_ptr + rows[:, None] * stride_xm + cols_k[None, :] * stride_xk
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


@triton.jit
def _grouped_gemm_dw_tma_kernel(
    dy_desc,  # (M, N) block (BLOCK_M, BLOCK_N)
    x_desc,  # (M, K) block (BLOCK_M, BLOCK_K)
    dw_desc,  # (E * N, K) block (BLOCK_N, BLOCK_K) when DW_TMA (the host checks N % BLOCK_N == 0)
    dy_ptr,
    x_ptr,
    dw_ptr,
    rows_ptr,  # as in _grouped_gemm_dw_kernel
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
    SIZES: tl.constexpr = False,
    E_POW2: tl.constexpr = 1,
):
    """``_grouped_gemm_dw_kernel`` with the expert's whole BLOCK_M-row chunks loaded by the
    copy engine and its last partial chunk by masked pointer loads (a descriptor cannot stop
    at the expert's last row, and rows of the next expert must not enter this sum; loading that
    chunk as a whole box and masking it afterwards measured 7% slower on an H200, 2026-11-22)."""
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    num_k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_expert = num_n_tiles * num_k_tiles
    num_tiles = E * tiles_per_expert
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)

    packed = _bounds_vector(rows_ptr, E, M, SIZES, E_POW2)
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
        row_start, row_end = _expert_rows(rows_ptr, expert, M, packed, SIZES, E_POW2)
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
    # the tuples grow by one chunk per unrolled step (a static_range runs at compile time)
    for c in tl.static_range(1, CHUNKS):
        a = a + (_dw_chunk_a(res_desc, first, rows, c, c0, BLOCK_M),)  # type: ignore[assignment]
        r = r + (first + _dw_chunk_start(c, rows, BLOCK_M),)  # type: ignore[assignment]
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
    rows_ptr,  # as in _grouped_gemm_dw_kernel
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
    SIZES: tl.constexpr = False,
    E_POW2: tl.constexpr = 1,
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
    packed = _bounds_vector(rows_ptr, E, M, SIZES, E_POW2)
    for item in range(pid, E * per_expert, NUM_PROGRAMS):
        expert = item // per_expert
        c0 = (item % per_expert) * (BLOCK_K if X_RES else BLOCK_N)
        row_start, row_end = _expert_rows(rows_ptr, expert, M, packed, SIZES, E_POW2)
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


@triton.jit
def _grouped_gemm_dw_flat_kernel(
    dy_ptr,
    x_ptr,
    dw_ptr,
    rows_ptr,  # as in _grouped_gemm_dw_kernel
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
    SIZES: tl.constexpr = False,
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
    if SIZES:  # ``_bounds_vector``'s bounds, unpacked: every expert's at once
        packed = _bounds_vector(rows_ptr, E, M, SIZES, E_POW2)
        lo = packed >> 32
        hi = packed & 4294967295
    else:
        lo = tl.load(rows_ptr + offs_e, mask=in_range, other=0)
        hi = tl.load(rows_ptr + offs_e + 1, mask=in_range, other=0)
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
