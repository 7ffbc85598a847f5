"""Tolerances, stated once per dtype: ||out - ref|| / ||ref|| against a float32 (or float64) twin.

The one table: the probes, the kernel tests (``qmoe_doctor.kernels.testing.assert_close``), the
benchmarks and the repro scripts read it, so CI (the interpreter) is never looser than a GPU
run. bf16 operands land between 1e-3 and 1e-2 (1.7e-3 measured on H200 at M=4096, E=128,
N=768, K=2048); float32 dots run as tf32 on the GPU (~3e-4), ~1e-7 in the interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

#: What was compared: one grouped GEMM (forward, dx, dw), or the MoE block (two GEMMs, an
#: activation and a weighted sum; its outputs and every gradient).
ToleranceKind = Literal["gemm", "block"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Tolerance:
    gemm: float
    block: float  # a block chains two GEMMs: about twice one GEMM's error


#: dtype, named as torch prints it without "torch." -> tolerances
TOLERANCES: dict[str, Tolerance] = {
    "bfloat16": Tolerance(gemm=1e-2, block=2e-2),
    "float16": Tolerance(gemm=2e-3, block=4e-3),  # measured 2e-4 (interpreter) for one GEMM
    "float32": Tolerance(gemm=2e-3, block=4e-3),
}

#: The GEMM column alone (what a single-GEMM repro script states).
REL_TOLERANCE: dict[str, float] = {name: t.gemm for name, t in TOLERANCES.items()}


def tolerance(dtype_name: str, kind: ToleranceKind = "gemm") -> float:
    """Tolerance for a dtype named as torch prints it ("bfloat16" or "torch.bfloat16")."""
    entry = TOLERANCES[dtype_name.removeprefix("torch.")]
    return entry.block if kind == "block" else entry.gemm
