"""Specimen ``default_buffer``: plants ``default-device-buffer``.

What it does wrong: the output ``y`` is allocated with ``device=x.device.type`` (that is,
``device="cuda"`` with no index) *before* the device guard is entered, so it lands on the
current device, not on ``x.device``. The launch itself is guarded and runs on ``x.device``.

When it misbehaves: only when the current CUDA device is not ``x.device``:

* no peer access x.device -> current device: ``ValueError: Pointer argument (at 2) cannot be
  accessed from Triton (cpu tensor?)`` for the ``y`` argument;
* peer access x.device -> current device on (one copy x.device -> current device enables it):
  the kernel writes ``y`` remotely and returns it on the wrong device (the caller's next op then
  fails with a device mismatch, or silently moves data).

With the current device equal to ``x.device`` (or on the CPU under the interpreter) it is
identical to ``grouped_gemm.moe_grouped_gemm``.
"""

from __future__ import annotations

import torch

from qmoe_doctor.kernels.grouped_gemm import (
    check_operands,
    device_guard,
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
    # PLANTED: device=x.device.type is "cuda" without an index, taken before the guard: y lands
    # on the current device (the correct kernel allocates with device=x.device inside the guard).
    y = torch.empty((m, n), device=x.device.type, dtype=out_dtype)
    with device_guard(x.device):
        if m == 0 or n == 0:
            return y
        if k == 0:
            return y.zero_()
        cfg = pick_config(m, n, k, e, x.device, x.dtype)
        launch_grouped_gemm(x, w, y, m_sizes, cfg, grid_size(m, n, e, cfg, x.device))
    return y
