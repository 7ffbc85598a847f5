"""Specimen ``rank_no_set_device``: plants ``device-never-set``.

What it does wrong: its rank hook ``qmoe_set_rank_device`` (called by every rank of
``qmoe-doctor scan --parallel``, see ``probes/parallel/hooks.py``) never calls
``torch.cuda.set_device``, as a training script that only does ``model.to(f"cuda:{local_rank}")``
never does. Each rank's tensors live on its own GPU, but its *current* device stays cuda:0.
The kernel entry point is the wrapper of the ``default_buffer`` specimen: its output is made with
``device="cuda"``, that is on the current device, as many public wrappers make theirs.

When it misbehaves: in every rank whose local rank is not 0, under data, tensor and expert
parallelism: the first kernel call allocates its output on cuda:0 (creating a CUDA context and
memory there, the "every rank shows up on GPU 0" symptom), and the launch on the rank's own GPU
cannot reach that buffer (``Pointer argument (at 2) cannot be accessed from Triton``) or, once
peer access is on, writes it remotely and returns it on the wrong GPU. Rank 0 (cuda:0 is its own
device), one process on one device, and the CPU (interpreter) are unaffected: there it is
identical to ``grouped_gemm.moe_grouped_gemm``.
"""

from __future__ import annotations

import torch

from qmoe_doctor.kernels.specimens import default_buffer


def moe_grouped_gemm(
    x: torch.Tensor,  # (M, K) rows sorted by expert
    w: torch.Tensor,  # (E, N, K)
    m_sizes: torch.Tensor,  # (E,) rows per expert
    *,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    # right whenever the current device is x.device: the planted fault is the rank's, below
    return default_buffer.moe_grouped_gemm(x, w, m_sizes, out_dtype=out_dtype)


def qmoe_set_rank_device(device: torch.device) -> None:
    """Rank hook: make ``device`` (``cuda:<local rank>``) this rank's current device."""
    # PLANTED: nothing here; the correct hook calls torch.cuda.set_device(device), so every
    # default allocation and unguarded launch of this rank follows cuda:0.
    del device
