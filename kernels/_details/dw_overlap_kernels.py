"""The overlapped dw kernel in Gluon (launched by ``kernels/dw_overlap.py``, whose docstring
describes the design: items, chunks, the x ring, the overlapped epilogue)."""

from __future__ import annotations

# gl and GluonTensorDescriptor serve the host code too (shared-memory layouts, descriptors)
__all__ = ["HAVE_GLUON", "GluonTensorDescriptor", "_grouped_gemm_dw_overlap_kernel", "gl"]

try:  # Gluon: Triton's explicit-layout dialect (not in every Triton; never under the interpreter)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor

    # names that moved between Triton releases (3.6 on the GPU machines, newer in CI)
    _cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
    _tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared
    _tma_store = tma.async_store if hasattr(tma, "async_store") else tma.async_copy_shared_to_global
    HAVE_GLUON = True
except Exception:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False


if HAVE_GLUON:

    @gluon.jit
    def _chunk_row(chunk, rows, R: gl.constexpr):
        """First row of chunk ``chunk`` relative to the expert's first row (the last chunk ends at
        the expert's last row; under R rows it starts before the expert, where TMA reads zeros
        or earlier experts' rows, which the mask removes)."""
        return gl.minimum(chunk * R, rows - R)

    @gluon.jit
    def _masked_chunk(dy_chunk, rows, chunk, R: gl.constexpr, a_layout: gl.constexpr):
        """dy^T chunk (BN, R) from shared memory as the MMA's register operand, with the rows
        this chunk must not count set to zero."""
        a = dy_chunk.permute((1, 0)).load(a_layout)
        own = _chunk_row(chunk, rows, R) + gl.arange(0, R, layout=gl.SliceLayout(0, a_layout))
        keep = gl.expand_dims(own >= chunk * R, 0)
        return gl.where(keep, a, gl.zeros_like(a))

    @gluon.jit
    def _store_tile(acc, c_bufs, stores, dw_desc, row, col):
        """Stage ``acc`` in the staging buffer used two stores ago (its copy-out done) and copy
        it out by TMA without waiting for the copy."""
        buf = c_bufs.index(stores % 2)
        tma.store_wait(pendings=1)
        buf.store(acc.to(dw_desc.dtype))
        fence_async_shared()
        _tma_store(dw_desc, [row, col], buf)
        return stores + 1

    @gluon.jit
    def _expect_chunks(bar, nch, nbytes: gl.constexpr, CHUNKS: gl.constexpr):
        """Arrive on ``bar`` expecting ``nch`` (1..CHUNKS) boxes of ``nbytes`` (the byte count
        must be a constant: one predicated arrive per possible count, exactly one taken)."""
        for n in gl.static_range(1, CHUNKS + 1):
            mbarrier.expect(bar, n * nbytes, pred=nch == n)

    @gluon.jit
    def _issue_x(x_desc, x_bufs, bars, slot, first, rows, k0, NCH: gl.constexpr, CHUNKS: gl.constexpr,
                 R: gl.constexpr):  # fmt: skip
        """The first NCH x chunks of K tile k0 into ring slot ``slot`` (past the expert's chunk
        count a chunk would only repeat the last one, masked to zero)."""
        bar = bars.index(slot)
        mbarrier.expect(bar, NCH * x_desc.block_type.nbytes)
        for c in gl.static_range(NCH):
            _tma_load(x_desc, [first + _chunk_row(c, rows, R), k0], bar, x_bufs.index(slot * CHUNKS + c))

    @gluon.jit
    def _issue_pair(dy_desc, x_desc, dy_bufs, x_bufs, bars, slot, first, rows, n0, k_lo, pair, chunks,
                    CHUNKS: gl.constexpr, R: gl.constexpr, BK: gl.constexpr):  # fmt: skip
        """Pair ``pair`` of the streamed sequence, (K tile - k_lo, chunk) = divmod(pair, chunks):
        that chunk of dy (columns n0..) and of x (the K tile) into ring slot ``slot`` (the
        slot-th buffer of each: the streamed ring spans every chunk buffer there is)."""
        t = k_lo + pair // chunks
        bar = bars.index(slot)
        r0 = first + _chunk_row(pair % chunks, rows, R)
        mbarrier.expect(bar, dy_desc.block_type.nbytes + x_desc.block_type.nbytes)
        _tma_load(dy_desc, [r0, n0], bar, dy_bufs.index(slot))
        _tma_load(x_desc, [r0, t * BK], bar, x_bufs.index(slot))

    @gluon.jit
    def _ready(bars, g, DEPTH: gl.constexpr):
        """Wait for the streamed ring's g-th load (this program's count) and return its slot."""
        slot = g % DEPTH
        mbarrier.wait(bars.index(slot), (g // DEPTH) & 1)
        return slot

    @gluon.jit
    def _refill(dy_desc, x_desc, dy_bufs, x_bufs, bars, loads, first, rows, n0, k_lo, done, total, chunks,
                CHUNKS: gl.constexpr, DEPTH: gl.constexpr, R: gl.constexpr, BK: gl.constexpr):  # fmt: skip
        """Pair ``done``'s MMA has completed in every warpgroup's view once all warps pass the
        barrier: its slot takes pair done + DEPTH, if there is one."""
        nxt = done + DEPTH
        if nxt < total:
            _cta_barrier()
            _issue_pair(dy_desc, x_desc, dy_bufs, x_bufs, bars, (loads + done) % DEPTH, first, rows, n0, k_lo, nxt,
                        chunks, CHUNKS, R, BK)  # fmt: skip

    @gluon.jit
    def _resident_walk(x_desc, x_bufs, bars, dy_bufs, dy_bar, c_bufs, dw_desc, loads, stores, items, first, rows,
                       out_row, num_k, zero, NCH: gl.constexpr, CHUNKS: gl.constexpr, STAGES: gl.constexpr,
                       R: gl.constexpr, BK: gl.constexpr, a_layout: gl.constexpr):  # fmt: skip
        """One (expert, n-tile) item whose NCH dy^T chunks are loading into ``dy_bufs``
        (arriving on ``dy_bar``): every K tile of dw from NCH x chunks per ring slot, tile t's
        MMAs issued before tile t-1 is stored. Returns the store count."""
        for j in gl.static_range(STAGES):
            if j < num_k:
                _issue_x(x_desc, x_bufs, bars, (loads + j) % STAGES, first, rows, j * BK, NCH, CHUNKS, R)
        mbarrier.wait(dy_bar, items & 1)
        a = (_masked_chunk(dy_bufs.index(0), rows, 0, R, a_layout),)
        for c in gl.static_range(1, NCH):  # unrolled at compile time: the tuple grows per chunk
            a = a + (_masked_chunk(dy_bufs.index(c), rows, c, R, a_layout),)  # type: ignore[assignment]
        prev = zero
        for t in range(num_k):
            g = loads + t
            slot = g % STAGES
            mbarrier.wait(bars.index(slot), (g // STAGES) & 1)
            acc = warpgroup_mma(a[0], x_bufs.index(slot * CHUNKS), zero, use_acc=False, is_async=True)
            for c in gl.static_range(1, NCH):
                acc = warpgroup_mma(a[c], x_bufs.index(slot * CHUNKS + c), acc, is_async=True)
            # tile t-1's epilogue runs while tile t's MMAs do
            if t > 0:
                stores = _store_tile(prev, c_bufs, stores, dw_desc, out_row, (t - 1) * BK)
            prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            # tile t's MMAs are done with its slot: load tile t + STAGES there
            nxt = t + STAGES
            if nxt < num_k:
                _cta_barrier()  # both warpgroups' MMAs are done with the slot
                _issue_x(x_desc, x_bufs, bars, slot, first, rows, nxt * BK, NCH, CHUNKS, R)
        return _store_tile(prev, c_bufs, stores, dw_desc, out_row, (num_k - 1) * BK)

    @gluon.jit
    def _zero_counted_rows(buf, rows, chunk, R: gl.constexpr, layout: gl.constexpr):
        """Set to zero, in shared memory, the rows of dy chunk ``chunk`` (R, BN) that an earlier
        chunk already counted or that lie before the expert (the shifted last chunk)."""
        v = buf.load(layout)
        own = _chunk_row(chunk, rows, R) + gl.arange(0, R, layout=gl.SliceLayout(1, layout))
        buf.store(gl.where(gl.expand_dims(own >= chunk * R, 1), v, gl.zeros_like(v)))

    @gluon.jit
    def _half_mma(dy_bufs, x_bufs, slot, base, zero, NCH: gl.constexpr, CHUNKS: gl.constexpr):
        """The MMAs of one half's dw tile, both operands from shared memory: the NCH dy^T
        chunks from ``dy_bufs[base:]`` against the NCH x chunks of ring slot ``slot``."""
        acc = warpgroup_mma(dy_bufs.index(base).permute((1, 0)), x_bufs.index(slot * CHUNKS), zero, use_acc=False,
                            is_async=True)  # fmt: skip
        for c in gl.static_range(1, NCH):
            acc = warpgroup_mma(dy_bufs.index(base + c).permute((1, 0)), x_bufs.index(slot * CHUNKS + c), acc,
                                is_async=True)  # fmt: skip
        return acc

    @gluon.jit
    def _paired_tile(x_desc, x_bufs, bars, dy_bufs, c_bufs, dw_desc, loads, stores, first, rows, out_row, num_k, t,
                     prev, zero, STORE_PREV: gl.constexpr, NCH: gl.constexpr, CHUNKS: gl.constexpr,
                     STAGES: gl.constexpr, R: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):  # fmt: skip
        """K tile t of a paired item: half A's MMAs (while half B's tile t-1, ``prev``, is
        stored if STORE_PREV), then half B's (while half A's tile t is stored); refills the
        slot. Returns (stores, half B's tile t)."""
        g = loads + t
        slot = g % STAGES
        mbarrier.wait(bars.index(slot), (g // STAGES) & 1)
        acc = _half_mma(dy_bufs, x_bufs, slot, 0, zero, NCH, CHUNKS)
        if STORE_PREV:
            stores = _store_tile(prev, c_bufs, stores, dw_desc, out_row + BN, (t - 1) * BK)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        acc2 = _half_mma(dy_bufs, x_bufs, slot, CHUNKS, zero, NCH, CHUNKS)
        stores = _store_tile(acc, c_bufs, stores, dw_desc, out_row, t * BK)
        acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc2,))
        nxt = t + STAGES
        if nxt < num_k:
            _cta_barrier()  # both warpgroups' MMAs are done with the slot
            _issue_x(x_desc, x_bufs, bars, slot, first, rows, nxt * BK, NCH, CHUNKS, R)
        return stores, acc2

    @gluon.jit
    def _paired_walk(x_desc, x_bufs, bars, dy_bufs, dy_bar, c_bufs, dw_desc, loads, stores, items, first, rows,
                     out_row, num_k, zero, NCH: gl.constexpr, CHUNKS: gl.constexpr, STAGES: gl.constexpr,
                     R: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, row_layout: gl.constexpr):  # fmt: skip
        """``_resident_walk`` for an item two tiles wide (dy columns n0..n0+2*BN, chunks of the
        first half in ``dy_bufs[:CHUNKS]``, of the second in ``dy_bufs[CHUNKS:]``): each x K tile
        is loaded once for both halves' tiles, so the x traffic per dw byte halves. The MMAs
        take dy^T from shared memory (no register operands) and alternate with the stores:
        half A's MMAs of tile t run while half B's tile t-1 is stored, half B's while half
        A's tile t is, so only two accumulators are ever live."""
        for j in gl.static_range(STAGES):
            if j < num_k:
                _issue_x(x_desc, x_bufs, bars, (loads + j) % STAGES, first, rows, j * BK, NCH, CHUNKS, R)
        mbarrier.wait(dy_bar, items & 1)
        if rows < NCH * R:  # the last chunk is shifted back: mask it once, in shared memory
            _zero_counted_rows(dy_bufs.index(NCH - 1), rows, NCH - 1, R, row_layout)
            _zero_counted_rows(dy_bufs.index(CHUNKS + NCH - 1), rows, NCH - 1, R, row_layout)
            fence_async_shared()  # the MMAs read it through the async proxy
            _cta_barrier()
        # tile 0 (no stored tile to overlap its first MMAs with), then the steady state: no
        # store under a runtime condition while MMAs are in flight
        stores, prev = _paired_tile(x_desc, x_bufs, bars, dy_bufs, c_bufs, dw_desc, loads, stores, first, rows, out_row,
                                    num_k, 0, zero, zero, False, NCH, CHUNKS, STAGES, R, BN, BK)  # fmt: skip
        for t in range(1, num_k):
            stores, prev = _paired_tile(x_desc, x_bufs, bars, dy_bufs, c_bufs, dw_desc, loads, stores, first, rows,
                                        out_row, num_k, t, prev, zero, True, NCH, CHUNKS, STAGES, R, BN, BK)  # fmt: skip
        return _store_tile(prev, c_bufs, stores, dw_desc, out_row + BN, (num_k - 1) * BK)

    @gluon.jit
    def _streamed_item(dy_desc, x_desc, dy_bufs, x_bufs, bars, c_bufs, dw_desc, loads, stores, first, rows, n0,
                       out_row, local, pieces, num_k, chunks, zero, CHUNKS: gl.constexpr, DEPTH: gl.constexpr,
                       R: gl.constexpr, BK: gl.constexpr, a_layout: gl.constexpr):  # fmt: skip
        """One (expert, n-tile, K piece) item of an expert past the resident chunks, dy columns
        n0.. (one tile wide), through the streamed ring (``bars``: DEPTH barriers, ``loads``:
        its own count): returns (loads, stores)."""
        # more rows than resident chunks: the (K tile, chunk) pairs in one pipelined
        # sequence, dy and x chunks both through a DEPTH-deep ring (slot s: dy_bufs[s] and
        # x_bufs[s]: every chunk buffer the resident walks use). Whole chunks feed the MMA from shared memory (dy^T as a
        # transposed view), the last, shifted one as a masked register operand. Each
        # MMA is left running while the previous one's slot is refilled.
        k_lo = (local % pieces) * num_k // pieces  # this item's K tiles
        k_hi = (local % pieces + 1) * num_k // pieces
        total = (k_hi - k_lo) * chunks
        for j in gl.static_range(DEPTH):
            if j < total:
                _issue_pair(dy_desc, x_desc, dy_bufs, x_bufs, bars, (loads + j) % DEPTH, first, rows, n0,
                            k_lo, j, chunks, CHUNKS, R, BK)  # fmt: skip
        acc = zero
        for t in range(k_lo, k_hi):
            q = (t - k_lo) * chunks
            slot = _ready(bars, loads + q, DEPTH)
            acc = warpgroup_mma(dy_bufs.index(slot).permute((1, 0)), x_bufs.index(slot), acc,
                                use_acc=False, is_async=True)  # fmt: skip
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            for c in range(1, chunks - 1):
                slot = _ready(bars, loads + q + c, DEPTH)
                acc = warpgroup_mma(dy_bufs.index(slot).permute((1, 0)), x_bufs.index(slot), acc,
                                    is_async=True)  # fmt: skip
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                _refill(dy_desc, x_desc, dy_bufs, x_bufs, bars, loads, first, rows, n0, k_lo, q + c - 1, total, chunks,
                        CHUNKS, DEPTH, R, BK)  # fmt: skip
            q = q + chunks - 1
            slot = _ready(bars, loads + q, DEPTH)
            a_last = _masked_chunk(dy_bufs.index(slot), rows, chunks - 1, R, a_layout)
            acc = warpgroup_mma(a_last, x_bufs.index(slot), acc, is_async=True)
            # the tile's last MMAs are waited for (an accumulator still in flight cannot be
            # carried into the next tile without ptxas serializing every wgmma), then its
            # two slots refill and the tile is stored while those loads run
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _refill(dy_desc, x_desc, dy_bufs, x_bufs, bars, loads, first, rows, n0, k_lo, q - 1, total, chunks,
                    CHUNKS, DEPTH, R, BK)  # fmt: skip
            _refill(dy_desc, x_desc, dy_bufs, x_bufs, bars, loads, first, rows, n0, k_lo, q, total, chunks,
                    CHUNKS, DEPTH, R, BK)  # fmt: skip
            stores = _store_tile(acc, c_bufs, stores, dw_desc, out_row, t * BK)
        return loads + total, stores

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _pieces(chunks, num_k, per, CHUNKS: gl.constexpr):
        """K pieces of an (expert, n-tile) item: 1 where the expert's dy stays resident, else
        about one per ``per`` row chunks (at most one per K tile)."""
        return gl.where(chunks > CHUNKS, gl.minimum((chunks + per - 1) // per, num_k), 1)

    @gluon.jit
    def _item_starts(lo, hi, E, n_tiles, num_k, e_idx, programs, R: gl.constexpr, CHUNKS: gl.constexpr,
                     HALVES: gl.constexpr):  # fmt: skip
        """(first item of each expert (int32; past the end for lanes >= E), its item count, the
        number of items, ``per`` for ``_pieces``). n_tiles items per expert (each HALVES tiles
        wide); an expert past the resident chunks has one-tile items (HALVES per item), cut
        along K. The resident experts' items come first, in expert order, then the others',
        which so fill the round-robin's last round first. Their pieces: about one per HALVES x
        CHUNKS row chunks (a piece then weighs about what a resident item does) where they all
        fit the last round's programs that hold one item fewer, else about one per CHUNKS row
        chunks (lighter pieces for the programs that get one more). ``share_of_items`` is the
        host twin; an H200 measurement (2026-11-22) gave what the last round costs. ``lo``,
        ``hi``: every expert's row bounds (``_expert_bounds``)."""
        live = e_idx < E
        chunks = (hi - lo + R - 1) // R
        streamed = live & (chunks > CHUNKS)
        tiles = gl.where(streamed, HALVES * n_tiles, n_tiles)
        resident = gl.where(live & (chunks <= CHUNKS), n_tiles, 0)
        resident_total = gl.sum(resident, axis=0)
        short = (programs - resident_total % programs) % programs  # programs with one item fewer
        coarse = gl.where(streamed, tiles * _pieces(chunks, num_k, HALVES * CHUNKS, CHUNKS), 0)
        per = gl.where(gl.sum(coarse, axis=0) <= short, HALVES * CHUNKS, CHUNKS)
        late = gl.where(streamed, tiles * _pieces(chunks, num_k, per, CHUNKS), 0)
        starts = gl.where(
            streamed,
            gl.associative_scan(late, 0, _add) - late + resident_total,
            gl.associative_scan(resident, 0, _add) - resident,
        )
        return gl.where(live, starts, 2**31 - 1), resident + late, resident_total + gl.sum(late, axis=0), per

    @gluon.jit
    def _expert_bounds(sizes_ptr, E, M, e_idx):
        """Every expert's rows [lo, hi) (int32, 0 <= lo <= hi <= M) from m_sizes, clamped as the
        forward's tile walk clamps (negative counts are 0, nothing passes M), by a prefix sum in
        int64 (the sum of clamped counts can pass 2**31): no bounds launch before this kernel."""
        sizes = gl.load(sizes_ptr + e_idx, mask=e_idx < E, other=0)
        sizes = gl.minimum(gl.maximum(sizes, 0), M).to(gl.int64)  # clamp in the loaded width first
        incl = gl.associative_scan(sizes, 0, _add)
        return gl.minimum(incl - sizes, M).to(gl.int32), gl.minimum(incl, M).to(gl.int32)

    @gluon.jit
    def _grouped_gemm_dw_overlap_kernel(
        dy_desc,  # (M, N) block (R, BN): one tile's columns
        x_desc,  # (M, K) block (R, BK)
        dw_desc,  # (E * N, K) block (BN, BK): one tile
        sizes_ptr,  # (E,) int32/int64 rows per expert (m_sizes), clamped here (``_expert_bounds``)
        M,
        N,
        K,
        E,
        NUM_PROGRAMS,
        CHUNKS: gl.constexpr,
        STAGES: gl.constexpr,
        E_POW2: gl.constexpr,
        HALVES: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        gl.static_assert(HALVES == 1 or HALVES == 2, "an item is one or two tiles wide")
        # the streamed ring: slot s is dy_bufs[s] and x_bufs[s], as deep as both have buffers
        DEPTH: gl.constexpr = CHUNKS * min(HALVES, STAGES)
        R: gl.constexpr = dy_desc.block_type.shape[0]
        BN: gl.constexpr = dy_desc.block_type.shape[1]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        dtype: gl.constexpr = dy_desc.dtype
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BK, 16]
        )
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)

        row_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])

        dy_bufs = gl.allocate_shared_memory(dtype, [HALVES * CHUNKS, R, BN], dy_desc.layout)
        x_bufs = gl.allocate_shared_memory(dtype, [STAGES * CHUNKS, R, BK], x_desc.layout)
        c_bufs = gl.allocate_shared_memory(dtype, [2, BN, BK], dw_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        sbars = gl.allocate_shared_memory(gl.int64, [DEPTH, 1], mbarrier.MBarrierLayout())
        dy_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        for i in gl.static_range(DEPTH):
            mbarrier.init(sbars.index(i), count=1)
        mbarrier.init(dy_bar, count=1)

        zero = gl.zeros((BN, BK), dtype=gl.float32, layout=mma_layout)
        n_tiles = N // (HALVES * BN)  # items per expert (one or two tiles wide)
        num_k = gl.cdiv(K, BK)
        loads = 0  # x tiles loaded so far by this program: ring slot and barrier phase
        sloads = 0  # the same for the streamed ring
        items = 0  # resident loads so far: dy_bar's phase
        stores = 0  # TMA stores so far: staging buffer
        # the items, round-robin over the programs as in the resident kernel (neighbouring
        # programs share the expert's x in L2): (expert, n-tile), and for an expert past the
        # resident chunks (expert, n-tile, K piece), so that a hot expert's items are as fine
        # as the others' (skewed routing, measured on an H200, 2026-11-22); with no such expert, item = expert * n_tiles
        # + n-tile, and no search
        e_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        e_idx = gl.arange(0, E_POW2, layout=e_layout)
        lo, hi = _expert_bounds(sizes_ptr, E, M, e_idx)
        starts, counts, total_items, per = _item_starts(lo, hi, E, n_tiles, num_k, e_idx, NUM_PROGRAMS, R, CHUNKS,
                                                        HALVES)  # fmt: skip
        uniform = total_items == E * n_tiles
        for g in range(gl.program_id(0), total_items, NUM_PROGRAMS):
            if uniform:
                expert = g // n_tiles
                local = g % n_tiles
            else:
                mine = (starts <= g) & (g < starts + counts)  # exactly one expert's items hold g
                expert = gl.sum(gl.where(mine, e_idx, 0), axis=0)
                local = g - gl.sum(gl.where(mine, starts, 0), axis=0)
            here = e_idx == expert
            first = gl.sum(gl.where(here, lo, 0), axis=0)  # < M < 2**31: a descriptor coordinate
            rows = gl.sum(gl.where(here, hi, 0), axis=0) - first
            chunks = gl.cdiv(rows, R)
            pieces = _pieces(chunks, num_k, per, CHUNKS)
            # an item is HALVES tiles wide, one tile past the resident chunks (``_item_starts``)
            n0 = (local // pieces) * gl.where(chunks > CHUNKS, BN, HALVES * BN)
            # a TMA coordinate (int32 by definition); the host refuses E * N >= 2**31
            out_row = expert * N + n0  # qmoe-doctor: ignore[int32-offset]
            _cta_barrier()  # every warp's MMAs of the previous item are done with the buffers
            if chunks == 0:
                for t in range(num_k):
                    for h in gl.static_range(HALVES):
                        stores = _store_tile(zero, c_bufs, stores, dw_desc, out_row + h * BN, t * BK)
            elif chunks <= CHUNKS:
                # only the expert's own chunks are loaded and multiplied (H200, 2026-11-22: +5-7% over
                # always CHUNKS, the surplus ones repeating the last chunk masked to zero). The
                # walk's chunk count is a constant, one copy per count: an MMA under a runtime
                # condition makes ptxas wait for the MMAs before the overlapped epilogue (C7517).
                _expect_chunks(dy_bar, chunks, HALVES * dy_desc.block_type.nbytes, CHUNKS)
                for h in gl.static_range(HALVES):
                    for c in gl.static_range(CHUNKS):
                        if c < chunks:
                            _tma_load(dy_desc, [first + _chunk_row(c, rows, R), n0 + h * BN], dy_bar,
                                      dy_bufs.index(h * CHUNKS + c))  # fmt: skip
                for nch in gl.static_range(1, CHUNKS + 1):
                    if chunks == nch:
                        if HALVES == 1:
                            stores = _resident_walk(x_desc, x_bufs, bars, dy_bufs, dy_bar, c_bufs, dw_desc, loads,
                                                    stores, items, first, rows, out_row, num_k, zero, nch, CHUNKS,
                                                    STAGES, R, BK, a_layout)  # fmt: skip
                        else:
                            stores = _paired_walk(x_desc, x_bufs, bars, dy_bufs, dy_bar, c_bufs, dw_desc, loads,
                                                  stores, items, first, rows, out_row, num_k, zero, nch, CHUNKS,
                                                  STAGES, R, BN, BK, row_layout)  # fmt: skip
                items += 1
                loads += num_k
            else:
                sloads, stores = _streamed_item(dy_desc, x_desc, dy_bufs, x_bufs, sbars, c_bufs, dw_desc, sloads,
                                                stores, first, rows, n0, out_row, local, pieces, num_k, chunks, zero,
                                                CHUNKS, DEPTH, R, BK, a_layout)  # fmt: skip
        tma.store_wait(pendings=0)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        for i in gl.static_range(DEPTH):
            mbarrier.invalidate(sbars.index(i))
        mbarrier.invalidate(dy_bar)
