"""Grouped GEMM for fused MoE: ``y[m] = x[m] @ w[e(m)].T`` with rows sorted by expert.

``moe_grouped_gemm(x, w, m_sizes)`` is the signature of the public Qwen3-MoE fused kernels:

* ``x``: (M, K), rows sorted by expert; the first ``m_sizes[0]`` rows belong to expert 0, ...
* ``w``: (E, N, K), one (N, K) weight per expert (any strides: ``w.transpose(1, 2)`` gives dx)
* ``m_sizes``: (E,) int32 or int64 row counts per expert, contiguous (a strided view is refused)

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
This module is the host side (checks, config choice, launchers, launch plans: what a call's
shapes, strides, dtypes, alignment and device decide is worked out once per such combination
and cached, and the launch goes through ``kernels/launch.py``; nothing is read on the host); the
Triton kernels themselves are in ``kernels/_details/grouped_gemm_kernels.py``.
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

from qmoe_doctor.core.launch_configs import GEMM_CONFIGS, TileConfig, gemm_fallback
from qmoe_doctor.kernels._details.grouped_gemm_kernels import (
    _grouped_gemm_flat_kernel,
    _grouped_gemm_kernel,
    _grouped_gemm_tail_kernel,
    _grouped_gemm_tma_kernel,
)
from qmoe_doctor.kernels.launch import Launch, rebase

__all__ = [
    "GemmConfig",
    "PLAN_LIMIT",
    "clear_plans",
    "grouped_gemm_call",
    "plan_stats",
    "moe_grouped_gemm",
    "moe_grouped_gemm_torch",
    "pick_config",
    "check_dx_shapes",
    "check_operands",
    "check_sizes_contiguous",
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
    elsewhere the resident Triton kernel of the same tiles serves); ``rows_first`` (forward and
    dx; name suffix ``-mf``): an expert's row tiles come before its column tiles in the tile
    order, so neighbouring programs share a weight tile (the larger operand) and an expert's
    row tiles run in the same round of the persistent programs; ``tail`` (forward and dx, with
    ``tma``, not ``flat``; name suffix ``-tN``): an expert that ends with at most ``tail`` rows
    past a full row tile computes them in that tile, from the same weight tile (one row tile
    fewer; ``kernels/_details/grouped_gemm_kernels.py``, ``_grouped_gemm_tail_kernel``); ``ws`` (dw
    only, Hopper, with ``tma``; name suffix ``-ws``): the warp-specialized Gluon kernel of
    ``kernels/dw_ws.py``, a loader warp running ahead across tiles while one warpgroup multiplies
    and stores (elsewhere the Triton TMA kernel of the same tiles serves)."""

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
    rows_first: bool = False
    tail: int = 0
    ws: bool = False

    @classmethod
    def from_tile(cls, tile: TileConfig) -> GemmConfig:
        """The plain kernel of a fallback table entry (``qmoe_doctor.core.launch_configs``)."""
        return cls(*tile)

    @property
    def tile(self) -> TileConfig:
        """The five numbers every launch takes (the variant switches left out)."""
        return TileConfig(self.block_m, self.block_n, self.block_k, self.num_warps, self.num_stages)

    @property
    def name(self) -> str:
        text = self.tile.name
        if self.programs_per_sm != 1:
            text += f"-p{self.programs_per_sm}"
        text += ("-tma" if self.tma else "") + ("-flat" if self.flat else "") + ("-mf" if self.rows_first else "")
        text += f"-t{self.tail}" if self.tail else ""
        text += f"-r{'x' if self.resident_x else ''}{self.resident}" if self.resident else ""
        return text + (f"-ov{self.overlap}" if self.overlap else "") + ("-ws" if self.ws else "")

    def smem_bytes(self, itemsize: int) -> int:
        """Shared memory the software pipeline asks for: one x tile and one w tile per stage
        (and the tail's x rows with ``tail``)."""
        return self.tile.smem_bytes(itemsize) + self.tail * self.block_k * itemsize * self.num_stages


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


#: The most shared memory one block may ask for on an H100 or H200 (shared_memory_per_block_optin).
HOPPER_BLOCK_SMEM = 232448


@functools.cache
def smem_limit(device_index: int) -> int:
    props = torch.cuda.get_device_properties(device_index)
    return int(getattr(props, "shared_memory_per_block_optin", 0) or HOPPER_BLOCK_SMEM)


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


def check_sizes_contiguous(m_sizes: torch.Tensor) -> None:
    """Every kernel reads m_sizes[e] at m_sizes_ptr + e: a strided view (``t[:, 0]``) would be
    read as other numbers, so it is refused, never read wrong."""
    if m_sizes.shape[0] > 1 and m_sizes.stride(0) != 1:
        raise ValueError(
            f"m_sizes must be contiguous (stride 1), got a view with stride {m_sizes.stride(0)}; "
            "pass m_sizes.contiguous()"
        )


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
    check_sizes_contiguous(m_sizes)
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


def check_dx_shapes(dy: torch.Tensor, w: torch.Tensor) -> None:
    """dx's own shape check, so the message speaks of dy and w, not of the transposed view the
    kernel sees."""
    if isinstance(dy, torch.Tensor) and isinstance(w, torch.Tensor) and dy.dim() == 2 and w.dim() == 3:
        if dy.shape[1] != w.shape[1]:
            raise ValueError(
                f"dy has N={dy.shape[1]} columns but w is (E, N, K)={tuple(w.shape)}: N must match"
            )


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
# Config choice: the device's measured table (kernels/tuning.py), else the fallback table
# (qmoe_doctor.core.launch_configs), pruned against the device's shared memory (no autotune at
# run time: a 1000-config autotune took 49 s for one shape on an H200).
# --------------------------------------------------------------------------------------------


def pick_config(
    m: int, n: int, k: int, e: int, device: torch.device, dtype: torch.dtype, *, op: str = "forward"
) -> GemmConfig:
    """The launch config of one call: the device's measured table (``kernels/tuning.py``
    says which one), the fallback table (``core.launch_configs``) where none applies; pruned to
    the device's shared memory either way. ``op`` is "forward" or "dx" (the forward kernel on
    w.T)."""
    if device.type != "cuda":
        return GemmConfig.from_tile(GEMM_CONFIGS["interpreter"])
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _pick_config(m, n, k, e, index, dtype, op)


@functools.lru_cache(maxsize=4096)
def _pick_config(m: int, n: int, k: int, e: int, index: int, dtype: torch.dtype, op: str) -> GemmConfig:
    """pick_config per (shape, device index, dtype, op), cached."""
    from qmoe_doctor.kernels import tuning

    avg_rows = max(1, m // max(1, e))
    device = torch.device("cuda", index)
    cfg = tuning.lookup(op, m / max(1, e), n, k, tuning.device_facts(index))
    if cfg is None:
        cfg = GemmConfig.from_tile(gemm_fallback(avg_rows, n))
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
# Kernel arguments (the kernels: kernels/_details/grouped_gemm_kernels.py). Each builder returns
# every argument but the tensors, by the kernel's parameter names; the launchers below and the
# launch plans further down share them.
# --------------------------------------------------------------------------------------------

Strides = tuple[int, ...]


def _tiles(cfg: GemmConfig) -> dict[str, int]:
    return {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "ROWS_FIRST": cfg.rows_first}


def _options(cfg: GemmConfig) -> dict[str, int]:
    return {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def _pointer_args(
    sizes: tuple[int, int, int, int], xs: Strides, ws: Strides, ys: Strides, cfg: GemmConfig, programs: int
) -> dict[str, Any]:
    m, n, k, e = sizes
    return {
        "M": m, "N": n, "K": k, "E": e,
        "stride_xm": xs[0], "stride_xk": xs[1],
        "stride_we": ws[0], "stride_wn": ws[1], "stride_wk": ws[2],
        "stride_ym": ys[0], "stride_yn": ys[1],
        "NUM_PROGRAMS": programs, **_tiles(cfg),
    }  # fmt: skip


def _tma_args(
    sizes: tuple[int, int, int, int], ys: Strides, w_rows: int, w_kn: bool, y_tma: bool, cfg: GemmConfig, programs: int
) -> dict[str, Any]:
    m, n, k, e = sizes
    return {
        "M": m, "N": n, "K": k, "E": e, "W_ROWS": w_rows,
        "stride_ym": ys[0], "stride_yn": ys[1],
        "NUM_PROGRAMS": programs, "W_KN": w_kn, "Y_TMA": y_tma, **_tiles(cfg),
    }  # fmt: skip


def _tail_args(
    sizes: tuple[int, int, int, int], ys: Strides, w_rows: int, w_kn: bool, cfg: GemmConfig, programs: int
) -> dict[str, Any]:
    m, n, k, e = sizes
    return {
        "M": m, "N": n, "K": k, "E": e, "W_ROWS": w_rows,
        "stride_ym": ys[0], "stride_yn": ys[1],
        "NUM_PROGRAMS": programs, "TAIL": cfg.tail, "W_KN": w_kn, **_tiles(cfg),
    }  # fmt: skip


def _flat_args(
    sizes: tuple[int, int, int, int],
    xs: Strides,
    ws: Strides,
    ys: Strides,
    w_rows: int,
    w_kn: bool,
    use_tma: bool,
    cfg: GemmConfig,
    programs: int,
) -> dict[str, Any]:
    args = _pointer_args(sizes, xs, ws, ys, cfg, programs)
    args.update(W_ROWS=w_rows, E_POW2=triton.next_power_of_2(sizes[3] + 1), USE_TMA=use_tma, W_KN=w_kn)
    args["TAIL"] = cfg.tail if use_tma else 0  # without TMA a tail config takes the pointer kernel's tiles
    return args


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
    args = _pointer_args((m, n, k, e), x.stride(), w.stride(), y.stride(), cfg, num_programs)
    # launches on the current device by contract (callers hold the guard): our calls go through
    # the guarded launch plans; the specimens call this unguarded to plant their fault
    _grouped_gemm_kernel[(num_programs,)](x, w, y, m_sizes, **args, **_options(cfg))  # qmoe-doctor: ignore[unguarded-launch]


# --------------------------------------------------------------------------------------------
# The Hopper path: the same tile walk, tiles loaded by the bulk tensor copy engine (TMA).
# --------------------------------------------------------------------------------------------


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


def tail_descriptor(x: torch.Tensor, cfg: GemmConfig) -> Any:
    """x's descriptor for the tail kernel's tail rows: blocks of (tail, BLOCK_K). Only where
    ``tma_plan`` gave a plan (so the class is there and x is aligned for it)."""
    m, k = x.shape
    return tensor_descriptor_class(x, cfg)(x, [m, k], [x.stride(0), 1], [cfg.tail, cfg.block_k])


def kernel_path(
    x: torch.Tensor,
    w: torch.Tensor,
    m_sizes: torch.Tensor,
    *,
    transposed: bool = False,
    out_dtype: torch.dtype | None = None,
    config: GemmConfig | None = None,
) -> str:
    """Which kernel ``moe_grouped_gemm`` (``moe_grouped_gemm_dx`` with ``transposed``: x is dy,
    w the forward's weight) takes for these operands and ``config`` (for reports): the path of
    the launch plan the call itself uses ("tma+flat+tail", "tma+flat", "tma+tail", "tma",
    "pointer+flat", "pointer"; "" where nothing launches: M, N or K == 0). Without a TMA plan a tail config takes
    the pointer kernel of the same tiles. Made (and kept) once per call shape like the call's own
    plan; launches nothing."""
    return _gemm_plan(x, w, m_sizes, out_dtype, config, transposed).path


def grid_size(m: int, n: int, e: int, cfg: GemmConfig, device: torch.device) -> int:
    """Programs of the persistent grid: at most one per SM of *this* device, never more than
    the tiles there can be (each expert may add one partial row tile)."""
    max_tiles = int((triton.cdiv(m, cfg.block_m) + e + 1) * triton.cdiv(n, cfg.block_n))
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return max(1, min(persistent_sms(index) * max(1, cfg.programs_per_sm), max_tiles))
    return max(1, min(4, max_tiles))  # interpreter: a few programs exercise the tile walk


# --------------------------------------------------------------------------------------------
# Launch plans: everything a call's shapes, strides, dtypes, alignment and device decide, made
# once per such combination and kept (per device: the device is part of the key). A call then
# checks nothing it already checked, picks nothing, builds one output and launches.
# --------------------------------------------------------------------------------------------

#: Plans kept per process (a few hundred bytes each); past this many the cache starts over, so a
#: process that sees ever new shapes (dynamic token counts) stays bounded.
PLAN_LIMIT = 4096


@dataclass(slots=True)
class PlanStats:
    """Plan lookups since the process started (tests and tools read them)."""

    hits: int = 0
    misses: int = 0


plan_stats = PlanStats()
_PLANS: dict[tuple[Any, ...], _GemmPlan] = {}


def clear_plans() -> None:
    """Forget every launch plan (a test that changes the config table, a tuning run)."""
    _PLANS.clear()
    _pick_config.cache_clear()


def _operand_key(t: torch.Tensor) -> tuple[Any, ...]:
    """What a plan depends on of one operand: everything Triton specialises a pointer argument
    on and every integer argument comes from (shape, strides), dtype, device, 16-byte alignment."""
    return (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


@dataclass(frozen=True, slots=True)
class _GemmPlan:
    """One forward-kernel call shape: ``run`` allocates the output and launches.

    ``sources`` says which of (x, w, y, m_sizes) fills each tensor argument of ``launch`` (a
    descriptor argument takes its tensor: the launch holds the descriptor's template)."""

    m: int
    n: int
    device: torch.device
    guard_index: int  # the device the launch guards; -1: none (CPU tensors)
    out_dtype: torch.dtype
    zero_only: bool  # K == 0: y is zeros, nothing launches
    launch: Launch | None  # None: nothing launches (M == 0 or N == 0, or K == 0)
    sources: tuple[int, ...] = ()
    config: GemmConfig | None = None
    path: str = ""

    def run(self, x: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor) -> torch.Tensor:
        # y on the operands' device, x's (its allocation follows that device's current stream);
        # the launch holds that device's guard (kernels/launch.py). new_empty without a dtype
        # where y takes x's: the cheapest allocation call (0.2-0.7 us less than torch.empty's
        # keywords, of a 25 us host budget)
        shape = (self.m, self.n)
        y = x.new_empty(shape) if self.out_dtype == x.dtype else x.new_empty(shape, dtype=self.out_dtype)
        if self.launch is None:
            return y.zero_() if self.zero_only else y
        values = (x, w, y, m_sizes)
        self.launch(*[values[i] for i in self.sources])
        return y


def _gemm_plan(
    x: torch.Tensor,
    w: torch.Tensor,
    m_sizes: torch.Tensor,
    out_dtype: torch.dtype | None,
    config: GemmConfig | None,
    transposed: bool,
) -> _GemmPlan:
    """The plan of this call, made on the first call of its kind (operands checked then: a
    later call with the same key passes the same checks)."""
    try:
        key = (
            _operand_key(x), _operand_key(w), _operand_key(m_sizes), out_dtype, config, transposed, _SM_RESERVE[0]
        )  # fmt: skip
    except AttributeError:  # not a tensor: check_operands says which argument
        key = None
    plan = _PLANS.get(key) if key is not None else None
    if plan is not None:
        plan_stats.hits += 1
        return plan
    plan_stats.misses += 1
    plan = _make_gemm_plan(x, w, m_sizes, out_dtype, config, transposed)
    if key is not None:
        if len(_PLANS) >= PLAN_LIMIT:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def _make_gemm_plan(
    x: torch.Tensor,
    w: torch.Tensor,
    m_sizes: torch.Tensor,
    out_dtype: torch.dtype | None,
    config: GemmConfig | None,
    transposed: bool,
) -> _GemmPlan:
    if transposed:
        check_dx_shapes(x, w)
    w_view = w.transpose(1, 2) if transposed and isinstance(w, torch.Tensor) and w.dim() == 3 else w
    check_operands(x, w_view, m_sizes)  # dx's messages name x too, as they always have
    m, k = x.shape
    e, n, _ = w_view.shape
    device = x.device
    guard = (device.index if device.index is not None else torch.cuda.current_device()) if device.type == "cuda" else -1
    out = out_dtype or x.dtype
    base = functools.partial(_GemmPlan, m=m, n=n, device=device, guard_index=guard, out_dtype=out)
    if m == 0 or n == 0 or k == 0:
        return base(zero_only=k == 0 and m * n > 0, launch=None)
    # dx passes w.transpose(1, 2): the table has its own entries for that layout
    op = "dx" if w_view.stride(1) == 1 and w_view.stride(2) != 1 else "forward"
    with device_guard(device):
        cfg = config or pick_config(m, n, k, e, device, x.dtype, op=op)
        programs = grid_size(m, n, e, cfg, device)
        y = torch.empty((m, n), device=device, dtype=out)  # the layout every call's y has
        plan = tma_plan(x, w_view, y, cfg)
    sizes = (m, n, k, e)
    xs, ws, ys = x.stride(), w_view.stride(), y.stride()
    opts = _options(cfg)
    if cfg.flat:
        x_desc, w_desc, _, w_rows, w_kn = plan if plan is not None else (None, None, None, 0, False)
        args = _flat_args(sizes, xs, ws, ys, w_rows, w_kn, plan is not None, cfg, programs)
        names = ["x_ptr", "w_ptr", "y_ptr", "m_sizes_ptr"]
        descriptors: dict[str, Any] = {}
        if plan is not None:
            names += ["x_desc", "w_desc"]
            descriptors = {"x_desc": _template(x_desc), "w_desc": _template(w_desc)}
            if args["TAIL"]:
                names.append("xt_desc")
                descriptors["xt_desc"] = _template(tail_descriptor(x, cfg))
            else:
                args["xt_desc"] = None
        else:
            args.update(x_desc=None, w_desc=None, xt_desc=None)
        launch = Launch(_grouped_gemm_flat_kernel, programs, args, names, opts, device_index=guard, descriptors=descriptors)
        path = ("tma+flat+tail" if args["TAIL"] else "tma+flat") if plan is not None else "pointer+flat"
        return base(zero_only=False, launch=launch, sources=(0, 1, 2, 3, 0, 1, 0)[: len(names)], config=cfg, path=path)
    if plan is not None and cfg.tail:
        x_desc, w_desc, _, w_rows, w_kn = plan
        args = _tail_args(sizes, ys, w_rows, w_kn, cfg, programs)
        names = ["x_desc", "xt_desc", "w_desc", "y_ptr", "m_sizes_ptr"]
        descriptors = {
            "x_desc": _template(x_desc), "xt_desc": _template(tail_descriptor(x, cfg)), "w_desc": _template(w_desc)
        }  # fmt: skip
        launch = Launch(_grouped_gemm_tail_kernel, programs, args, names, opts, device_index=guard, descriptors=descriptors)
        return base(zero_only=False, launch=launch, sources=(0, 0, 1, 2, 3), config=cfg, path="tma+tail")
    if plan is not None:
        x_desc, w_desc, y_desc, w_rows, w_kn = plan
        args = _tma_args(sizes, ys, w_rows, w_kn, y_desc is not None, cfg, programs)
        names = ["x_desc", "w_desc", "y_ptr", "m_sizes_ptr"]
        sources = [0, 1, 2, 3]
        descriptors = {"x_desc": _template(x_desc), "w_desc": _template(w_desc)}
        if y_desc is not None:
            names.append("y_desc")
            sources.append(2)
            descriptors["y_desc"] = _template(y_desc)
        else:
            args["y_desc"] = None
        launch = Launch(_grouped_gemm_tma_kernel, programs, args, names, opts, device_index=guard, descriptors=descriptors)
        return base(zero_only=False, launch=launch, sources=tuple(sources), config=cfg, path="tma")
    args = _pointer_args(sizes, xs, ws, ys, cfg, programs)
    names = ["x_ptr", "w_ptr", "y_ptr", "m_sizes_ptr"]
    launch = Launch(_grouped_gemm_kernel, programs, args, names, opts, device_index=guard)
    return base(zero_only=False, launch=launch, sources=(0, 1, 2, 3), config=cfg, path="pointer")


def _template(desc: Any) -> Any:
    """A descriptor made at plan time, without its tensor (a plan must not keep the first
    call's activations alive): every call puts its own in (``launch.rebase``)."""
    return rebase(desc, None)


def grouped_gemm_call(
    x: torch.Tensor,
    w: torch.Tensor,
    m_sizes: torch.Tensor,
    *,
    transposed: bool,
    out_dtype: torch.dtype | None = None,
    check_routing: bool = False,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """``moe_grouped_gemm`` (``transposed=False``) and dx (``transposed=True``: the forward
    kernel on ``w.transpose(1, 2)``, read through swapped strides, no view made per call)."""
    plan = _gemm_plan(x, w, m_sizes, out_dtype, config, transposed)
    if check_routing:
        check_routing_sizes(m_sizes, plan.m)
    return plan.run(x, w, m_sizes)


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
    m_sizes on the host and so synchronizes: off by default. Nothing else reads a tensor on the
    host: the call is a cached launch plan, an output and a launch.
    """
    return grouped_gemm_call(
        x, w, m_sizes, transposed=False, out_dtype=out_dtype, check_routing=check_routing, config=config
    )


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
