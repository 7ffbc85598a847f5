"""Pieces the specimens share that ``grouped_gemm.py`` binds to its own kernel.

``guarded_forward`` is the body of the correct ``moe_grouped_gemm`` with the kernel as an
argument: a specimen whose fault lives inside the ``@triton.jit`` body passes its copied kernel
here (launched through ``grouped_gemm.launch_grouped_gemm(..., kernel=...)``) and keeps
everything else identical to the correct wrapper.
"""

from __future__ import annotations

from typing import Any

import torch

from qmoe_doctor.kernels.grouped_gemm import (
    check_operands,
    device_guard,
    grid_size,
    launch_grouped_gemm,
    pick_config,
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
        launch_grouped_gemm(x, w, y, m_sizes, cfg, grid_size(m, n, e, cfg, x.device), kernel=kernel)
    return y
