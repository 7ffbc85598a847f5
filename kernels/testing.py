"""What the kernel tests share, on the CPU (the Triton interpreter) and on a GPU, in the manner of
triton_kernels' ``testing.py``: the comparison, the canaries, the operand layouts and the case
tables. Each case row names the edge it covers.

* ``assert_close(ref, tri, dtype, kind=...)``: ``||tri - ref|| / ||ref||`` within the tolerance
  table of ``qmoe_doctor.core.tolerances`` (the one the probes judge by), every element finite;
* canaries: ``poisoned_output`` gives an output view full of NaN inside a buffer full of
  ``CANARY``; ``assert_canary_intact`` checks nothing outside the view was written;
* layouts: ``make_view`` returns a tensor equal to its input laid out differently in memory, with
  NaN wherever a kernel must not read;
* case tables: ``GEMM_CASES`` (forward and dx), ``DW_CASES`` (dw), ``BLOCK_CASES`` (the MoE
  block), with their operand builders;
* ``sm90_compile_report``: a Gluon kernel compiled for sm_90 on a CPU (its shared memory, PTX and
  ptxas' report), for the tests of the kernels' structure.

Imports torch (child side only); never pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from qmoe_doctor.core.shapes import PRESETS, MoEShape
from qmoe_doctor.core.tolerances import ToleranceKind, tolerance
from qmoe_doctor.kernels.grouped_gemm import GemmConfig
from qmoe_doctor.kernels.moe_block import MoEBlock, MoEBlockTorch

__all__ = [
    "sm90_compile_report",
    "BLOCK_CASES",
    "CANARY",
    "CPU_DTYPES",
    "DW_CASES",
    "GEMM_CASES",
    "ROUTING_MARGIN",
    "VIEWS",
    "BlockCase",
    "DwCase",
    "GemmCase",
    "assert_canary_intact",
    "assert_close",
    "balanced_sizes",
    "case_id",
    "dw_operands",
    "gemm_operands",
    "make_block_inputs",
    "make_view",
    "poisoned_output",
    "rel_err",
    "twin_of",
]

CANARY = -768.0  # written around outputs; must be there after the run (exact in bf16 and fp16)
CPU_DTYPES = (torch.float32, torch.float16)  # bf16 tl.dot is garbage in the interpreter


# --------------------------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------------------------


def rel_err(ref: torch.Tensor, tri: torch.Tensor) -> float:
    """``||tri - ref|| / ||ref||`` in float64; ``max |tri|`` when ``ref`` is all zeros (every
    expert empty: any output there is wrong by that much)."""
    ref64 = ref.detach().double()
    denom = float(ref64.norm())
    if denom == 0:
        return float(tri.detach().double().abs().max()) if tri.numel() else 0.0
    return float((tri.detach().double() - ref64).norm()) / denom


def assert_close(
    ref: torch.Tensor, tri: torch.Tensor, dtype: torch.dtype, *, kind: ToleranceKind = "gemm"
) -> None:
    """``tri`` (the kernel's output) against ``ref`` (its twin, in float64) within the tolerance of
    ``dtype`` for ``kind``; a reference of zeros is refused (the case would test nothing)."""
    assert tri.shape == ref.shape, f"shape {tuple(tri.shape)} != reference {tuple(ref.shape)}"
    assert torch.isfinite(tri).all(), "output has non-finite values (read past an operand?)"
    assert float(ref.detach().double().norm()) > 0, "reference is all zeros: the case tests nothing"
    tol = tolerance(str(dtype), kind)
    err = rel_err(ref, tri)
    assert err <= tol, f"relative error {err:.3e} > {tol:.0e} ({dtype}, {kind})"


# --------------------------------------------------------------------------------------------
# Canaries
# --------------------------------------------------------------------------------------------


def poisoned_output(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An output view full of NaN inside a buffer full of CANARY: (view, buffer, inside mask)."""
    full = tuple(s + 6 for s in shape)
    buf = torch.full(full, CANARY, dtype=dtype, device=device)
    index = tuple(slice(2, 2 + s) for s in shape)
    buf[index] = float("nan")
    inside = torch.zeros(full, dtype=torch.bool, device=device)
    inside[index] = True
    return buf[index], buf, inside


def assert_canary_intact(buf: torch.Tensor, inside: torch.Tensor) -> None:
    outside = buf[~inside]
    assert (outside == CANARY).all(), f"{int((outside != CANARY).sum())} canary elements overwritten"


# --------------------------------------------------------------------------------------------
# Layouts: each returns a tensor equal to ``t`` laid out differently in memory, with NaN
# wherever the kernel must not read (before/after the rows, the columns around a slice).
# --------------------------------------------------------------------------------------------

VIEWS = ("contiguous", "transposed", "offset", "sliced")


def make_view(t: torch.Tensor, view: str) -> torch.Tensor:
    if view == "contiguous":
        return t.clone()
    if view == "transposed":  # last two dims stored swapped: strides (1, rows)
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if view == "offset":  # storage offset, NaN rows (2-D) / experts (3-D) before and after
        buf = torch.full((t.shape[0] + 5, *t.shape[1:]), float("nan"), dtype=t.dtype, device=t.device)
        buf[2 : 2 + t.shape[0]] = t
        return buf[2 : 2 + t.shape[0]]
    if view == "sliced":  # row stride wider than the row, NaN columns on both sides
        pad = [s + 7 for s in t.shape]
        pad[0] = t.shape[0]
        buf = torch.full(pad, float("nan"), dtype=t.dtype, device=t.device)
        index = (slice(None),) + tuple(slice(3, 3 + s) for s in t.shape[1:])
        buf[index] = t
        return buf[index]
    raise ValueError(view)


def balanced_sizes(m: int, e: int) -> tuple[int, ...]:
    """M rows over E experts, M // E each and the remainder on the last (the case tables' default)."""
    base = [m // e] * e
    base[-1] += m - sum(base)
    return tuple(base)


# --------------------------------------------------------------------------------------------
# Forward and dx. x_view applies to the 2-D operand (x, or dy for dx), w_view to the weights;
# sizes None means spread over the experts by ``balanced_sizes``.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class GemmCase:
    edge: str
    m: int
    e: int
    n: int
    k: int
    sizes: tuple[int, ...] | None = None
    x_view: str = "contiguous"
    w_view: str = "contiguous"
    sizes_dtype: torch.dtype = torch.int32
    config: GemmConfig | None = None

    def m_sizes(self, device: torch.device | str = "cpu") -> torch.Tensor:
        sizes = self.sizes if self.sizes is not None else balanced_sizes(self.m, self.e)
        assert len(sizes) == self.e
        return torch.tensor(sizes, dtype=self.sizes_dtype, device=device)

    def covered_rows(self) -> int:
        """Rows the (clamped) m_sizes cover; the rest must come out as zeros."""
        row = 0
        for size in self.m_sizes().tolist():
            row += min(max(size, 0), self.m - row)
        return row


# fmt: off
GEMM_CASES: tuple[GemmCase, ...] = (
    GemmCase(edge="balanced", m=64, e=4, n=32, k=48),
    GemmCase(edge="empty-experts", m=64, e=5, n=32, k=48, sizes=(0, 20, 0, 44, 0)),
    GemmCase(edge="one-hot-expert", m=64, e=4, n=32, k=48, sizes=(0, 0, 64, 0)),
    GemmCase(edge="all-rows-in-last-expert", m=64, e=4, n=32, k=48, sizes=(0, 0, 0, 64)),
    GemmCase(edge="prime-mnk", m=37, e=3, n=29, k=31, sizes=(11, 0, 26)),
    GemmCase(edge="m-under-one-tile", m=5, e=3, n=33, k=35, sizes=(2, 0, 3)),
    GemmCase(edge="many-tiles-per-expert", m=70, e=3, n=40, k=36, sizes=(33, 1, 36), config=GemmConfig(16, 16, 16, num_warps=4, num_stages=1)),
    GemmCase(edge="x-transposed", m=40, e=3, n=24, k=40, x_view="transposed"),
    GemmCase(edge="x-storage-offset-nan-around", m=40, e=3, n=24, k=40, x_view="offset"),
    GemmCase(edge="x-sliced-columns", m=40, e=3, n=24, k=40, x_view="sliced"),
    GemmCase(edge="w-transposed", m=40, e=3, n=24, k=40, w_view="transposed"),
    GemmCase(edge="w-storage-offset-nan-experts-around", m=40, e=3, n=24, k=40, w_view="offset"),
    GemmCase(edge="w-sliced", m=40, e=3, n=24, k=40, w_view="sliced"),
    GemmCase(edge="int64-sizes", m=40, e=3, n=24, k=40, sizes=(9, 30, 1), sizes_dtype=torch.int64),
    GemmCase(edge="sizes-sum-under-m", m=40, e=3, n=24, k=40, sizes=(10, 0, 17)),
    GemmCase(edge="sizes-sum-past-m-nan-after-x", m=40, e=3, n=24, k=40, sizes=(30, 30, 1000), x_view="offset"),
    GemmCase(edge="negative-sizes", m=40, e=4, n=24, k=40, sizes=(-5, 25, -1, 15), x_view="offset"),
    GemmCase(edge="int64-sizes-past-m", m=40, e=2, n=24, k=40, sizes=(2**40, 5), sizes_dtype=torch.int64, x_view="offset"),
)
# fmt: on


def case_id(case: GemmCase) -> str:
    return case.edge


def gemm_operands(
    case: GemmCase, dtype: torch.dtype, device: torch.device | str = "cpu", *, n_first: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a, w, m_sizes) for a case: a is (M, K) for the forward, (M, N) when ``n_first`` (dx)."""
    gen = torch.Generator().manual_seed(zlib.crc32(case.edge.encode()))
    a_cols = case.n if n_first else case.k
    a = torch.randn(case.m, a_cols, generator=gen).to(device=device, dtype=dtype)
    w = (torch.randn(case.e, case.n, case.k, generator=gen) / case.k**0.5).to(device=device, dtype=dtype)
    return make_view(a, case.x_view), make_view(w, case.w_view), case.m_sizes(device)


# --------------------------------------------------------------------------------------------
# dw: its operands are dy (M, N) and x (M, K), its output (E, N, K).
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class DwCase:
    edge: str
    m: int
    e: int
    n: int
    k: int
    sizes: tuple[int, ...] | None = None
    dy_view: str = "contiguous"
    x_view: str = "contiguous"
    sizes_dtype: torch.dtype = torch.int32
    config: GemmConfig | None = None

    def m_sizes(self) -> torch.Tensor:
        sizes = self.sizes if self.sizes is not None else balanced_sizes(self.m, self.e)
        assert len(sizes) == self.e
        return torch.tensor(sizes, dtype=self.sizes_dtype)


# fmt: off
DW_CASES: tuple[DwCase, ...] = (
    DwCase(edge="balanced", m=64, e=4, n=32, k=48),
    DwCase(edge="empty-experts-give-zero-dw", m=64, e=5, n=32, k=48, sizes=(0, 20, 0, 44, 0)),
    DwCase(edge="one-hot-expert", m=64, e=4, n=32, k=48, sizes=(0, 0, 64, 0)),
    DwCase(edge="all-rows-in-last-expert", m=64, e=4, n=32, k=48, sizes=(0, 0, 0, 64)),
    DwCase(edge="prime-mnk", m=37, e=3, n=29, k=31, sizes=(11, 0, 26)),
    DwCase(edge="m-under-one-tile", m=5, e=3, n=33, k=35, sizes=(2, 0, 3)),
    DwCase(edge="many-row-chunks", m=70, e=3, n=20, k=36, sizes=(33, 1, 36), config=GemmConfig(16, 16, 16, num_warps=4, num_stages=1)),
    DwCase(edge="dy-transposed", m=40, e=3, n=24, k=40, dy_view="transposed"),
    DwCase(edge="x-transposed", m=40, e=3, n=24, k=40, x_view="transposed"),
    DwCase(edge="dy-storage-offset-nan-around", m=40, e=3, n=24, k=40, dy_view="offset"),
    DwCase(edge="x-storage-offset-nan-around", m=40, e=3, n=24, k=40, x_view="offset"),
    DwCase(edge="dy-and-x-sliced", m=40, e=3, n=24, k=40, dy_view="sliced", x_view="sliced"),
    DwCase(edge="int64-sizes", m=40, e=3, n=24, k=40, sizes=(9, 30, 1), sizes_dtype=torch.int64),
    DwCase(edge="sizes-sum-under-m", m=40, e=3, n=24, k=40, sizes=(10, 0, 17)),
    DwCase(edge="sizes-sum-past-m-nan-after-rows", m=40, e=3, n=24, k=40, sizes=(30, 30, 1000), dy_view="offset", x_view="offset"),
    DwCase(edge="negative-sizes", m=40, e=4, n=24, k=40, sizes=(-5, 25, -1, 15), dy_view="offset", x_view="offset"),
    DwCase(edge="int64-sizes-past-2**31", m=40, e=2, n=24, k=40, sizes=(2**40, 5), sizes_dtype=torch.int64, x_view="offset"),
)
# fmt: on


def dw_operands(case: DwCase, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dy, x, m_sizes) for a dw case, on the CPU."""
    gen = torch.Generator().manual_seed(zlib.crc32(case.edge.encode()))
    dy = torch.randn(case.m, case.n, generator=gen).to(dtype)
    x = torch.randn(case.m, case.k, generator=gen).to(dtype)
    return make_view(dy, case.dy_view), make_view(x, case.x_view), case.m_sizes()


# --------------------------------------------------------------------------------------------
# The MoE block, against its twin run in float64 from the same state dict.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockCase:
    edge: str
    shape: MoEShape
    tokens: int
    dtype: torch.dtype = torch.float32
    hot_expert: int | None = None  # steer every token's top-1 to this expert


def _shape(e: int, k: int, h: int, i: int, norm: bool = True) -> MoEShape:
    return MoEShape(name="test", num_experts=e, top_k=k, hidden=h, intermediate=i, norm_topk_prob=norm)


BLOCK_CASES: tuple[BlockCase, ...] = (
    BlockCase(edge="tiny-preset", shape=PRESETS["tiny"], tokens=24),
    BlockCase(edge="prime-sizes-top3", shape=_shape(5, 3, 37, 19), tokens=13),
    BlockCase(edge="top1-no-renormalize", shape=_shape(4, 1, 32, 16, norm=False), tokens=16),
    BlockCase(edge="more-experts-than-rows", shape=_shape(16, 2, 32, 16), tokens=3),
    BlockCase(edge="single-token", shape=PRESETS["tiny"], tokens=1),
    BlockCase(edge="one-hot-expert", shape=PRESETS["tiny"], tokens=16, hot_expert=5),
    BlockCase(edge="float16", shape=PRESETS["tiny"], tokens=16, dtype=torch.float16),
)

ROUTING_MARGIN = 0.05  # logit gap kept between the k-th and (k+1)-th expert of every token


def make_block_inputs(case: BlockCase, device: torch.device | str = "cpu") -> tuple[MoEBlock, torch.Tensor]:
    """A block in case.dtype and hidden states whose top-k choice is the same in every dtype:
    tokens whose k-th and (k+1)-th router logits (exact, from the case.dtype values) are
    closer than ROUTING_MARGIN are dropped."""
    torch.manual_seed(0)
    block = MoEBlock(case.shape, device=device, dtype=torch.float32)
    s = case.shape
    cand = torch.randn(8 * case.tokens + 32, s.hidden, device=device)
    if case.hot_expert is not None:
        direction = torch.ones(s.hidden, device=device) / s.hidden**0.5
        with torch.no_grad():
            block.gate.weight[case.hot_expert] += 4 * direction
        cand += direction
    block = block.to(case.dtype)
    cand = cand.to(case.dtype)
    logits = (cand.double() @ block.gate.weight.double().T).sort(dim=-1, descending=True).values
    if s.top_k < s.num_experts:
        cand = cand[(logits[:, s.top_k - 1] - logits[:, s.top_k]) > ROUTING_MARGIN]
    assert cand.shape[0] >= case.tokens
    return block, cand[: case.tokens]


def twin_of(block: MoEBlock, dtype: torch.dtype = torch.float64) -> MoEBlockTorch:
    twin = MoEBlockTorch(block.shape, device=block.gate_up_proj.device, dtype=dtype)
    twin.load_state_dict(block.state_dict())  # same names, same shapes; copy_ converts dtype
    return twin


_SM90_SCRIPT = """
import importlib, json, os, subprocess, sys, tempfile
from qmoe_doctor.kernels.tuning import config_from_name
from triton.backends.nvidia.compiler import get_ptxas
module, name = sys.argv[1].split(":")
k = getattr(importlib.import_module(module), name)(config_from_name(sys.argv[2]))
with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
    f.write(k.asm["ptx"])
v = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
os.unlink(f.name)
print(json.dumps({"shared": k.metadata.shared, "ptx": k.asm["ptx"], "ptxas": v.stderr}))
"""


def sm90_compile_report(compile_fn: str, config: str, timeout: float = 600) -> dict[str, Any] | None:
    """The kernel that ``compile_fn`` (``"module:function"``, taking a launch config, as
    ``dw_overlap.compile_offline``) builds for ``config``, compiled for sm_90 by Triton's own
    compiler in a fresh process (the interpreter some tests run under patches Triton's builtins
    in this one): ``{"shared": bytes, "ptx": text, "ptxas": ptxas -v's report}``. None where
    Triton's bundled ptxas is missing; RuntimeError with the child's stderr when it fails."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _SM90_SCRIPT, compile_fn, config], capture_output=True, text=True, env=env, timeout=timeout
    )
    if done.returncode and "ptxas" in done.stderr and "No such file" in done.stderr:
        return None
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report
