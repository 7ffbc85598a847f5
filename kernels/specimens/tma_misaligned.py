"""Specimen ``tma_misaligned``: plants ``misaligned-operand``, in the persistent TMA-descriptor style.

``tma_persistent`` (the correct twin) with one change in its host code: x goes to the kernel as
the caller handed it. The twin checks what a TMA descriptor needs (a 16-byte-aligned base and
16-byte-aligned strides but the last, which must be 1) and copies x into an aligned buffer when
x is not; this one makes the descriptors on x unchecked, as a public kernel of this design does.

Why it faults where a plain ``tl.load`` kernel does not: Triton's launcher specializes every
pointer argument on 16-byte divisibility, so a kernel that loads through pointers is simply
compiled without the alignment hint for a misaligned view and runs right (our ``grouped_gemm``
and every pointer-load specimen pass the scan's ``offsets: storage-offset-1`` cell). A tensor
descriptor is another matter: ``tl.make_tensor_descriptor`` writes a TMA tensor map from the
base and strides it is given, and the bulk tensor copy engine requires the base and every stride
but the last to be multiples of 16 bytes; nothing in Triton checks the values at run time. The
copy faults: ``CUDA error: misaligned address`` (cudaErrorMisalignedAddress, 716), a sticky error
that ends the CUDA context. Measured on an H100 with the public kernel of this design: x two
bytes into its storage (``storage-offset-1`` in bfloat16) faults, 16 bytes in
(``storage-offset-8``) passes (FINDINGS.md, 2026-12-06).

When it misbehaves: whenever x is not 16-byte aligned: a view a few elements into its storage
(the scan's ``offsets: storage-offset-1`` cell), or a row pitch that is not a multiple of 16
bytes (K * itemsize % 16 != 0, or a padded row stride of that kind). Under ``TRITON_INTERPRET=1``
the interpreter's own descriptor check refuses the same views (``AssertionError: base must be
16-byte aligned`` / ``stride must be 16-byte aligned``) inside the launch, before any tile moves.
With x 16-byte aligned it is identical to ``tma_persistent``; w and y are still checked.
"""

from __future__ import annotations

import torch

from qmoe_doctor.kernels.specimens.tma_persistent import _grouped_gemm_tma_kernel, forward, tma_operand


def moe_grouped_gemm(
    x: torch.Tensor,  # (M, K) rows sorted by expert
    w: torch.Tensor,  # (E, N, K)
    m_sizes: torch.Tensor,  # (E,) rows per expert
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The wrapper: w as (E*N, K) (a view where w's layout allows one, else a copy)."""
    e, n, k = w.shape
    return grouped_gemm_flat(x, w.reshape(e * n, k), m_sizes, out_dtype=out_dtype)


def grouped_gemm_flat(
    x: torch.Tensor,  # (M, K) rows sorted by expert; must be 16-byte aligned (never checked)
    w2d: torch.Tensor,  # (E*N, K)
    m_sizes: torch.Tensor,  # (E,) rows per expert
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    # PLANTED: x goes to its descriptors unchecked; tma_persistent.py passes tma_operand(x), which
    # copies x into a 16-byte-aligned buffer when its base or row stride is not
    return forward(_grouped_gemm_tma_kernel, x, tma_operand(w2d), m_sizes, out_dtype=out_dtype)
