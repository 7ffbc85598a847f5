"""Backward kernels (``tri``) against their twins in float64 (``ref``), one row per edge.

dx reuses the forward case table (the 2-D operand is dy). dw has its own table
(``kernels.testing.DW_CASES``): its operands are dy (M, N) and x (M, K), and its output
(E, N, K) is poisoned with NaN inside a CANARY buffer, so every element must be written (empty
experts give zeros, never stale memory).
"""

from __future__ import annotations

import pytest
import torch

from qmoe_doctor.kernels.backward import (
    deferred_weight_grads,
    dw_grid_size,
    launch_grouped_gemm_dw,
    moe_fused_linear,
    moe_grouped_gemm_dw,
    moe_grouped_gemm_dw_torch,
    moe_grouped_gemm_dx,
    moe_grouped_gemm_dx_torch,
    pick_dw_config,
    row_bounds,
    row_bounds_torch,
)
from qmoe_doctor.kernels.grouped_gemm import moe_grouped_gemm, moe_grouped_gemm_torch
from qmoe_doctor.kernels.testing import (
    DW_CASES,
    GEMM_CASES,
    DwCase,
    GemmCase,
    assert_canary_intact,
    assert_close,
    case_id,
    dw_operands,
    gemm_operands,
    poisoned_output,
)

# --------------------------------------------------------------------------------------------
# dx: the forward table, dy in the 2-D operand's layout.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", GEMM_CASES, ids=case_id)
def test_dx_matches_reference(case: GemmCase) -> None:
    dy, w, m_sizes = gemm_operands(case, torch.float32, n_first=True)
    tri = moe_grouped_gemm_dx(dy, w, m_sizes, config=case.config)
    ref = moe_grouped_gemm_dx_torch(dy.double(), w.double(), m_sizes)
    assert tri.shape == (case.m, case.k)
    assert_close(ref, tri, torch.float32)
    assert (tri[case.covered_rows() :] == 0).all(), "rows no expert covers must be zeros"


# --------------------------------------------------------------------------------------------
# dw: its own table.
# --------------------------------------------------------------------------------------------


def dw_ref(dy: torch.Tensor, x: torch.Tensor, m_sizes: torch.Tensor) -> torch.Tensor:
    return moe_grouped_gemm_dw_torch(dy.double(), x.double(), m_sizes)


@pytest.mark.parametrize("case", DW_CASES, ids=lambda c: c.edge)
def test_dw_matches_reference(case: DwCase) -> None:
    dy, x, m_sizes = dw_operands(case, torch.float32)
    tri = moe_grouped_gemm_dw(dy, x, m_sizes, config=case.config)
    assert tri.shape == (case.e, case.n, case.k)
    ref = dw_ref(dy, x, m_sizes)
    assert_close(ref, tri, torch.float32)
    empty = (ref == 0).flatten(1).all(dim=1)  # experts with no rows
    assert (tri[empty] == 0).all(), "experts with no rows must get zero dw"


@pytest.mark.parametrize("case", DW_CASES, ids=lambda c: c.edge)
def test_dw_writes_every_element_and_nothing_else(case: DwCase) -> None:
    dy, x, m_sizes = dw_operands(case, torch.float32)
    dw, buf, inside = poisoned_output((case.e, case.n, case.k), torch.float32, "cpu")
    cfg = case.config or pick_dw_config(case.n, case.k, x.device, x.dtype)
    bounds = row_bounds(m_sizes, case.m)
    launch_grouped_gemm_dw(dy, x, dw, bounds, cfg, dw_grid_size(case.e, case.n, case.k, cfg, x.device))
    assert_close(dw_ref(dy, x, m_sizes), dw, torch.float32)
    assert_canary_intact(buf, inside)


# The resident kernels take 16-bit operands (tensor descriptors): float16 under the interpreter.
# 16-row chunks: the cases' experts have 0 to 64 rows, so each path is taken (empty experts,
# one chunk shifted before the expert, several chunks with the last one overlapping, and more
# chunks than MAX_CHUNKS); dy resident ("-r") and x resident ("-rx").
RESIDENT_CONFIGS = ["16x32x32-w4-s2-tma-r2", "16x32x32-w4-s2-tma-rx2", "16x32x32-w4-s2-tma-r1", "16x32x32-w4-s2-tma-r5"]


@pytest.mark.parametrize("name", RESIDENT_CONFIGS)
@pytest.mark.parametrize("case", DW_CASES, ids=lambda c: c.edge)
def test_dw_resident_matches_reference(case: DwCase, name: str) -> None:
    from qmoe_doctor.kernels.backward import dw_tma_plan
    from qmoe_doctor.kernels.tuning import config_from_name

    cfg = config_from_name(name)
    dy, x, m_sizes = dw_operands(case, torch.float16)
    dw = torch.empty((case.e, case.n, case.k), dtype=torch.float16)
    aligned = case.n % 8 == 0 and case.k % 8 == 0  # 16-byte rows: what a descriptor needs
    if case.dy_view == case.x_view == "contiguous" and aligned:  # else the pointer kernel serves
        assert dw_tma_plan(dy, x, dw, cfg) is not None, "this case should take the resident kernel"
    tri = moe_grouped_gemm_dw(dy, x, m_sizes, config=cfg)
    assert_close(dw_ref(dy, x, m_sizes), tri, torch.float16)
    empty = (dw_ref(dy, x, m_sizes) == 0).flatten(1).all(dim=1)
    assert (tri[empty] == 0).all(), "experts with no rows must get zero dw"


@pytest.mark.parametrize("name", RESIDENT_CONFIGS)
def test_dw_resident_never_reads_unrouted_rows(name: str) -> None:
    """Rows after the routed ones (capacity padding, garbage) hold NaN: no chunk may reach them,
    since the resident kernel masks only one operand (0 * NaN is NaN)."""
    from qmoe_doctor.kernels.tuning import config_from_name

    gen = torch.Generator().manual_seed(11)
    sizes = torch.tensor([3, 0, 37, 5], dtype=torch.int32)  # 45 of 64 rows routed
    dy = torch.randn(64, 32, generator=gen).half()
    x = torch.randn(64, 48, generator=gen).half()
    dy[45:] = float("nan")
    x[45:] = float("nan")
    tri = moe_grouped_gemm_dw(dy, x, sizes, config=config_from_name(name))
    assert_close(dw_ref(dy[:45], x[:45], sizes), tri, torch.float16)


@pytest.mark.parametrize("edge", ["prime-mnk", "dy-and-x-sliced"])
def test_dw_float16(edge: str) -> None:
    (case,) = [c for c in DW_CASES if c.edge == edge]
    dy, x, m_sizes = dw_operands(case, torch.float16)
    tri = moe_grouped_gemm_dw(dy, x, m_sizes)
    assert tri.dtype == torch.float16
    assert_close(dw_ref(dy, x, m_sizes), tri, torch.float16)


# Up to FOLDED_MAX_EXPERTS experts every dw kernel sums the experts' row bounds from m_sizes
# itself (one launch per call); past it they come from ``row_bounds``' launch (two). Both must
# give the same dw, bit for bit (the same tiles and order of the sums), on every edge: negative
# counts, counts past M, int64 counts past 2**31. Each kernel form: pointer, flat, TMA, resident.
FOLD_CONFIGS = ["16x16x16-w4-s1", "16x32x16-w4-s1-flat", "16x32x32-w4-s2-tma", "16x32x32-w4-s2-tma-r2", "16x32x32-w4-s2-tma-rx2"]


@pytest.mark.parametrize("name", FOLD_CONFIGS)
@pytest.mark.parametrize("case", DW_CASES, ids=lambda c: c.edge)
def test_dw_sums_its_row_bounds_as_the_bounds_launch_does(
    case: DwCase, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qmoe_doctor.kernels import backward, launch
    from qmoe_doctor.kernels.tuning import config_from_name

    cfg = config_from_name(name)
    dtype = torch.float16 if cfg.tma else torch.float32
    dy, x, m_sizes = dw_operands(case, dtype)
    out: dict[str, torch.Tensor] = {}
    launches: dict[str, int] = {}
    for how, limit in (("folded", backward.FOLDED_MAX_EXPERTS), ("launched", 0)):
        monkeypatch.setattr(backward, "FOLDED_MAX_EXPERTS", limit)
        monkeypatch.setattr(backward, "_DW_PLANS", {})
        before = launch.counts.standard + launch.counts.lean
        out[how] = moe_grouped_gemm_dw(dy, x, m_sizes, config=cfg)
        launches[how] = launch.counts.standard + launch.counts.lean - before
    assert torch.equal(out["folded"], out["launched"])
    assert launches == {"folded": 1, "launched": 2}
    assert_close(dw_ref(dy, x, m_sizes), out["folded"], dtype)


@pytest.mark.parametrize("name", FOLD_CONFIGS)
@pytest.mark.parametrize("count", [17, 0, -3, 2**31 - 1])
def test_dw_of_one_expert_sums_its_bounds_right(name: str, count: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """E = 1: the kernels' vector of counts is one long (E_POW2 = 1). The one expert gets
    min(max(count, 0), M) of the 20 rows, the same dw as from the bounds launch."""
    from qmoe_doctor.kernels import backward
    from qmoe_doctor.kernels.tuning import config_from_name

    cfg = config_from_name(name)
    dtype = torch.float16 if cfg.tma else torch.float32
    gen = torch.Generator().manual_seed(count % 97)
    dy, x = torch.randn(20, 32, generator=gen).to(dtype), torch.randn(20, 48, generator=gen).to(dtype)
    sizes = torch.tensor([count], dtype=torch.int32)
    folded = moe_grouped_gemm_dw(dy, x, sizes, config=cfg)
    monkeypatch.setattr(backward, "FOLDED_MAX_EXPERTS", 0)
    monkeypatch.setattr(backward, "_DW_PLANS", {})
    assert torch.equal(folded, moe_grouped_gemm_dw(dy, x, sizes, config=cfg))
    if count > 0:
        assert_close(dw_ref(dy, x, sizes), folded, dtype)
    else:  # no rows: zeros (assert_close refuses an all-zero reference)
        assert (folded == 0).all()


@pytest.mark.parametrize("name", ["16x16x16-w4-s1", "16x32x16-w4-s1-flat"])
def test_dw_folds_the_row_bounds_up_to_the_limit(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """At FOLDED_MAX_EXPERTS experts (the kernel's vector of counts is that long) the kernel sums
    the bounds; one expert more and the plan launches ``row_bounds`` first. Both right. The plan
    is asked at the real limit; the kernels run at a limit of 40 (1024 experts' tiles cost the
    interpreter 10 s and show it nothing 40 do not)."""
    from qmoe_doctor.kernels import backward
    from qmoe_doctor.kernels.backward import FOLDED_MAX_EXPERTS, _dw_plan
    from qmoe_doctor.kernels.tuning import config_from_name

    cfg = config_from_name(name)

    def case(e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(e)
        sizes = torch.zeros(e, dtype=torch.int32)
        sizes[[0, e // 3, e - 2, e - 1]] = torch.tensor([3, 5, 4, 6], dtype=torch.int32)  # 18 rows
        return torch.randn(18, 16, generator=gen), torch.randn(18, 16, generator=gen), sizes

    for e in (FOLDED_MAX_EXPERTS, FOLDED_MAX_EXPERTS + 1):
        dy, x, sizes = case(e)
        assert (_dw_plan(dy, x, sizes, None, cfg).bounds is None) == (e == FOLDED_MAX_EXPERTS)
    monkeypatch.setattr(backward, "FOLDED_MAX_EXPERTS", 40)
    monkeypatch.setattr(backward, "_DW_PLANS", {})
    for e in (40, 41):
        dy, x, sizes = case(e)
        assert (_dw_plan(dy, x, sizes, None, cfg).bounds is None) == (e == 40)
        assert_close(dw_ref(dy, x, sizes), moe_grouped_gemm_dw(dy, x, sizes, config=cfg), torch.float32)


@pytest.mark.parametrize(
    "sizes, m, want",
    [
        ((3, 4, 5), 12, (0, 3, 7, 12)),
        ((3, 4, 5), 9, (0, 3, 7, 9)),  # past M: clamped, as the forward clamps
        ((-2, 4, -1, 5), 12, (0, 0, 4, 4, 9)),  # negatives count as 0
        ((0, 0), 5, (0, 0, 0)),  # all empty
        ((2**31 - 1, 2**31 - 1), 2**33, (0, 2**31 - 1, 2**32 - 2)),  # int32 counts, int64 sum
    ],
)
@pytest.mark.parametrize("impl", [row_bounds, row_bounds_torch], ids=["triton", "torch"])
def test_row_bounds_clamp_like_the_forward(impl, sizes: tuple[int, ...], m: int, want: tuple[int, ...]) -> None:
    bounds = impl(torch.tensor(sizes, dtype=torch.int32), m)
    assert bounds.dtype == torch.int64
    assert bounds.tolist() == list(want)


@pytest.mark.parametrize("e", [1, 7, 128, 160, 300])
def test_row_bounds_kernel_matches_its_torch_twin(e: int) -> None:
    """The Triton kernel (the interpreter here) against the torch ops, with negative counts,
    empty experts, int64 counts and an M that cuts the sum short."""
    gen = torch.Generator().manual_seed(e)
    sizes = torch.randint(-3, 40, (e,), generator=gen)
    sizes[:: max(1, e // 5)] = 0
    for dtype in (torch.int32, torch.int64):
        counts = sizes.to(dtype)
        total = int(counts.clamp_min(0).sum())
        for m in (total, max(1, total // 2), total + 17):
            assert row_bounds(counts, m).tolist() == row_bounds_torch(counts, m).tolist()


def test_dw_no_rows_gives_zeros() -> None:
    dw = moe_grouped_gemm_dw(torch.randn(0, 8), torch.randn(0, 16), torch.zeros(3, dtype=torch.int32))
    assert dw.shape == (3, 8, 16)
    assert (dw == 0).all()


def test_dw_is_deterministic() -> None:
    dy, x, m_sizes = dw_operands(DW_CASES[0], torch.float32)
    assert torch.equal(moe_grouped_gemm_dw(dy, x, m_sizes), moe_grouped_gemm_dw(dy, x, m_sizes))


# --------------------------------------------------------------------------------------------
# Autograd: moe_fused_linear against autograd through the twin, float64.
# --------------------------------------------------------------------------------------------

AUTOGRAD_CASES = [c for c in GEMM_CASES if c.edge in ("balanced", "empty-experts", "prime-mnk", "sizes-sum-under-m", "w-transposed")]


@pytest.mark.parametrize("case", AUTOGRAD_CASES, ids=case_id)
def test_fused_linear_grads_match_twin_autograd(case: GemmCase) -> None:
    x, w, m_sizes = gemm_operands(case, torch.float32)
    x.requires_grad_(True)
    w.requires_grad_(True)
    x64 = x.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    dy = torch.randn(case.m, case.n, generator=torch.Generator().manual_seed(7))

    y = moe_fused_linear(x, w, m_sizes)
    y.backward(dy)
    y64 = moe_grouped_gemm_torch(x64, w64, m_sizes)
    y64.backward(dy.double())

    assert_close(y64, y, torch.float32)
    assert x.grad is not None and w.grad is not None
    assert_close(x64.grad, x.grad, torch.float32)
    assert_close(w64.grad, w.grad, torch.float32)


def test_fused_linear_takes_another_forward_kernel() -> None:
    """kernel= swaps the forward only; backward stays ours."""
    case = GEMM_CASES[0]
    x, w, m_sizes = gemm_operands(case, torch.float32)
    x.requires_grad_(True)
    w.requires_grad_(True)
    calls: list[str] = []

    def twin(x_: torch.Tensor, w_: torch.Tensor, m_: torch.Tensor) -> torch.Tensor:
        calls.append("twin")
        return moe_grouped_gemm_torch(x_, w_, m_)

    y = moe_fused_linear(x, w, m_sizes, kernel=twin)
    y.sum().backward()
    assert calls == ["twin"]
    assert_close(moe_grouped_gemm(x.detach(), w.detach(), m_sizes), y, torch.float32)
    assert w.grad is not None
    ones = torch.ones(case.m, case.n)
    assert_close(moe_grouped_gemm_dw_torch(ones.double(), x.detach().double(), m_sizes), w.grad, torch.float32)


def test_fused_linear_no_grad_for_m_sizes_and_only_needed_grads() -> None:
    case = GEMM_CASES[0]
    x, w, m_sizes = gemm_operands(case, torch.float32)
    w.requires_grad_(True)  # x needs no grad: dx is skipped
    moe_fused_linear(x, w, m_sizes).sum().backward()
    assert x.grad is None and w.grad is not None and m_sizes.grad is None


def test_deferred_weight_grads_leave_dw_for_the_caller() -> None:
    """Inside ``deferred_weight_grads`` the backward gives dx at once and no weight gradient; the
    closures it leaves return (the weight itself, the dw the plain backward gives). Nested lists
    collect only their own; outside them the plain backward is back."""
    case = GEMM_CASES[0]
    x, w, m_sizes = gemm_operands(case, torch.float32)
    x.requires_grad_(True)
    w.requires_grad_(True)
    plain_x, plain_w = torch.autograd.grad(moe_fused_linear(x, w, m_sizes).sum(), (x, w))
    with deferred_weight_grads() as outer:
        y = moe_fused_linear(x, w, m_sizes)
        with deferred_weight_grads() as inner:
            y.sum().backward()
    assert w.grad is None and outer == [] and len(inner) == 1
    assert_close(plain_x, x.grad, torch.float32)
    weight, dw = inner[0]()
    assert weight is w
    assert_close(plain_w, dw, torch.float32)
    x.grad = None
    moe_fused_linear(x, w, m_sizes).sum().backward()
    assert w.grad is not None


@pytest.mark.parametrize(
    ("name", "path"),
    [
        ("16x32x32-w4-s2", "pointer"),
        ("16x32x32-w4-s2-flat", "pointer+flat"),
        ("16x32x32-w4-s2-tma", "tma"),
        ("16x32x32-w4-s2-tma-r2", "tma+resident"),
        ("16x32x32-w4-s2-tma-ov2", "tma+resident"),  # no Gluon here: the resident Triton kernel
        ("16x64x32-w4-s1-tma-ws", "tma"),  # no Gluon here: the Triton TMA kernel of the same tiles
    ],
)
def test_dw_kernel_path_names_the_kernel_the_call_runs(name: str, path: str) -> None:
    """``dw_kernel_path`` (what the tuner's and the benchmarks' reports print) is the path of the
    plan the call itself then uses: a Hopper-only config names the kernel that runs it here, the
    path launches nothing, and the call that follows makes no plan of its own."""
    from qmoe_doctor.kernels import launch
    from qmoe_doctor.kernels.backward import dw_kernel_path
    from qmoe_doctor.kernels.grouped_gemm import plan_stats
    from qmoe_doctor.kernels.tuning import config_from_name

    cfg = config_from_name(name)
    gen = torch.Generator().manual_seed(3)
    sizes = torch.tensor([20, 0, 41, 3], dtype=torch.int32)
    dy = torch.randn(64, 64, generator=gen).half()
    x = torch.randn(64, 32, generator=gen).half()
    launched = (launch.counts.standard, launch.counts.lean)
    assert dw_kernel_path(dy, x, sizes, config=cfg) == path
    assert (launch.counts.standard, launch.counts.lean) == launched
    misses = plan_stats.misses
    tri = moe_grouped_gemm_dw(dy, x, sizes, config=cfg)
    assert plan_stats.misses == misses
    assert_close(dw_ref(dy, x, sizes), tri, torch.float16)
