"""The routed protocol, child side: kernels that take the router's token ids instead of counts.

A routed kernel is ``fn(hidden_states (T, H), w (E, N, H), topk_ids (T, k), topk_weights (T, k)[,
expert_map]) -> out`` (``qmoe_doctor.core.kernel_ref.Protocol``): ``adapter:routed:TARGET`` takes
``out (T, N)``, each token's slots reduced with their weights; ``adapter:routed-rows:TARGET``
takes ``out (T*k, N)``, one unweighted row per slot. Its plain-torch twins are
``qmoe_doctor.kernels.routed.routed_moe_torch`` / ``routed_moe_rows_torch``.

The loaded object is a :class:`RoutedKernel`. The probes of the ``m_sizes`` protocol (single,
the placements, peer access, stream orders, offsets, the int32 expert boundary) call it as
``fn(x, w, m_sizes)``: x's M rows become M tokens with one slot each (k = 1), each row's expert
read from ``m_sizes`` on the device (a ``searchsorted`` of its running sum, no synchronization:
a race on the counts stays a race on the ids), weight 1. The routed cells
(``probes/routed_conditions.py``) call ``routed_fn`` itself with real top-k routing and its edges.

What a routed kernel may also declare, found by looking at it (nothing to register):

* ``expert_map``: a fifth parameter of that name (or a fifth positional one) takes a global ->
  local expert map; without it the expert-map cells are skipped with the reason.
* its routing step: ``fn.route(topk_ids, topk_weights, num_experts, expert_map=None)`` returning a
  dict of tensors, and a ``routing=`` parameter that takes that dict instead of routing itself.
  The keys say the style: ``sorted_token_ids`` (P,) int32 flat slot ids per padded position (the
  padding holds T*k), ``expert_ids`` (P // BLOCK_M,) int32 the local expert of each block (-1: none)
  and ``num_tokens_post_padded`` (1,) int32 (the sorted-token-ids style); or ``hist`` (E,) int32
  rows per expert, ``gather_indx`` (T*k,) int32 sorted position -> flat slot id (-1 past the routed
  rows) and ``scatter_indx`` (T*k,) int32 flat slot id -> sorted position (-1: routed nowhere)
  (the gather/scatter style). The padded-count and gather-past-T cells hand the kernel its own
  routing with one entry lying.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from qmoe_doctor.core.kernel_ref import BUILTIN_ADAPTERS
from qmoe_doctor.probes.adapters import AdaptedKernel, KernelLimits
from qmoe_doctor.probes.loader import KernelFn

__all__ = [
    "ROUTED",
    "ROUTED_ROWS",
    "RoutedAdapter",
    "RoutedKernel",
    "as_routed",
    "m_sizes_view",
    "routing_style",
]

#: The routed signature, in messages.
ROUTED_SIGNATURE = "fn(hidden_states, w, topk_ids, topk_weights[, expert_map])"
SORTED_KEYS = frozenset({"sorted_token_ids", "expert_ids", "num_tokens_post_padded"})
GATHER_KEYS = frozenset({"hist", "gather_indx", "scatter_indx"})


def m_sizes_view(routed_fn: KernelFn) -> KernelFn:
    """``fn(x, w, m_sizes)`` over a routed kernel: x's rows as tokens with one slot each. Rows
    past ``sum(m_sizes)`` get the id E (routed nowhere: zero, as the ``m_sizes`` twin has them)."""

    def fn(x: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor) -> Any:
        m = x.shape[0]
        ends = torch.cumsum(m_sizes.to(torch.int64), 0)
        expert = torch.searchsorted(ends, torch.arange(m, device=m_sizes.device), right=True)
        topk_ids = expert.unsqueeze(1)  # (M, 1) int64, as torch.topk gives ids
        topk_weights = torch.ones((m, 1), dtype=x.dtype, device=x.device)
        return routed_fn(x, w, topk_ids, topk_weights)

    fn.__name__ = getattr(routed_fn, "__name__", "routed_kernel")
    fn.__qualname__ = f"m_sizes_view({fn.__name__})"
    return fn


def _parameters(fn: Any) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None


def takes_expert_map(fn: Any) -> bool:
    """``fn`` has an ``expert_map`` parameter (or five positional ones)."""
    params = _parameters(fn)
    if params is None:
        return False
    if any(p.name == "expert_map" for p in params):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 5 or any(p.kind is p.VAR_POSITIONAL for p in params)


def routing_step(fn: Any) -> Callable[..., Any] | None:
    """The kernel's own routing step (``fn.route``) when it also takes ``routing=``; else None."""
    route = getattr(fn, "route", None)
    params = _parameters(fn)
    if not callable(route) or params is None:
        return None
    return route if any(p.name == "routing" for p in params) else None


def routing_style(routing: Any) -> str | None:
    """The style of a routing step's dict from its keys: "sorted", "gather", or None."""
    if not isinstance(routing, dict):
        return None
    if SORTED_KEYS <= set(routing):
        return "sorted"
    if GATHER_KEYS <= set(routing):
        return "gather"
    return None


class RoutedKernel(AdaptedKernel):
    """A routed kernel: callable as ``fn(x, w, m_sizes)`` (:func:`m_sizes_view`), with the
    routed function and what it declares for the routed cells."""

    def __init__(
        self, routed_fn: KernelFn, *, rows: bool, ref: str = "", limits: KernelLimits | None = None
    ) -> None:
        super().__init__(m_sizes_view(routed_fn), ref=ref, limits=limits or KernelLimits())
        self.routed_fn = routed_fn
        self.rows = rows  # out is (T*k, N) unweighted, else (T, N) reduced
        self.protocol = "routed-rows" if rows else "routed"
        self.takes_expert_map = takes_expert_map(routed_fn)
        self.route = routing_step(routed_fn)

    def __repr__(self) -> str:
        return f"RoutedKernel({self.ref!r}, protocol={self.protocol})"


def as_routed(kernel: Any) -> RoutedKernel | None:
    """The RoutedKernel behind a (watched) kernel, or None for a kernel of the m_sizes protocol."""
    seen = 0
    while kernel is not None and seen < 8:
        if isinstance(kernel, RoutedKernel):
            return kernel
        kernel = getattr(kernel, "__wrapped__", None)
        seen += 1
    return None


def _check_routed_signature(fn: Any) -> None:
    params = _parameters(fn)
    if params is None:
        return  # builtins / C extensions: the call will tell
    try:
        inspect.Signature(params).bind(object(), object(), object(), object())
    except TypeError as exc:
        raise TypeError(
            f"{getattr(fn, '__name__', fn)!r} has signature {inspect.Signature(params)}; the routed protocol "
            f"calls {ROUTED_SIGNATURE}: {exc}"
        ) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class RoutedAdapter:
    """``adapter:routed[:TARGET]`` / ``adapter:routed-rows[:TARGET]`` (a KernelAdapter)."""

    rows: bool
    default_target: str
    dtypes: frozenset[str] | None = None
    needs_contiguous: bool = False
    supports_cpu: bool = True

    def adapt(self, target: Any) -> RoutedKernel:
        routed = as_routed(target)
        fn = routed.routed_fn if routed is not None else target  # a routed specimen, loaded already
        if not callable(fn):
            raise TypeError(f"the target is a {type(fn).__name__}, not a function {ROUTED_SIGNATURE}")
        _check_routed_signature(fn)
        return RoutedKernel(fn, rows=self.rows)


#: ``adapter:routed[:TARGET]``: out (T, N), the slots reduced with their weights.
ROUTED = RoutedAdapter(rows=False, default_target=str(BUILTIN_ADAPTERS["routed"].default_target))
#: ``adapter:routed-rows[:TARGET]``: out (T*k, N), one unweighted row per slot.
ROUTED_ROWS = RoutedAdapter(rows=True, default_target=str(BUILTIN_ADAPTERS["routed-rows"].default_target))
