"""Grouped GEMM for fused MoE: ``y[m] = x[m] @ w[e(m)].T`` with rows sorted by expert.

``moe_grouped_gemm(x, w, m_sizes)`` is the signature of the public Qwen3-MoE fused kernels:

* ``x``: (M, K), rows sorted by expert; the first ``m_sizes[0]`` rows belong to expert 0, ...
* ``w``: (E, N, K), one (N, K) weight per expert (any strides: ``w.transpose(1, 2)`` gives dx)
* ``m_sizes``: (E,) int32 or int64 row counts per expert

What makes it right under every placement (each item is a cause in ``qmoe_doctor.core.causes``):

* the launch happens inside ``torch.cuda.device(x.device)``, so Triton picks x's device and that
  device's current stream (``missing-device-guard``, ``wrong-device-stream``);
* every buffer is allocated on ``x.device`` (``default-device-buffer``);
* SM count and shared-memory limit are read from ``x.device``, cached per device index
  (``per-device-state-cached``, ``launch-config-fault``);
* offsets that can pass 2**31 elements (expert * stride_we, row * stride_xm) are formed in
  int64 where they are formed, and only there (``int32-offset-overflow``);
* rows are masked by M: a wrong ``m_sizes`` (negative, or summing past M) can never read or
  write outside x or y (``invalid-routing``). Rows that ``m_sizes`` does not cover are zero.

``moe_grouped_gemm_torch`` is the slow, obvious twin with the same signature and semantics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

__all__ = [
    "GemmConfig",
    "moe_grouped_gemm",
    "moe_grouped_gemm_torch",
    "pick_config",
    "check_operands",
    "device_guard",
    "num_sms",
    "persistent_sms",
    "reserved_sms",
    "sm_reserve",
    "interpreting",
    "kernel_path",
    "tma_plan",
]


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True, slots=True)
class GemmConfig:
    """A launch config. ``programs_per_sm``: persistent programs per SM (2 lets one program's
    epilogue overlap another's main loop where shared memory allows two); ``tma``: load tiles
    through tensor descriptors (the bulk tensor copy engine) where the device and the operands'
    alignment allow it, pointer loads otherwise; ``flat``: one flattened loop over each program's
    (tile, k-step) pairs, so that the software pipeline runs on across tile boundaries (the
    next tile's first loads are in flight while this tile's epilogue stores); ``resident`` (dw
    only, with ``tma``): experts of up to ``resident`` row chunks keep their output gradient in
    registers while the program walks every K tile of dw (``backward``'s resident kernel);
    ``resident_x``: keep x resident instead and walk every N tile (name suffix ``-rxN``);
    ``overlap`` (dw only, Hopper): the Gluon kernel of ``kernels/dw_overlap.py``, dy resident
    like ``-rN`` with the epilogue of one tile overlapped with the next tile's MMA (``-ovN``;
    elsewhere the resident Triton kernel of the same tiles serves)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 8
    num_stages: int = 3
    programs_per_sm: int = 1
    tma: bool = False
    flat: bool = False
    resident: int = 0
    resident_x: bool = False
    overlap: int = 0

    @property
    def name(self) -> str:
        text = f"{self.block_m}x{self.block_n}x{self.block_k}-w{self.num_warps}-s{self.num_stages}"
        if self.programs_per_sm != 1:
            text += f"-p{self.programs_per_sm}"
        text += ("-tma" if self.tma else "") + ("-flat" if self.flat else "")
        text += f"-r{'x' if self.resident_x else ''}{self.resident}" if self.resident else ""
        return text + (f"-ov{self.overlap}" if self.overlap else "")

    def smem_bytes(self, itemsize: int) -> int:
        """Shared memory the software pipeline asks for: one x tile and one w tile per stage."""
        return (self.block_m + self.block_n) * self.block_k * itemsize * self.num_stages


# --------------------------------------------------------------------------------------------
# Per-device facts, keyed by device index (never cached from "the first device").
# --------------------------------------------------------------------------------------------


@functools.cache
def num_sms(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


@functools.cache
def capability(device_index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(device_index)
    return int(major), int(minor)


@functools.cache
def smem_limit(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or 232448)


# SMs the persistent grids leave free (``reserved_sms``): a collective running on another stream
# (expert parallelism's all-to-all) gets SMs while our GEMMs run, instead of waiting for them.
_SM_RESERVE = [0]


def sm_reserve() -> int:
    """How many SMs of each device the persistent grids leave free now (0 unless inside
    ``reserved_sms``)."""
    return _SM_RESERVE[0]


@contextlib.contextmanager
def reserved_sms(count: int) -> Iterator[None]:
    """Within this block our persistent grids use at most ``num_sms - count`` SMs' worth of
    programs (never fewer than one SM's). Process-wide, not per thread: autograd's backward runs
    on its own thread, so ``moe_fused_linear`` records the value at forward and restores it."""
    if count < 0:
        raise ValueError(f"cannot reserve a negative number of SMs ({count})")
    before = _SM_RESERVE[0]
    _SM_RESERVE[0] = int(count)
    try:
        yield
    finally:
        _SM_RESERVE[0] = before


def persistent_sms(device_index: int) -> int:
    """SMs of this device the persistent grids may fill (all but the reserved ones)."""
    return max(1, num_sms(device_index) - _SM_RESERVE[0])


def device_guard(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """``torch.cuda.device(device)`` for CUDA tensors, a no-op for CPU tensors (interpreter)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


# --------------------------------------------------------------------------------------------
# Argument checks: clear errors naming the argument.
# --------------------------------------------------------------------------------------------

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_operands(x: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor, *, what: str = "x") -> None:
    """Validate shapes, dtypes and devices of a grouped GEMM call (no synchronization)."""
    for name, t in (("x", x), ("w", w), ("m_sizes", m_sizes)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{what} must be 2-D (M, K), got shape {tuple(x.shape)}")
    if w.dim() != 3:
        raise ValueError(f"w must be 3-D (E, N, K), got shape {tuple(w.shape)}")
    if m_sizes.dim() != 1:
        raise ValueError(f"m_sizes must be 1-D (E,), got shape {tuple(m_sizes.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{what} must be bfloat16, float16 or float32, got {x.dtype}")
    if w.dtype != x.dtype:
        raise TypeError(f"w has dtype {w.dtype} but {what} has {x.dtype}; they must match")
    if m_sizes.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"m_sizes must be int32 or int64, got {m_sizes.dtype}")
    if w.shape[2] != x.shape[1]:
        raise ValueError(
            f"{what} has K={x.shape[1]} columns but w is (E, N, K)={tuple(w.shape)}: K must match"
        )
    if m_sizes.shape[0] != w.shape[0]:
        raise ValueError(f"m_sizes has {m_sizes.shape[0]} entries but w has E={w.shape[0]} experts")
    devices = {t.device for t in (x, w, m_sizes)}
    if len(devices) > 1:
        placed = ", ".join(f"{n} on {t.device}" for n, t in ((what, x), ("w", w), ("m_sizes", m_sizes)))
        raise ValueError(f"operands are on different devices ({placed}); move them to one device")
    if x.device.type == "cpu" and not interpreting():
        raise ValueError(
            f"{what} is a CPU tensor: the Triton kernel needs CUDA tensors "
            "(or TRITON_INTERPRET=1 to run it on the CPU); use moe_grouped_gemm_torch for CPU"
        )
    if x.device.type not in ("cuda", "cpu"):
        raise ValueError(f"{what} is on {x.device}; only CUDA devices are supported")


def check_routing_sizes(m_sizes: torch.Tensor, m: int) -> None:
    """Opt-in routing check: synchronizes (reads m_sizes on the host)."""
    sizes = m_sizes.detach().to("cpu", torch.int64)
    if bool((sizes < 0).any()):
        bad = [i for i, v in enumerate(sizes.tolist()) if v < 0]
        raise ValueError(f"m_sizes has negative counts at experts {bad[:8]}")
    total = int(sizes.sum())
    if total != m:
        raise ValueError(f"m_sizes sums to {total} but x has M={m} rows; routing and rows disagree")


# --------------------------------------------------------------------------------------------
# Config choice: a small table, pruned against the device's shared memory (no autotune at run
# time: a 1000-config autotune took 49 s for one shape on an H200).
# --------------------------------------------------------------------------------------------


def pick_config(
    m: int, n: int, k: int, e: int, device: torch.device, dtype: torch.dtype, *, op: str = "forward"
) -> GemmConfig:
    """The launch config of one call: the measured table (``kernels/tuning.py``) on the
    devices it was measured for, a small built-in rule elsewhere; pruned to the device's
    shared memory either way. ``op`` is "forward" or "dx" (the forward kernel on w.T)."""
    if device.type != "cuda":
        return GemmConfig(32, 32, 32, num_warps=4, num_stages=1)  # interpreter: small and quick
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _pick_config(m, n, k, e, index, dtype, op)


@functools.lru_cache(maxsize=4096)
def _pick_config(m: int, n: int, k: int, e: int, index: int, dtype: torch.dtype, op: str) -> GemmConfig:
    """pick_config per (shape, device index, dtype, op), cached: a call with few rows takes tens
    of microseconds on the GPU, and the table lookup must not add more on the host."""
    from qmoe_doctor.kernels import tuning

    avg_rows = max(1, m // max(1, e))
    device = torch.device("cuda", index)
    cfg = tuning.lookup(op, m / max(1, e), n, k, capability(index))
    if cfg is None:
        if avg_rows <= 64:
            cfg = GemmConfig(64, 128, 64, num_warps=4, num_stages=4)
        elif n >= 256:
            cfg = GemmConfig(128, 256, 64, num_warps=8, num_stages=3)
        else:
            cfg = GemmConfig(128, 128, 64, num_warps=8, num_stages=3)
    return fit_config(cfg, device, dtype)


def fit_config(cfg: GemmConfig, device: torch.device, dtype: torch.dtype) -> GemmConfig:
    """Drop pipeline stages until the config fits this device's shared memory."""
    if device.type != "cuda":
        return cfg
    limit = smem_limit(device.index if device.index is not None else torch.cuda.current_device())
    itemsize = torch.empty((), dtype=dtype).element_size()
    while cfg.num_stages > 1 and cfg.smem_bytes(itemsize) > limit:
        cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    return cfg


# --------------------------------------------------------------------------------------------
# The kernel.
# --------------------------------------------------------------------------------------------


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
):
    """Persistent grid: program p takes tiles p, p + NUM_PROGRAMS, ... of the expert-major
    tile sequence; after the experts, rows no expert covers are written as zeros."""
    pid = tl.program_id(0)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)

    tiles_before = 0  # tiles of the experts already walked (same count in every program)
    row_start = 0  # first row of the current expert
    for expert in range(E + 1):
        if expert < E:
            m_size = tl.load(m_sizes_ptr + expert)
            # mask by M: negative counts become 0, counts past the last row stop at M. Clamp
            # in the loaded width, then narrow: an int64 count past 2**31 (a stale value in a
            # recycled block) would otherwise truncate to an arbitrary int32.
            m_size = tl.minimum(tl.maximum(m_size, 0), tl.maximum(M - row_start, 0)).to(tl.int32)
        else:
            m_size = tl.maximum(M - row_start, 0)  # rows no expert covers: written as zeros
        num_tiles = tl.cdiv(m_size, BLOCK_M) * num_n_tiles
        # first tile of this expert that belongs to this program
        tile = tiles_before + (pid - tiles_before % NUM_PROGRAMS + NUM_PROGRAMS) % NUM_PROGRAMS
        while tile < tiles_before + num_tiles:
            local = tile - tiles_before
            tile_m = local // num_n_tiles
            tile_n = local % num_n_tiles
            first_row = row_start + tile_m * BLOCK_M
            row_mask = (first_row + offs_m) < (row_start + m_size)
            cols = tile_n * BLOCK_N + offs_n
            col_mask = cols < N
            # first_row * stride_ym passes 2**31 for M*N > 2**31 (1M tokens x 2048): int64 here
            y_tile = y_ptr + tl.cast(first_row, tl.int64) * stride_ym
            y_ptrs = y_tile + offs_m[:, None] * stride_ym + cols[None, :] * stride_yn
            out_mask = row_mask[:, None] & col_mask[None, :]
            if expert < E:
                # first_row * stride_xm passes 2**31 for M*K > 2**31
                x_ptrs = (
                    x_ptr
                    + tl.cast(first_row, tl.int64) * stride_xm
                    + offs_m[:, None] * stride_xm
                    + offs_k[None, :] * stride_xk
                )
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
                tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
            else:
                zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                tl.store(y_ptrs, zeros.to(y_ptr.dtype.element_ty), mask=out_mask)
            tile += NUM_PROGRAMS
        tiles_before += num_tiles
        row_start += m_size


def launch_grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    m_sizes: torch.Tensor,
    cfg: GemmConfig,
    num_programs: int,
) -> None:
    """Launch on the current device and stream. Callers hold the device guard."""
    m, k = x.shape
    e, n, _ = w.shape
    _grouped_gemm_kernel[(num_programs,)](
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
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


# --------------------------------------------------------------------------------------------
# The Hopper path: the same tile walk, tiles loaded by the bulk tensor copy engine (TMA).
# --------------------------------------------------------------------------------------------


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
    for expert in range(E + 1):
        if expert < E:
            m_size = tl.load(m_sizes_ptr + expert)
            m_size = tl.minimum(tl.maximum(m_size, 0), tl.maximum(M - row_start, 0)).to(tl.int32)
        else:
            m_size = tl.maximum(M - row_start, 0)  # rows no expert covers: written as zeros
        num_tiles = tl.cdiv(m_size, BLOCK_M) * num_n_tiles
        tile = tiles_before + (pid - tiles_before % NUM_PROGRAMS + NUM_PROGRAMS) % NUM_PROGRAMS
        while tile < tiles_before + num_tiles:
            local = tile - tiles_before
            tile_m = local // num_n_tiles
            tile_n = local % num_n_tiles
            first_row = row_start + tile_m * BLOCK_M
            n0 = tile_n * BLOCK_N
            if expert < E:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for k0 in range(0, K, BLOCK_K):
                    a = x_desc.load([first_row, k0])
                    if W_KN:
                        b = w_desc.load([expert * W_ROWS + k0, n0])
                        acc = tl.dot(a, b, acc)
                    else:
                        b = w_desc.load([expert * W_ROWS + n0, k0])
                        acc = tl.dot(a, b.T, acc)
                out = acc.to(y_ptr.dtype.element_ty)
            else:
                out = tl.zeros((BLOCK_M, BLOCK_N), dtype=y_ptr.dtype.element_ty)
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


#: (x_desc, w_desc, y_desc or None, W_ROWS, W_KN)
TmaPlan = tuple[Any, Any, Any, int, bool]


def _tma_ready(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def tensor_descriptor_class(x: torch.Tensor, cfg: GemmConfig) -> Any:
    """Triton's host-side TensorDescriptor when ``cfg`` asks for TMA and this call can have it
    (a Hopper-or-newer GPU, or the interpreter, and 16-bit operands); None otherwise."""
    if not cfg.tma or x.dtype not in (torch.bfloat16, torch.float16):
        return None
    if interpreting():
        if x.device.type != "cpu":
            return None
    elif x.device.type != "cuda" or capability(
        x.device.index if x.device.index is not None else torch.cuda.current_device()
    ) < (9, 0):
        return None
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # an older Triton: the pointer kernel serves
        return None
    return TensorDescriptor


def tma_plan(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor | None, cfg: GemmConfig) -> TmaPlan | None:
    """Tensor descriptors for the TMA kernel: (x_desc, w_desc, y_desc or None, W_ROWS, W_KN),
    or None when this call must take the pointer kernel (no TMA on the device, 32-bit or
    unaligned operands, a weight layout the 2-D view cannot describe, the interpreter)."""
    TensorDescriptor = tensor_descriptor_class(x, cfg)
    if TensorDescriptor is None:
        return None
    item = x.element_size()
    m, k = x.shape
    e, n, _ = w.shape

    def aligned(stride: int) -> bool:
        return (stride * item) % 16 == 0

    if x.stride(1) != 1 or not aligned(x.stride(0)) or not _tma_ready(x) or not _tma_ready(w):
        return None
    x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [cfg.block_m, cfg.block_k])
    if w.stride(2) == 1 and w.stride(0) == n * w.stride(1) and aligned(w.stride(1)):
        w_desc = TensorDescriptor(w, [e * n, k], [w.stride(1), 1], [cfg.block_n, cfg.block_k])
        w_rows, w_kn = n, False
    elif (
        w.stride(1) == 1 and w.stride(0) == k * w.stride(2) and aligned(w.stride(2)) and k % cfg.block_k == 0
    ):
        w_desc = TensorDescriptor(w, [e * k, n], [w.stride(2), 1], [cfg.block_k, cfg.block_n])
        w_rows, w_kn = k, True
    else:
        return None
    y_desc = None
    if y is not None and y.stride(1) == 1 and aligned(y.stride(0)) and _tma_ready(y):
        y_desc = TensorDescriptor(y, [m, n], [y.stride(0), 1], [cfg.block_m, cfg.block_n])
    return x_desc, w_desc, y_desc, w_rows, w_kn


def launch_grouped_gemm_tma(
    plan: TmaPlan,
    y: torch.Tensor,
    m_sizes: torch.Tensor,
    m: int,
    n: int,
    k: int,
    e: int,
    cfg: GemmConfig,
    num_programs: int,
) -> None:
    """Launch the TMA kernel on the current device and stream. Callers hold the device guard."""
    x_desc, w_desc, y_desc, w_rows, w_kn = plan
    _grouped_gemm_tma_kernel[(num_programs,)](
        x_desc,
        w_desc,
        y,
        y_desc,
        m_sizes,
        m,
        n,
        k,
        e,
        w_rows,
        y.stride(0),
        y.stride(1),
        NUM_PROGRAMS=num_programs,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        W_KN=w_kn,
        Y_TMA=y_desc is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


@triton.jit
def _grouped_gemm_flat_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    m_sizes_ptr,
    x_desc,  # USE_TMA: as in _grouped_gemm_tma_kernel; otherwise unused
    w_desc,
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
):
    """The same tiles as ``_grouped_gemm_kernel`` (expert-major, round-robin over programs), walked
    as ONE loop over this program's (tile, k-step) pairs. Expert row bounds come from a
    vector prefix sum of the clamped counts (negative counts are 0, nothing passes M: the
    bounds of the sequential walk); slot E holds the rows no expert covers, written as zeros
    (its w loads are masked off, or past the last expert where the descriptor reads zeros)."""
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
    for _ in range(0, my_tiles * k_tiles):
        ki = tl.where(ki == k_tiles - 1, 0, ki + 1)
        if ki == 0:
            tile += NUM_PROGRAMS
            expert = tl.sum((tile_incl <= tile).to(tl.int32), 0)
            here = offs_e == expert
            local = tile - tl.sum(tl.where(here, tile_excl, 0), 0)
            first_row = tl.sum(tl.where(here, starts, 0), 0) + (local // num_n_tiles) * BLOCK_M
            row_end = tl.sum(tl.where(here, ends, 0), 0)
            n0 = (local % num_n_tiles) * BLOCK_N
        k0 = ki * BLOCK_K
        if USE_TMA:
            a = x_desc.load([first_row, k0])
            if W_KN:
                b = w_desc.load([expert * W_ROWS + k0, n0])
                acc = tl.dot(a, b, acc)
            else:
                b = w_desc.load([expert * W_ROWS + n0, k0])
                acc = tl.dot(a, b.T, acc)
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


def launch_grouped_gemm_flat(
    x: torch.Tensor,
    w: torch.Tensor,
    y: torch.Tensor,
    m_sizes: torch.Tensor,
    cfg: GemmConfig,
    num_programs: int,
    plan: TmaPlan | None,
) -> None:
    """Launch the flattened kernel (TMA loads when ``plan`` is given). Callers hold the guard."""
    m, k = x.shape
    e, n, _ = w.shape
    x_desc, w_desc, _, w_rows, w_kn = plan if plan is not None else (None, None, None, 0, False)
    _grouped_gemm_flat_kernel[(num_programs,)](
        x,
        w,
        y,
        m_sizes,
        x_desc,
        w_desc,
        m,
        n,
        k,
        e,
        w_rows,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        y.stride(0),
        y.stride(1),
        num_programs,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        E_POW2=triton.next_power_of_2(e + 1),
        USE_TMA=plan is not None,
        W_KN=w_kn,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


def kernel_path(x: torch.Tensor, w: torch.Tensor, cfg: GemmConfig) -> str:
    """Which kernel a call with this config takes: "tma" or "pointer", "+flat" (for reports)."""
    path = "tma" if tma_plan(x, w, None, cfg) is not None else "pointer"
    return path + ("+flat" if cfg.flat else "")


def grid_size(m: int, n: int, e: int, cfg: GemmConfig, device: torch.device) -> int:
    """Programs of the persistent grid: at most one per SM of *this* device, never more than
    the tiles there can be (each expert may add one partial row tile)."""
    max_tiles = (triton.cdiv(m, cfg.block_m) + e + 1) * triton.cdiv(n, cfg.block_n)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return max(1, min(persistent_sms(index) * max(1, cfg.programs_per_sm), max_tiles))
    return max(1, min(4, max_tiles))  # interpreter: a few programs exercise the tile walk


def moe_grouped_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    m_sizes: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    check_routing: bool = False,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """``y[m] = x[m] @ w[e(m)].T`` for rows sorted by expert. See the module docstring.

    ``check_routing=True`` also verifies ``m_sizes`` (no negatives, sums to M); it reads
    m_sizes on the host and so synchronizes: off by default.
    """
    check_operands(x, w, m_sizes)
    m, k = x.shape
    e, n, _ = w.shape
    if check_routing:
        check_routing_sizes(m_sizes, m)
    out_dtype = out_dtype or x.dtype
    with device_guard(x.device):
        y = torch.empty((m, n), device=x.device, dtype=out_dtype)
        if m == 0 or n == 0:
            return y
        if k == 0:
            return y.zero_()
        op = "dx" if w.stride(1) == 1 and w.stride(2) != 1 else "forward"  # dx passes w.transpose(1, 2)
        cfg = config or pick_config(m, n, k, e, x.device, x.dtype, op=op)
        programs = grid_size(m, n, e, cfg, x.device)
        plan = tma_plan(x, w, y, cfg)
        if cfg.flat:
            launch_grouped_gemm_flat(x, w, y, m_sizes, cfg, programs, plan)
        elif plan is not None:
            launch_grouped_gemm_tma(plan, y, m_sizes, m, n, k, e, cfg, programs)
        else:
            launch_grouped_gemm(x, w, y, m_sizes, cfg, programs)
    return y


def moe_grouped_gemm_torch(
    x: torch.Tensor,
    w: torch.Tensor,
    m_sizes: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    check_routing: bool = False,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """The slow, obvious twin: a loop over experts in float32 (float64 for float64 operands,
    so it can be the float64 reference of the tests), same masking semantics."""
    del config  # accepted for signature parity
    if check_routing:
        check_routing_sizes(m_sizes, x.shape[0])
    m = x.shape[0]
    n = w.shape[1]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = torch.zeros((m, n), device=x.device, dtype=acc)
    row = 0
    for expert, size in enumerate(_clamped_sizes(m_sizes, m)):
        if size:
            y[row : row + size] = x[row : row + size].to(acc) @ w[expert].to(acc).T
        row += size
    return y.to(out_dtype or x.dtype)


def _clamped_sizes(m_sizes: torch.Tensor, m: int) -> Iterator[int]:
    """m_sizes as the kernel reads them: negatives are 0, nothing runs past row M."""
    row = 0
    for size in m_sizes.detach().to("cpu", torch.int64).tolist():
        size = min(max(int(size), 0), max(m - row, 0))
        yield size
        row += size
