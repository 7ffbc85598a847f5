"""Specimen ``cached_sms``: plants ``per-device-state-cached``.

What it does wrong: the SM count that sizes its persistent grid is read once, from whatever
device is current at the first call (``torch.cuda.current_device()``, not ``x.device``), and kept
in a module global for every later call on every device: the pattern of bitsandbytes #1952 and
of the public fused-MoE wrappers (FINDINGS.md, "Measured on one H100 ... 2026-11-25"). The launch
itself is guarded and every buffer is on ``x.device``.

When it misbehaves: only on a host whose GPUs differ in SM count (two GPU models, MIG slices):
the grid is sized for the first device, too few programs (idle SMs) or too many on the others.
The persistent tile walk is right for any program count, so the numbers stay right; on identical
GPUs nothing differs at all. No scan cell can see it there: ``qmoe-doctor lint`` (rule
``cached-device-property``) names it, and so ``check`` does.

Under the interpreter (CPU tensors) the grid is 4 programs, as in ``grouped_gemm.py``.
"""

from __future__ import annotations

import torch

from qmoe_doctor.kernels._details.grouped_gemm_kernels import _grouped_gemm_kernel
from qmoe_doctor.kernels.grouped_gemm import check_operands, device_guard, pick_config
from qmoe_doctor.kernels.specimens._common import launch_kernel

_NUM_SMS: int | None = None  # the first device's SM count, reused for every device


def _sm_count() -> int:
    global _NUM_SMS
    if _NUM_SMS is None:
        # PLANTED: read from the current device, once; grouped_gemm.num_sms(x.device.index) is
        # keyed by the operands' device
        _NUM_SMS = int(torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count)
    return _NUM_SMS


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
        cfg = pick_config(m, n, k, e, x.device, x.dtype)
        max_tiles = (-(-m // cfg.block_m) + e + 1) * -(-n // cfg.block_n)
        sms = _sm_count() if x.device.type == "cuda" else 4
        launch_kernel(_grouped_gemm_kernel, x, w, y, m_sizes, cfg, max(1, min(sms, max_tiles)))
    return y
