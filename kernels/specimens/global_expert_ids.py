"""Specimen ``global_expert_ids``: plants ``invalid-routing``.

What it does wrong: its rank hook ``qmoe_local_expert_ids`` (called by each rank of expert
parallelism in ``qmoe-doctor scan --parallel ep``, see ``probes/parallel/hooks.py``) returns
the router's *global* expert ids unchanged instead of remapping them to the rank's own weight
stack (``ids - first_expert``). The grouped GEMM is the correct one.

When it misbehaves: under expert parallelism, on every rank but the first: rank r owns experts
``[r * E_local, (r + 1) * E_local)`` and receives exactly those ids, all of them past the end of
its local stack of ``E_local`` experts. Our routing counts such rows under no expert, so that
rank's experts return zero rows (silently wrong, for the tokens of every rank routed there); a
kernel that indexes its weights by id reads past the stack instead. Rank 0's ids are the same
globally and locally, so it computes right. Without expert parallelism (one device, data,
tensor or pipeline parallelism) the hook is never called and the kernel is identical to
``grouped_gemm.moe_grouped_gemm``.
"""

from __future__ import annotations

import torch

from qmoe_doctor.kernels.grouped_gemm import moe_grouped_gemm as _correct_grouped_gemm


def moe_grouped_gemm(
    x: torch.Tensor,  # (M, K) rows sorted by expert
    w: torch.Tensor,  # (E, N, K)
    m_sizes: torch.Tensor,  # (E,) rows per expert
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    return _correct_grouped_gemm(x, w, m_sizes, out_dtype=out_dtype)


def qmoe_local_expert_ids(ids: torch.Tensor, first_expert: int, num_local: int) -> torch.Tensor:
    """Rank hook: the rank's local id (in ``[0, num_local)``) of each global expert id it got."""
    del first_expert, num_local
    # PLANTED: no remap; the correct hook returns ids - first_expert
    return ids
