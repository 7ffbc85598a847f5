"""The Qwen3-MoE sparse block on our kernels, and its stock per-expert-loop twin.

``MoEBlock.forward(hidden_states (T, H)) -> (out (T, H), router_logits (T, E))``:

1. router: ``gate`` Linear(H, E, bias=False); softmax in float32; top-k; renormalize the k
   weights when ``norm_topk_prob``; weights cast back to the hidden dtype (as Transformers does);
2. ``sort_by_expert``: the T*k (token, slot) rows sorted by expert, gathered from the tokens;
3. ``moe_fused_linear`` with ``gate_up_proj`` (E, 2*I, H): gate is the first I columns, up the
   last I; ``SiLU(gate) * up``; ``moe_fused_linear`` with ``down_proj`` (E, H, I);
4. each row times its routing weight, summed back to its token (``combine.combine_rows``: a
   segment sum without atomics; ``gather_rows`` is step 2's gather with the same backward).

``kernel=`` is the forward grouped GEMM (the signature of ``moe_grouped_gemm``), ours by default,
so the doctor can run the same block on another kernel; backward is always our dx/dw kernels.

``MoEBlockTorch`` is the twin: the stock Transformers loop over experts (``x @ w[e].T``), with the
same parameter names and shapes, so ``twin.load_state_dict(block.state_dict())`` works.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from qmoe_doctor.core.shapes import MoEShape, get_preset
from qmoe_doctor.kernels.backward import GroupedGemm, moe_fused_linear
from qmoe_doctor.kernels.combine import combine_rows, gather_rows
from qmoe_doctor.kernels.grouped_gemm import moe_grouped_gemm
from qmoe_doctor.kernels.routing import sort_by_expert

__all__ = ["MoEBlock", "MoEBlockTorch", "resolve_shape", "route_tokens"]


def resolve_shape(
    shape: MoEShape | str | None = None,
    *,
    num_experts: int | None = None,
    top_k: int | None = None,
    hidden: int | None = None,
    intermediate: int | None = None,
    norm_topk_prob: bool | None = None,
) -> MoEShape:
    """A preset (object or name) with explicit sizes overriding it, or explicit sizes alone."""
    if isinstance(shape, str):
        shape = get_preset(shape)
    if shape is None:
        sizes = {"num_experts": num_experts, "top_k": top_k, "hidden": hidden, "intermediate": intermediate}
        missing = [key for key, value in sizes.items() if value is None]
        if missing:
            raise ValueError(f"give a MoEShape (or preset name) or all of the sizes; missing: {missing}")
        shape = MoEShape(name="custom", num_experts=0, top_k=0, hidden=0, intermediate=0)
    overridden = dataclasses.replace(
        shape,
        num_experts=shape.num_experts if num_experts is None else num_experts,
        top_k=shape.top_k if top_k is None else top_k,
        hidden=shape.hidden if hidden is None else hidden,
        intermediate=shape.intermediate if intermediate is None else intermediate,
        norm_topk_prob=shape.norm_topk_prob if norm_topk_prob is None else norm_topk_prob,
    )
    if overridden != shape and shape.name != "custom":
        overridden = dataclasses.replace(overridden, name=f"{shape.name}-custom")
    shape = overridden
    for key in ("num_experts", "top_k", "hidden", "intermediate"):
        if getattr(shape, key) <= 0:
            raise ValueError(f"{key} must be positive, got {getattr(shape, key)}")
    if shape.top_k > shape.num_experts:
        raise ValueError(f"top_k={shape.top_k} is more than num_experts={shape.num_experts}")
    return shape


def route_tokens(
    gate: nn.Linear, shape: MoEShape, hidden_states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router: ``gate`` (Linear(H, E)), softmax in float32, top-k, the k weights renormalized
    when ``shape.norm_topk_prob``, cast back to the hidden dtype. hidden_states (T, H) ->
    router_logits (T, E), topk_weights (T, k), topk_ids (T, k). The block, its twin and the
    expert-parallel block of ``probes/parallel`` all route through it."""
    if hidden_states.dim() != 2 or hidden_states.shape[1] != shape.hidden:
        raise ValueError(f"hidden_states must be (T, {shape.hidden}), got shape {tuple(hidden_states.shape)}")
    router_logits = gate(hidden_states)
    probs = F.softmax(router_logits, dim=1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, shape.top_k, dim=-1)
    if shape.norm_topk_prob:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return router_logits, topk_weights.to(hidden_states.dtype), topk_ids


class _SparseMoEBase(nn.Module):
    """Parameters and router shared by the block and its twin (same names, same shapes)."""

    def __init__(
        self,
        shape: MoEShape | str | None = None,
        *,
        num_experts: int | None = None,
        top_k: int | None = None,
        hidden: int | None = None,
        intermediate: int | None = None,
        norm_topk_prob: bool | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.shape = resolve_shape(
            shape,
            num_experts=num_experts,
            top_k=top_k,
            hidden=hidden,
            intermediate=intermediate,
            norm_topk_prob=norm_topk_prob,
        )
        s = self.shape
        self.num_experts = s.num_experts
        self.top_k = s.top_k
        self.norm_topk_prob = s.norm_topk_prob
        self.gate = nn.Linear(s.hidden, s.num_experts, bias=False, device=device, dtype=dtype)
        # (E, 2*I, H): rows [0, I) are gate_proj, rows [I, 2I) are up_proj of each expert
        self.gate_up_proj = nn.Parameter(
            torch.empty(s.num_experts, 2 * s.intermediate, s.hidden, device=device, dtype=dtype)
        )
        # (E, H, I)
        self.down_proj = nn.Parameter(
            torch.empty(s.num_experts, s.hidden, s.intermediate, device=device, dtype=dtype)
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # scaled so activations keep unit size through both GEMMs (tests compare real numbers)
        if self.gate_up_proj.is_meta:
            return  # shapes only (a 480B-class stack planned without memory): nothing to fill
        with torch.no_grad():
            nn.init.normal_(self.gate.weight, std=self.shape.hidden**-0.5)
            nn.init.normal_(self.gate_up_proj, std=self.shape.hidden**-0.5)
            nn.init.normal_(self.down_proj, std=self.shape.intermediate**-0.5)

    def route(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> router_logits (T, E), topk_weights (T, k) in the hidden dtype, topk_ids (T, k)."""
        return route_tokens(self.gate, self.shape, hidden_states)

    def extra_repr(self) -> str:
        s = self.shape
        return (
            f"experts={s.num_experts}, top_k={s.top_k}, hidden={s.hidden}, "
            f"intermediate={s.intermediate}, norm_topk_prob={s.norm_topk_prob}"
        )


class MoEBlock(_SparseMoEBase):
    """The Qwen3-MoE sparse block on the fused grouped GEMM (see the module docstring)."""

    def __init__(
        self,
        shape: MoEShape | str | None = None,
        *,
        num_experts: int | None = None,
        top_k: int | None = None,
        hidden: int | None = None,
        intermediate: int | None = None,
        norm_topk_prob: bool | None = None,
        kernel: GroupedGemm = moe_grouped_gemm,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(
            shape,
            num_experts=num_experts,
            top_k=top_k,
            hidden=hidden,
            intermediate=intermediate,
            norm_topk_prob=norm_topk_prob,
            device=device,
            dtype=dtype,
        )
        self.kernel = kernel

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        router_logits, topk_weights, topk_ids = self.route(hidden_states)
        routing = sort_by_expert(topk_ids, self.num_experts)
        tokens, k = topk_ids.shape
        # token t's k rows sit at sorted positions inv_perm[t*k : t*k + k]
        starts = torch.arange(0, tokens * k + 1, k, device=hidden_states.device)
        x = gather_rows(hidden_states, routing.token_idx, routing.inv_perm, starts)  # (T*k, H) sorted
        gate_up = moe_fused_linear(x, self.gate_up_proj, routing.m_sizes, kernel=self.kernel)  # (T*k, 2I)
        gate, up = gate_up.chunk(2, dim=-1)
        act = F.silu(gate) * up  # (T*k, I)
        down = moe_fused_linear(act, self.down_proj, routing.m_sizes, kernel=self.kernel)  # (T*k, H)
        # out[t] = sum_k topk_weights[t, k] * down[inv_perm[t*k + k]]: one pass, no atomics
        out = combine_rows(down, routing.inv_perm, starts, topk_weights.reshape(-1))
        return out, router_logits


class MoEBlockTorch(_SparseMoEBase):
    """The twin: Transformers' Qwen3MoeSparseMoeBlock loop over experts, same parameters."""

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        router_logits, topk_weights, topk_ids = self.route(hidden_states)
        out = torch.zeros_like(hidden_states)
        # (E, k, T): expert_mask[e, slot, token] is 1 where token chose e in that slot
        expert_mask = F.one_hot(topk_ids, num_classes=self.num_experts).permute(2, 1, 0)
        for expert in range(self.num_experts):
            slot, token = torch.where(expert_mask[expert])
            if token.numel() == 0:
                continue
            x = hidden_states[token]
            gate, up = (x @ self.gate_up_proj[expert].T).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ self.down_proj[expert].T
            y = y * topk_weights[token, slot, None]
            out.index_add_(0, token, y.to(hidden_states.dtype))
        return out, router_logits
