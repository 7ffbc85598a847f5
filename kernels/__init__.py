"""Our fused MoE kernels (Triton), each with a plain-torch twin of the same signature."""

from qmoe_doctor.kernels.grouped_gemm import (
    GemmConfig,
    moe_grouped_gemm,
    moe_grouped_gemm_torch,
)

__all__ = ["GemmConfig", "moe_grouped_gemm", "moe_grouped_gemm_torch"]
