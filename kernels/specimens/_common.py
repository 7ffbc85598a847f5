"""Pieces the specimens share that ``grouped_gemm.py`` binds to its own kernel.

``launch_kernel`` is ``grouped_gemm.launch_grouped_gemm`` with the kernel as an argument, and
``guarded_forward`` is the body of the correct ``moe_grouped_gemm`` with the same argument: a
specimen whose fault lives inside the ``@triton.jit`` body passes its copied kernel here and
keeps everything else identical to the correct wrapper.
"""

from __future__ import annotations

from typing import Any

import torch

from qmoe_doctor.kernels.grouped_gemm import (
    GemmConfig,
    check_operands,
    device_guard,
    grid_size,
    pick_config,
)


def launch_kernel(
    kernel: Any,  # a @triton.jit function with _grouped_gemm_kernel's parameters
    x: torch.Tensor,  # (M, K)
    w: torch.Tensor,  # (E, N, K)
    y: torch.Tensor,  # (M, N)
    m_sizes: torch.Tensor,  # (E,)
    cfg: GemmConfig,
    num_programs: int,
) -> None:
    """Launch on the current device and stream. Callers hold the device guard."""
    m, k = x.shape
    e, n, _ = w.shape
    kernel[(num_programs,)](
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


def guarded_forward(
    kernel: Any,
    x: torch.Tensor,
    w: torch.Tensor,
    m_sizes: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The correct wrapper (guard, buffers on x.device, per-device config), launching ``kernel``."""
    check_operands(x, w, m_sizes)
    m, k = x.shape
    e, n, _ = w.shape
    out_dtype = out_dtype or x.dtype
    with device_guard(x.device):
        y = torch.empty((m, n), device=x.device, dtype=out_dtype)
        if m == 0 or n == 0:
            return y
        if k == 0:
            return y.zero_()
        cfg = pick_config(m, n, k, e, x.device, x.dtype)
        launch_kernel(kernel, x, w, y, m_sizes, cfg, grid_size(m, n, e, cfg, x.device))
    return y
