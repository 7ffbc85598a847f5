"""Rank hooks: what a framework does around the kernel in each rank, as seams a kernel module may
override (the specimens use them to plant rank-level faults).

A kernel named by ``--kernel module:function`` (or ``specimen:NAME``) is looked up as usual; its
*module* may also define

* ``qmoe_set_rank_device(device: torch.device) -> None``: make the rank's device current. The
  default calls ``torch.cuda.set_device(device)`` (nothing on the CPU);
* ``qmoe_local_expert_ids(ids: Tensor, first_expert: int, num_local: int) -> Tensor``: under
  expert parallelism, the local id in ``[0, num_local)`` of each global expert id a rank
  received. The default is ``ids - first_expert``.

Nothing else of the module is used. Both defaults are correct; a module that defines neither
runs exactly as the built-in kernel's ranks do.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

SET_DEVICE_HOOK = "qmoe_set_rank_device"
LOCAL_IDS_HOOK = "qmoe_local_expert_ids"

SetDevice = Callable[[torch.device], None]
LocalIds = Callable[[torch.Tensor, int, int], torch.Tensor]


def set_rank_device(device: torch.device) -> None:
    """The correct set-up: the rank's GPU becomes its current device, first thing."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def local_expert_ids(ids: torch.Tensor, first_expert: int, num_local: int) -> torch.Tensor:
    """The correct remap: global expert ``first_expert + j`` is local expert ``j``."""
    del num_local  # the ids a rank receives are its own experts' by construction
    return ids - first_expert


@dataclass(frozen=True, slots=True)
class RankHooks:
    set_device: SetDevice
    local_expert_ids: LocalIds
    overridden: tuple[str, ...]  # hook names the kernel's module defines


def hooks_for(kernel: Any) -> RankHooks:
    """The hooks of ``kernel``'s module, with the correct defaults for those it lacks."""
    module = inspect.getmodule(kernel)
    set_device = getattr(module, SET_DEVICE_HOOK, None) if module is not None else None
    local_ids = getattr(module, LOCAL_IDS_HOOK, None) if module is not None else None
    overridden = tuple(
        name for name, hook in ((SET_DEVICE_HOOK, set_device), (LOCAL_IDS_HOOK, local_ids)) if callable(hook)
    )
    return RankHooks(
        set_device=set_device if callable(set_device) else set_rank_device,
        local_expert_ids=local_ids if callable(local_ids) else local_expert_ids,
        overridden=overridden,
    )


__all__ = [
    "LOCAL_IDS_HOOK",
    "SET_DEVICE_HOOK",
    "RankHooks",
    "hooks_for",
    "local_expert_ids",
    "set_rank_device",
]
