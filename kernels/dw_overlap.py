"""dw on Hopper with the epilogue overlapped with the next tile's MMA (Gluon, ``-ovN`` configs).

``dw[e] = dy_e.T @ x_e`` is write-bound at MoE shapes: at 30b gate_up with 2048 tokens each
expert has ~128 rows, so a 128x128 dw tile is a 128-deep MMA followed by a 32 KB store. The
Triton resident kernel (``backward._grouped_gemm_dw_resident_kernel``) runs MMA and epilogue
in turn in one instruction stream: Triton waits for every outstanding MMA before an
accumulator is read, so the tensor cores idle during the epilogue and the stores wait for the
MMA. Here, written in Gluon (explicit ``warpgroup_mma`` / ``warpgroup_mma_wait``), a program
issues tile t's MMAs asynchronously and, while they run, converts and stores tile t-1 from a
second accumulator (two 128x128 fp32 accumulators over 8 warps: 128 registers per thread).

Paired items (a block_n of 256, ``overlap_halves``): an item is two 128-wide dw tiles, and
each x K tile is loaded once for both (``_paired_walk``): the x traffic per dw byte halves. Both
MMA operands then come from shared memory (dy^T masked there once per item), and half A's MMAs
run while half B's previous tile is stored and the other way round, so two accumulators
suffice. On an H200 (2026-11-22): 357 TFLOP/s against 308 for the one-tile items at 30b gate_up with balanced
routing (every x byte was read from L2 once per 128 dw columns; now once per 256).

Work split: the items are (expert, n-tile) as in the resident kernel, round-robin over the
programs of a persistent grid, except that an expert past the resident chunks has one-tile
items, cut along K, after every resident expert's: with skewed routing a hot expert's
(expert, n-tile) items were each several times the others and the programs that got them still
got a full share of the rest; the pieces are sized to the round-robin's last round where they
fit it (``_item_starts``; ``share_of_items`` is the host twin).

Masking as in the resident kernel: for an item the expert's dy^T columns are loaded ONCE (its
own row chunks, at most CHUNKS, of R rows each, each a whole TMA box, the last shifted back to
end at the expert's last row) and masked (rows already counted by an earlier chunk, rows
before the expert): in registers for one-tile items, in shared memory for paired ones. Then
every K tile of dw streams only x chunks (as many as the expert has: the walk is compiled once
per chunk count) through a STAGES-deep ring and is stored by TMA from a double-buffered staging
tile. No chunk reads past the expert's last row, so rows no expert covers never reach dw.
Experts with more than CHUNKS chunks stream both operands chunk by chunk through a ring that
spans every chunk buffer (CHUNKS x min(HALVES, STAGES) slots, its own barriers): whole chunks
feed the MMA from shared memory, the last (shifted, masked) one from registers, each MMA left
running while the ring refills (the tile's store is not overlapped there: see the comment in
``_streamed_item``); empty experts store zeros.

Needs: a Hopper GPU (sm_90), bf16/fp16, Triton with Gluon (3.5+), N a multiple of the tile's
BN (the dw store's 2-D view (E*N, K) must not cross experts); ``dw_overlap_plan`` returns None
otherwise and the caller takes the Triton kernels. The Gluon kernel itself is in
``kernels/_details/dw_overlap_kernels.py``; this module is its host side.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from qmoe_doctor.kernels._details import dw_overlap_kernels as _gluon

__all__ = [
    "HAVE_GLUON",
    "dw_overlap_kernel",
    "overlap_args",
    "dw_overlap_ok",
    "dw_overlap_plan",
    "dw_overlap_smem_bytes",
    "gluon_dw_descriptors",
    "gluon_operands_ok",
    "launch_dw_overlap",
    "overlap_halves",
    "share_of_items",
]

# Whether this Triton has Gluon (3.5+): without it every -ovN config takes the resident Triton
# kernel of the same tiles (backward.overlap_fallback). The Gluon names below are read only
# where HAVE_GLUON holds.
HAVE_GLUON: bool = _gluon.HAVE_GLUON


PAIRED_BLOCK_N = 256  # an -ovN config this wide takes items of two 128-wide tiles (``_paired_walk``)


def overlap_halves(block_n: int) -> int:
    """dw tiles per item of the overlapped kernel: 2 for a block_n of PAIRED_BLOCK_N (two tiles
    of 128 columns of dw sharing each x load), else 1 (one tile block_n wide)."""
    return 2 if block_n == PAIRED_BLOCK_N else 1


def dw_overlap_smem_bytes(rows: int, bn: int, bk: int, chunks: int, stages: int, itemsize: int) -> int:
    """Shared memory of one program: the resident dy chunks (the item's whole width bn), the x
    ring, two staging tiles (one tile wide), the barriers (x ring, streamed ring, dy)."""
    halves = overlap_halves(bn)
    tile = bn // halves
    barriers = stages + chunks * min(halves, stages) + 1
    return itemsize * (chunks * rows * bn + stages * chunks * rows * bk + 2 * tile * bk) + 8 * barriers


@functools.lru_cache(maxsize=64)
def _smem_layout_cached(shape: tuple[int, ...], dtype: torch.dtype) -> Any:
    return _gluon.gl.NVMMASharedLayout.get_default_for(
        list(shape), _gluon.gl.bfloat16 if dtype == torch.bfloat16 else _gluon.gl.float16
    )


def _smem_layout(shape: list[int], dtype: torch.dtype) -> Any:
    """The TMA box's shared-memory layout, computed once per (shape, dtype): a dw call at a
    small batch is launch-bound, and the host must not redo this for every call."""
    return _smem_layout_cached(tuple(shape), dtype)


def share_of_items(
    rows: list[int], n_tiles: int, num_k: int, programs: int, r: int, chunks: int, halves: int = 1
) -> list[list[tuple[int, int, int, int]]]:
    """The overlapped kernel's items per program, computed on the host the way the kernel does
    (``_pieces`` / ``_item_starts``): (expert, first dw tile, tiles, K piece) in order, item g
    to program g % programs; ``n_tiles`` counts dw tiles (N / 128 for paired items). An expert
    whose rows fit ``chunks`` chunks of ``r`` rows has items of ``halves`` tiles (all K tiles);
    a larger one has one-tile items cut along K, after every resident expert's: about one
    piece per ``halves`` x ``chunks`` row chunks where they all fit the programs that hold one
    resident item fewer, else one per ``chunks``. For tests and tools."""
    out: list[list[tuple[int, int, int, int]]] = [[] for _ in range(programs)]
    chunks_of = [-(-max(0, n) // r) for n in rows]
    streamed = [e for e, c in enumerate(chunks_of) if c > chunks]
    resident = [e for e, c in enumerate(chunks_of) if c <= chunks]

    def pieces(c: int, per: int) -> int:
        return min(-(-c // per), num_k)

    short = (programs - len(resident) * (n_tiles // halves) % programs) % programs
    coarse = sum(n_tiles * pieces(chunks_of[e], halves * chunks) for e in streamed)
    per = halves * chunks if coarse <= short else chunks
    g = 0
    for e in resident + streamed:
        width, k_pieces = (1, pieces(chunks_of[e], per)) if chunks_of[e] > chunks else (halves, 1)
        for i in range(n_tiles // width * k_pieces):
            out[g % programs].append((e, i // k_pieces * width, width, i % k_pieces))
            g += 1
    return out


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def gluon_operands_ok(dy: torch.Tensor, x: torch.Tensor) -> bool:
    """What both Gluon dw kernels need of the operands: Gluon, an sm_90 device, 16-bit operands
    of one dtype whose rows the copy engine can address (unit stride, 16-byte aligned rows)."""
    if not HAVE_GLUON or dy.device.type != "cuda":
        return False
    if dy.dtype not in (torch.bfloat16, torch.float16) or x.dtype != dy.dtype:
        return False
    from qmoe_doctor.kernels.grouped_gemm import _tma_ready, capability

    index = dy.device.index if dy.device.index is not None else torch.cuda.current_device()
    if capability(index)[0] != 9:
        return False
    return all(
        t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and _tma_ready(t) for t in (dy, x)
    )


def gluon_dw_descriptors(
    dy: torch.Tensor, x: torch.Tensor, dw: torch.Tensor, r: int, bn: int, bk: int
) -> tuple[Any, Any, Any] | None:
    """Gluon tensor descriptors of dy (boxes r x bn), x (r x bk) and dw's (E*N, K) view (bn x
    bk), or None where the copy engine cannot store that view (dw not contiguous per expert, a
    dtype other than dy's, unaligned) or its row coordinate expert * N + n0 would pass int32."""
    m, n = dy.shape
    k = x.shape[1]
    e = dw.shape[0]
    if dw.dtype != dy.dtype or e * n >= 2**31:
        return None
    if not (dw.stride(2) == 1 and dw.stride(0) == n * dw.stride(1) and (dw.stride(1) * dw.element_size()) % 16 == 0):
        return None
    from qmoe_doctor.kernels.grouped_gemm import _tma_ready

    if not _tma_ready(dw):
        return None
    dy_desc = _gluon.GluonTensorDescriptor(dy, [m, n], [dy.stride(0), 1], [r, bn], _smem_layout([r, bn], dy.dtype))
    x_desc = _gluon.GluonTensorDescriptor(x, [m, k], [x.stride(0), 1], [r, bk], _smem_layout([r, bk], dy.dtype))
    dw_desc = _gluon.GluonTensorDescriptor(
        dw, [e * n, k], [dw.stride(1), 1], [bn, bk], _smem_layout([bn, bk], dy.dtype)
    )
    return dy_desc, x_desc, dw_desc


def dw_overlap_ok(dy: torch.Tensor, x: torch.Tensor, cfg: Any) -> bool:
    """Whether a dw of these operands with ``cfg`` can take the overlapped kernel
    (``gluon_operands_ok``), N a multiple of the tile, and the tile split evenly over the warps
    (16 rows of BN per warp and repeat), STAGES <= CHUNKS."""
    if not getattr(cfg, "overlap", 0):
        return False
    tile = cfg.block_n // overlap_halves(cfg.block_n)
    if dy.shape[1] % cfg.block_n or tile % (16 * cfg.num_warps) or cfg.num_stages > cfg.overlap:
        return False
    return gluon_operands_ok(dy, x)


def dw_overlap_plan(
    dy: torch.Tensor, x: torch.Tensor, dw: torch.Tensor, cfg: Any
) -> tuple[Any, Any, Any] | None:
    """Gluon tensor descriptors (dy, x, dw) for the overlapped kernel, or None when this call
    cannot take it (``dw_overlap_ok``, ``gluon_dw_descriptors``)."""
    if not dw_overlap_ok(dy, x, cfg):
        return None
    return gluon_dw_descriptors(dy, x, dw, cfg.block_m, cfg.block_n // overlap_halves(cfg.block_n), cfg.block_k)


def dw_overlap_kernel() -> Any:
    """The Gluon kernel (only where HAVE_GLUON)."""
    return _gluon._grouped_gemm_dw_overlap_kernel


def overlap_args(dy: torch.Tensor, x: torch.Tensor, dw: torch.Tensor, cfg: Any, num_programs: int) -> dict[str, Any]:
    """Every argument of the overlapped kernel but the three descriptors and m_sizes, by name
    (``num_warps`` is a parameter of the Gluon kernel and its launch option at once)."""
    return {
        "M": dy.shape[0],
        "N": dy.shape[1],
        "K": x.shape[1],
        "E": dw.shape[0],
        "NUM_PROGRAMS": num_programs,
        "CHUNKS": cfg.overlap,
        "STAGES": cfg.num_stages,
        "E_POW2": _pow2(dw.shape[0]),
        "HALVES": overlap_halves(cfg.block_n),
        "num_warps": cfg.num_warps,
    }


def launch_dw_overlap(
    plan: tuple[Any, Any, Any], dy: torch.Tensor, x: torch.Tensor, dw: torch.Tensor, m_sizes: torch.Tensor,
    cfg: Any, num_programs: int,
) -> None:  # fmt: skip
    """Launch the overlapped dw kernel on the current device and stream (callers hold the guard);
    the kernel sums the experts' row bounds from ``m_sizes`` itself."""
    dy_desc, x_desc, dw_desc = plan
    dw_overlap_kernel()[(num_programs,)](
        dy_desc=dy_desc, x_desc=x_desc, dw_desc=dw_desc, sizes_ptr=m_sizes, **overlap_args(dy, x, dw, cfg, num_programs)
    )


def compile_offline(
    cfg: Any, dtype: str = "bf16", capability: int = 90, experts_pow2: int = 128, sizes: str = "*i32"
) -> Any:
    """Compile the overlapped kernel for ``cfg`` without a GPU (Triton's compiler and its
    bundled ptxas only): the compiled kernel, whose ``asm`` holds ttgir / ptx / cubin and
    ``metadata.shared`` its shared memory. The CPU tests check the kernel's structure on it
    (registers: run the bundled ``ptxas -v`` on ``asm["ptx"]``)."""
    if not HAVE_GLUON:
        raise RuntimeError("this Triton has no Gluon (triton.experimental.gluon)")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    gdt = {"bf16": _gluon.gl.bfloat16, "fp16": _gluon.gl.float16}[dtype]

    def desc(shape: list[int]) -> str:
        return f"tensordesc<{dtype}{list(shape)},{_gluon.gl.NVMMASharedLayout.get_default_for(shape, gdt)!r}>"

    r, bn, bk = cfg.block_m, cfg.block_n // overlap_halves(cfg.block_n), cfg.block_k
    signature = {
        "dy_desc": desc([r, bn]),
        "x_desc": desc([r, bk]),
        "dw_desc": desc([bn, bk]),
        "sizes_ptr": sizes,  # m_sizes: *i32 or *i64
        **{name: "i32" for name in ("M", "N", "K", "E", "NUM_PROGRAMS")},
        **{name: "constexpr" for name in ("CHUNKS", "STAGES", "E_POW2", "HALVES", "num_warps")},
    }
    constexprs = {
        "CHUNKS": cfg.overlap,
        "STAGES": cfg.num_stages,
        "E_POW2": experts_pow2,
        "HALVES": overlap_halves(cfg.block_n),
        "num_warps": cfg.num_warps,
    }
    source = GluonASTSource(_gluon._grouped_gemm_dw_overlap_kernel, signature, constexprs=constexprs)
    return triton.compile(
        source, target=GPUTarget("cuda", capability, 32), options={"num_warps": cfg.num_warps}
    )
