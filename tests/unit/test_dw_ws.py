"""The warp-specialized dw kernel (``kernels/dw_ws.py``, configs ``-ws``) without a GPU.

The Gluon kernel runs only on an sm_90 GPU (tests/gpu); here: its config names, its shared
memory and launch options, the fallback every other device takes (the Triton TMA kernel of the
same tiles, run under the interpreter against the float64 reference, NaN in the unrouted rows),
and the kernel compiled for sm_90 by Triton's own compiler on this CPU: it must compile, fit two
programs per SM where the config asks for two, keep ptxas from spilling, and hand the loader
warp and the multiplying warpgroup the registers the launch options promise.
"""

from __future__ import annotations

import functools
import os
import re

import pytest
import torch

from qmoe_doctor.kernels.backward import (
    _dw_plan,
    _dw_smem_bytes,
    moe_grouped_gemm_dw,
    moe_grouped_gemm_dw_torch,
)
from qmoe_doctor.kernels.dw_ws import (
    HAVE_WS,
    LOADER_REGS,
    TWO_PER_SM_REGS,
    dw_ws_kernel,
    dw_ws_ok,
    dw_ws_smem_bytes,
    ws_args,
    ws_fallback,
    ws_options,
    ws_store_buffers,
)
from qmoe_doctor.kernels.grouped_gemm import HOPPER_BLOCK_SMEM
from qmoe_doctor.kernels.testing import assert_close, sm90_compile_report
from qmoe_doctor.kernels.tuning import config_from_name

SM_SMEM = 233472  # shared memory of one H100 / H200 SM
BLOCK_RESERVED = 1024  # what the driver keeps per resident block


def test_names_round_trip_and_errors() -> None:
    for name in ("32x128x128-w4-s4-p2-tma-ws", "32x128x128-w4-s8-tma-ws", "64x128x128-w4-s4-tma-ws"):
        cfg = config_from_name(name)
        assert cfg.name == name and cfg.ws and cfg.tma
    for bad in (
        "32x128x128-w8-s4-tma-ws",  # two warpgroups
        "32x128x128-w4-s4-ws",  # no -tma
        "32x128x128-w4-s4-p3-tma-ws",
        "32x128x128-w4-s4-tma-ov2-ws",
        "32x128x128-w4-s4-tma-r2-ws",
        "32x128x128-w4-s4-tma-flat-ws",
    ):
        with pytest.raises(ValueError, match="launch config"):
            config_from_name(bad)


def test_fallback_is_the_tma_kernel_of_the_same_tiles() -> None:
    assert ws_fallback(config_from_name("32x128x128-w4-s4-p2-tma-ws")).name == "32x128x128-w4-s4-p2-tma"


def test_smem_buffers_and_options() -> None:
    two = config_from_name("32x128x128-w4-s4-p2-tma-ws")
    one = config_from_name("32x128x128-w4-s8-tma-ws")
    assert (ws_store_buffers(two), ws_store_buffers(one)) == (1, 2)
    # the ring of (dy, x) chunks, the staging tiles, two barriers a stage
    assert dw_ws_smem_bytes(two, 2) == 2 * (4 * 32 * 256 + 128 * 128) + 16 * 4
    assert dw_ws_smem_bytes(one, 2) == 2 * (8 * 32 * 256 + 2 * 128 * 128) + 16 * 8
    assert _dw_smem_bytes(two, 2) == dw_ws_smem_bytes(two, 2)
    assert 2 * (dw_ws_smem_bytes(two, 2) + BLOCK_RESERVED) <= SM_SMEM  # two programs share an SM
    assert ws_options(two) == {"maxnreg": TWO_PER_SM_REGS} and ws_options(one) == {}
    # two programs of 8 warps (the multiplier's warpgroup and the loader's) at the cap fill the SM
    assert 2 * 8 * 32 * TWO_PER_SM_REGS == 65536


def test_kernel_arguments_are_the_kernel_s_parameters() -> None:
    """``ws_args`` and the four tensors are exactly the kernel's parameters (the launch plan
    refuses anything else), with E_POW2 the power of two at or above E and the staging tiles
    of the config."""
    cfg = config_from_name("32x128x128-w4-s4-p2-tma-ws")
    dy, x, dw = torch.empty(64, 256), torch.empty(64, 384), torch.empty(160, 256, 384)
    args = ws_args(dy, x, dw, cfg, 264)
    assert (args["E"], args["E_POW2"], args["NBUF"], args["STAGES"], args["NUM_PROGRAMS"]) == (160, 256, 1, 4, 264)
    assert (args["M"], args["N"], args["K"], args["num_warps"]) == (64, 256, 384, 4)
    if HAVE_WS:
        tensors = {"dy_desc", "x_desc", "dw_desc", "sizes_ptr"}
        assert set(args) | tensors == set(dw_ws_kernel().arg_names)


@pytest.mark.parametrize(
    "sizes",
    [[300, 0, 517, 7, 200], [2, 1, 0, 5, 190], [0, 0, 0, 0, 64]],
    ids=["mixed", "under-a-chunk", "one-expert"],
)
def test_cpu_takes_the_fallback_and_matches_the_reference(sizes: list[int]) -> None:
    """On the CPU (the interpreter) the -ws config takes the Triton TMA kernel of its tiles: the
    same dw as the float64 loop, unrouted NaN rows kept out, empty experts zero."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("the Triton kernels run on the CPU only under TRITON_INTERPRET=1")
    cfg = config_from_name("16x64x32-w4-s1-tma-ws")
    gen = torch.Generator().manual_seed(3)
    routed = sum(sizes)
    x = torch.randn(routed + 9, 64, generator=gen).half()
    dy = torch.randn(routed + 9, 128, generator=gen).half()
    x[routed:] = float("nan")
    dy[routed:] = float("nan")
    m_sizes = torch.tensor(sizes)
    assert not dw_ws_ok(dy, x, cfg)
    assert _dw_plan(dy, x, m_sizes, None, cfg).path == "tma"
    dw = moe_grouped_gemm_dw(dy, x, m_sizes, config=cfg)
    ref = moe_grouped_gemm_dw_torch(dy[:routed].double(), x[:routed].double(), m_sizes)
    assert_close(ref, dw, torch.float16)  # finite (no unrouted NaN row reached it), within tolerance
    for e, size in enumerate(sizes):
        if size == 0:
            assert (dw[e] == 0).all()


# ---- the Gluon kernel compiled for sm_90 on this CPU ---------------------------------------

needs_ws = pytest.mark.skipif(not HAVE_WS, reason="this Triton has no Gluon warp_specialize of the pairs form")


@functools.cache  # a config several tests read is compiled once per pytest worker
def _compiled(name: str) -> dict:
    """The kernel compiled for sm_90 on this CPU (``kernels.testing.sm90_compile_report``)."""
    report = sm90_compile_report("qmoe_doctor.kernels.dw_ws:compile_ws_offline", name)
    if report is None:
        pytest.skip("Triton's bundled ptxas is missing")
    return report


@needs_ws
@pytest.mark.parametrize(
    "name",
    # the deepest rings of the tuner's candidates (about 224 KiB) fit one block only just
    ["32x128x128-w4-s4-p2-tma-ws", "32x128x128-w4-s8-tma-ws", "64x128x128-w4-s5-tma-ws", "32x128x128-w4-s10-tma-ws"],
)
def test_kernel_compiles_fits_and_keeps_its_registers(name: str) -> None:
    cfg = config_from_name(name)
    got = _compiled(name)
    want = dw_ws_smem_bytes(cfg, 2)
    assert want <= got["shared"] <= want + 256  # the host's count is what the kernel allocates
    assert got["shared"] <= HOPPER_BLOCK_SMEM
    report = got["ptxas"]
    assert re.search(r"\b0 bytes spill stores", report), report
    regs = int(re.search(r"Used (\d+) registers", report).group(1))  # type: ignore[union-attr]
    # warp specialization: the loader warp is set to its own budget, the multiplier above the
    # launch's count (it holds the 128x128 fp32 accumulator)
    moves = {(m.group(1), int(m.group(2))) for m in re.finditer(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", got["ptx"])}
    assert any(n == LOADER_REGS for _, n in moves), moves
    raised = max(n for kind, n in moves if kind == "inc")
    assert raised >= 200 and raised > LOADER_REGS, moves
    if cfg.programs_per_sm > 1:
        assert regs <= TWO_PER_SM_REGS < raised, report  # two programs per SM at launch
        assert 2 * (got["shared"] + BLOCK_RESERVED) <= SM_SMEM
    assert "wgmma.mma_async" in got["ptx"] and "cp.async.bulk.tensor.2d.shared" in got["ptx"]
