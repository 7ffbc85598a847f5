"""Backward of the grouped GEMM, and the autograd function that ties forward and backward.

With ``y[m] = x[m] @ w[e(m)].T`` (rows sorted by expert, see ``grouped_gemm``):

* ``dx[m] = dy[m] @ w[e(m)]``: the forward kernel on ``w.transpose(1, 2)`` (it takes strides);
* ``dw[e] = dy_e.T @ x_e``: a Triton kernel of its own. Program p of a persistent grid takes
  tiles p, p + NUM_PROGRAMS, ... of the (expert, n-tile, k-tile) sequence and, for each, walks
  that expert's rows in BLOCK_M chunks. The rows of each expert come from an exclusive cumsum of
  ``m_sizes`` made on x's device inside the device guard, clamped to M exactly as the forward
  clamps them, so a wrong ``m_sizes`` can never read outside dy or x. Empty experts give zero dw.
  Variants, chosen per shape by the measured config table (``kernels/tuning.py``): copy-engine
  (TMA) loads, one flattened loop, and the *resident* kernel (``-rN`` / ``-rxN`` configs), which
  keeps one operand of an expert in registers while it walks every tile of the other
  (``_grouped_gemm_dw_resident_kernel``).

``moe_fused_linear(x, w, m_sizes)`` is the autograd function (no gradient for ``m_sizes``).
Each kernel has its slow, obvious twin: ``moe_grouped_gemm_dx_torch``, ``moe_grouped_gemm_dw_torch``.
The Triton kernels themselves are in ``kernels/_details/backward_kernels.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import triton

from qmoe_doctor.core.launch_configs import GEMM_CONFIGS, dw_fallback
from qmoe_doctor.kernels._details.backward_kernels import (
    _grouped_gemm_dw_flat_kernel,
    _grouped_gemm_dw_kernel,
    _grouped_gemm_dw_resident_kernel,
    _grouped_gemm_dw_tma_kernel,
    _row_bounds_kernel,
)
from qmoe_doctor.kernels.dw_overlap import (
    dw_overlap_kernel,
    dw_overlap_plan,
    dw_overlap_smem_bytes,
    overlap_args,
    overlap_halves,
)
from qmoe_doctor.kernels.dw_ws import (
    dw_ws_kernel,
    dw_ws_plan,
    dw_ws_smem_bytes,
    ws_args,
    ws_fallback,
    ws_options,
)
from qmoe_doctor.kernels.grouped_gemm import (
    PLAN_LIMIT,
    GemmConfig,
    _clamped_sizes,
    _operand_key,
    _tma_ready,
    check_dx_shapes,
    check_routing_sizes,
    check_sizes_contiguous,
    device_guard,
    grouped_gemm_call,
    interpreting,
    moe_grouped_gemm,
    moe_grouped_gemm_torch,
    persistent_sms,
    plan_stats,
    reserved_sms,
    sm_reserve,
    smem_limit,
    tensor_descriptor_class,
)
from qmoe_doctor.kernels.launch import Launch, rebase

__all__ = [
    "FOLDED_MAX_EXPERTS",
    "GroupedGemm",
    "check_dw_operands",
    "deferred_weight_grads",
    "dw_grid_size",
    "dw_kernel_path",
    "dw_tma_plan",
    "launch_grouped_gemm_dw",
    "moe_fused_linear",
    "moe_grouped_gemm_dw",
    "moe_grouped_gemm_dw_torch",
    "moe_grouped_gemm_dx",
    "moe_grouped_gemm_dx_torch",
    "pick_dw_config",
    "row_bounds",
    "row_bounds_torch",
]


class GroupedGemm(Protocol):
    """The seam for a forward kernel: the signature of ``moe_grouped_gemm``."""

    def __call__(self, x: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor, /) -> torch.Tensor: ...


_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# --------------------------------------------------------------------------------------------
# dx: the forward kernel on the transposed weights.
# --------------------------------------------------------------------------------------------


def moe_grouped_gemm_dx(
    dy: torch.Tensor,
    w: torch.Tensor,
    m_sizes: torch.Tensor,
    *,
    check_routing: bool = False,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """``dx[m] = dy[m] @ w[e(m)]``: dy (M, N), w (E, N, K), m_sizes (E,) -> dx (M, K).

    Rows ``m_sizes`` does not cover are zero; the device guard, buffers and masking are the
    forward's (it is the forward kernel on ``w.transpose(1, 2)``, read through swapped strides).
    """
    return grouped_gemm_call(dy, w, m_sizes, transposed=True, check_routing=check_routing, config=config)


def moe_grouped_gemm_dx_torch(
    dy: torch.Tensor,
    w: torch.Tensor,
    m_sizes: torch.Tensor,
    *,
    check_routing: bool = False,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """The slow, obvious twin of ``moe_grouped_gemm_dx``."""
    check_dx_shapes(dy, w)
    return moe_grouped_gemm_torch(dy, w.transpose(1, 2), m_sizes, check_routing=check_routing, config=config)


# --------------------------------------------------------------------------------------------
# dw: its own kernels (kernels/_details/backward_kernels.py); checks, config, launchers here.
# --------------------------------------------------------------------------------------------


def check_dw_operands(dy: torch.Tensor, x: torch.Tensor, m_sizes: torch.Tensor) -> None:
    """Validate shapes, dtypes and devices of a dw call (no synchronization)."""
    for name, t in (("dy", dy), ("x", x), ("m_sizes", m_sizes)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dy.dim() != 2:
        raise ValueError(f"dy must be 2-D (M, N), got shape {tuple(dy.shape)}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (M, K), got shape {tuple(x.shape)}")
    if m_sizes.dim() != 1:
        raise ValueError(f"m_sizes must be 1-D (E,), got shape {tuple(m_sizes.shape)}")
    check_sizes_contiguous(m_sizes)
    if dy.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"dy must be bfloat16, float16 or float32, got {dy.dtype}")
    if x.dtype != dy.dtype:
        raise TypeError(f"x has dtype {x.dtype} but dy has {dy.dtype}; they must match")
    if m_sizes.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"m_sizes must be int32 or int64, got {m_sizes.dtype}")
    if dy.shape[0] != x.shape[0]:
        raise ValueError(f"dy has M={dy.shape[0]} rows but x has M={x.shape[0]}: they must match")
    devices = {t.device for t in (dy, x, m_sizes)}
    if len(devices) > 1:
        placed = ", ".join(f"{n} on {t.device}" for n, t in (("dy", dy), ("x", x), ("m_sizes", m_sizes)))
        raise ValueError(f"operands are on different devices ({placed}); move them to one device")
    if dy.device.type == "cpu" and not interpreting():
        raise ValueError(
            "dy is a CPU tensor: the Triton kernel needs CUDA tensors "
            "(or TRITON_INTERPRET=1 to run it on the CPU); use moe_grouped_gemm_dw_torch for CPU"
        )
    if dy.device.type not in ("cuda", "cpu"):
        raise ValueError(f"dy is on {dy.device}; only CUDA devices are supported")


def row_bounds(m_sizes: torch.Tensor, m: int) -> torch.Tensor:
    """(E + 1,) int64 on m_sizes' device: expert e owns rows [bounds[e], bounds[e + 1]).

    The same clamping as the forward's tile walk: negative counts are 0, nothing passes M
    (``min(cumsum, M)``). int64: the cumsum of int32 counts can pass 2**31. No synchronization.
    One small Triton launch (``_row_bounds_kernel``): the six torch ops of ``row_bounds_torch``
    cost 56 us of host time per dw call on an H200 host, a third of the whole call.
    """
    with device_guard(m_sizes.device):
        return _bounds_plan(m_sizes, m)(m_sizes)


class _BoundsPlan:
    """``row_bounds`` of one (m_sizes layout, M): its Triton launch, or the torch twin."""

    __slots__ = ("device", "e", "launch", "m")

    def __init__(self, m_sizes: torch.Tensor, m: int) -> None:
        e = m_sizes.shape[0]
        self.e, self.m, self.device = e, m, m_sizes.device
        on_triton = m_sizes.device.type == "cuda" or (interpreting() and m_sizes.device.type == "cpu")
        self.launch: Launch | None = None
        if on_triton and e <= _BOUNDS_MAX_EXPERTS:
            index = _guard_index(m_sizes.device)
            self.launch = Launch(
                _row_bounds_kernel,
                1,
                {"E": e, "M": m, "BLOCK_E": triton.next_power_of_2(max(e, 1))},
                ("sizes_ptr", "bounds_ptr"),
                {"num_warps": 4},
                device_index=index,
            )

    def __call__(self, m_sizes: torch.Tensor) -> torch.Tensor:
        """The bounds on m_sizes' device (the launch holds its guard)."""
        if self.launch is None:
            return row_bounds_torch(m_sizes, self.m)
        bounds = torch.empty(self.e + 1, dtype=torch.int64, device=self.device)
        self.launch(m_sizes, bounds)
        return bounds


_BOUNDS_PLANS: dict[tuple[Any, ...], _BoundsPlan] = {}


def _bounds_plan(m_sizes: torch.Tensor, m: int) -> _BoundsPlan:
    key = (_operand_key(m_sizes), m)
    plan = _BOUNDS_PLANS.get(key)
    if plan is None:
        plan = _BoundsPlan(m_sizes, m)
        if len(_BOUNDS_PLANS) >= PLAN_LIMIT:
            _BOUNDS_PLANS.clear()
        _BOUNDS_PLANS[key] = plan
    return plan


def _guard_index(device: torch.device) -> int:
    """The device guard's index of ``device``; -1 for CPU tensors (no guard)."""
    if device.type != "cuda":
        return -1
    return device.index if device.index is not None else torch.cuda.current_device()


def row_bounds_torch(m_sizes: torch.Tensor, m: int) -> torch.Tensor:
    """``row_bounds`` in torch ops: its twin, and its path for more than 16384 experts."""
    ends = torch.cumsum(m_sizes.to(torch.int64).clamp_min(0), dim=0).clamp_max(m)
    return torch.cat([ends.new_zeros(1), ends])


_BOUNDS_MAX_EXPERTS = 16384  # one program holds every count

# Up to this many experts the Triton dw kernels sum the row bounds from m_sizes themselves (a
# vector of the next power of two, once per program): no launch before dw's, which cost 11-22 us
# of host time per call. Past it that vector would cost registers (and a reduction over it per
# tile), and the bounds come from ``row_bounds``' launch (real MoE layers have 8-512 experts).
# The Gluon kernel always sums them: it holds a vector over the experts for its work split anyway.
FOLDED_MAX_EXPERTS = 1024


def _dw_smem_bytes(cfg: GemmConfig, itemsize: int) -> int:
    if cfg.ws:
        return dw_ws_smem_bytes(cfg, itemsize)
    if cfg.overlap:
        return dw_overlap_smem_bytes(
            cfg.block_m, cfg.block_n, cfg.block_k, cfg.overlap, cfg.num_stages, itemsize
        )
    if cfg.resident:
        # per stage: the streamed operand's tile for every resident chunk; once: the resident
        # operand's chunks and a dw tile
        rows = cfg.resident * cfg.block_m
        stream, res = (cfg.block_n, cfg.block_k) if cfg.resident_x else (cfg.block_k, cfg.block_n)
        return (rows * stream * cfg.num_stages + rows * res + cfg.block_n * cfg.block_k) * itemsize
    # per stage: one dy tile (BLOCK_M, BLOCK_N) and one x tile (BLOCK_M, BLOCK_K)
    return (cfg.block_n + cfg.block_k) * cfg.block_m * itemsize * cfg.num_stages


def pick_dw_config(
    n: int, k: int, device: torch.device, dtype: torch.dtype, *, avg_rows: float = 128.0
) -> GemmConfig:
    """dw tile: block_n x block_k of dw, block_m rows of reduction per step.

    The measured table (``kernels/tuning.py``) on the devices it was measured for, the fallback
    table (``core.launch_configs``) elsewhere; pruned against this device's shared memory
    (128x256x64 with 3 stages asks 245760 B on an H200, which has 232448 B: a launch-config
    fault).
    """
    if device.type != "cuda":
        return GemmConfig.from_tile(GEMM_CONFIGS["interpreter"])
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _pick_dw_config(n, k, index, dtype, round(avg_rows, 1))


@functools.lru_cache(maxsize=4096)
def _pick_dw_config(n: int, k: int, index: int, dtype: torch.dtype, avg_rows: float) -> GemmConfig:
    from qmoe_doctor.kernels import tuning

    cfg = tuning.lookup("dw", avg_rows, n, k, tuning.device_facts(index))
    if cfg is None:
        cfg = GemmConfig.from_tile(dw_fallback(n, k))
    return _fit_dw(cfg, index, dtype)


def _fit_dw(cfg: GemmConfig, index: int, dtype: torch.dtype) -> GemmConfig:
    """``cfg`` with fewer stages until its shared memory fits device ``index``."""
    limit = smem_limit(index)
    itemsize = torch.empty((), dtype=dtype).element_size()
    while cfg.num_stages > 1 and _dw_smem_bytes(cfg, itemsize) > limit:
        cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    return cfg


def dw_grid_size(e: int, n: int, k: int, cfg: GemmConfig, device: torch.device) -> int:
    """Programs of the persistent dw grid: at most one per SM of *this* device, never more
    than the E * n-tiles * k-tiles there are (E * n-tiles work items for the resident kernel,
    E * k-tiles with x resident)."""
    n_tiles, k_tiles = int(triton.cdiv(n, cfg.block_n)), int(triton.cdiv(k, cfg.block_k))
    if cfg.overlap:
        tiles = e * n_tiles
    elif cfg.resident:
        tiles = e * (k_tiles if cfg.resident_x else n_tiles)
    else:
        tiles = e * n_tiles * k_tiles
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return max(1, min(persistent_sms(index) * max(1, cfg.programs_per_sm), tiles))
    return max(1, min(4, tiles))  # interpreter: a few programs exercise the tile walk


def _dw_sizes(dy: torch.Tensor, x: torch.Tensor, dw: torch.Tensor) -> tuple[int, ...]:
    """M, N, K, E and the seven strides, in the order every dw kernel takes them."""
    return (
        dy.shape[0],
        dy.shape[1],
        x.shape[1],
        dw.shape[0],
        dy.stride(0),
        dy.stride(1),
        x.stride(0),
        x.stride(1),
        dw.stride(0),
        dw.stride(1),
        dw.stride(2),
    )


def _launch_options(cfg: GemmConfig) -> dict[str, int]:
    """The tile sizes and launch options of ``cfg`` as Triton keywords."""
    return {
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
    }


def launch_grouped_gemm_dw(
    dy: torch.Tensor,
    x: torch.Tensor,
    dw: torch.Tensor,
    bounds: torch.Tensor,
    cfg: GemmConfig,
    num_programs: int,
) -> None:
    """Launch on the current device and stream. Callers hold the device guard.

    dy (M, N), x (M, K), dw (E, N, K) any strides, bounds (E + 1,) int64 from ``row_bounds``.
    """
    # launches on the current device by contract (callers hold the guard): our own calls go
    # through the guarded launch plans, tests and tools call it inside a guard
    _grouped_gemm_dw_kernel[(num_programs,)](  # qmoe-doctor: ignore[unguarded-launch]
        dy, x, dw, bounds, *_dw_sizes(dy, x, dw), NUM_PROGRAMS=num_programs, **_launch_options(cfg)
    )


def overlap_fallback(cfg: GemmConfig) -> GemmConfig:
    """Where the Gluon kernel of an ``-ovN`` config cannot run (no Hopper GPU, no Gluon, the
    interpreter, N not a multiple of the item, unaligned operands): the resident Triton kernel
    of the same tiles (a paired item's one tile: 128 wide) and chunk count (at most 6, the
    Triton kernel's largest)."""
    tile = cfg.block_n // overlap_halves(cfg.block_n)
    return dataclasses.replace(
        cfg, block_n=tile, overlap=0, resident=min(cfg.overlap, 6), resident_x=False, tma=True
    )


def dw_tma_plan(
    dy: torch.Tensor, x: torch.Tensor, dw: torch.Tensor, cfg: GemmConfig
) -> tuple[Any, Any, Any] | None:
    """(dy_desc, x_desc, dw_desc or None) for the TMA dw kernel, or None for the pointer kernel."""
    TensorDescriptor = tensor_descriptor_class(x, cfg)
    if TensorDescriptor is None:
        return None
    item = x.element_size()
    m, n = dy.shape
    k = x.shape[1]
    e = dw.shape[0]
    for t in (dy, x):
        if t.stride(1) != 1 or (t.stride(0) * item) % 16 or not _tma_ready(t):
            return None
    dy_desc = TensorDescriptor(dy, [m, n], [dy.stride(0), 1], [cfg.block_m, cfg.block_n])
    x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [cfg.block_m, cfg.block_k])
    dw_desc = None
    if (
        dw.stride(2) == 1
        and dw.stride(0) == n * dw.stride(1)
        and (dw.stride(1) * dw.element_size()) % 16 == 0
        and _tma_ready(dw)
        and n % cfg.block_n == 0
    ):
        dw_desc = TensorDescriptor(dw, [e * n, k], [dw.stride(1), 1], [cfg.block_n, cfg.block_k])
    return dy_desc, x_desc, dw_desc


def launch_grouped_gemm_dw_tma(
    plan: tuple[Any, Any, Any],
    dy: torch.Tensor,
    x: torch.Tensor,
    dw: torch.Tensor,
    bounds: torch.Tensor,
    cfg: GemmConfig,
    num_programs: int,
) -> None:
    """Launch the TMA dw kernel, or the resident one when ``cfg.resident``, on the current device
    and stream. Callers hold the device guard."""
    dy_desc, x_desc, dw_desc = plan
    if cfg.resident:
        # launches on the current device by contract (callers hold the guard): our own calls go
        # through the guarded launch plans, tests and tools call it inside a guard
        _grouped_gemm_dw_resident_kernel[(num_programs,)](  # qmoe-doctor: ignore[unguarded-launch]
            dy_desc,
            x_desc,
            dw_desc,
            dw,
            bounds,
            dy.shape[0],
            dy.shape[1],
            x.shape[1],
            dw.shape[0],
            dw.stride(0),
            dw.stride(1),
            dw.stride(2),
            num_programs,
            MAX_CHUNKS=cfg.resident,
            DW_TMA=dw_desc is not None,
            X_RES=cfg.resident_x,
            **_launch_options(cfg),
        )
        return
    # launches on the current device by contract (callers hold the guard): our own calls go
    # through the guarded launch plans, tests and tools call it inside a guard
    _grouped_gemm_dw_tma_kernel[(num_programs,)](  # qmoe-doctor: ignore[unguarded-launch]
        dy_desc,
        x_desc,
        dw_desc,
        dy,
        x,
        dw,
        bounds,
        *_dw_sizes(dy, x, dw),
        NUM_PROGRAMS=num_programs,
        DW_TMA=dw_desc is not None,
        **_launch_options(cfg),
    )


def launch_grouped_gemm_dw_flat(
    dy: torch.Tensor,
    x: torch.Tensor,
    dw: torch.Tensor,
    bounds: torch.Tensor,
    cfg: GemmConfig,
    num_programs: int,
) -> None:
    """Launch the flattened dw kernel on the current device and stream. Callers hold the guard."""
    # launches on the current device by contract (callers hold the guard): our own calls go
    # through the guarded launch plans, tests and tools call it inside a guard
    _grouped_gemm_dw_flat_kernel[(num_programs,)](  # qmoe-doctor: ignore[unguarded-launch]
        dy,
        x,
        dw,
        bounds,
        *_dw_sizes(dy, x, dw),
        num_programs,
        E_POW2=triton.next_power_of_2(dw.shape[0]),
        **_launch_options(cfg),
    )


# --------------------------------------------------------------------------------------------
# dw launch plans (as the forward's, ``grouped_gemm._GemmPlan``): made once per operand layout,
# device and config; a call allocates dw and launches once (the kernel sums the experts' row
# bounds from m_sizes itself), or, past FOLDED_MAX_EXPERTS, launches the row bounds first.
# --------------------------------------------------------------------------------------------


def _dw_args(dy: torch.Tensor, x: torch.Tensor, dw: torch.Tensor, cfg: GemmConfig, programs: int) -> dict[str, Any]:
    """The pointer, TMA and flat dw kernels' scalar arguments by name (``_dw_sizes``'s order)."""
    names = ("M", "N", "K", "E", "stride_dym", "stride_dyn", "stride_xm", "stride_xk")
    args: dict[str, Any] = dict(zip(names + ("stride_we", "stride_wn", "stride_wk"), _dw_sizes(dy, x, dw), strict=True))
    args.update(NUM_PROGRAMS=programs, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
    return args


@dataclass(frozen=True, slots=True)
class _DwPlan:
    """One dw call shape. ``sources`` index (dy, x, dw, rows) per tensor argument of
    ``launch`` (a descriptor argument takes its tensor: the launch holds the template), rows
    being m_sizes itself or, with ``bounds``, the row bounds made from it by a launch before dw's."""

    e: int
    n: int
    k: int
    m: int
    device: torch.device
    guard_index: int
    out_dtype: torch.dtype
    zero_only: bool  # M == 0: dw is zeros, nothing launches
    launch: Launch | None
    bounds: _BoundsPlan | None = None
    sources: tuple[int, ...] = ()
    config: GemmConfig | None = None
    path: str = ""

    def run(self, dy: torch.Tensor, x: torch.Tensor, m_sizes: torch.Tensor) -> torch.Tensor:
        # as the forward plan's: dw on x's device (new_empty), each launch holds its guard
        shape = (self.e, self.n, self.k)
        dw = x.new_empty(shape) if self.out_dtype == x.dtype else x.new_empty(shape, dtype=self.out_dtype)
        if self.launch is None:
            return dw.zero_() if self.zero_only else dw
        # the bounds (past FOLDED_MAX_EXPERTS) on x.device's current stream, before the dw launch
        rows = m_sizes if self.bounds is None else self.bounds(m_sizes)
        values = (dy, x, dw, rows)
        self.launch(*[values[i] for i in self.sources])
        return dw


_DW_PLANS: dict[tuple[Any, ...], _DwPlan] = {}


def _dw_plan(
    dy: torch.Tensor, x: torch.Tensor, m_sizes: torch.Tensor, out_dtype: torch.dtype | None, config: GemmConfig | None
) -> _DwPlan:
    try:
        key: tuple[Any, ...] | None = (
            _operand_key(dy), _operand_key(x), _operand_key(m_sizes), out_dtype, config, sm_reserve()
        )  # fmt: skip
    except AttributeError:  # not a tensor: check_dw_operands says which argument
        key = None
    plan = _DW_PLANS.get(key) if key is not None else None
    if plan is not None:
        plan_stats.hits += 1
        return plan
    plan_stats.misses += 1
    plan = _make_dw_plan(dy, x, m_sizes, out_dtype, config)
    if key is not None:
        if len(_DW_PLANS) >= PLAN_LIMIT:
            _DW_PLANS.clear()
        _DW_PLANS[key] = plan
    return plan


def _template(desc: Any) -> Any:
    return rebase(desc, None)  # no tensor kept alive by a plan (grouped_gemm._template)


def _gluon_launch(
    kernel: Any,
    descs: tuple[Any, Any, Any],
    kernel_args: Callable[..., dict[str, Any]],
    options: dict[str, int],
    dy: torch.Tensor,
    x: torch.Tensor,
    dw: torch.Tensor,
    cfg: GemmConfig,
    guard: int,
) -> Launch:
    """The launch of a Gluon dw kernel (the overlapped or the warp-specialized one): its three
    descriptors (templates, rebased per call) and m_sizes are the tensors, ``kernel_args`` gives
    the rest for the persistent grid of ``cfg``."""
    programs = dw_grid_size(dw.shape[0], dy.shape[1], x.shape[1], cfg, dy.device)
    dy_desc, x_desc, dw_desc = descs
    return Launch(
        kernel,
        programs,
        kernel_args(dy, x, dw, cfg, programs),
        ("dy_desc", "x_desc", "dw_desc", "sizes_ptr"),
        options,
        device_index=guard,
        descriptors={"dy_desc": _template(dy_desc), "x_desc": _template(x_desc), "dw_desc": _template(dw_desc)},
    )


def _make_dw_plan(
    dy: torch.Tensor, x: torch.Tensor, m_sizes: torch.Tensor, out_dtype: torch.dtype | None, config: GemmConfig | None
) -> _DwPlan:
    check_dw_operands(dy, x, m_sizes)
    m, n = dy.shape
    k = x.shape[1]
    e = m_sizes.shape[0]
    device = x.device
    guard = _guard_index(device)
    out = out_dtype or x.dtype
    base = functools.partial(_DwPlan, e=e, n=n, k=k, m=m, device=device, guard_index=guard, out_dtype=out)
    if e * n * k == 0 or m == 0:
        return base(zero_only=e * n * k > 0, launch=None)
    with device_guard(device):
        dw = torch.empty((e, n, k), device=device, dtype=out)  # the layout every call's dw has
        cfg = config or pick_dw_config(n, k, device, x.dtype, avg_rows=m / max(1, e))
        # the Gluon kernels (Hopper; each sums the bounds itself), else the Triton kernel of
        # the same tiles, which may need fewer stages
        if cfg.ws:
            descs = dw_ws_plan(dy, x, dw, cfg)
            if descs is not None:
                launch = _gluon_launch(dw_ws_kernel(), descs, ws_args, ws_options(cfg), dy, x, dw, cfg, guard)
                return base(zero_only=False, launch=launch, sources=(0, 1, 2, 3), config=cfg, path="gluon+ws")
            cfg = ws_fallback(cfg)
            if device.type == "cuda":
                cfg = _fit_dw(cfg, guard, x.dtype)
        if cfg.overlap:
            descs = dw_overlap_plan(dy, x, dw, cfg)
            if descs is not None:
                launch = _gluon_launch(dw_overlap_kernel(), descs, overlap_args, {}, dy, x, dw, cfg, guard)
                return base(zero_only=False, launch=launch, sources=(0, 1, 2, 3), config=cfg, path="gluon+overlap")
            cfg = overlap_fallback(cfg)
            if device.type == "cuda":
                cfg = _fit_dw(cfg, guard, x.dtype)
        programs = dw_grid_size(e, n, k, cfg, device)
        plan = None if cfg.flat else dw_tma_plan(dy, x, dw, cfg)
        # the Triton kernels: the bounds summed in the kernel, or past FOLDED_MAX_EXPERTS launched
        folded = e <= FOLDED_MAX_EXPERTS
        bounds = None if folded else _bounds_plan(m_sizes, m)
        rows = {"SIZES": folded, "E_POW2": triton.next_power_of_2(e) if folded else 1}
    opts = _launch_options(cfg)
    tiles = {"num_warps": opts.pop("num_warps"), "num_stages": opts.pop("num_stages")}
    args = _dw_args(dy, x, dw, cfg, programs)
    args.update(rows)
    if cfg.flat:
        args.update(E_POW2=triton.next_power_of_2(e))
        launch = Launch(_grouped_gemm_dw_flat_kernel, programs, args, ("dy_ptr", "x_ptr", "dw_ptr", "rows_ptr"), tiles, device_index=guard)
        return base(zero_only=False, launch=launch, bounds=bounds, sources=(0, 1, 2, 3), config=cfg, path="pointer+flat")
    if plan is None:
        launch = Launch(_grouped_gemm_dw_kernel, programs, args, ("dy_ptr", "x_ptr", "dw_ptr", "rows_ptr"), tiles, device_index=guard)
        return base(zero_only=False, launch=launch, bounds=bounds, sources=(0, 1, 2, 3), config=cfg, path="pointer")
    dy_desc, x_desc, dw_desc = plan
    descriptors = {"dy_desc": _template(dy_desc), "x_desc": _template(x_desc)}
    names = ["dy_desc", "x_desc"]
    sources = [0, 1]
    if dw_desc is not None:
        names.append("dw_desc")
        sources.append(2)
        descriptors["dw_desc"] = _template(dw_desc)
    else:
        args["dw_desc"] = None
    if cfg.resident:
        for name in ("stride_dym", "stride_dyn", "stride_xm", "stride_xk"):
            del args[name]
        args.update(MAX_CHUNKS=cfg.resident, DW_TMA=dw_desc is not None, X_RES=cfg.resident_x)
        kernel, path = _grouped_gemm_dw_resident_kernel, "tma+resident"
        names += ["dw_ptr", "rows_ptr"]
        sources += [2, 3]
    else:
        args.update(DW_TMA=dw_desc is not None)
        kernel, path = _grouped_gemm_dw_tma_kernel, "tma"
        names += ["dy_ptr", "x_ptr", "dw_ptr", "rows_ptr"]
        sources += [0, 1, 2, 3]
    launch = Launch(kernel, programs, args, names, tiles, device_index=guard, descriptors=descriptors)
    return base(zero_only=False, launch=launch, bounds=bounds, sources=tuple(sources), config=cfg, path=path)


def moe_grouped_gemm_dw(
    dy: torch.Tensor,
    x: torch.Tensor,
    m_sizes: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    check_routing: bool = False,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """``dw[e] = dy_e.T @ x_e``: dy (M, N), x (M, K), m_sizes (E,) -> dw (E, N, K).

    Every element of dw is written (empty experts give zeros). ``check_routing=True`` also
    verifies ``m_sizes`` (no negatives, sums to M); it synchronizes: off by default. Nothing
    else reads a tensor on the host: a cached launch plan, one allocation, one launch (the
    kernel sums the experts' row bounds from m_sizes; past FOLDED_MAX_EXPERTS experts a launch
    before it makes them).
    """
    plan = _dw_plan(dy, x, m_sizes, out_dtype, config)
    if check_routing:
        check_routing_sizes(m_sizes, plan.m)
    return plan.run(dy, x, m_sizes)


def dw_kernel_path(
    dy: torch.Tensor,
    x: torch.Tensor,
    m_sizes: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    config: GemmConfig | None = None,
) -> str:
    """Which kernel ``moe_grouped_gemm_dw`` takes for these operands and ``config`` (for
    reports): the path of the launch plan the call itself uses, so a config the device or the
    operands cannot run names the kernel that runs it instead ("gluon+ws", "gluon+overlap",
    "tma+resident", "tma", "pointer+flat", "pointer"; "" where nothing launches: M == 0 or an
    empty dw). Made (and kept) once per call shape like the call's own plan; launches nothing."""
    return _dw_plan(dy, x, m_sizes, out_dtype, config).path


def moe_grouped_gemm_dw_torch(
    dy: torch.Tensor,
    x: torch.Tensor,
    m_sizes: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    check_routing: bool = False,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """The slow, obvious twin: a loop over experts in float32 (float64 for float64 operands),
    same clamping of m_sizes."""
    del config  # accepted for signature parity
    m = dy.shape[0]
    if check_routing:
        check_routing_sizes(m_sizes, m)
    e = m_sizes.shape[0]
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    dw = torch.zeros((e, dy.shape[1], x.shape[1]), device=x.device, dtype=acc)
    row = 0
    for expert, size in enumerate(_clamped_sizes(m_sizes, m)):
        if size:
            dw[expert] = dy[row : row + size].to(acc).T @ x[row : row + size].to(acc)
        row += size
    return dw.to(out_dtype or x.dtype)


# --------------------------------------------------------------------------------------------
# Autograd.
# --------------------------------------------------------------------------------------------


class _MoEFusedLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor, kernel: GroupedGemm
    ) -> torch.Tensor:
        ctx.save_for_backward(x, w, m_sizes)
        ctx.sm_reserve = sm_reserve()  # the backward runs on autograd's thread: carry it over
        return kernel(x, w, m_sizes)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w, m_sizes = ctx.saved_tensors
        reserve = ctx.sm_reserve
        with reserved_sms(reserve):
            dx = moe_grouped_gemm_dx(dy.to(w.dtype), w, m_sizes) if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:
            return dx, None, None, None
        if _DEFERRED:  # the caller runs the weight gradient later (``deferred_weight_grads``)
            dy_x = dy.to(x.dtype)

            def weight_grad() -> tuple[torch.Tensor, torch.Tensor]:
                with reserved_sms(reserve):
                    return w, moe_grouped_gemm_dw(dy_x, x, m_sizes)

            _DEFERRED[-1].append(weight_grad)
            return dx, None, None, None
        with reserved_sms(reserve):
            dw = moe_grouped_gemm_dw(dy.to(x.dtype), x, m_sizes)
        return dx, dw, None, None


# Weight gradients left for later: while a list is open, ``moe_fused_linear``'s backward computes
# the input gradient only and appends a closure for the weight's. Process-wide (autograd may run
# the backward on its own thread), innermost list first.
_DEFERRED: list[list[Callable[[], tuple[torch.Tensor, torch.Tensor]]]] = []


@contextlib.contextmanager
def deferred_weight_grads() -> Iterator[list[Callable[[], tuple[torch.Tensor, torch.Tensor]]]]:
    """Within this block the backward of ``moe_fused_linear`` returns no weight gradient; it
    appends to the yielded list a closure that computes it, returning ``(weight, dw)``, for the
    caller to run (and add into ``weight.grad``) when it chooses: expert parallelism sends the
    input gradients on their way first and computes the weight gradients while they travel."""
    pending: list[Callable[[], tuple[torch.Tensor, torch.Tensor]]] = []
    _DEFERRED.append(pending)
    try:
        yield pending
    finally:
        del _DEFERRED[next(i for i, item in enumerate(_DEFERRED) if item is pending)]


def moe_fused_linear(
    x: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor, *, kernel: GroupedGemm = moe_grouped_gemm
) -> torch.Tensor:
    """Differentiable ``y[m] = x[m] @ w[e(m)].T``: forward by ``kernel`` (ours by default, or
    any kernel of the same signature the doctor wants to exercise), backward by our dx and dw
    kernels. No gradient for ``m_sizes``."""
    result: torch.Tensor = _MoEFusedLinear.apply(x, w, m_sizes, kernel)  # type: ignore[no-untyped-call, unused-ignore]  # torch before 2.14 leaves Function.apply untyped
    return result
