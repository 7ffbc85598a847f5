"""dw on Hopper with the epilogue overlapped with the next tile's MMA (Gluon, ``-ovN`` configs).

``dw[e] = dy_e.T @ x_e`` is write-bound at MoE shapes: at 30b gate_up with 2048 tokens each
expert has ~128 rows, so a 128x128 dw tile is a 128-deep MMA followed by a 32 KB store. The
Triton resident kernel (``backward._grouped_gemm_dw_resident_kernel``) runs MMA and epilogue
in turn in one instruction stream: Triton waits for every outstanding MMA before an
accumulator is read, so the tensor cores idle during the epilogue and the stores wait for the
MMA. Here, written in Gluon (explicit ``warpgroup_mma`` / ``warpgroup_mma_wait``), a program
issues tile t's MMAs asynchronously and, while they run, converts and stores tile t-1 from a
second accumulator (two 128x128 fp32 accumulators over 8 warps: 128 registers per thread).

Work split: the items are (expert, n-tile) as in the resident kernel, round-robin over the
programs of a persistent grid, except that the items of an expert past the resident chunks are
also cut along K (about one piece per CHUNKS row chunks): with skewed routing a hot expert's
(expert, n-tile) items were each several times the others and the programs that got them still
got a full share of the rest (``share_of_items`` is the host twin). Masking as in the resident kernel: for an
item the expert's dy^T columns n0..n0+BN are loaded ONCE (its own row chunks, at most CHUNKS,
of R rows each, each a whole TMA box, the last shifted back to end at the expert's last row)
into registers, masked there (rows already counted by an earlier chunk, rows before the
expert), then every K tile of dw streams only x chunks (as many as the expert has: the walk is
compiled once per chunk count) through a STAGES-deep ring and is stored by TMA from a
double-buffered staging tile. No chunk reads past the expert's last row,
so rows no expert covers never reach dw. Experts with more than CHUNKS chunks stream both
operands chunk by chunk through the same ring: whole chunks feed the MMA from shared memory, the
last (shifted, masked) one from registers, each MMA left running while the ring refills (the
tile's store is not overlapped there: see the comment in the kernel); empty experts store zeros.
STAGES <= CHUNKS (the streamed path keeps each slot's dy chunk in the resident buffers).

Needs: a Hopper GPU (sm_90), bf16/fp16, Triton with Gluon (3.5+), N a multiple of the tile's
BN (the dw store's 2-D view (E*N, K) must not cross experts); ``dw_overlap_plan`` returns None
otherwise and the caller takes the Triton kernels.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

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

__all__ = [
    "HAVE_GLUON",
    "dw_overlap_ok",
    "dw_overlap_plan",
    "dw_overlap_smem_bytes",
    "launch_dw_overlap",
    "share_of_items",
]


def dw_overlap_smem_bytes(rows: int, bn: int, bk: int, chunks: int, stages: int, itemsize: int) -> int:
    """Shared memory of one program: the resident dy chunks, the x ring, two staging tiles."""
    return itemsize * (chunks * rows * bn + stages * chunks * rows * bk + 2 * bn * bk) + 8 * (stages + 1)


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
        that chunk of dy (columns n0..) and of x (the K tile) into ring slot ``slot``."""
        t = k_lo + pair // chunks
        bar = bars.index(slot)
        r0 = first + _chunk_row(pair % chunks, rows, R)
        mbarrier.expect(bar, dy_desc.block_type.nbytes + x_desc.block_type.nbytes)
        _tma_load(dy_desc, [r0, n0], bar, dy_bufs.index(slot))
        _tma_load(x_desc, [r0, t * BK], bar, x_bufs.index(slot * CHUNKS))

    @gluon.jit
    def _ready(bars, g, STAGES: gl.constexpr):
        """Wait for the ring's g-th load (this program's count) and return its slot."""
        slot = g % STAGES
        mbarrier.wait(bars.index(slot), (g // STAGES) & 1)
        return slot

    @gluon.jit
    def _refill(dy_desc, x_desc, dy_bufs, x_bufs, bars, loads, first, rows, n0, k_lo, done, total, chunks,
                CHUNKS: gl.constexpr, STAGES: gl.constexpr, R: gl.constexpr, BK: gl.constexpr):  # fmt: skip
        """Pair ``done``'s MMA has completed in every warpgroup's view once all warps pass the
        barrier: its slot takes pair done + STAGES, if there is one."""
        nxt = done + STAGES
        if nxt < total:
            _cta_barrier()
            _issue_pair(dy_desc, x_desc, dy_bufs, x_bufs, bars, (loads + done) % STAGES, first, rows, n0, k_lo, nxt,
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
        for c in gl.static_range(1, NCH):
            a = a + (_masked_chunk(dy_bufs.index(c), rows, c, R, a_layout),)
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
    def _add(a, b):
        return a + b

    @gluon.jit
    def _pieces(chunks, num_k, CHUNKS: gl.constexpr):
        """K pieces of an (expert, n-tile) item: 1 where the expert's dy stays resident, else
        about one per CHUNKS row chunks (at most one per K tile)."""
        return gl.where(chunks > CHUNKS, gl.minimum((chunks + CHUNKS - 1) // CHUNKS, num_k), 1)

    @gluon.jit
    def _item_starts(bounds_ptr, E, n_tiles, num_k, e_idx, R: gl.constexpr, CHUNKS: gl.constexpr):
        """(first item of each expert (int32; past the end for lanes >= E), number of items):
        n_tiles items per expert, times its K pieces (``_pieces``)."""
        live = e_idx < E
        lo = gl.load(bounds_ptr + e_idx, mask=live, other=0)
        hi = gl.load(bounds_ptr + e_idx + 1, mask=live, other=0)
        chunks = ((gl.maximum(hi - lo, 0) + R - 1) // R).to(gl.int32)
        count = gl.where(live, n_tiles * _pieces(chunks, num_k, CHUNKS), 0)
        starts = gl.associative_scan(count, 0, _add) - count
        return gl.where(live, starts, 2**31 - 1), gl.sum(count, axis=0)

    @gluon.jit
    def _grouped_gemm_dw_overlap_kernel(
        dy_desc,  # (M, N) block (R, BN)
        x_desc,  # (M, K) block (R, BK)
        dw_desc,  # (E * N, K) block (BN, BK)
        bounds_ptr,  # (E + 1,) int64 row offsets, clamped to [0, M] by the host
        M,
        N,
        K,
        E,
        NUM_PROGRAMS,
        CHUNKS: gl.constexpr,
        STAGES: gl.constexpr,
        E_POW2: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        gl.static_assert(STAGES <= CHUNKS, "the streamed path keeps slot s's dy chunk in dy_bufs[s]")
        R: gl.constexpr = dy_desc.block_type.shape[0]
        BN: gl.constexpr = dy_desc.block_type.shape[1]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        dtype: gl.constexpr = dy_desc.dtype
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BK, 16]
        )
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)

        dy_bufs = gl.allocate_shared_memory(dtype, [CHUNKS, R, BN], dy_desc.layout)
        x_bufs = gl.allocate_shared_memory(dtype, [STAGES * CHUNKS, R, BK], x_desc.layout)
        c_bufs = gl.allocate_shared_memory(dtype, [2, BN, BK], dw_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        dy_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        mbarrier.init(dy_bar, count=1)

        zero = gl.zeros((BN, BK), dtype=gl.float32, layout=mma_layout)
        n_tiles = N // BN
        num_k = gl.cdiv(K, BK)
        loads = 0  # x tiles loaded so far by this program: ring slot and barrier phase
        items = 0  # resident loads so far: dy_bar's phase
        stores = 0  # TMA stores so far: staging buffer
        # the items, round-robin over the programs as in the resident kernel (neighbouring
        # programs share the expert's x in L2): (expert, n-tile), and for an expert past the
        # resident chunks (expert, n-tile, K piece), so that a hot expert's items are as fine
        # as the others' (skewed routing, run 40); with no such expert, item = expert * n_tiles
        # + n-tile, and no search
        e_layout: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
        e_idx = gl.arange(0, E_POW2, layout=e_layout)
        starts, total_items = _item_starts(bounds_ptr, E, n_tiles, num_k, e_idx, R, CHUNKS)
        uniform = total_items == E * n_tiles
        for g in range(gl.program_id(0), total_items, NUM_PROGRAMS):
            if uniform:
                expert = g // n_tiles
                local = g % n_tiles
            else:
                expert = gl.sum(gl.where(starts <= g, 1, 0), axis=0) - 1
                local = g - gl.sum(gl.where(e_idx == expert, starts, 0), axis=0)
            row_start = gl.minimum(gl.maximum(gl.load(bounds_ptr + expert), 0), M)
            row_end = gl.minimum(gl.maximum(gl.load(bounds_ptr + expert + 1), row_start), M)
            rows = (row_end - row_start).to(gl.int32)
            first = row_start.to(gl.int32)
            pieces = _pieces(gl.cdiv(rows, R), num_k, CHUNKS)
            n0 = (local // pieces) * BN
            # a TMA coordinate (int32 by definition); the host refuses E * N >= 2**31
            out_row = expert * N + n0  # qmoe-doctor: ignore[int32-offset]
            chunks = gl.cdiv(rows, R)
            _cta_barrier()  # every warp's MMAs of the previous item are done with the buffers
            if chunks == 0:
                for t in range(num_k):
                    stores = _store_tile(zero, c_bufs, stores, dw_desc, out_row, t * BK)
            elif chunks <= CHUNKS:
                # only the expert's own chunks are loaded and multiplied (run 53: +5-7% over
                # always CHUNKS, the surplus ones repeating the last chunk masked to zero). The
                # walk's chunk count is a constant, one copy per count: an MMA under a runtime
                # condition makes ptxas wait for the MMAs before the overlapped epilogue (C7517).
                _expect_chunks(dy_bar, chunks, dy_desc.block_type.nbytes, CHUNKS)
                for c in gl.static_range(CHUNKS):
                    if c < chunks:
                        _tma_load(dy_desc, [first + _chunk_row(c, rows, R), n0], dy_bar, dy_bufs.index(c))
                for nch in gl.static_range(1, CHUNKS + 1):
                    if chunks == nch:
                        stores = _resident_walk(x_desc, x_bufs, bars, dy_bufs, dy_bar, c_bufs, dw_desc, loads, stores,
                                                items, first, rows, out_row, num_k, zero, nch, CHUNKS, STAGES, R,
                                                BK, a_layout)  # fmt: skip
                items += 1
                loads += num_k
            else:
                # more rows than resident chunks: the (K tile, chunk) pairs in one pipelined
                # sequence, dy and x chunks both through the ring (slot s's dy in dy_bufs[s]:
                # STAGES <= CHUNKS). Whole chunks feed the MMA from shared memory (dy^T as a
                # transposed view), the last, shifted one as a masked register operand. Each
                # MMA is left running while the previous one's slot is refilled.
                k_lo = (local % pieces) * num_k // pieces  # this item's K tiles
                k_hi = (local % pieces + 1) * num_k // pieces
                total = (k_hi - k_lo) * chunks
                for j in gl.static_range(STAGES):
                    if j < total:
                        _issue_pair(dy_desc, x_desc, dy_bufs, x_bufs, bars, (loads + j) % STAGES, first, rows, n0,
                                    k_lo, j, chunks, CHUNKS, R, BK)  # fmt: skip
                acc = zero
                for t in range(k_lo, k_hi):
                    q = (t - k_lo) * chunks
                    slot = _ready(bars, loads + q, STAGES)
                    acc = warpgroup_mma(dy_bufs.index(slot).permute((1, 0)), x_bufs.index(slot * CHUNKS), acc,
                                        use_acc=False, is_async=True)  # fmt: skip
                    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                    for c in range(1, chunks - 1):
                        slot = _ready(bars, loads + q + c, STAGES)
                        acc = warpgroup_mma(dy_bufs.index(slot).permute((1, 0)), x_bufs.index(slot * CHUNKS), acc,
                                            is_async=True)  # fmt: skip
                        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                        _refill(dy_desc, x_desc, dy_bufs, x_bufs, bars, loads, first, rows, n0, k_lo, q + c - 1, total, chunks,
                                CHUNKS, STAGES, R, BK)  # fmt: skip
                    q = q + chunks - 1
                    slot = _ready(bars, loads + q, STAGES)
                    a_last = _masked_chunk(dy_bufs.index(slot), rows, chunks - 1, R, a_layout)
                    acc = warpgroup_mma(a_last, x_bufs.index(slot * CHUNKS), acc, is_async=True)
                    # the tile's last MMAs are waited for (an accumulator still in flight cannot be
                    # carried into the next tile without ptxas serializing every wgmma), then its
                    # two slots refill and the tile is stored while those loads run
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                    _refill(dy_desc, x_desc, dy_bufs, x_bufs, bars, loads, first, rows, n0, k_lo, q - 1, total, chunks,
                            CHUNKS, STAGES, R, BK)  # fmt: skip
                    _refill(dy_desc, x_desc, dy_bufs, x_bufs, bars, loads, first, rows, n0, k_lo, q, total, chunks,
                            CHUNKS, STAGES, R, BK)  # fmt: skip
                    stores = _store_tile(acc, c_bufs, stores, dw_desc, out_row, t * BK)
                loads += total
        tma.store_wait(pendings=0)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))
        mbarrier.invalidate(dy_bar)


@functools.lru_cache(maxsize=64)
def _smem_layout_cached(shape: tuple[int, ...], dtype: torch.dtype) -> Any:
    return gl.NVMMASharedLayout.get_default_for(
        list(shape), gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    )


def _smem_layout(shape: list[int], dtype: torch.dtype) -> Any:
    """The TMA box's shared-memory layout, computed once per (shape, dtype): a dw call at a
    small batch is launch-bound, and the host must not redo this for every call."""
    return _smem_layout_cached(tuple(shape), dtype)


def share_of_items(
    rows: list[int], n_tiles: int, num_k: int, programs: int, r: int, chunks: int
) -> list[list[tuple[int, int, int]]]:
    """The overlapped kernel's items per program, computed on the host the way the kernel does
    (``_pieces`` / ``_item_starts``): (expert, n-tile, K piece) in order, item g to program
    g % programs. An expert whose rows fit ``chunks`` chunks of ``r`` rows has one item per
    n-tile (all K tiles); a larger one is cut along K into about one piece per ``chunks`` row
    chunks. For tests and tools."""
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(programs)]
    g = 0
    for e, n in enumerate(rows):
        c = -(-max(0, n) // r)
        pieces = min(-(-c // chunks), num_k) if c > chunks else 1
        for i in range(n_tiles * pieces):
            out[g % programs].append((e, i // pieces, i % pieces))
            g += 1
    return out


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def dw_overlap_ok(dy: torch.Tensor, x: torch.Tensor, cfg: Any) -> bool:
    """Whether a dw of these operands with ``cfg`` can take the overlapped kernel: Gluon, an
    sm_90 device, 16-bit operands with rows aligned for TMA, N a multiple of the tile, and the
    tile split evenly over the warps (16 rows of BN per warp and repeat), STAGES <= CHUNKS."""
    if not HAVE_GLUON or not getattr(cfg, "overlap", 0) or dy.device.type != "cuda":
        return False
    if dy.dtype not in (torch.bfloat16, torch.float16) or x.dtype != dy.dtype:
        return False
    from qmoe_doctor.kernels.grouped_gemm import _tma_ready, capability

    index = dy.device.index if dy.device.index is not None else torch.cuda.current_device()
    if capability(index)[0] != 9:
        return False
    if dy.shape[1] % cfg.block_n or cfg.block_n % (16 * cfg.num_warps) or cfg.num_stages > cfg.overlap:
        return False
    return all(
        t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and _tma_ready(t) for t in (dy, x)
    )


def dw_overlap_plan(
    dy: torch.Tensor, x: torch.Tensor, dw: torch.Tensor, cfg: Any
) -> tuple[Any, Any, Any] | None:
    """Gluon tensor descriptors (dy, x, dw) for the overlapped kernel, or None when this call
    cannot take it (``dw_overlap_ok``, and a dw whose (E*N, K) view the copy engine can store)."""
    if not dw_overlap_ok(dy, x, cfg) or dw.dtype != dy.dtype:
        return None
    m, n = dy.shape
    k = x.shape[1]
    e = dw.shape[0]
    if not (dw.stride(2) == 1 and dw.stride(0) == n * dw.stride(1) and (dw.stride(1) * 2) % 16 == 0):
        return None
    if e * n >= 2**31:  # the store's row coordinate expert * N + n0 is an int32
        return None
    from qmoe_doctor.kernels.grouped_gemm import _tma_ready

    if not _tma_ready(dw):
        return None
    r, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    dy_desc = GluonTensorDescriptor(dy, [m, n], [dy.stride(0), 1], [r, bn], _smem_layout([r, bn], dy.dtype))
    x_desc = GluonTensorDescriptor(x, [m, k], [x.stride(0), 1], [r, bk], _smem_layout([r, bk], dy.dtype))
    dw_desc = GluonTensorDescriptor(
        dw, [e * n, k], [dw.stride(1), 1], [bn, bk], _smem_layout([bn, bk], dy.dtype)
    )
    return dy_desc, x_desc, dw_desc


def launch_dw_overlap(
    plan: tuple[Any, Any, Any], dy: torch.Tensor, x: torch.Tensor, dw: torch.Tensor, bounds: torch.Tensor,
    cfg: Any, num_programs: int,
) -> None:  # fmt: skip
    """Launch the overlapped dw kernel on the current device and stream (callers hold the guard)."""
    dy_desc, x_desc, dw_desc = plan
    _grouped_gemm_dw_overlap_kernel[(num_programs,)](
        dy_desc,
        x_desc,
        dw_desc,
        bounds,
        dy.shape[0],
        dy.shape[1],
        x.shape[1],
        dw.shape[0],
        num_programs,
        CHUNKS=cfg.overlap,
        STAGES=cfg.num_stages,
        E_POW2=_pow2(dw.shape[0]),
        num_warps=cfg.num_warps,
    )


def compile_offline(cfg: Any, dtype: str = "bf16", capability: int = 90, experts_pow2: int = 128) -> Any:
    """Compile the overlapped kernel for ``cfg`` without a GPU (Triton's compiler and its
    bundled ptxas only): the compiled kernel, whose ``asm`` holds ttgir / ptx / cubin and
    ``metadata.shared`` its shared memory. The CPU tests check the kernel's structure on it
    (registers: run the bundled ``ptxas -v`` on ``asm["ptx"]``)."""
    if not HAVE_GLUON:
        raise RuntimeError("this Triton has no Gluon (triton.experimental.gluon)")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]

    def desc(shape: list[int]) -> str:
        return f"tensordesc<{dtype}{list(shape)},{gl.NVMMASharedLayout.get_default_for(shape, gdt)!r}>"

    r, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    signature = {
        "dy_desc": desc([r, bn]),
        "x_desc": desc([r, bk]),
        "dw_desc": desc([bn, bk]),
        "bounds_ptr": "*i64",
        **{name: "i32" for name in ("M", "N", "K", "E", "NUM_PROGRAMS")},
        **{name: "constexpr" for name in ("CHUNKS", "STAGES", "E_POW2", "num_warps")},
    }
    constexprs = {
        "CHUNKS": cfg.overlap,
        "STAGES": cfg.num_stages,
        "E_POW2": experts_pow2,
        "num_warps": cfg.num_warps,
    }
    source = GluonASTSource(_grouped_gemm_dw_overlap_kernel, signature, constexprs=constexprs)
    return triton.compile(
        source, target=GPUTarget("cuda", capability, 32), options={"num_warps": cfg.num_warps}
    )
