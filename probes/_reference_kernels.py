"""Trivial reference Triton kernels of our own, for checking the environment (not the kernel
under test): if one of these fails, the failure belongs to the machine."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def count_loop_kernel(out_ptr, n, WIDTH: tl.constexpr):  # out (WIDTH,) float32; n: a scalar arg
    """out[:] = n, counted by a loop bounded by a scalar argument (as every grouped GEMM's
    expert and K loops are)."""
    offs = tl.arange(0, WIDTH)
    acc = tl.zeros((WIDTH,), dtype=tl.float32)
    for _ in range(n):
        acc += 1.0
    tl.store(out_ptr + offs, acc)
