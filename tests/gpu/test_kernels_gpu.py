"""The kernel case tables again, on CUDA in bfloat16, plus what only a GPU can show.

* every forward / dx / dw / block case of tests/unit in bf16 against a float64 reference,
  with the outputs poisoned inside CANARY buffers;
* offsets just under and just over 2**31 elements (expert * stride_we, row * stride_xm);
* a moderately large shape (M=4096, E=128, N=768, K=2048: the FINDINGS shape);
* ``multigpu``: operands on cuda:1 while cuda:0 is current (and touched), including x still
  being written on cuda:1's stream: our kernels launch on the operands' device and stream;
* the lean launch path (``kernels/launch.py``): bitwise the standard launch's results (also
  direct to the C launcher, with kept descriptor encodings, as operands move between
  addresses), no host synchronization in steady state (torch's sync debug mode), CUDA-graph
  capture, and a launch hook turning it off.

Run on a GPU machine: ``python -m pytest tests/gpu -q`` (skipped without GPUs).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qmoe_doctor.core.tolerances import tolerance
from qmoe_doctor.kernels.backward import (
    dw_grid_size,
    launch_grouped_gemm_dw,
    moe_grouped_gemm_dw,
    moe_grouped_gemm_dw_torch,
    moe_grouped_gemm_dx,
    moe_grouped_gemm_dx_torch,
    pick_dw_config,
    row_bounds,
)
from qmoe_doctor.kernels.grouped_gemm import (
    grid_size,
    launch_grouped_gemm,
    moe_grouped_gemm,
    moe_grouped_gemm_torch,
    pick_config,
)
from qmoe_doctor.kernels.moe_block import MoEBlock
from qmoe_doctor.kernels.testing import (
    BLOCK_CASES,
    DW_CASES,
    GEMM_CASES,
    BlockCase,
    DwCase,
    GemmCase,
    assert_canary_intact,
    assert_close,
    case_id,
    gemm_operands,
    make_block_inputs,
    make_view,
    poisoned_output,
    rel_err,
    twin_of,
)
from qmoe_doctor.probes.stream_hold import hold_stream

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
CUDA = "cuda:0"


def _dw_operands(case: DwCase, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(3)
    dy = torch.randn(case.m, case.n, generator=gen).to(device, dtype)
    x = torch.randn(case.m, case.k, generator=gen).to(device, dtype)
    return make_view(dy, case.dy_view), make_view(x, case.x_view), case.m_sizes().to(device)


# --------------------------------------------------------------------------------------------
# The CPU case tables, bf16 on cuda:0.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", GEMM_CASES, ids=case_id)
def test_forward_bf16(case: GemmCase) -> None:
    x, w, m_sizes = gemm_operands(case, BF16, CUDA)
    tri = moe_grouped_gemm(x, w, m_sizes, config=case.config)
    assert_close(moe_grouped_gemm_torch(x.double(), w.double(), m_sizes), tri, BF16)
    assert (tri[case.covered_rows() :] == 0).all()

    y, buf, inside = poisoned_output((case.m, case.n), BF16, CUDA)
    cfg = case.config or pick_config(case.m, case.n, case.k, case.e, x.device, x.dtype)
    launch_grouped_gemm(x, w, y, m_sizes, cfg, grid_size(case.m, case.n, case.e, cfg, x.device))
    assert_close(moe_grouped_gemm_torch(x.double(), w.double(), m_sizes), y, BF16)
    assert_canary_intact(buf, inside)


@pytest.mark.parametrize("case", GEMM_CASES, ids=case_id)
def test_dx_bf16(case: GemmCase) -> None:
    dy, w, m_sizes = gemm_operands(case, BF16, CUDA, n_first=True)
    tri = moe_grouped_gemm_dx(dy, w, m_sizes, config=case.config)
    assert_close(moe_grouped_gemm_dx_torch(dy.double(), w.double(), m_sizes), tri, BF16)
    assert (tri[case.covered_rows() :] == 0).all()


@pytest.mark.parametrize("case", DW_CASES, ids=lambda c: c.edge)
def test_dw_bf16(case: DwCase) -> None:
    dy, x, m_sizes = _dw_operands(case, BF16, CUDA)
    ref = moe_grouped_gemm_dw_torch(dy.double(), x.double(), m_sizes)
    assert_close(ref, moe_grouped_gemm_dw(dy, x, m_sizes, config=case.config), BF16)

    dw, buf, inside = poisoned_output((case.e, case.n, case.k), BF16, CUDA)
    cfg = case.config or pick_dw_config(case.n, case.k, x.device, x.dtype)
    bounds = row_bounds(m_sizes, case.m)
    launch_grouped_gemm_dw(dy, x, dw, bounds, cfg, dw_grid_size(case.e, case.n, case.k, cfg, x.device))
    assert_close(ref, dw, BF16)
    assert_canary_intact(buf, inside)


GPU_BLOCK_CASES = [dataclasses.replace(c, dtype=BF16) for c in BLOCK_CASES if c.dtype == torch.float32]


@pytest.mark.parametrize("case", GPU_BLOCK_CASES, ids=lambda c: c.edge)
def test_block_bf16_forward_and_grads(case: BlockCase) -> None:
    block, hidden = make_block_inputs(case, CUDA)
    _check_block(block, hidden, case)


def _check_block(block: MoEBlock, hidden: torch.Tensor, case: BlockCase) -> None:
    twin = twin_of(block)
    x = hidden.clone().requires_grad_(True)
    x64 = hidden.double().requires_grad_(True)
    out, logits = block(x)
    ref, ref_logits = twin(x64)
    assert out.device == hidden.device
    assert_close(ref, out, case.dtype, kind="block")
    assert_close(ref_logits, logits, case.dtype, kind="block")
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device)
    (out.float() * grad).sum().backward()
    (ref * grad.double()).sum().backward()
    assert_close(x64.grad, x.grad, case.dtype, kind="block")
    ref_params = dict(twin.named_parameters())
    for name, p in block.named_parameters():
        assert_close(ref_params[name].grad, p.grad, case.dtype, kind="block")


# --------------------------------------------------------------------------------------------
# Offsets at the int32 boundary: the one element that matters sits just under / just over
# 2**31 elements from the base pointer (4 GiB of bf16 per test).
# --------------------------------------------------------------------------------------------

I32 = 2**31
SMALL_N, SMALL_K, ROWS = 64, 64, 48


@pytest.mark.parametrize(
    "stride_we",
    [
        pytest.param(I32 - SMALL_N * SMALL_K, id="expert-1-ends-just-under-2**31"),
        pytest.param(I32, id="expert-1-starts-at-2**31"),
        pytest.param(I32 + 16 * SMALL_K, id="expert-1-just-over-2**31"),
    ],
)
def test_expert_offset_at_int32_boundary(stride_we: int) -> None:
    """w (2, N, K) whose expert 1 lies ~2**31 elements from expert 0; all rows to expert 1,
    then half and half. forward, dx and dw (dw written through the same strided layout)."""
    nk = SMALL_N * SMALL_K
    buf = torch.zeros(stride_we + nk, dtype=BF16, device=CUDA)
    w = buf.as_strided((2, SMALL_N, SMALL_K), (stride_we, SMALL_K, 1))
    gen = torch.Generator(device=CUDA).manual_seed(0)
    w[0].copy_(torch.randn(SMALL_N, SMALL_K, device=CUDA, generator=gen))
    w[1].copy_(torch.randn(SMALL_N, SMALL_K, device=CUDA, generator=gen))
    x = torch.randn(ROWS, SMALL_K, device=CUDA, generator=gen).to(BF16)
    dy = torch.randn(ROWS, SMALL_N, device=CUDA, generator=gen).to(BF16)
    for sizes in ((0, ROWS), (ROWS // 2, ROWS // 2)):
        m_sizes = torch.tensor(sizes, dtype=torch.int32, device=CUDA)
        assert_close(
            moe_grouped_gemm_torch(x.double(), w.double(), m_sizes), moe_grouped_gemm(x, w, m_sizes), BF16
        )
        assert_close(
            moe_grouped_gemm_dx_torch(dy.double(), w.double(), m_sizes),
            moe_grouped_gemm_dx(dy, w, m_sizes),
            BF16,
        )
        dw = w  # the same layout: expert 1's gradient is written ~2**31 elements in
        dw.fill_(float("nan"))
        cfg = pick_dw_config(SMALL_N, SMALL_K, x.device, x.dtype)
        launch_grouped_gemm_dw(
            dy, x, dw, row_bounds(m_sizes, ROWS), cfg, dw_grid_size(2, SMALL_N, SMALL_K, cfg, x.device)
        )
        ref = moe_grouped_gemm_dw_torch(dy.double(), x.double(), m_sizes)
        assert_close(ref[1], dw[1], BF16)
        if sizes[0]:
            assert_close(ref[0], dw[0], BF16)
        else:
            assert (dw[0] == 0).all()
        w[0].copy_(torch.randn(SMALL_N, SMALL_K, device=CUDA, generator=gen))
        w[1].copy_(torch.randn(SMALL_N, SMALL_K, device=CUDA, generator=gen))
    del buf
    torch.cuda.empty_cache()


ROW_STRIDE_UNDER = (I32 - SMALL_K) // 3 // 16 * 16  # row 3 ends before element 2**31
ROW_STRIDE_OVER = -(-I32 // 3 // 16) * 16  # row 3 starts past element 2**31


@pytest.mark.parametrize(
    "stride",
    [
        pytest.param(ROW_STRIDE_UNDER, id="row-3-just-under-2**31"),
        pytest.param(ROW_STRIDE_OVER, id="row-3-just-over-2**31"),
    ],
)
def test_row_offset_at_int32_boundary(stride: int) -> None:
    """A (4, 64) operand whose row stride is so wide that row 3 sits ~2**31 elements in, used
    as x (forward, dw) and as dy (dx, dw: N = K = 64 here)."""
    rows = 4
    assert (3 * stride >= I32) == (stride == ROW_STRIDE_OVER)
    buf = torch.zeros(3 * stride + SMALL_K, dtype=BF16, device=CUDA)
    wide = buf.as_strided((rows, SMALL_K), (stride, 1))
    gen = torch.Generator(device=CUDA).manual_seed(1)
    for r in range(rows):
        wide[r].copy_(torch.randn(SMALL_K, device=CUDA, generator=gen))
    w = torch.randn(2, SMALL_N, SMALL_K, device=CUDA, generator=gen).to(BF16)
    m_sizes = torch.tensor([1, 3], dtype=torch.int32, device=CUDA)
    wide64 = wide.double()
    assert_close(
        moe_grouped_gemm_torch(wide64, w.double(), m_sizes), moe_grouped_gemm(wide, w, m_sizes), BF16
    )
    assert_close(
        moe_grouped_gemm_dx_torch(wide64, w.double(), m_sizes), moe_grouped_gemm_dx(wide, w, m_sizes), BF16
    )
    assert_close(
        moe_grouped_gemm_dw_torch(wide64, wide64, m_sizes), moe_grouped_gemm_dw(wide, wide, m_sizes), BF16
    )
    del buf, wide
    torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------
# A moderately large shape (the FINDINGS measurement shape).
# --------------------------------------------------------------------------------------------


def test_large_shape_forward_dx_dw() -> None:
    m, e, n, k = 4096, 128, 768, 2048
    gen = torch.Generator(device=CUDA).manual_seed(0)
    ids = torch.rand(m // 8, e, device=CUDA, generator=gen).topk(8, dim=-1).indices
    m_sizes = torch.bincount(ids.flatten(), minlength=e).to(torch.int32)
    x = torch.randn(m, k, device=CUDA, generator=gen).to(BF16)
    dy = torch.randn(m, n, device=CUDA, generator=gen).to(BF16)
    w = (torch.randn(e, n, k, device=CUDA, generator=gen) / k**0.5).to(BF16)
    # float32 reference (float64 at this size is slow on some GPUs); bf16 tolerance is 5x looser
    assert_close(
        moe_grouped_gemm_torch(x.float(), w.float(), m_sizes), moe_grouped_gemm(x, w, m_sizes), BF16
    )
    assert_close(
        moe_grouped_gemm_dx_torch(dy.float(), w.float(), m_sizes), moe_grouped_gemm_dx(dy, w, m_sizes), BF16
    )
    assert_close(
        moe_grouped_gemm_dw_torch(dy.float(), x.float(), m_sizes), moe_grouped_gemm_dw(dy, x, m_sizes), BF16
    )


def test_mixed_devices_cuda_and_cpu_refused() -> None:
    with pytest.raises(ValueError, match="different devices.*w on cpu"):
        moe_grouped_gemm(
            torch.randn(8, 16, device=CUDA), torch.randn(2, 8, 16), torch.tensor([4, 4], device=CUDA)
        )
    with pytest.raises(ValueError, match="different devices.*m_sizes on cpu"):
        moe_grouped_gemm_dw(
            torch.randn(8, 8, device=CUDA), torch.randn(8, 16, device=CUDA), torch.tensor([4, 4])
        )


# --------------------------------------------------------------------------------------------
# Two GPUs: operands on cuda:1, cuda:0 current and touched.
# --------------------------------------------------------------------------------------------


@pytest.mark.multigpu
def test_operands_on_cuda1_with_cuda0_current() -> None:
    torch.zeros(1, device="cuda:0")  # cuda:0 has a context: an unguarded launch would fault here
    case = next(c for c in GEMM_CASES if c.edge == "prime-mnk")
    dev = "cuda:1"
    x, w, m_sizes = gemm_operands(case, BF16, dev)
    dy = torch.randn(case.m, case.n, device=dev).to(BF16)
    with torch.cuda.device(0):
        y = moe_grouped_gemm(x, w, m_sizes)
        dx = moe_grouped_gemm_dx(dy, w, m_sizes)
        dw = moe_grouped_gemm_dw(dy, x, m_sizes)
        for t in (y, dx, dw):
            assert t.device == torch.device(dev)
        assert_close(moe_grouped_gemm_torch(x.double(), w.double(), m_sizes), y, BF16)
        assert_close(moe_grouped_gemm_dx_torch(dy.double(), w.double(), m_sizes), dx, BF16)
        assert_close(moe_grouped_gemm_dw_torch(dy.double(), x.double(), m_sizes), dw, BF16)
        block_case = dataclasses.replace(BLOCK_CASES[0], dtype=BF16)
        block, hidden = make_block_inputs(block_case, dev)
        _check_block(block, hidden, block_case)


@pytest.mark.multigpu
def test_cuda1_kernel_ordered_after_producer_on_cuda1_stream() -> None:
    """x is still being written on cuda:1's stream (behind a 1 s hold) when we are called
    with cuda:0 current and peer access 0->1 enabled: launched on cuda:1's current stream, our
    kernel runs after the producer. An unguarded launch here reads half-written x
    (FINDINGS: relative error 0.50, no exception)."""
    torch.zeros(1, device="cuda:0").to("cuda:1")  # one copy 0->1, as device_map pipelines do
    case = next(c for c in GEMM_CASES if c.edge == "balanced")
    dev = torch.device("cuda:1")
    _, w, m_sizes = gemm_operands(case, BF16, dev)
    src = torch.randn(case.m, case.k, device=dev).to(BF16)
    x = torch.zeros_like(src)
    with torch.cuda.device(dev):
        hold_stream(1.0)  # cuda:1's current stream
        x.copy_(src)  # the producer, queued behind the hold
    with torch.cuda.device(0):
        y = moe_grouped_gemm(x, w, m_sizes)
    assert_close(moe_grouped_gemm_torch(src.double(), w.double(), m_sizes), y, BF16)


@pytest.mark.multigpu
def test_mixed_gpus_refused() -> None:
    with pytest.raises(ValueError, match="different devices"):
        moe_grouped_gemm(
            torch.randn(8, 16, device="cuda:0"),
            torch.randn(2, 8, 16, device="cuda:1"),
            torch.tensor([4, 4], device="cuda:0"),
        )


# --------------------------------------------------------------------------------------------
# The benchmark script on a GPU, at a small shape (it must run; the numbers are not checked).
# --------------------------------------------------------------------------------------------


def test_bench_kernels_runs_on_gpu(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = ["--m", "1024", "--e", "8", "--n", "256", "--k", "256", "--json-out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_kernels", *args],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["timed"] is True
    ours = [r for r in report["rows"] if r["impl"] == "qmoe"]
    assert len(ours) == 3 and all(r["tflops"] and r["rel_err"] < tolerance("bfloat16") for r in ours)


# --------------------------------------------------------------------------------------------
# Hopper paths and the row combine, compiled (the interpreter runs them in the unit tests)
# --------------------------------------------------------------------------------------------

HOPPER_CONFIGS = [
    "128x256x64-w8-s4-tma-flat",
    "64x128x64-w4-s5-tma-flat",
    "128x256x64-w8-s3-tma",
    "128x256x64-w8-s4-flat",
    "64x128x64-w4-s4-p2",
    # tails of 32 rows or fewer in the last full row tile: 517 = 4 * 128 + 5 and 900 = 7 * 128 + 4
    # end with one; in the fourth routing 150, 140, 129, 160 (at the bound) and 284 = 2 * 128 + 28
    # do, 161 does not
    "128x256x64-w8-s3-tma-t32",
    "128x256x64-w8-s4-tma-t32",
    # the H100 table's tail picks (2048-token forwards of 235B gate_up and down, 480B gate_up)
    "128x128x128-w8-s3-tma-t32",
    "128x128x64-w4-s3-p2-tma-t32",
    # the flattened loop with the tail
    "128x256x64-w8-s3-tma-flat-t32",
    "128x128x128-w8-s2-tma-flat-mf-t16",
]


@pytest.mark.parametrize("name", HOPPER_CONFIGS)
@pytest.mark.parametrize(
    "sizes",
    [[300, 0, 517, 7, 200], [-5, 900, 0, 30, 10], [64, 64, 64, 64, 0], [150, 140, 129, 160, 161, 284]],
    ids=str,
)
def test_hopper_forward_and_dx_paths(name: str, sizes: list[int]) -> None:
    from qmoe_doctor.kernels.tuning import config_from_name

    cfg = config_from_name(name)
    dev = torch.device("cuda", 0)
    gen = torch.Generator(device=dev).manual_seed(len(name))
    m, n, k = 1024, 384, 512
    x = torch.randn(m, k, generator=gen, device=dev).bfloat16()
    w = (torch.randn(len(sizes), n, k, generator=gen, device=dev) / k**0.5).bfloat16()
    dy = torch.randn(m, n, generator=gen, device=dev).bfloat16()
    m_sizes = torch.tensor(sizes, device=dev, dtype=torch.int32)
    y = moe_grouped_gemm(x, w, m_sizes, config=cfg)
    assert (
        rel_err(moe_grouped_gemm_torch(x.double(), w.double(), m_sizes), y)
        < tolerance("bfloat16")
    )
    dx = moe_grouped_gemm_dx(dy, w, m_sizes, config=cfg)
    ref = moe_grouped_gemm_dx_torch(dy.double(), w.double(), m_sizes)
    assert rel_err(ref, dx) < tolerance("bfloat16")


HOPPER_DW_CONFIGS = [
    "32x128x128-w4-s4-p2-tma",
    "64x128x128-w8-s3-flat",
    "64x128x128-w8-s3",
    "64x128x128-w8-s3-tma-r3",
    "32x128x128-w8-s4-tma-r4",
    "64x128x128-w8-s3-tma-r1",
    "64x128x128-w8-s3-tma-rx3",
    "64x128x64-w4-s3-p2-tma-rx2",
    "32x128x128-w8-s3-tma-r6",
    # the Gluon kernel with the overlapped epilogue (sm_90; elsewhere, and at N=320, its fallback)
    "64x128x128-w8-s2-tma-ov3",
    "32x128x128-w8-s3-tma-ov5",
    "16x128x128-w8-s2-tma-ov2",
    "16x128x128-w8-s3-tma-ov10",  # 16-row chunks; at N=320 the fallback, -r6
    "32x256x128-w8-s2-tma-ov5",  # paired items; N=384 and 320 are no multiple of 256: the fallback
    # the warp-specialized Gluon kernel (sm_90; at N=320 its fallback, the Triton TMA kernel)
    "32x128x128-w4-s4-p2-tma-ws",
    "32x128x128-w4-s8-tma-ws",
    "64x128x128-w4-s4-tma-ws",
]

WS_CONFIGS = ["32x128x128-w4-s4-p2-tma-ws", "32x128x128-w4-s8-tma-ws", "64x128x128-w4-s4-tma-ws", "64x128x128-w4-s5-tma-ws"]


@pytest.mark.parametrize("name", WS_CONFIGS)
@pytest.mark.parametrize("k", [2048, 520], ids=["K=2048", "K=520"])
def test_ws_dw_at_moe_scale(name: str, k: int) -> None:
    """30b gate_up's dw at 8192 tokens (E=128, N=1536, ~512 rows per expert) on the
    warp-specialized kernel itself: an empty expert, a hot one, experts under one chunk, 256
    unrouted NaN rows at the end; K=520 ends in an 8-column K tile (loads read zeros past K,
    the store clips there)."""
    from qmoe_doctor.kernels.dw_ws import dw_ws_plan
    from qmoe_doctor.kernels.tuning import config_from_name

    if torch.cuda.get_device_capability(0)[0] != 9:
        pytest.skip("the warp-specialized dw kernel is for sm_90")
    cfg = config_from_name(name)
    dev = torch.device("cuda", 0)
    gen = torch.Generator(device=dev).manual_seed(23)
    e, n, routed = 128, 1536, 65280
    counts = torch.bincount(torch.randint(0, e, (routed,), generator=gen, device=dev), minlength=e)
    counts[3] += counts[4] + counts[5] - 20
    counts[4], counts[5] = 0, 20  # an empty expert and one under a chunk
    counts[7] += counts[8:11].sum() - 30  # a hot expert, ~2000 rows
    counts[8:11] = 10  # three experts under a chunk
    # no negative count: the kernels clamp one to 0, and the experts after it would then reach
    # past the routed rows (a version of this test that took 500 rows off ~510-row experts did)
    assert int(counts.min()) >= 0 and int(counts.sum()) == routed
    x = torch.randn(routed + 256, k, generator=gen, device=dev).bfloat16()
    dy = torch.randn(routed + 256, n, generator=gen, device=dev).bfloat16()
    x[routed:] = float("nan")
    dy[routed:] = float("nan")
    probe = torch.empty((e, n, k), device=dev, dtype=torch.bfloat16)
    assert dw_ws_plan(dy, x, probe, cfg) is not None, "this call should take the Gluon kernel"
    del probe
    dw = moe_grouped_gemm_dw(dy, x, counts, config=cfg)
    torch.cuda.synchronize()
    ref = moe_grouped_gemm_dw_torch(dy[:routed].float(), x[:routed].float(), counts)
    assert torch.isfinite(dw).all(), "rows no expert covers reached dw"
    assert (dw[4] == 0).all(), "an empty expert must get zero dw"
    assert rel_err(ref, dw) < tolerance("bfloat16")


OVERLAP_CONFIGS = [
    "64x128x128-w8-s2-tma-ov3",
    "32x128x128-w8-s3-tma-ov5",
    "32x128x64-w8-s4-tma-ov5",
    "16x128x128-w8-s3-tma-ov10",
    "32x256x128-w8-s2-tma-ov5",  # paired items: two 128-wide tiles per x load
    "16x256x128-w8-s2-tma-ov8",
]


@pytest.mark.parametrize(
    "name",
    [
        "32x128x128-w8-s3-tma-ov5",
        "64x128x128-w8-s2-tma-ov3",
        "16x128x128-w8-s3-tma-ov10",
        "32x256x128-w8-s2-tma-ov5",
        "16x256x128-w8-s2-tma-ov8",
    ],
)
def test_overlap_dw_k_not_a_multiple_of_the_tile(name: str) -> None:
    """K = 520: the last K tile has 8 columns; the x loads read zeros past K and the TMA
    store clips the tile there (a store past K would land in the next row of dw). Every
    expert chunk count from 0 to past the resident chunks, each walk of the kernel."""
    counts = torch.tensor([150, 0, 37, 260, 90, 1, 64, 65, 100, 128, 129, 160, 161, 33])
    _gluon_dw_matches_reference(name, counts.cuda(), 256, 520, seed=5)


@pytest.mark.parametrize("name", OVERLAP_CONFIGS)
def test_overlap_dw_at_moe_scale(name: str) -> None:
    """30b gate_up's dw (E=128, N=1536, K=2048) on the Gluon kernel itself: ~125 rows per expert
    (the resident path), one empty expert, two experts past the resident chunks (the streamed
    path), 384 unrouted NaN rows at the end."""
    from qmoe_doctor.kernels.dw_overlap import dw_overlap_plan
    from qmoe_doctor.kernels.tuning import config_from_name

    if torch.cuda.get_device_capability(0)[0] != 9:
        pytest.skip("the overlapped dw kernel is for sm_90")
    cfg = config_from_name(name)
    dev = torch.device("cuda", 0)
    gen = torch.Generator(device=dev).manual_seed(17)
    m, e, n, k = 16384, 128, 1536, 2048
    counts = torch.bincount(torch.randint(0, e, (16000,), generator=gen, device=dev), minlength=e)
    counts[5] += counts[6]
    counts[6] = 0
    counts[9] += 300  # past every resident chunk count here
    counts[20:30] -= 30  # ~125 rows each before
    assert int(counts.sum()) == 16000 and int(counts.max()) > cfg.overlap * cfg.block_m
    x = torch.randn(m, k, generator=gen, device=dev).bfloat16()
    dy = torch.randn(m, n, generator=gen, device=dev).bfloat16()
    x[16000:] = float("nan")
    dy[16000:] = float("nan")
    probe = torch.empty((e, n, k), device=dev, dtype=torch.bfloat16)
    assert dw_overlap_plan(dy, x, probe, cfg) is not None, "this call should take the Gluon kernel"
    del probe
    dw = moe_grouped_gemm_dw(dy, x, counts, config=cfg)
    torch.cuda.synchronize()
    ref = moe_grouped_gemm_dw_torch(dy[:16000], x[:16000], counts).float()
    assert torch.isfinite(dw).all(), "rows no expert covers reached dw"
    assert (dw[6] == 0).all(), "an empty expert must get zero dw"
    assert rel_err(ref, dw) < tolerance("bfloat16")


def _gluon_dw_matches_reference(name: str, counts: torch.Tensor, n: int, k: int, seed: int) -> torch.Tensor:
    """dw of random bf16 operands with these expert counts (and 64 unrouted NaN rows after them)
    on the Gluon kernel itself, checked against the float64 loop: the dw, for further checks."""
    from qmoe_doctor.kernels.dw_overlap import dw_overlap_plan
    from qmoe_doctor.kernels.tuning import config_from_name

    if torch.cuda.get_device_capability(0)[0] != 9:
        pytest.skip("the overlapped dw kernel is for sm_90")
    cfg = config_from_name(name)
    dev = counts.device
    gen = torch.Generator(device=dev).manual_seed(seed)
    routed = int(counts.sum())
    x = torch.randn(routed + 64, k, generator=gen, device=dev).bfloat16()
    dy = torch.randn(routed + 64, n, generator=gen, device=dev).bfloat16()
    x[routed:] = float("nan")
    dy[routed:] = float("nan")
    probe = torch.empty((counts.shape[0], n, k), device=dev, dtype=torch.bfloat16)
    assert dw_overlap_plan(dy, x, probe, cfg) is not None, "this call should take the Gluon kernel"
    del probe
    dw = moe_grouped_gemm_dw(dy, x, counts, config=cfg)
    ref = moe_grouped_gemm_dw_torch(dy[:routed].double(), x[:routed].double(), counts)
    assert torch.isfinite(dw).all(), "rows no expert covers reached dw"
    assert rel_err(ref, dw) < tolerance("bfloat16")
    return dw


@pytest.mark.parametrize("name", OVERLAP_CONFIGS)
def test_overlap_dw_streamed_experts(name: str) -> None:
    """Every expert past the resident chunks (the 8192-token case): the streamed path alone,
    with whole-chunk MMAs from shared memory, the last chunk shifted and masked, and the items
    cut along K. Counts: a multiple of the chunk (nothing to mask), one row past it, odd ones."""
    from qmoe_doctor.kernels.tuning import config_from_name

    cfg = config_from_name(name)
    gen = torch.Generator().manual_seed(29)
    floor = cfg.overlap * cfg.block_m + 1
    counts = torch.randint(floor, floor + 500, (16,), generator=gen)
    counts[0] = 8 * cfg.block_m
    counts[1] = 8 * cfg.block_m + 1
    _gluon_dw_matches_reference(name, counts.cuda(), 512, 1024, seed=29)


@pytest.mark.parametrize("name", OVERLAP_CONFIGS)
@pytest.mark.parametrize("hot", [0, 31, 63])
def test_overlap_dw_skewed_routing(name: str, hot: int) -> None:
    """3000 rows on one expert (first, middle, last), 0-120 on the others, one empty: the hot
    expert's items are cut along K and go round-robin with the rest; every dw tile must still
    be written once, right, and the empty expert's dw zero."""
    gen = torch.Generator().manual_seed(41 + hot)
    counts = torch.randint(0, 120, (64,), generator=gen)
    counts[hot] = 3000
    counts[(hot + 5) % 64] = 0
    dw = _gluon_dw_matches_reference(name, counts.cuda(), 512, 1024, seed=41 + hot)
    assert (dw[(hot + 5) % 64] == 0).all(), "an empty expert must get zero dw"


@pytest.mark.parametrize("name", ["32x128x128-w8-s3-tma-ov5", "32x256x128-w8-s2-tma-ov5"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
def test_overlap_dw_clamps_the_counts_as_the_forward_does(name: str, dtype: torch.dtype) -> None:
    """The Gluon kernel sums the experts' row bounds from m_sizes itself: a negative count is 0,
    and the count that passes M (int32 2**31 - 1: its int64 sum passes 2**31) stops at M; the
    experts after it get no rows. Every row of dy and x is routed and finite here."""
    from qmoe_doctor.kernels.dw_overlap import dw_overlap_plan
    from qmoe_doctor.kernels.tuning import config_from_name

    if torch.cuda.get_device_capability(0)[0] != 9:
        pytest.skip("the overlapped dw kernel is for sm_90")
    cfg = config_from_name(name)
    dev = torch.device("cuda", 0)
    gen = torch.Generator(device=dev).manual_seed(3)
    counts = torch.tensor([-7, 150, 0, 90, 2**31 - 1, 40, -1], dtype=dtype, device=dev)
    m, n, k = 400, 512, 384  # the fifth expert gets rows 240..400
    x = torch.randn(m, k, generator=gen, device=dev).bfloat16()
    dy = torch.randn(m, n, generator=gen, device=dev).bfloat16()
    probe = torch.empty((counts.shape[0], n, k), device=dev, dtype=torch.bfloat16)
    assert dw_overlap_plan(dy, x, probe, cfg) is not None, "this call should take the Gluon kernel"
    del probe
    dw = moe_grouped_gemm_dw(dy, x, counts, config=cfg)
    ref = moe_grouped_gemm_dw_torch(dy.double(), x.double(), counts)
    assert rel_err(ref, dw) < tolerance("bfloat16")
    assert (dw[[0, 2, 5, 6]] == 0).all(), "experts with no rows (negative, empty, after M) get zeros"


@pytest.mark.parametrize(
    "name", ["32x128x128-w8-s3-tma-ov5", "32x256x128-w8-s2-tma-ov5", "32x128x128-w4-s5-p2-tma", "64x128x64-w4-s3"]
)
@pytest.mark.parametrize("count", [300, 2**31 - 1, -1])
def test_dw_of_one_expert_compiled(name: str, count: int) -> None:
    """E = 1 compiled (a vector of one count; E_POW2 = 1) in the Gluon kernel (sm_90; elsewhere its
    fallback), the TMA and the pointer kernel: the expert gets min(max(count, 0), M) rows."""
    from qmoe_doctor.kernels.tuning import config_from_name

    cfg = config_from_name(name)
    dev = torch.device("cuda", 0)
    gen = torch.Generator(device=dev).manual_seed(13)
    dy = torch.randn(320, 512, generator=gen, device=dev).bfloat16()
    x = torch.randn(320, 384, generator=gen, device=dev).bfloat16()
    sizes = torch.tensor([count], dtype=torch.int32, device=dev)
    dw = moe_grouped_gemm_dw(dy, x, sizes, config=cfg)
    if count <= 0:
        assert (dw == 0).all(), "an expert with no rows must get zero dw"
        return
    ref = moe_grouped_gemm_dw_torch(dy.double(), x.double(), sizes)
    assert rel_err(ref, dw) < tolerance("bfloat16")


@pytest.mark.parametrize("name", HOPPER_DW_CONFIGS)
@pytest.mark.parametrize(
    ("sizes", "n"),
    [
        ([300, 0, 517, 7, 200], 384),
        ([40, 0, 130, 3, 64], 384),  # 237 of 1024 rows routed: the rest are NaN and must stay out
        ([1024, 0, 0, 0, 0], 320),  # 320 % 128: dw stored by pointer stores
        ([2, 1, 0, 5, 190], 384),  # experts under one chunk: the shifted chunk reaches before row 0
    ],
    ids=str,
)
def test_hopper_dw_paths(name: str, sizes: list[int], n: int) -> None:
    from qmoe_doctor.kernels.tuning import config_from_name

    cfg = config_from_name(name)
    dev = torch.device("cuda", 0)
    gen = torch.Generator(device=dev).manual_seed(7)
    x = torch.randn(1024, 512, generator=gen, device=dev).bfloat16()
    dy = torch.randn(1024, n, generator=gen, device=dev).bfloat16()
    routed = sum(sizes)
    x[routed:] = float("nan")
    dy[routed:] = float("nan")
    m_sizes = torch.tensor(sizes, device=dev)
    dw = moe_grouped_gemm_dw(dy, x, m_sizes, config=cfg)
    ref = moe_grouped_gemm_dw_torch(dy[:routed].double(), x[:routed].double(), m_sizes)
    assert torch.isfinite(dw).all(), "rows no expert covers reached dw"
    assert rel_err(ref, dw) < tolerance("bfloat16")


def test_row_combine_on_gpu_matches_its_twin() -> None:
    from qmoe_doctor.kernels.combine import segment_starts, segment_sum, segment_sum_torch

    dev = torch.device("cuda", 0)
    gen = torch.Generator(device=dev).manual_seed(3)
    counts = torch.tensor([3, 0, 8, 1, 5] * 20, device=dev)
    rows = torch.randn(int(counts.sum()), 2048, generator=gen, device=dev).bfloat16()
    order = torch.randperm(rows.shape[0], generator=gen, device=dev)
    starts = segment_starts(counts)
    w = torch.randn(order.shape[0], generator=gen, device=dev).bfloat16()
    got = segment_sum(rows, order, starts, w)
    want = segment_sum_torch(rows.float(), order, starts, w.float())
    assert rel_err(want, got) < tolerance("bfloat16")


# --------------------------------------------------------------------------------------------
# The lean launch path (kernels/launch.py) and the launch plans, compiled
# --------------------------------------------------------------------------------------------

LEAN_CONFIGS = [
    None, "128x256x64-w8-s4-tma-flat", "128x256x64-w8-s3-tma", "128x256x64-w8-s3-tma-t32", "64x128x64-w4-s4-p2",
    "32x256x128-w8-s2-tma-ov5", "32x128x128-w4-s4-p2-tma-ws",
]  # fmt: skip


def _dw_only(cfg: object) -> bool:
    """A config of a dw-only kernel (the Gluon ones): forward and dx take their table's."""
    return bool(getattr(cfg, "overlap", 0) or getattr(cfg, "ws", False))


def _lean_operands(seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    x = torch.randn(2048, 512, generator=gen, device=CUDA).to(BF16)
    w = (torch.randn(16, 256, 512, generator=gen, device=CUDA) / 512**0.5).to(BF16)
    dy = torch.randn(2048, 256, generator=gen, device=CUDA).to(BF16)
    sizes = torch.tensor([200, 0, 131, 64, 97, 300, 5, 128, 128, 100, 200, 11, 300, 100, 84, 200], device=CUDA, dtype=torch.int32)
    return x, w, dy, sizes


def _fresh_plans() -> None:
    from qmoe_doctor.kernels import backward, grouped_gemm

    grouped_gemm.clear_plans()
    backward._DW_PLANS.clear()
    backward._BOUNDS_PLANS.clear()


@pytest.mark.parametrize("name", LEAN_CONFIGS, ids=str)
def test_lean_launch_gives_what_the_standard_launch_gives(name: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Second and later calls take the compiled kernel's launcher; their results are bitwise the
    results of the same plans launched through JITFunction.run (QMOE_DOCTOR_LEAN_LAUNCH=0)."""
    from qmoe_doctor.core.knobs import QMOE_LEAN_LAUNCH as LEAN_LAUNCH_ENV
    from qmoe_doctor.kernels import launch
    from qmoe_doctor.kernels.tuning import config_from_name

    cfg = config_from_name(name) if name else None
    x, w, dy, sizes = _lean_operands(0)
    calls = {
        "forward": lambda: moe_grouped_gemm(x, w, sizes, config=cfg if cfg and not _dw_only(cfg) else None),
        "dx": lambda: moe_grouped_gemm_dx(dy, w, sizes, config=cfg if cfg and not _dw_only(cfg) else None),
        "dw": lambda: moe_grouped_gemm_dw(dy, x, sizes, config=cfg if cfg and _dw_only(cfg) else None),
    }
    _fresh_plans()
    monkeypatch.setenv(LEAN_LAUNCH_ENV, "0")
    standard = {op: fn() for op, fn in calls.items()}
    _fresh_plans()
    monkeypatch.delenv(LEAN_LAUNCH_ENV)
    for fn in calls.values():
        fn()  # the first call of each plan goes through JITFunction.run
    before = launch.counts.lean
    lean = {op: fn() for op, fn in calls.items()}
    torch.cuda.synchronize()
    assert launch.counts.lean > before, "no call took the lean path"
    for op in calls:
        assert torch.equal(lean[op], standard[op]), op
    ref = moe_grouped_gemm_torch(x.double(), w.double(), sizes)
    assert rel_err(lean["forward"], ref) < tolerance("bfloat16")


@pytest.mark.parametrize("name", LEAN_CONFIGS, ids=str)
def test_direct_launches_follow_operands_to_new_addresses(name: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The direct launch keeps each descriptor's encoding per address: calls that alternate
    between operands at different addresses (and come back to one) give bitwise what the
    standard launch gives for each; on Triton 3.6 the calls went direct."""
    import triton

    from qmoe_doctor.core.knobs import QMOE_LEAN_LAUNCH as LEAN_LAUNCH_ENV
    from qmoe_doctor.kernels import launch
    from qmoe_doctor.kernels.tuning import config_from_name

    cfg = config_from_name(name) if name else None
    fwd_cfg = cfg if cfg and not _dw_only(cfg) else None
    dw_cfg = cfg if cfg and _dw_only(cfg) else None
    sets = [_lean_operands(seed) for seed in (3, 4, 5)]
    sizes = sets[0][3]

    def results() -> list[tuple[torch.Tensor, ...]]:
        out = []
        for x, w, dy, _ in (*sets, sets[0], sets[2]):
            out.append((
                moe_grouped_gemm(x, w, sizes, config=fwd_cfg),
                moe_grouped_gemm_dx(dy, w, sizes, config=fwd_cfg),
                moe_grouped_gemm_dw(dy, x, sizes, config=dw_cfg),
            ))  # fmt: skip
        return out

    _fresh_plans()
    monkeypatch.setenv(LEAN_LAUNCH_ENV, "0")
    standard = results()
    _fresh_plans()
    monkeypatch.delenv(LEAN_LAUNCH_ENV)
    before = launch.counts.direct
    lean = results()
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(lean, standard, strict=True)):
        for op, got, want in zip(("forward", "dx", "dw"), a, b, strict=True):
            assert torch.equal(got, want), f"call {i} {op}"
    if triton.__version__.startswith("3.6."):
        assert launch.counts.direct > before, "Triton 3.6: no launch went direct"


def test_lean_plans_read_nothing_on_the_host_and_capture_in_a_graph() -> None:
    """Steady-state calls synchronize nothing (torch's sync debug mode raises on any op that
    would), and a CUDA graph captures them (capture fails on a host read)."""
    x, w, dy, sizes = _lean_operands(1)
    ops = (
        lambda: moe_grouped_gemm(x, w, sizes),
        lambda: moe_grouped_gemm_dx(dy, w, sizes),
        lambda: moe_grouped_gemm_dw(dy, x, sizes),
    )
    for fn in ops:
        fn()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = [fn() for fn in ops]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in ops:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        captured = [fn() for fn in ops]
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(eager, captured, strict=True):
        assert torch.equal(a, b)


def test_lean_path_steps_aside_for_a_launch_hook() -> None:
    """A profiler's launch hook must see every launch: with one installed, calls go through
    JITFunction.run again."""
    from triton import knobs

    from qmoe_doctor.kernels import launch

    x, w, _, sizes = _lean_operands(2)
    moe_grouped_gemm(x, w, sizes)
    seen: list[object] = []

    def hook(metadata: object) -> None:
        seen.append(metadata)

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        before = launch.counts.standard
        moe_grouped_gemm(x, w, sizes)
        torch.cuda.synchronize()
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert launch.counts.standard == before + 1 and seen
