"""Specimen ``autotuned``: a correct kernel with a public-sized autotune space, plants no cause.

The public fused-MoE kernels autotune over about a thousand configs keyed on the problem shape
(FINDINGS.md, "Measured on one H100 ... 2026-11-25": 74 s for the first call of a fresh process
from a cold Triton cache, 1.4 s with ``TRITON_CACHE_AUTOTUNING=1`` and a warm cache). This is the
correct persistent kernel of ``grouped_gemm.py`` behind ``@triton.autotune`` over 1,000 configs
(5 x 5 x 4 tile shapes, 2 warp counts, 5 stage counts), keyed on M, N and K, pruned per call to
the tiles that fit the problem and this device's shared memory. The kernel only stores into
``y`` (never reads it), so the autotuner's benchmark runs on the caller's buffers are harmless:
no ``restore_value`` is needed.

It never misbehaves. What it tests is the doctor's cost and honesty with such a kernel: a
default scan must call it healthy, in a minute on one GPU from a cold cache, while the
repeat-call probe still autotunes for real (the one cell where a first-call fault of an
autotuned kernel shows; ``--autotune``, docs/cells.md).

Under ``TRITON_INTERPRET=1`` the pruning keeps two small configs and the autotuner gets a
wall-clock benchmarker (Triton's default needs a GPU driver), as ``autotune_inplace`` does.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton

from qmoe_doctor.kernels._details.grouped_gemm_kernels import _grouped_gemm_kernel
from qmoe_doctor.kernels.grouped_gemm import check_operands, device_guard, interpreting, num_sms, smem_limit

_TILES_M = (16, 32, 64, 128, 256)
_TILES_N = (16, 32, 64, 128, 256)
_TILES_K = (16, 32, 64, 128)
_WARPS = (4, 8)
_STAGES = (1, 2, 3, 4, 5)
#: The tile the list starts from: the autotuner tries configs in this order, and a policy that
#: takes one config without benchmarking (``--autotune first``) takes the first that survives
#: pruning, as a public list puts its hand-picked default first.
_DEFAULT = (64, 128, 64, 4, 3)
# Interpreter: two small configs (the benchmark runs the kernel in Python on the CPU).
_INTERPRETER_TILES = ((32, 32, 32, 4, 1), (16, 32, 32, 4, 1))
_INTERPRETER_REPS = 2  # timed runs per config on the CPU, after one warm-up run


def _distance(cfg: tuple[int, int, int, int, int]) -> float:
    return sum(abs(math.log2(a) - math.log2(b)) for a, b in zip(cfg, _DEFAULT, strict=True))


def _configs() -> list[triton.Config]:
    tiles = sorted(itertools.product(_TILES_M, _TILES_N, _TILES_K, _WARPS, _STAGES), key=_distance)
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=s)
        for bm, bn, bk, w, s in tiles
    ]


def _tile(cfg: triton.Config) -> tuple[int, int, int, int, int]:
    kw = cfg.kwargs
    return kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], cfg.num_warps, cfg.num_stages


def _prune(configs: list[triton.Config], named_args: dict[str, Any], **_: Any) -> list[triton.Config]:
    """The configs worth benchmarking for this call: tiles no larger than the problem, and a
    software pipeline that fits the shared memory of the operands' device (read per device)."""
    if interpreting():
        return [c for c in configs if _tile(c) in _INTERPRETER_TILES]
    x = named_args["x_ptr"]
    m, n, k = int(named_args["M"]), int(named_args["N"]), int(named_args["K"])
    limit = smem_limit(x.device.index or 0)
    itemsize = x.element_size()
    kept = []
    for c in configs:
        bm, bn, bk, warps, stages = _tile(c)
        if bm > max(16, triton.next_power_of_2(m)) or bn > max(16, triton.next_power_of_2(n)):
            continue
        if bk > max(16, triton.next_power_of_2(k)):
            continue
        if (bm + bn) * bk * itemsize * stages > limit:
            continue
        if warps == 8 and bm * bn < 64 * 64:
            continue  # eight warps on a small tile: idle threads
        kept.append(c)
    return kept or configs[:1]


def _wall_clock_bench(kernel_call: Callable[[], object], quantiles: Sequence[float]) -> list[float]:
    """Triton's benchmarker contract (ms at the given quantiles), measured with perf_counter."""
    kernel_call()
    times: list[float] = []
    for _ in range(_INTERPRETER_REPS):
        start = time.perf_counter()
        kernel_call()
        times.append((time.perf_counter() - start) * 1e3)
    times.sort()
    return [times[min(len(times) - 1, int(q * len(times)))] for q in quantiles]


# PLANTED: the public kernels' autotune space (1,000 configs, pruned, keyed on the shape) around
# the correct kernel; grouped_gemm.py picks its config from a measured table instead
_autotuned_kernel = triton.autotune(
    configs=_configs(),
    key=["M", "N", "K"],
    prune_configs_by={"early_config_prune": _prune},
    do_bench=_wall_clock_bench if interpreting() else None,
)(_grouped_gemm_kernel)


def moe_grouped_gemm(
    x: torch.Tensor,  # (M, K) rows sorted by expert
    w: torch.Tensor,  # (E, N, K)
    m_sizes: torch.Tensor,  # (E,) rows per expert
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    check_operands(x, w, m_sizes)
    m, k = x.shape
    e, n, _ = w.shape
    with device_guard(x.device):
        y = torch.empty((m, n), device=x.device, dtype=out_dtype or x.dtype)
        if m == 0 or n == 0:
            return y
        if k == 0:
            return y.zero_()
        # The persistent walk is right for any program count: size the grid for the smallest
        # tile (most tiles), capped by this device's SM count; a constexpr, so one per device.
        max_tiles = (triton.cdiv(m, 16) + e + 1) * triton.cdiv(n, 16)
        sms = num_sms(x.device.index or 0) if x.device.type == "cuda" else 4
        programs = max(1, min(sms, max_tiles))
        _autotuned_kernel[(programs,)](
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
            NUM_PROGRAMS=programs,
        )  # BLOCK_*, num_warps, num_stages: from the autotuner
    return y
