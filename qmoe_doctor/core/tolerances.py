"""Tolerances, stated once per dtype: ||out - ref|| / ||ref|| against a float32 twin.

Used by the probes and the kernel tests alike; CI (the interpreter) is never looser than a
GPU run. bf16 operands land between 1e-3 and 1e-2 (1.7e-3 measured on H200 at M=4096,
E=128, N=768, K=2048); float32 dots run as tf32 on the GPU (~3e-4).
"""

from __future__ import annotations

REL_TOLERANCE: dict[str, float] = {
    "bfloat16": 1e-2,
    "float16": 2e-3,
    "float32": 2e-3,
}


def tolerance(dtype_name: str) -> float:
    """Tolerance for a dtype named as torch prints it ("bfloat16" or "torch.bfloat16")."""
    return REL_TOLERANCE[dtype_name.removeprefix("torch.")]
