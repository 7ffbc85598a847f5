"""Specimen ``gather_sms_device0``: plants ``per-device-state-cached``.

What it does wrong: the correct ``gather_scatter`` ragged matmul, its persistent grid sized from
the SM count of device 0, read once at the first call and kept in a module global
(``torch.cuda.get_device_properties(0).multi_processor_count``), as public persistent kernels'
wrappers write it, instead of the operands' device (``grouped_gemm.num_sms(x.device.index)``). The
launch itself is guarded and every buffer is on the operands' device.

When it misbehaves: only where device 0 is not the operands' device and has another SM count: a
host of two GPU models (the grid sized for the other card: idle SMs, or more programs than
SMs), or ``CUDA_VISIBLE_DEVICES`` reordering the cards so that ordinal 0 is not the card the
tuning assumed. Its tile walk is right for any number of programs, so the numbers stay right:
no scan cell can see it on identical GPUs (the H100 and H200 both have 132 SMs), and a pair of
cards of different SM counts would show it only as time, which no cell of a single-device group
compares. ``qmoe-doctor lint`` (rule ``cached-device-property``, a fixed index cached in a
global) names it, and so ``check`` does. Under the interpreter (CPU tensors) the grid is 4
programs, as in ``gather_scatter``.
"""

from __future__ import annotations

import torch

from qmoe_doctor.kernels.specimens.gather_scatter import Routing, _ragged_kernel, forward, route

_NUM_SMS: int | None = None  # device 0's SM count, reused for every device


def _programs(device: torch.device, tiles: int) -> int:
    global _NUM_SMS
    if device.type != "cuda":
        return max(1, min(4, tiles))
    if _NUM_SMS is None:
        # PLANTED: device 0's SM count, once; gather_scatter.programs_for reads the operands' device
        _NUM_SMS = int(torch.cuda.get_device_properties(0).multi_processor_count)
    return max(1, min(_NUM_SMS, tiles))


def ragged_moe(
    hidden_states: torch.Tensor,  # (T, H)
    w: torch.Tensor,  # (E, N, H)
    topk_ids: torch.Tensor,  # (T, k)
    topk_weights: torch.Tensor,  # (T, k)
    expert_map: torch.Tensor | None = None,  # (E_global,) global id -> local id, -1 elsewhere
    *,
    routing: Routing | None = None,  # a routing of these ids (route's dict); None: made here
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``gather_scatter.ragged_moe`` with the grid of device 0's SM count."""
    return forward(
        _ragged_kernel,
        route,
        hidden_states,
        w,
        topk_ids,
        topk_weights,
        expert_map,
        routing,
        out_dtype,
        _programs,
    )


ragged_moe.route = route  # type: ignore[attr-defined]
