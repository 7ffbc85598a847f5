"""Specimen ``unguarded``: plants ``missing-device-guard``.

What it does wrong: the wrapper launches without ``with device_guard(x.device):`` and sizes its
persistent grid from the *current* device's SM count (``torch.cuda.current_device()``), the way
most public fused-MoE wrappers do. ``y`` is still allocated with ``device=x.device``.

When it misbehaves: only when the current CUDA device is not ``x.device``. Triton launches on
the current device and that device's current stream:

* no peer access current -> x.device (and the current device's context exists):
  ``ValueError: Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)``;
* peer access current -> x.device on (one copy current -> x.device enables it): correct numbers,
  but the kernel runs on the current GPU reading x.device's memory remotely, several times
  slower than the guarded launch (12x measured on 2x H200);
* that, with x (or m_sizes) still being written on x.device's stream: the launch is unordered
  against that producer, so it reads stale memory: wrong results, or an illegal memory access
  when the stale value is a row count.

With the current device equal to x.device (or on the CPU under the interpreter) it is identical
to ``grouped_gemm.moe_grouped_gemm``.
"""

from __future__ import annotations

import torch

from qmoe_doctor.kernels.grouped_gemm import (
    check_operands,
    grid_size,
    launch_grouped_gemm,
    pick_config,
)


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
    out_dtype = out_dtype or x.dtype
    y = torch.empty((m, n), device=x.device, dtype=out_dtype)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    # PLANTED: no `with device_guard(x.device):` around the launch, and config and grid come from
    # the current device: Triton launches on the current device's stream, not x.device's.
    launch_device = _current_device(x.device)
    cfg = pick_config(m, n, k, e, launch_device, x.dtype)
    launch_grouped_gemm(x, w, y, m_sizes, cfg, grid_size(m, n, e, cfg, launch_device))
    return y


def _current_device(operand_device: torch.device) -> torch.device:
    """The device an unguarded wrapper really targets: the current CUDA device (CPU stays CPU)."""
    if operand_device.type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return operand_device
