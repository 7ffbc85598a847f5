"""The Hopper paths (TMA loads, flattened persistent loop), the config names, and the
row-combine kernels, against their float64 twins in the interpreter (which table a device gets:
tests/unit/test_configs_per_device.py).

On a GPU the same kernels run compiled (tests/gpu/test_kernels_gpu.py takes the table's picks);
here the interpreter runs them on CPU tensors. A case that the TMA path cannot serve (an
unaligned stride) must fall back to the pointer kernel and still be right.
"""

from __future__ import annotations

import pytest
import torch

from qmoe_doctor.core.tolerances import tolerance
from qmoe_doctor.kernels import tuning
from qmoe_doctor.kernels.backward import (
    dw_tma_plan,
    moe_grouped_gemm_dw,
    moe_grouped_gemm_dw_torch,
    moe_grouped_gemm_dx,
    moe_grouped_gemm_dx_torch,
)
from qmoe_doctor.kernels.combine import (
    combine_rows,
    gather_rows,
    grouping,
    segment_starts,
    segment_sum,
    segment_sum_torch,
    sum_rows,
)
from qmoe_doctor.kernels.grouped_gemm import GemmConfig, kernel_path, moe_grouped_gemm, moe_grouped_gemm_torch
from qmoe_doctor.kernels.testing import rel_err

# (M, m_sizes, N, K): aligned for TMA (16-byte rows in fp16), with empty, partial, negative and
# over-long counts, uncovered rows, K tails
CASES = [
    (40, [10, 0, 30], 40, 48),
    (37, [5, 13, 2, 17], 24, 64),
    (30, [4, 6, 0], 24, 32),
    (64, [-3, 70, 10], 40, 32),
    (50, [0, 0, 0], 16, 32),
]
CONFIGS = [
    GemmConfig(32, 32, 32, 4, 1, tma=True),
    GemmConfig(32, 32, 32, 4, 1, flat=True),
    GemmConfig(32, 32, 32, 4, 1, tma=True, flat=True),
    GemmConfig(16, 32, 16, 4, 1, programs_per_sm=2, tma=True, flat=True),
    # an expert's row tiles first (-mf): 16-row tiles give the experts here up to four
    GemmConfig(16, 32, 16, 4, 1, rows_first=True),
    GemmConfig(16, 32, 16, 4, 1, tma=True, rows_first=True),
    GemmConfig(16, 32, 16, 4, 1, flat=True, rows_first=True),
    GemmConfig(16, 32, 16, 4, 1, programs_per_sm=2, tma=True, flat=True, rows_first=True),
    # an expert's last rows in its last full row tile (-t16; test_tail_rows_* has the cases
    # where that happens)
    GemmConfig(32, 32, 32, 4, 1, tma=True, tail=16),
    GemmConfig(32, 32, 16, 4, 2, tma=True, rows_first=True, tail=16),
]
TOL = tolerance("float16")  # every operand here is float16: tensor descriptors take 16-bit data


def _ops(
    m: int, sizes: list[int], n: int, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(m * 100 + n)
    x = torch.randn(m, k, generator=gen).half()
    w = torch.randn(len(sizes), n, k, generator=gen).half()
    dy = torch.randn(m, n, generator=gen).half()
    return x, w, dy, torch.tensor(sizes, dtype=torch.int32)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"M{c[0]}-{c[1]}-N{c[2]}-K{c[3]}")
def test_forward_and_dx_paths(cfg: GemmConfig, case: tuple[int, list[int], int, int]) -> None:
    m, sizes, n, k = case
    x, w, dy, m_sizes = _ops(m, sizes, n, k)
    assert kernel_path(x, w, m_sizes, config=cfg).startswith("tma" if cfg.tma else "pointer")
    y = moe_grouped_gemm(x, w, m_sizes, config=cfg)
    assert not torch.isnan(y).any()
    assert rel_err(moe_grouped_gemm_torch(x.double(), w.double(), m_sizes), y) < TOL
    dx = moe_grouped_gemm_dx(dy, w, m_sizes, config=cfg)
    assert rel_err(moe_grouped_gemm_dx_torch(dy.double(), w.double(), m_sizes), dx) < TOL


@pytest.mark.parametrize("transposed", [False, True], ids=["forward", "dx"])
@pytest.mark.parametrize(
    ("name", "path"),
    [
        ("32x32x32-w4-s1", "pointer"),
        ("32x32x32-w4-s1-flat", "pointer+flat"),
        ("32x32x32-w4-s1-tma", "tma"),
        ("32x32x32-w4-s1-tma-flat", "tma+flat"),
        ("32x32x32-w4-s1-tma-t16", "tma+tail"),
        ("32x32x32-w4-s1-tma-flat-t16", "tma+flat+tail"),
    ],
)
def test_kernel_path_names_the_kernel_the_call_runs(name: str, path: str, transposed: bool) -> None:
    """``kernel_path`` (what the tuner's reports print) is the path of the plan the forward or
    dx call itself then uses: it launches nothing, and the call that follows makes no plan."""
    from qmoe_doctor.kernels import launch
    from qmoe_doctor.kernels.grouped_gemm import plan_stats

    cfg = tuning.config_from_name(name)
    x, w, dy, m_sizes = _ops(40, [10, 0, 30], 64, 48)  # N and K whole 32-wide tiles: TMA both ways
    a = dy if transposed else x
    launched = (launch.counts.standard, launch.counts.lean)
    assert kernel_path(a, w, m_sizes, transposed=transposed, config=cfg) == path
    assert (launch.counts.standard, launch.counts.lean) == launched
    misses = plan_stats.misses
    if transposed:
        got, want = moe_grouped_gemm_dx(dy, w, m_sizes, config=cfg), moe_grouped_gemm_dx_torch(dy.double(), w.double(), m_sizes)
    else:
        got, want = moe_grouped_gemm(x, w, m_sizes, config=cfg), moe_grouped_gemm_torch(x.double(), w.double(), m_sizes)
    assert plan_stats.misses == misses
    assert rel_err(want, got) < TOL


@pytest.mark.parametrize(
    "cfg",
    [
        GemmConfig(32, 32, 32, 4, 1, tma=True),
        GemmConfig(16, 32, 16, 4, 1, flat=True),
        GemmConfig(32, 32, 32, 4, 1, flat=True),
    ],
    ids=lambda c: c.name,
)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"M{c[0]}-{c[1]}-N{c[2]}-K{c[3]}")
def test_dw_paths(cfg: GemmConfig, case: tuple[int, list[int], int, int]) -> None:
    m, sizes, n, k = case
    x, _, dy, m_sizes = _ops(m, sizes, n, k)
    dw = moe_grouped_gemm_dw(dy, x, m_sizes, config=cfg)
    assert rel_err(moe_grouped_gemm_dw_torch(dy.double(), x.double(), m_sizes), dw) < TOL


@pytest.mark.parametrize(
    "cfg",
    [GemmConfig(32, 32, 32, 4, 1, tma=True), GemmConfig(16, 32, 32, 4, 1, tma=True)],
    ids=lambda c: c.name,
)
def test_dw_partial_chunks_never_read_the_rows_after_the_expert(cfg: GemmConfig) -> None:
    """The TMA dw loads an expert's last partial chunk as a whole box that runs on into rows of
    no expert here (m_sizes sum to 35 of 40); those rows hold inf and NaN and must not reach dw."""
    x, _, dy, _ = _ops(40, [10, 20, 10], 32, 64)
    m_sizes = torch.tensor([10, 20, 5], dtype=torch.int32)
    x[35:] = float("inf")
    dy[35:] = float("nan")
    dw = moe_grouped_gemm_dw(dy, x, m_sizes, config=cfg)
    assert torch.isfinite(dw).all()
    assert rel_err(moe_grouped_gemm_dw_torch(dy[:35].double(), x[:35].double(), m_sizes), dw) < TOL


@pytest.mark.parametrize(
    "cfg",
    [
        GemmConfig(32, 32, 32, 4, 1, flat=True),
        GemmConfig(32, 32, 32, 4, 1, tma=True, flat=True),
        GemmConfig(16, 32, 16, 4, 1, programs_per_sm=2, tma=True, flat=True, rows_first=True),
    ],
    ids=lambda c: c.name,
)
def test_flat_kernels_write_zeros_where_no_expert_covers_whatever_x_holds(cfg: GemmConfig) -> None:
    """Rows past the routed ones (a padded buffer: uninitialised memory, here inf and NaN) are
    zeros in y and dx, as in every other kernel: the flattened loop's zero tiles multiply those
    rows by zero weights, and 0 * NaN is NaN, so their product is dropped before the store."""
    x, w, dy, _ = _ops(100, [30, 0, 40], 40, 48)
    m_sizes = torch.tensor([30, 0, 40], dtype=torch.int32)
    x[70:85], x[85:] = float("nan"), float("inf")
    dy[70:85], dy[85:] = float("nan"), float("-inf")
    y = moe_grouped_gemm(x, w, m_sizes, config=cfg)
    assert torch.isfinite(y).all() and not y[70:].any()
    assert rel_err(moe_grouped_gemm_torch(x[:70].double(), w.double(), m_sizes), y[:70]) < TOL
    dx = moe_grouped_gemm_dx(dy, w, m_sizes, config=cfg)
    assert torch.isfinite(dx).all() and not dx[70:].any()
    assert rel_err(moe_grouped_gemm_dx_torch(dy[:70].double(), w.double(), m_sizes), dx[:70]) < TOL


TAIL_CONFIGS = [
    GemmConfig(32, 32, 32, 4, 1, tma=True, tail=16),
    GemmConfig(32, 16, 16, 4, 2, tma=True, rows_first=True, tail=16),
    # the flattened loop with the tail (every k-step multiplies the tail rows; one tile stores them)
    GemmConfig(32, 32, 32, 4, 1, tma=True, flat=True, tail=16),
    GemmConfig(32, 16, 16, 4, 2, programs_per_sm=2, tma=True, flat=True, rows_first=True, tail=16),
]
# (M, m_sizes, N, K) for 32-row tiles with 16 tail rows: 36 = 32 + 4 and 33 = 32 + 1 end with a
# tail, 48 = 32 + 16 exactly at the bound, 49 = 32 + 17 past it (two row tiles), 64 two full
# tiles and no tail, 16 and 31 no full tile; counts past M clamped into a tail (80 -> 44 =
# 32 + 12) or out of one (80 -> 54 = 32 + 22); negative counts; rows no expert covers; K tails
TAIL_CASES = [
    (130, [36, 33, 16, 31, 0], 40, 48),
    (170, [48, 49, 64, 0], 24, 64),
    (80, [36, 80], 32, 40),
    (90, [-5, 36, 80], 16, 32),
]


@pytest.mark.parametrize("cfg", TAIL_CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("case", TAIL_CASES, ids=lambda c: f"M{c[0]}-{c[1]}-N{c[2]}-K{c[3]}")
def test_tail_rows_ride_with_the_expert_s_last_full_tile(cfg: GemmConfig, case: tuple[int, list[int], int, int]) -> None:
    """The tail kernel reads a tail box of TAIL rows whatever the expert's tail is: the rows
    after it (the next expert's, or rows no expert covers, NaN here) must not reach y."""
    m, sizes, n, k = case
    x, w, dy, m_sizes = _ops(m, sizes, n, k)
    covered = min(m, sum(max(v, 0) for v in sizes))
    x[covered:] = float("nan")
    dy[covered:] = float("nan")
    assert kernel_path(x, w, m_sizes, config=cfg) == ("tma+flat+tail" if cfg.flat else "tma+tail")
    y = moe_grouped_gemm(x, w, m_sizes, config=cfg)
    assert torch.isfinite(y).all() and not y[covered:].any()
    assert rel_err(moe_grouped_gemm_torch(x.double(), w.double(), m_sizes), y) < TOL
    dx = moe_grouped_gemm_dx(dy, w, m_sizes, config=cfg)
    assert torch.isfinite(dx).all() and not dx[covered:].any()
    assert rel_err(moe_grouped_gemm_dx_torch(dy.double(), w.double(), m_sizes), dx) < TOL


def test_a_tail_config_without_tma_takes_the_pointer_kernel_of_its_tiles() -> None:
    cfg = GemmConfig(32, 32, 32, 4, 1, tma=True, tail=16)
    big = torch.randn(131, 49).half()
    x = big[1:, 1:]  # 98-byte rows: no tensor descriptor
    w = torch.randn(5, 24, 48).half()
    m_sizes = torch.tensor([36, 33, 16, 31, 0])
    assert kernel_path(x, w, m_sizes, config=cfg) == "pointer"
    y = moe_grouped_gemm(x, w, m_sizes, config=cfg)
    assert rel_err(moe_grouped_gemm_torch(x.double(), w.double(), m_sizes), y) < TOL


def test_unaligned_operands_take_the_pointer_kernel_and_stay_right() -> None:
    cfg = GemmConfig(32, 32, 32, 4, 1, tma=True, flat=True)
    big = torch.randn(41, 49).half()
    x = big[1:, 1:]  # row stride 49 halves = 98 bytes: no tensor descriptor can describe it
    w = torch.randn(3, 24, 48).half()
    m_sizes = torch.tensor([10, 20, 10])
    assert kernel_path(x, w, m_sizes, config=cfg) == "pointer+flat"
    y = moe_grouped_gemm(x, w, m_sizes, config=cfg)
    assert rel_err(moe_grouped_gemm_torch(x.double(), w.double(), m_sizes), y) < TOL
    dw = torch.empty(3, 24, 48).half()
    assert dw_tma_plan(torch.randn(40, 24).half(), x, dw, cfg) is None


# --------------------------------------------------------------------------------------------
# The measured table
# --------------------------------------------------------------------------------------------


def test_config_names_round_trip() -> None:
    resident = [
        GemmConfig(64, 128, 128, 8, 3, tma=True, resident=3),
        GemmConfig(64, 128, 64, 4, 3, programs_per_sm=2, tma=True, resident=2, resident_x=True),
    ]
    for cfg in CONFIGS + [GemmConfig(128, 256, 64, 8, 4, tma=True, flat=True)] + resident:
        assert tuning.config_from_name(cfg.name) == cfg
    assert [c.name for c in resident] == ["64x128x128-w8-s3-tma-r3", "64x128x64-w4-s3-p2-tma-rx2"]
    with pytest.raises(ValueError, match="expected BMxBNxBK"):
        tuning.config_from_name("128x256-w8")
    with pytest.raises(ValueError, match="expected BMxBNxBK"):
        tuning.config_from_name("128x256x64-w8-s3-fast")
    with pytest.raises(ValueError, match="1 to 6 resident row chunks"):
        tuning.config_from_name("64x128x128-w8-s3-tma-r7")
    assert GemmConfig(128, 256, 64, 8, 3, tma=True, flat=True, rows_first=True).name == "128x256x64-w8-s3-tma-flat-mf"
    with pytest.raises(ValueError, match="-mf orders the forward's tiles"):
        tuning.config_from_name("32x256x128-w8-s2-tma-ov5-mf")
    assert tuning.config_from_name("128x256x64-w8-s3-tma-t32") == GemmConfig(128, 256, 64, 8, 3, tma=True, tail=32)
    flat_tail = GemmConfig(128, 128, 128, 8, 3, tma=True, flat=True, tail=32)
    assert tuning.config_from_name("128x128x128-w8-s3-tma-flat-t32") == flat_tail
    assert flat_tail.name == "128x128x128-w8-s3-tma-flat-t32"
    for name in ("128x256x64-w8-s3-t32", "128x256x64-w8-s3-flat-t32", "32x256x128-w8-s2-tma-ov5-t16"):
        with pytest.raises(ValueError, match="it takes -tma"):
            tuning.config_from_name(name)
    for name in ("128x256x64-w8-s3-tma-t8", "128x256x64-w8-s3-tma-t48", "128x256x64-w8-s3-tma-t128"):
        with pytest.raises(ValueError, match="a power of two from 16 to below the tile's rows"):
            tuning.config_from_name(name)


def test_resident_dw_grid_and_shared_memory_follow_the_resident_operand() -> None:
    from qmoe_doctor.kernels.backward import _dw_smem_bytes, dw_grid_size

    cpu = torch.device("cpu")
    dy_res = GemmConfig(64, 128, 128, 8, 3, tma=True, resident=3)
    x_res = GemmConfig(64, 128, 128, 8, 3, tma=True, resident=3, resident_x=True)
    # work items: (expert, n-tile) with dy resident, (expert, k-tile) with x resident; the
    # interpreter's grid caps at 4 programs, so compare below that cap
    assert dw_grid_size(1, 128, 512, dy_res, cpu) == 1
    assert dw_grid_size(1, 128, 512, x_res, cpu) == 4
    # per stage: 3 chunks x 64 rows of the streamed operand; once: the resident chunks, a dw tile
    assert _dw_smem_bytes(dy_res, 2) == (3 * 64 * 128 * 3 + 3 * 64 * 128 + 128 * 128) * 2 == 229376
    narrow = GemmConfig(64, 128, 64, 4, 2, tma=True, resident=3, resident_x=True)
    assert _dw_smem_bytes(narrow, 2) == (3 * 64 * 128 * 2 + 3 * 64 * 64 + 128 * 64) * 2


# --------------------------------------------------------------------------------------------
# Row combine
# --------------------------------------------------------------------------------------------


def _segments(
    gen: torch.Generator, counts: list[int], h: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = sum(counts)
    order = torch.randperm(rows, generator=gen)
    starts = segment_starts(torch.tensor(counts))
    return torch.randn(rows, h, generator=gen), order, starts


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [8] * 4, [0, 0], [1]], ids=str)
@pytest.mark.parametrize("h", [5, 300])
def test_segment_sum_matches_its_twin(counts: list[int], h: int) -> None:
    gen = torch.Generator().manual_seed(len(counts) * 10 + h)
    rows, order, starts = _segments(gen, counts, h)
    w = torch.randn(order.shape[0], generator=gen)
    for weights in (None, w):
        got = segment_sum(rows, order, starts, weights)
        assert torch.allclose(got, segment_sum_torch(rows, order, starts, weights), atol=1e-5)


def test_combine_and_gather_gradients_match_index_ops() -> None:
    gen = torch.Generator().manual_seed(3)
    counts = [3, 0, 5, 1, 4]
    rows, order, starts = _segments(gen, counts, 37)
    w = torch.randn(order.shape[0], generator=gen)
    seg_of_pos = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    seg_of_row = torch.empty_like(order)
    seg_of_row[order] = seg_of_pos
    # combine: out[s] = sum_j w[j] rows[order[j]] == index_add of weighted rows (the kernel
    # accumulates in float32, hence 1e-5 against float64)
    r1 = rows.clone().double().requires_grad_()
    w1 = w.clone().double().requires_grad_()
    got = combine_rows(r1, order, starts, w1)
    r2 = rows.clone().double().requires_grad_()
    w2 = w.clone().double().requires_grad_()
    w_of_row = w2[torch.argsort(order)]
    want = torch.zeros(len(counts), 37, dtype=torch.float64).index_add(0, seg_of_row, r2 * w_of_row[:, None])
    g = torch.randn(len(counts), 37, generator=gen).double()
    (got * g).sum().backward()
    (want * g).sum().backward()
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(r1.grad, r2.grad, atol=1e-5) and torch.allclose(w1.grad, w2.grad, atol=1e-5)
    # gather: src[index] whose backward sums per source row
    src = torch.randn(len(counts), 37, generator=gen).double().requires_grad_()
    src2 = src.detach().clone().requires_grad_()
    got = gather_rows(src, seg_of_row, order, starts)
    want = src2[seg_of_row]
    gg = torch.randn_like(got)
    (got * gg).sum().backward()
    (want * gg).sum().backward()
    assert torch.equal(got, want) and torch.allclose(src.grad, src2.grad, atol=1e-5)
    # sum_rows: unweighted segment sum by index, backward a gather
    idx = torch.tensor([2, 0, 2, 1, 0, 2])
    o, st = grouping(idx, 4)
    r = torch.randn(6, 9, generator=gen).double().requires_grad_()
    out = sum_rows(r, idx, o, st)
    assert torch.allclose(out, torch.zeros(4, 9, dtype=torch.float64).index_add(0, idx, r.detach()))
    out.sum().backward()
    assert torch.equal(r.grad, torch.ones_like(r))


def test_combine_refuses_mixed_devices_and_bad_shapes() -> None:
    with pytest.raises(ValueError, match="2-D"):
        segment_sum(torch.zeros(3), torch.arange(3), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="must match"):
        segment_sum(torch.zeros(3, 2), torch.arange(3), torch.tensor([0, 3]), torch.ones(2))


def test_reserved_sms_is_scoped_and_reaches_the_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    """reserved_sms sets how many SMs the persistent grids leave free, restores it on exit, and
    moe_fused_linear's backward runs under the value its forward saw (autograd's own thread)."""
    from qmoe_doctor.kernels import backward as bw
    from qmoe_doctor.kernels import grouped_gemm as gg

    assert gg.sm_reserve() == 0
    with pytest.raises(ValueError):
        with gg.reserved_sms(-1):
            pass
    monkeypatch.setattr(gg, "num_sms", lambda index: 132)
    with gg.reserved_sms(16):
        assert gg.sm_reserve() == 16 and gg.persistent_sms(0) == 116
        with gg.reserved_sms(200):
            assert gg.persistent_sms(0) == 1  # never fewer than one SM's worth
    assert gg.sm_reserve() == 0 and gg.persistent_sms(0) == 132
    seen: list[int] = []
    real_dx = bw.moe_grouped_gemm_dx

    def spy_dx(*args: object, **kw: object) -> torch.Tensor:
        seen.append(gg.sm_reserve())
        return real_dx(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(bw, "moe_grouped_gemm_dx", spy_dx)
    x, w, _, m_sizes = _ops(40, [10, 20, 10], 32, 64)
    x = x.float().requires_grad_()
    with gg.reserved_sms(8):
        y = bw.moe_fused_linear(x, w.float(), m_sizes)
    y.sum().backward()  # outside the block: the saved 8 applies
    assert seen == [8] and gg.sm_reserve() == 0
