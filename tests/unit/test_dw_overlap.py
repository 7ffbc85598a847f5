"""The overlapped dw kernel (``kernels/dw_overlap.py``, configs ``-ovN``) without a GPU.

The Gluon kernel itself runs only on an sm_90 GPU (tests/gpu); here: its config names, its
shared-memory and grid arithmetic, the fallback every other device takes (the resident Triton
kernel of the same tiles, run under the interpreter against the float64 reference, NaN in the
unrouted rows), and the kernel compiled for sm_90 by Triton's own compiler on this CPU: it must
compile, fit an H200's shared memory, keep ptxas from spilling or serializing its wgmma, and
issue each tile's TMA store while that tile's successor's MMAs are in flight (what the kernel is
for).
"""

from __future__ import annotations

import functools
import math
import re

import pytest
import torch

from qmoe_doctor.kernels.backward import (
    _dw_smem_bytes,
    dw_grid_size,
    moe_grouped_gemm_dw,
    moe_grouped_gemm_dw_torch,
    overlap_fallback,
)
from qmoe_doctor.kernels.dw_overlap import (
    HAVE_GLUON,
    dw_overlap_ok,
    dw_overlap_plan,
    overlap_halves,
    share_of_items,
)
from qmoe_doctor.kernels.grouped_gemm import HOPPER_BLOCK_SMEM
from qmoe_doctor.kernels.testing import assert_close, sm90_compile_report
from qmoe_doctor.kernels.tuning import config_from_name


def test_names_round_trip_and_errors() -> None:
    for name in ("64x128x128-w8-s2-tma-ov3", "16x32x32-w4-s1-tma-ov2", "16x128x128-w8-s3-tma-ov10"):
        cfg = config_from_name(name)
        assert cfg.name == name and cfg.overlap == int(name.split("-ov")[1]) and not cfg.resident
    for bad in ("64x128x128-w8-s2-tma-ov13", "64x128x128-w8-s2-tma-ov0x", "64x128x128-w8-s2-tma-r2-ov2"):
        with pytest.raises(ValueError, match="launch config"):
            config_from_name(bad)


def test_fallback_is_the_resident_kernel_of_the_same_tiles() -> None:
    fb = overlap_fallback(config_from_name("64x128x64-w8-s3-ov3"))
    assert fb.name == "64x128x64-w8-s3-tma-r3"
    # the Triton kernel holds at most 6 chunks: 16-row chunks past that fall back to 6
    assert overlap_fallback(config_from_name("16x128x128-w8-s3-tma-ov10")).name == "16x128x128-w8-s3-tma-r6"
    # a paired item (two 128-wide tiles) falls back to the Triton kernel of one such tile
    assert overlap_fallback(config_from_name("32x256x128-w8-s2-tma-ov5")).name == "32x128x128-w8-s2-tma-r5"


def test_paired_items_smem_and_grid_arithmetic() -> None:
    """block_n 256 with -ovN: items of two 128-wide dw tiles sharing each x load. The resident
    dy chunks are the item's whole width, the staging tiles one tile wide; half as many items."""
    assert (overlap_halves(256), overlap_halves(128), overlap_halves(64)) == (2, 1, 1)
    cfg = config_from_name("32x256x128-w8-s2-tma-ov5")
    # the streamed ring spans all 10 dy chunk buffers (and 10 of the x ring's): 10 barriers
    want = 2 * (5 * 32 * 256 + 2 * 5 * 32 * 128 + 2 * 128 * 128) + 8 * (2 + 10 + 1)
    assert _dw_smem_bytes(cfg, 2) == want <= HOPPER_BLOCK_SMEM
    single = config_from_name("32x128x128-w8-s2-tma-ov5")
    # the second half's dy chunks, and 5 more streamed-ring barriers
    assert _dw_smem_bytes(cfg, 2) - _dw_smem_bytes(single, 2) == 2 * 5 * 32 * 128 + 8 * 5
    assert dw_grid_size(128, 1536, 2048, cfg, torch.device("cpu")) == 4


def test_smem_and_grid_arithmetic() -> None:
    cfg = config_from_name("64x128x128-w8-s2-tma-ov3")
    # dy: 3 chunks of 64x128; x: 2 stages x 3 chunks of 64x128; two 128x128 staging tiles (bf16)
    # and 8-byte barriers: 2 for the x ring, 3 for the streamed ring (one per dy chunk), 1 for dy
    want = 2 * (3 * 64 * 128 + 2 * 3 * 64 * 128 + 2 * 128 * 128) + 8 * (2 + 3 + 1)
    assert _dw_smem_bytes(cfg, 2) == want
    assert want <= HOPPER_BLOCK_SMEM
    # work items are (expert, n-tile): 128 experts x 12 n-tiles; the interpreter takes a few
    assert dw_grid_size(128, 1536, 2048, cfg, torch.device("cpu")) == 4
    assert dw_grid_size(1, 128, 2048, cfg, torch.device("cpu")) == 1


@pytest.mark.parametrize(
    "rows",
    [
        [128] * 128,  # uniform (30b gate_up, 2048 tokens)
        [819] + [122] * 127,  # 5% of the rows on the first expert (the skew measured on an H200, 2026-11-22)
        [122] * 127 + [819],  # ... on the last
        [0] * 60 + [5000] + [0] * 67,  # everything on one expert
        [512] * 128,  # 8192 tokens: every expert past the resident chunks
        [3, 0, 0, 700, 1, 0, 40],  # fewer items than programs
    ],
    ids=["uniform", "hot-first", "hot-last", "one-expert", "all-streamed", "tiny"],
)
@pytest.mark.parametrize("halves", [1, 2], ids=["one-tile", "paired"])
def test_item_share_covers_every_item_once_and_balances_cost(rows: list[int], halves: int) -> None:
    """The overlapped kernel's items (host twin of ``_item_starts`` / ``_pieces``): every
    (expert, dw tile, K tile) covered by exactly one item, and with a hot expert the most loaded
    program well under what whole (expert, n-tile) items gave (H200, 2026-11-22: 157 TFLOP/s against 270
    uniform, with 5% of the rows on one expert). Paired items (two tiles) only where the expert
    stays resident: past the resident chunks items are one tile wide (H200, 2026-11-22: paired ones there
    made random routing 260 TFLOP/s against 357 balanced)."""
    n_tiles, num_k, programs, r, chunks = 12, 16, 132, 32, 5
    shares = share_of_items(rows, n_tiles, num_k, programs, r, chunks, halves)
    items = sorted(item for run in shares for item in run)
    pieces_of = {e: 1 + max(p for ee, _, _, p in items if ee == e) for e in range(len(rows))}
    covered = sorted(
        (e, t, k)
        for e, first, width, piece in items
        for t in range(first, first + width)
        for k in range(piece * num_k // pieces_of[e], (piece + 1) * num_k // pieces_of[e])
    )
    assert covered == [(e, t, k) for e in range(len(rows)) for t in range(n_tiles) for k in range(num_k)]
    assert all(pieces_of[e] == 1 for e, n in enumerate(rows) if n <= chunks * r)
    for e, _, width, _ in items:
        assert width == (halves if rows[e] <= chunks * r else 1)

    def cost(e: int, width: int, piece: int, pieces: int) -> int:
        """K tiles x (row chunks + the epilogue) x tiles."""
        k_tiles = (piece + 1) * num_k // pieces - piece * num_k // pieces
        return k_tiles * (math.ceil(rows[e] / r) + 1) * width

    loads = [sum(cost(e, width, piece, pieces_of[e]) for e, _, width, piece in run) for run in shares]
    whole = [
        sum(cost(i // n_tiles, 1, 0, 1) for i in range(p, len(rows) * n_tiles, programs))
        for p in range(programs)
    ]
    assert sum(loads) == sum(whole)
    if max(rows) > 4 * sum(rows) / len(rows) and len(rows) > programs / n_tiles:
        assert max(loads) < 0.85 * max(whole), (max(loads), max(whole))


def test_paired_items_leave_experts_past_the_chunks_no_seventh_item() -> None:
    """The case measured on an H200 (2026-11-22): 2048 tokens of 30b gate_up (12 dw tiles of 128, 16 K tiles), paired items,
    32-row chunks x 5, random routing with two experts past 160 rows. Their one-tile items are
    cut into pieces about as heavy as a paired item (here: whole K) and come last, so no
    program gets more items than the 756 resident ones alone give it (half-K pieces made 804
    items: 12 programs with a seventh)."""
    rows = [128] * 63 + [161] + [128] * 63 + [163]
    shares = share_of_items(rows, 12, 16, 132, 32, 5, halves=2)
    assert sum(len(run) for run in shares) == 126 * 6 + 2 * 12
    assert max(len(run) for run in shares) == 6
    streamed = [item for run in shares for item in run if item[0] in (63, 127)]
    assert {(width, piece) for _, _, width, piece in streamed} == {(1, 0)}
    # the round-robin order: every resident expert's items before the two experts' items
    order = sorted((g * 132 + p, item[0]) for p, run in enumerate(shares) for g, item in enumerate(run))
    experts = [e for _, e in order]
    assert set(experts[-24:]) == {63, 127} and not {63, 127} & set(experts[:-24])


def test_cpu_operands_never_take_the_gluon_kernel() -> None:
    cfg = config_from_name("64x128x128-w8-s2-tma-ov3")
    dy = torch.zeros(64, 128, dtype=torch.bfloat16)
    x = torch.zeros(64, 256, dtype=torch.bfloat16)
    assert not dw_overlap_ok(dy, x, cfg)
    assert dw_overlap_plan(dy, x, torch.zeros(2, 128, 256, dtype=torch.bfloat16), cfg) is None


@pytest.mark.parametrize("name", ["16x32x32-w4-s2-tma-ov2", "16x32x32-w4-s1-tma-ov1"])
@pytest.mark.parametrize(
    "sizes",
    [[3, 0, 37, 5], [0, 0, 45, 0], [45, 0, 0, 0], [1, 1, 1, 42]],
    ids=str,
)
def test_fallback_matches_reference_and_skips_unrouted_rows(name: str, sizes: list[int]) -> None:
    gen = torch.Generator().manual_seed(5)
    dy = torch.randn(64, 32, generator=gen).half()
    x = torch.randn(64, 48, generator=gen).half()
    dy[45:] = float("nan")  # 45 of 64 rows routed: the rest must never reach dw
    x[45:] = float("nan")
    m_sizes = torch.tensor(sizes, dtype=torch.int32)
    got = moe_grouped_gemm_dw(dy, x, m_sizes, config=config_from_name(name))
    want = moe_grouped_gemm_dw_torch(dy[:45].double(), x[:45].double(), m_sizes)
    assert_close(want, got, torch.float16)  # finite (no unrouted NaN row reached it), within tolerance
    for e, size in enumerate(sizes):
        if size == 0:
            assert (got[e] == 0).all()


# ---- the Gluon kernel compiled for sm_90 on this CPU ---------------------------------------

needs_gluon = pytest.mark.skipif(not HAVE_GLUON, reason="this Triton has no Gluon")


@functools.cache  # a config several tests read is compiled once per pytest worker
def _compiled(name: str) -> dict:
    """The kernel compiled for sm_90 on this CPU (``kernels.testing.sm90_compile_report``)."""
    report = sm90_compile_report("qmoe_doctor.kernels.dw_overlap:compile_offline", name)
    if report is None:
        pytest.skip("Triton's bundled ptxas is missing")
    return report


def _resident_loop(ptx: str) -> list[str]:
    """The instructions of interest, in program order, of the loop that issues several
    wgmma groups per iteration (the resident path's K loop)."""
    keep = re.compile(
        r"wgmma\.mma_async|wgmma\.commit_group|wgmma\.wait_group|cp\.async\.bulk\.tensor\.\dd\.global\.shared"
        r"|cp\.async\.bulk\.tensor\.\dd\.shared|stmatrix|st\.shared|mbarrier\.try_wait"
    )
    return [m.group(0) for line in ptx.splitlines() if (m := keep.search(line))]


@needs_gluon
@pytest.mark.parametrize("name", ["64x128x128-w8-s2-tma-ov3", "64x128x64-w8-s3-tma-ov3"])
def test_gluon_kernel_compiles_for_sm90_and_fits(name: str) -> None:
    shared = _compiled(name)["shared"]
    assert _dw_smem_bytes(config_from_name(name), 2) - 64 <= shared <= HOPPER_BLOCK_SMEM


@needs_gluon
@pytest.mark.parametrize(
    "name",
    [
        "64x128x128-w8-s2-tma-ov3",
        "32x128x128-w8-s3-tma-ov5",
        "16x128x128-w8-s3-tma-ov10",
        "32x256x128-w8-s2-tma-ov5",  # paired items: both operands from shared memory
    ],
)
def test_ptxas_keeps_the_wgmma_pipeline(name: str) -> None:
    """ptxas (the one Triton uses for sm_90) must neither spill nor serialize the kernel's
    wgmma: an accumulator read or copied while its MMA is in flight (say, carried into the next
    tile's loop still running) makes ptxas serialize every wgmma of the kernel (C7514), which
    silently costs the resident path its overlap too. Nor may it inject a wait for them
    (C7517): an MMA under a runtime condition (say, skipping an expert's surplus chunks with
    an ``if`` inside the K loop) makes ptxas wait before the accumulator is selected, that is
    before the overlapped epilogue; the resident walk is compiled once per chunk count instead."""
    report = _compiled(name)["ptxas"]
    regs = re.search(r"Used (\d+) registers", report)
    assert regs, report
    assert int(regs.group(1)) <= 255
    assert "C7514" not in report and "serialized" not in report, report
    assert "C7517" not in report and "is injected" not in report, report
    assert re.search(r"\b0 bytes spill stores", report), report


@needs_gluon
@pytest.mark.parametrize("name", ["64x128x128-w8-s2-tma-ov3", "32x256x128-w8-s2-tma-ov4"])
def test_gluon_kernel_stores_a_tile_while_the_next_tiles_mmas_run(name: str) -> None:
    """Between committing a tile's wgmma groups and waiting for them, the resident loop stages
    the previous tile (stmatrix) and issues its TMA store: the overlap this kernel exists for.
    A kernel that waits for its MMAs before every epilogue (the Triton one) has no TMA store in
    that window. With paired items (the second config) only the paired walk can store there:
    the streamed path waits for its MMAs before each store."""
    ops = _resident_loop(_compiled(name)["ptx"])
    windows = []
    pending = False
    seen: list[str] = []
    for op in ops:
        if op == "wgmma.commit_group":
            pending, seen = True, []
        elif op == "wgmma.wait_group":
            if pending:
                windows.append(seen)
            pending = False
        elif pending:
            seen.append(op)
    stores = [w for w in windows if any(o.endswith(".global.shared") for o in w)]
    assert stores, f"no TMA store is issued while MMAs are outstanding: windows {windows}"
    assert any("stmatrix" in o or o == "st.shared" for o in stores[0])
