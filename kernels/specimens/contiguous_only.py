"""Specimen ``contiguous_only``: a correct kernel that refuses strided inputs, plants no cause.

The public fused-MoE wrappers check their input contract with plain asserts
(``assert x.is_contiguous()`` and friends, FINDINGS.md, "Measured on one H100 ... 2026-11-25").
This one is ``grouped_gemm.moe_grouped_gemm`` behind the same three asserts.

It never misbehaves: a strided view (the scan's ``offsets:padded-rows`` cell passes x as a
row-padded view, ``offsets:transposed-w`` passes w transposed) is refused with an
``AssertionError`` raised by the wrapper before any launch, nothing written. That is the kernel
honouring its contract: the doctor must label those cells ``rejected``, name the refused input,
and call the kernel healthy. Contiguous views with a storage offset pass the asserts and are
computed like any other input.
"""

from __future__ import annotations

import torch

from qmoe_doctor.kernels._details.grouped_gemm_kernels import _grouped_gemm_kernel
from qmoe_doctor.kernels.specimens._common import guarded_forward


def moe_grouped_gemm(
    x: torch.Tensor,  # (M, K) rows sorted by expert, contiguous
    w: torch.Tensor,  # (E, N, K), contiguous
    m_sizes: torch.Tensor,  # (E,) rows per expert
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    # PLANTED: the input contract of the public wrappers, checked by asserts before any launch
    # (grouped_gemm.py takes any strides); one without a message, as most are written
    assert x.is_contiguous()
    assert w.is_contiguous(), "w must be contiguous (E, N, K)"
    assert m_sizes.is_contiguous(), "m_sizes must be contiguous"
    return guarded_forward(_grouped_gemm_kernel, x, w, m_sizes, out_dtype=out_dtype)
