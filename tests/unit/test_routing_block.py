"""Routing (sort by expert) and the MoE block against their twins.

Routing is integer work: ``tri`` and ``ref`` must be equal, element for element. The block is
compared with its twin (the stock per-expert loop) run in float64 from the same state dict:
outputs, router logits, and the gradients of every parameter and of the input.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from qmoe_doctor.core.shapes import PRESETS
from qmoe_doctor.kernels.grouped_gemm import moe_grouped_gemm_torch
from qmoe_doctor.kernels.moe_block import MoEBlock, MoEBlockTorch, resolve_shape
from qmoe_doctor.kernels.routing import Routing, sort_by_expert, sort_by_expert_torch
from qmoe_doctor.kernels.testing import BLOCK_CASES, BlockCase, assert_close, make_block_inputs, twin_of

# --------------------------------------------------------------------------------------------
# Routing.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RoutingCase:
    edge: str
    ids: tuple[tuple[int, ...], ...]  # (T, k)
    e: int
    dtype: torch.dtype = torch.int64


def _random_ids(t: int, k: int, e: int, seed: int) -> tuple[tuple[int, ...], ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(tuple(torch.randperm(e, generator=gen)[:k].tolist()) for _ in range(t))


ROUTING_CASES: tuple[RoutingCase, ...] = (
    RoutingCase(edge="random-top2-of-8", ids=_random_ids(20, 2, 8, 0), e=8),
    RoutingCase(edge="int32-ids", ids=_random_ids(20, 2, 8, 1), e=8, dtype=torch.int32),
    RoutingCase(edge="empty-experts", ids=((1, 5), (5, 1), (1, 5)), e=8),
    RoutingCase(edge="one-hot-expert-top1", ids=((3,), (3,), (3,), (3,)), e=4),
    RoutingCase(edge="all-in-last-expert", ids=((7,), (7,)), e=8),
    RoutingCase(edge="single-token", ids=((2, 0, 1),), e=3),
    RoutingCase(edge="no-tokens", ids=(), e=4),
    RoutingCase(edge="ties-keep-token-order", ids=((0, 1), (1, 0), (0, 1), (1, 0)), e=2),
    RoutingCase(edge="minus-one-sentinels-sort-last", ids=((0, -1), (-1, 1), (1, 0)), e=2),
    RoutingCase(edge="global-ids-past-e-sort-last", ids=((0, 9), (4, 1), (1, 0)), e=2),
)


def _ids_tensor(case: RoutingCase) -> torch.Tensor:
    if not case.ids:
        return torch.empty((0, 2), dtype=case.dtype)
    return torch.tensor(case.ids, dtype=case.dtype)


@pytest.mark.parametrize("case", ROUTING_CASES, ids=lambda c: c.edge)
def test_sort_by_expert_matches_twin(case: RoutingCase) -> None:
    ids = _ids_tensor(case)
    tri = sort_by_expert(ids, case.e)
    ref = sort_by_expert_torch(ids, case.e)
    for name in ("m_sizes", "token_idx", "perm", "inv_perm"):
        a, b = getattr(tri, name), getattr(ref, name)
        assert a.dtype == b.dtype, name
        assert torch.equal(a, b), f"{name}: {a.tolist()} != {b.tolist()}"
    assert tri.m_sizes.dtype == torch.int32


@pytest.mark.parametrize("case", ROUTING_CASES, ids=lambda c: c.edge)
def test_sort_by_expert_invariants(case: RoutingCase) -> None:
    ids = _ids_tensor(case)
    r: Routing = sort_by_expert(ids, case.e)
    flat = ids.reshape(-1).long()
    k = ids.shape[1]
    n = flat.numel()
    assert r.num_rows == n
    assert torch.equal(r.inv_perm[r.perm], torch.arange(n))
    assert torch.equal(r.token_idx, r.perm // k)
    valid = (flat >= 0) & (flat < case.e)
    assert int(r.m_sizes.sum()) == int(valid.sum())
    # the first sum(m_sizes) sorted rows run through the experts in order
    covered = int(r.m_sizes.sum())
    expected = torch.repeat_interleave(torch.arange(case.e), r.m_sizes.long())
    assert torch.equal(flat[r.perm[:covered]], expected)
    assert not valid[r.perm[covered:]].any()  # bad ids only after every expert's rows


def test_sort_by_expert_check_names_bad_ids() -> None:
    ids = torch.tensor([[0, 1], [-1, 1], [1, 5]])
    with pytest.raises(ValueError, match=r"2 expert ids outside \[0, 2\).*\[1, 0\]=-1.*\[2, 1\]=5"):
        sort_by_expert(ids, 2, check=True)
    with pytest.raises(ValueError, match="outside"):
        sort_by_expert_torch(ids, 2, check=True)
    sort_by_expert(torch.tensor([[0, 1]]), 2, check=True)  # valid ids pass


# --------------------------------------------------------------------------------------------
# The block.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: c.edge)
def test_block_forward_and_grads_match_twin(case: BlockCase) -> None:
    block, hidden = make_block_inputs(case)
    twin = twin_of(block)
    x = hidden.clone().requires_grad_(True)
    x64 = hidden.double().requires_grad_(True)

    out, logits = block(x)
    ref, ref_logits = twin(x64)
    assert out.dtype == case.dtype and logits.shape == (case.tokens, case.shape.num_experts)
    assert_close(ref, out, case.dtype, kind="block")
    assert_close(ref_logits, logits, case.dtype, kind="block")

    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out.float() * grad).sum().backward()
    (ref * grad.double()).sum().backward()
    assert x.grad is not None and x64.grad is not None
    assert_close(x64.grad, x.grad, case.dtype, kind="block")
    ref_params = dict(twin.named_parameters())
    for name, p in block.named_parameters():
        assert p.grad is not None, name
        ref_grad = ref_params[name].grad
        assert ref_grad is not None, name
        assert_close(ref_grad, p.grad, case.dtype, kind="block")


def test_block_runs_another_kernel() -> None:
    case = BLOCK_CASES[0]
    block, hidden = make_block_inputs(case)
    calls: list[int] = []

    def kernel(x: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return moe_grouped_gemm_torch(x, w, m_sizes)

    other = MoEBlock(case.shape, kernel=kernel)
    other.load_state_dict(block.state_dict())
    out, _ = other(hidden)
    assert calls == [case.tokens * case.shape.top_k] * 2  # gate_up and down
    assert_close(block(hidden)[0], out, torch.float32, kind="block")


def test_block_non_contiguous_hidden_states() -> None:
    block, hidden = make_block_inputs(BLOCK_CASES[0])
    strided = hidden.T.contiguous().T
    assert not strided.is_contiguous()
    assert_close(twin_of(block)(hidden.double())[0], block(strided)[0], torch.float32, kind="block")


def test_state_dict_round_trips_both_ways() -> None:
    block = MoEBlock("tiny")
    twin = MoEBlockTorch("tiny")
    assert {k: v.shape for k, v in block.state_dict().items()} == {
        k: v.shape for k, v in twin.state_dict().items()
    }
    assert set(block.state_dict()) == {"gate.weight", "gate_up_proj", "down_proj"}
    block.load_state_dict(twin.state_dict())
    assert torch.equal(block.gate_up_proj, twin.gate_up_proj)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build_on_meta(name: str) -> None:
    s = PRESETS[name]
    block = MoEBlock(name, device="meta", dtype=torch.bfloat16)
    assert block.gate_up_proj.shape == (s.num_experts, *s.gate_up_nk)
    assert block.down_proj.shape == (s.num_experts, *s.down_nk)
    assert block.gate.weight.shape == (s.num_experts, s.hidden)


def test_constructor_explicit_sizes_and_overrides() -> None:
    block = MoEBlock(num_experts=6, top_k=2, hidden=16, intermediate=8)
    assert block.gate_up_proj.shape == (6, 16, 16) and block.down_proj.shape == (6, 16, 8)
    over = resolve_shape("qwen3-30b-a3b", num_experts=4, top_k=2)
    assert (over.num_experts, over.top_k, over.hidden) == (4, 2, 2048)
    with pytest.raises(ValueError, match="missing"):
        resolve_shape(num_experts=4)
    with pytest.raises(ValueError, match="top_k=5 is more than num_experts=4"):
        resolve_shape(num_experts=4, top_k=5, hidden=8, intermediate=8)
    with pytest.raises(KeyError, match="unknown preset"):
        MoEBlock("qwen9")


def test_block_rejects_wrong_hidden_shape() -> None:
    block = MoEBlock("tiny")
    with pytest.raises(ValueError, match=r"hidden_states must be \(T, 64\)"):
        block(torch.randn(4, 32))

