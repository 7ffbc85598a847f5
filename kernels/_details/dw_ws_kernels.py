"""The warp-specialized dw kernel in Gluon (launched by ``kernels/dw_ws.py``, whose docstring
describes the design: a loader warp running ahead across tiles, one warpgroup multiplying and
storing)."""

from __future__ import annotations

import inspect

from qmoe_doctor.kernels._details.dw_overlap_kernels import HAVE_GLUON

__all__ = ["HAVE_WS", "LOADER_REGS", "_grouped_gemm_dw_ws_kernel"]

LOADER_REGS = 48  # the loader warp's registers (setmaxnreg): the experts' bounds and a few scalars


def _ws_pairs() -> bool:
    """Whether this Gluon's ``warp_specialize`` takes (partition, args) pairs, the default
    partition first (Triton 3.6 and later); an older form is not supported here."""
    from triton.experimental.gluon import language as gl

    return "functions_and_args" in inspect.signature(gl.warp_specialize).parameters


# Whether this Triton can build the kernel: Gluon, and its current warp_specialize
HAVE_WS: bool = HAVE_GLUON and _ws_pairs()

if HAVE_WS:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from qmoe_doctor.kernels._details.dw_overlap_kernels import (
        _chunk_row,
        _expert_bounds,
        _masked_chunk,
        _tma_load,
        _tma_store,
    )

    _LOADER_REGS = gl.constexpr(LOADER_REGS)

    @gluon.jit
    def _ws_tile(tile, lo, hi, e_idx, tiles_per_expert, k_tiles, BN: gl.constexpr, BK: gl.constexpr):
        """Tile ``tile`` of the (expert, n-tile, k-tile) sequence: (expert, n0, k0, the expert's
        first row, its row count)."""
        expert = tile // tiles_per_expert
        local = tile % tiles_per_expert
        here = e_idx == expert
        first = gl.sum(gl.where(here, lo, 0), axis=0)  # < M < 2**31: a descriptor coordinate
        rows = gl.sum(gl.where(here, hi, 0), axis=0) - first
        return expert, (local // k_tiles) * BN, (local % k_tiles) * BK, first, rows

    @gluon.jit
    def _ws_loader(dy_desc, x_desc, dy_bufs, x_bufs, ready, empty, sizes_ptr, M, N, K, E, NUM_PROGRAMS,
                   E_POW2: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
        """The loader warp: for every tile of this program, the expert's row chunks of dy (columns
        n0..) and x (columns k0..), each into the next free ring slot; the last chunk shifted back
        to end at the expert's last row (under R rows it starts before the expert, even before
        row 0, where the copy engine reads zeros), so no chunk reads past the expert."""
        R: gl.constexpr = dy_desc.block_type.shape[0]
        BN: gl.constexpr = dy_desc.block_type.shape[1]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        e_idx = gl.arange(0, E_POW2, layout=gl.BlockedLayout([1], [32], [1], [0]))
        lo, hi = _expert_bounds(sizes_ptr, E, M, e_idx)
        k_tiles = gl.cdiv(K, BK)
        tiles_per_expert = (N // BN) * k_tiles
        g = 0  # chunks loaded by this program: ring slot and phase
        for tile in range(gl.program_id(0), E * tiles_per_expert, NUM_PROGRAMS):
            _, n0, k0, first, rows = _ws_tile(tile, lo, hi, e_idx, tiles_per_expert, k_tiles, BN, BK)
            for c in range(gl.cdiv(rows, R)):
                slot = g % STAGES
                mbarrier.wait(empty.index(slot), ((g // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
                bar = ready.index(slot)
                mbarrier.expect(bar, dy_desc.block_type.nbytes + x_desc.block_type.nbytes)
                r0 = first + _chunk_row(c, rows, R)
                _tma_load(dy_desc, [r0, n0], bar, dy_bufs.index(slot))
                _tma_load(x_desc, [r0, k0], bar, x_bufs.index(slot))
                g += 1

    @gluon.jit
    def _ws_multiplier(dy_desc, x_desc, dw_desc, dy_bufs, x_bufs, c_bufs, ready, empty, sizes_ptr, M, N, K, E,
                       NUM_PROGRAMS, E_POW2: gl.constexpr, STAGES: gl.constexpr, NBUF: gl.constexpr,
                       num_warps: gl.constexpr):  # fmt: skip
        """One warpgroup: each tile's whole chunks from shared memory (dy^T a transposed view),
        the last one as a masked register operand (rows an earlier chunk counted, rows before the
        expert: zero), each MMA left running while the previous chunk's slot goes back to the
        loader; then the tile through a staging buffer and a TMA store not waited for. An empty
        expert's tile stores zeros. One warpgroup only: a slot is released once this warpgroup's
        own wgmma wait has passed, which covers every warp of it."""
        R: gl.constexpr = dy_desc.block_type.shape[0]
        BN: gl.constexpr = dy_desc.block_type.shape[1]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BK, 16]
        )
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
        e_idx = gl.arange(0, E_POW2, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
        lo, hi = _expert_bounds(sizes_ptr, E, M, e_idx)
        k_tiles = gl.cdiv(K, BK)
        tiles_per_expert = (N // BN) * k_tiles
        zero = gl.zeros((BN, BK), dtype=gl.float32, layout=mma_layout)
        g = 0  # chunks consumed: ring slot and phase, as the loader counts them
        stores = 0
        for tile in range(gl.program_id(0), E * tiles_per_expert, NUM_PROGRAMS):
            expert, n0, k0, first, rows = _ws_tile(tile, lo, hi, e_idx, tiles_per_expert, k_tiles, BN, BK)
            chunks = gl.cdiv(rows, R)
            acc = zero
            for c in range(chunks - 1):
                slot = g % STAGES
                mbarrier.wait(ready.index(slot), (g // STAGES) & 1)
                acc = warpgroup_mma(dy_bufs.index(slot).permute((1, 0)), x_bufs.index(slot), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                mbarrier.arrive(empty.index((g + STAGES - 1) % STAGES), pred=c > 0)  # chunk g-1's MMA is done
                g += 1
            if chunks > 0:
                slot = g % STAGES
                mbarrier.wait(ready.index(slot), (g // STAGES) & 1)
                a_last = _masked_chunk(dy_bufs.index(slot), rows, chunks - 1, R, a_layout)
                acc = warpgroup_mma(a_last, x_bufs.index(slot), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(empty.index((g + STAGES - 1) % STAGES), pred=chunks > 1)
                fence_async_shared()  # the masked chunk was read through the generic proxy; TMA refills it
                mbarrier.arrive(empty.index(slot))
                g += 1
            buf = c_bufs.index(stores % NBUF)
            tma.store_wait(pendings=NBUF - 1)  # the store that used this buffer has read it
            buf.store(acc.to(dw_desc.dtype))
            fence_async_shared()
            # a descriptor coordinate is an element index (int32 by definition, < E * N: the host
            # refuses more); the copy engine forms the 64-bit address
            _tma_store(dw_desc, [expert * N + n0, k0], buf)  # qmoe-doctor: ignore[int32-offset]
            stores += 1
        tma.store_wait(pendings=0)

    @gluon.jit
    def _grouped_gemm_dw_ws_kernel(
        dy_desc,  # (M, N) block (R, BN)
        x_desc,  # (M, K) block (R, BK)
        dw_desc,  # (E * N, K) block (BN, BK)
        sizes_ptr,  # (E,) int32/int64 rows per expert (m_sizes), clamped here (``_expert_bounds``)
        M,
        N,
        K,
        E,
        NUM_PROGRAMS,
        STAGES: gl.constexpr,
        NBUF: gl.constexpr,
        E_POW2: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        R: gl.constexpr = dy_desc.block_type.shape[0]
        BN: gl.constexpr = dy_desc.block_type.shape[1]
        BK: gl.constexpr = x_desc.block_type.shape[1]
        dtype: gl.constexpr = dy_desc.dtype
        dy_bufs = gl.allocate_shared_memory(dtype, [STAGES, R, BN], dy_desc.layout)
        x_bufs = gl.allocate_shared_memory(dtype, [STAGES, R, BK], x_desc.layout)
        c_bufs = gl.allocate_shared_memory(dtype, [NBUF, BN, BK], dw_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        fence_async_shared()
        # the partitions' arguments are written out in the call: a tuple bound to a name first
        # turns its constexprs into values
        gl.warp_specialize(
            [
                (_ws_multiplier, (dy_desc, x_desc, dw_desc, dy_bufs, x_bufs, c_bufs, ready, empty, sizes_ptr, M, N, K,
                                  E, NUM_PROGRAMS, E_POW2, STAGES, NBUF, num_warps)),
                (_ws_loader, (dy_desc, x_desc, dy_bufs, x_bufs, ready, empty, sizes_ptr, M, N, K, E, NUM_PROGRAMS,
                              E_POW2, STAGES)),
            ],
            [1],
            [_LOADER_REGS],
        )  # fmt: skip
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))
