"""Our fused MoE kernels (Triton), each with a plain-torch twin of the same signature.

Under ``TRITON_INTERPRET=1`` importing them also drops a check of Triton's interpreter that
changes no result (``interpreter.py``): every process that runs our kernels on the CPU gets it."""

from qmoe_doctor.kernels import interpreter as _interpreter
from qmoe_doctor.kernels.backward import (
    GroupedGemm,
    moe_fused_linear,
    moe_grouped_gemm_dw,
    moe_grouped_gemm_dw_torch,
    moe_grouped_gemm_dx,
    moe_grouped_gemm_dx_torch,
)
from qmoe_doctor.kernels.grouped_gemm import (
    GemmConfig,
    moe_grouped_gemm,
    moe_grouped_gemm_torch,
)
from qmoe_doctor.kernels.moe_block import MoEBlock, MoEBlockTorch
from qmoe_doctor.kernels.routing import Routing, sort_by_expert, sort_by_expert_torch

_interpreter.speed_up()  # read at each interpreted launch, so after the imports is early enough

__all__ = [
    "GemmConfig",
    "GroupedGemm",
    "MoEBlock",
    "MoEBlockTorch",
    "Routing",
    "moe_fused_linear",
    "moe_grouped_gemm",
    "moe_grouped_gemm_dw",
    "moe_grouped_gemm_dw_torch",
    "moe_grouped_gemm_dx",
    "moe_grouped_gemm_dx_torch",
    "moe_grouped_gemm_torch",
    "sort_by_expert",
    "sort_by_expert_torch",
]
