"""Specimen ``wrong_stream``: plants ``wrong-device-stream``.

What it does wrong: the launch is guarded (right device), but it runs inside
``torch.cuda.stream(torch.cuda.default_stream(x.device))``: the null/default-stream habit,
instead of the caller's current stream of ``x.device`` (which Triton would use by itself).

When it misbehaves: only when the caller's current stream on ``x.device`` is a side stream
whose producer of ``x`` (or ``m_sizes``) has not finished: the kernel on the default stream is
not ordered after that producer and reads stale ``x``, so the result is silently wrong. It
also writes ``y`` on a stream the caller never waits for. On the default stream, or with the
producer finished (or on the CPU under the interpreter), it is identical to
``grouped_gemm.moe_grouped_gemm``.
"""

from __future__ import annotations

import contextlib

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
    with device_guard(x.device):
        y = torch.empty((m, n), device=x.device, dtype=out_dtype)
        if m == 0 or n == 0:
            return y
        if k == 0:
            return y.zero_()
        cfg = pick_config(m, n, k, e, x.device, x.dtype)
        # PLANTED: launch on x.device's default (null) stream, not the caller's current stream.
        with _default_stream(x.device):
            launch_grouped_gemm(x, w, y, m_sizes, cfg, grid_size(m, n, e, cfg, x.device))
    return y


def _default_stream(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """``torch.cuda.stream(default_stream(device))`` for CUDA, a no-op on the CPU (interpreter)."""
    if device.type == "cuda":
        return torch.cuda.stream(torch.cuda.default_stream(device))
    return contextlib.nullcontext()
