"""Model shape presets (pure data, no torch): used by the kernels, the planner and the audit."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class MoEShape:
    """The shape of one Qwen3-MoE sparse block."""

    name: str
    num_experts: int  # E
    top_k: int  # experts per token
    hidden: int  # hidden_size (K of gate_up, N of down)
    intermediate: int  # moe_intermediate_size (gate_up has 2 * intermediate rows per expert)
    norm_topk_prob: bool = True

    @property
    def gate_up_nk(self) -> tuple[int, int]:
        """(N, K) of one expert of the fused gate_up stack."""
        return 2 * self.intermediate, self.hidden

    @property
    def down_nk(self) -> tuple[int, int]:
        """(N, K) of one expert of the down stack."""
        return self.hidden, self.intermediate


PRESETS: dict[str, MoEShape] = {
    p.name: p
    for p in (
        MoEShape(name="tiny", num_experts=8, top_k=2, hidden=64, intermediate=32),
        MoEShape(name="qwen3-30b-a3b", num_experts=128, top_k=8, hidden=2048, intermediate=768),
        MoEShape(name="qwen3-235b-a22b", num_experts=128, top_k=8, hidden=4096, intermediate=1536),
        MoEShape(name="qwen3-coder-480b-a35b", num_experts=160, top_k=8, hidden=6144, intermediate=2560),
    )
}


def get_preset(name: str) -> MoEShape:
    try:
        return PRESETS[name]
    except KeyError:
        known = ", ".join(PRESETS)
        raise KeyError(f"unknown preset {name!r}; known presets: {known}") from None
