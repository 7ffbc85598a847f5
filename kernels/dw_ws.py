"""dw on Hopper with a loader warp running ahead across tiles (Gluon, warp-specialized; ``-ws`` configs).

``dw[e] = dy_e.T @ x_e`` at many rows per expert (8192 tokens: ~512 rows at 30B) is a long
reduction per dw tile, and the Triton TMA kernel (``backward._grouped_gemm_dw_tma_kernel``)
restarts its software pipeline at every tile and loads each expert's last partial chunk by
masked pointer loads, synchronously: Nsight Compute on an H100 (2026-12-06) put half its stall
cycles on those loads and its tensor pipe at 53% busy, against 62% for ``torch._grouped_mm``'s
warp-specialized CUTLASS kernel. Here one loader warp issues every tile's row chunks of dy and
x by TMA through a STAGES-deep ring of mbarriers and runs ahead into the next tiles while one
warpgroup multiplies (async wgmma, each MMA left running while the previous chunk's slot goes
back to the loader) and stores each tile by TMA without waiting for the store. The last chunk
of each tile is shifted back to end at the expert's last row and masked in registers (the
overlapped kernel's ``_masked_chunk``): nothing reads past the expert, so rows no expert covers
never reach dw. Two programs per SM (``-p2``: one staging tile, 128 registers a thread at
launch, which the warpgroups then trade by ``setmaxnreg``: the loader's down to 48, the
multiplier's up to hold its 128x128 fp32 accumulator) let one program's epilogue run under the
other's MMAs; one program per SM takes two staging tiles. Measured on one H100 (2026-12-06,
against the table's pick of that day): 510.5 TFLOP/s against 452.2 at 30B gate_up with 8192
tokens, 517.1 against 460.4 at 30B down, 295.7 against 267.8 at 30B gate_up with 2048 tokens.

Needs: a Hopper GPU (sm_90), bf16/fp16, a Triton whose Gluon takes ``warp_specialize``'s
(partition, args) pairs (3.6+), 4 warps (one warpgroup; BN a multiple of 64), N a multiple of
BN (the store's 2-D view (E*N, K) must not cross experts), E*N < 2**31. ``dw_ws_plan`` returns
None otherwise and the caller takes the Triton TMA kernel of the same tiles (``ws_fallback``).
The kernel is in ``kernels/_details/dw_ws_kernels.py``; this module is its host side.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from qmoe_doctor.kernels._details import dw_ws_kernels as _ws
from qmoe_doctor.kernels.dw_overlap import gluon_dw_descriptors, gluon_operands_ok

__all__ = [
    "HAVE_WS",
    "LOADER_REGS",
    "compile_ws_offline",
    "dw_ws_kernel",
    "dw_ws_ok",
    "dw_ws_plan",
    "dw_ws_smem_bytes",
    "ws_args",
    "ws_fallback",
    "ws_options",
    "ws_store_buffers",
]

if TYPE_CHECKING:
    from qmoe_doctor.kernels.grouped_gemm import GemmConfig

HAVE_WS: bool = _ws.HAVE_WS
LOADER_REGS: int = _ws.LOADER_REGS

#: registers a thread at launch with two programs per SM: 2 x 8 warps (the multiplying
#: warpgroup and the loader's, rounded up to one) x 32 x 128 fill the SM's 65536; within a
#: program the loader's warpgroup then gives registers to the multiplier's (``setmaxnreg``)
TWO_PER_SM_REGS = 128


def ws_store_buffers(cfg: GemmConfig) -> int:
    """Staging tiles for the TMA stores: one with two programs per SM (shared memory for two
    programs; a tile's store has the next tile's whole main loop to finish), else two."""
    return 1 if cfg.programs_per_sm > 1 else 2


def ws_options(cfg: GemmConfig) -> dict[str, int]:
    """Launch options: the register cap that lets two programs share an SM (``-p2``)."""
    return {"maxnreg": TWO_PER_SM_REGS} if cfg.programs_per_sm > 1 else {}


def dw_ws_smem_bytes(cfg: GemmConfig, itemsize: int) -> int:
    """Shared memory of one program: the (dy, x) chunk ring, the staging tiles, two barriers
    a stage."""
    ring = cfg.num_stages * cfg.block_m * (cfg.block_n + cfg.block_k)
    return itemsize * (ring + ws_store_buffers(cfg) * cfg.block_n * cfg.block_k) + 16 * cfg.num_stages


def ws_fallback(cfg: GemmConfig) -> GemmConfig:
    """Where the Gluon kernel cannot run: the Triton TMA kernel of the same tiles."""
    return dataclasses.replace(cfg, ws=False)


def dw_ws_ok(dy: torch.Tensor, x: torch.Tensor, cfg: Any) -> bool:
    """Whether a dw of these operands with ``cfg`` can take the warp-specialized kernel
    (``dw_overlap.gluon_operands_ok``, this Gluon's ``warp_specialize``, 4 warps, N a multiple of
    BN, BN a multiple of 64 and BK at most 256)."""
    if not HAVE_WS or not getattr(cfg, "ws", False):
        return False
    if cfg.num_warps != 4 or cfg.block_n % 64 or cfg.block_k > 256 or dy.shape[1] % cfg.block_n:
        return False
    return gluon_operands_ok(dy, x)


def dw_ws_plan(dy: torch.Tensor, x: torch.Tensor, dw: torch.Tensor, cfg: Any) -> tuple[Any, Any, Any] | None:
    """Gluon tensor descriptors (dy, x, dw) for the warp-specialized kernel, or None when this
    call cannot take it (``dw_ws_ok``, ``dw_overlap.gluon_dw_descriptors``)."""
    if not dw_ws_ok(dy, x, cfg):
        return None
    return gluon_dw_descriptors(dy, x, dw, cfg.block_m, cfg.block_n, cfg.block_k)


def dw_ws_kernel() -> Any:
    """The Gluon kernel (only where HAVE_WS)."""
    return _ws._grouped_gemm_dw_ws_kernel


def ws_args(dy: torch.Tensor, x: torch.Tensor, dw: torch.Tensor, cfg: Any, num_programs: int) -> dict[str, Any]:
    """Every argument of the kernel but the three descriptors and m_sizes, by name
    (``num_warps`` is a parameter of the Gluon kernel and its launch option at once)."""
    e = dw.shape[0]
    return {
        "M": dy.shape[0],
        "N": dy.shape[1],
        "K": x.shape[1],
        "E": e,
        "NUM_PROGRAMS": num_programs,
        "STAGES": cfg.num_stages,
        "NBUF": ws_store_buffers(cfg),
        "E_POW2": 1 << max(0, e - 1).bit_length(),
        "num_warps": cfg.num_warps,
    }


def compile_ws_offline(cfg: Any, dtype: str = "bf16", capability: int = 90, experts_pow2: int = 128) -> Any:
    """Compile the kernel for ``cfg`` without a GPU (Triton's compiler and its bundled ptxas
    only), as ``dw_overlap.compile_offline`` does for the overlapped kernel: the compiled
    kernel (``asm`` ttgir / ptx, ``metadata.shared``)."""
    if not HAVE_WS:
        raise RuntimeError("this Triton has no Gluon warp_specialize of the (partition, args) form")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from qmoe_doctor.kernels._details.dw_overlap_kernels import gl

    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]

    def desc(shape: list[int]) -> str:
        return f"tensordesc<{dtype}{list(shape)},{gl.NVMMASharedLayout.get_default_for(shape, gdt)!r}>"

    r, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    signature = {
        "dy_desc": desc([r, bn]),
        "x_desc": desc([r, bk]),
        "dw_desc": desc([bn, bk]),
        "sizes_ptr": "*i32",
        **{name: "i32" for name in ("M", "N", "K", "E", "NUM_PROGRAMS")},
        **{name: "constexpr" for name in ("STAGES", "NBUF", "E_POW2", "num_warps")},
    }
    constexprs = {
        "STAGES": cfg.num_stages,
        "NBUF": ws_store_buffers(cfg),
        "E_POW2": experts_pow2,
        "num_warps": cfg.num_warps,
    }
    source = GluonASTSource(_ws._grouped_gemm_dw_ws_kernel, signature, constexprs=constexprs)
    return triton.compile(
        source, target=GPUTarget("cuda", capability, 32), options={"num_warps": cfg.num_warps, **ws_options(cfg)}
    )
