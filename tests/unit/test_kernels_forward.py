"""Forward grouped GEMM (``tri``) against its twin in float64 (``ref``), one row per edge.

This module also holds what the other kernel tests share: the tolerance table (stated once per
dtype), the layouts operands are built in (views with NaN around them), and the helpers. On a
machine without a GPU the kernels run in the Triton interpreter (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from qmoe_doctor.kernels.grouped_gemm import (
    GemmConfig,
    grid_size,
    launch_grouped_gemm,
    moe_grouped_gemm,
    moe_grouped_gemm_torch,
    pick_config,
)

# --------------------------------------------------------------------------------------------
# Tolerances: ||tri - ref|| / ||ref|| against a float64 reference, once per dtype. The same
# numbers hold on a GPU (fp32 there is tf32 in tl.dot), so CI is never looser than a GPU run.
# "gemm": one grouped GEMM (forward, dx, dw); "block": the MoE block, two GEMMs + SiLU + combine,
# outputs and every gradient.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class Tol:
    gemm: float
    block: float


TOLERANCE: dict[torch.dtype, Tol] = {
    torch.float32: Tol(gemm=2e-3, block=5e-3),  # tf32 on GPU; ~1e-7 in the interpreter
    torch.float16: Tol(gemm=2e-3, block=5e-3),  # measured 2e-4 (interpreter) for one GEMM
    torch.bfloat16: Tol(gemm=1e-2, block=2e-2),  # 1.7e-3 measured on H200 at M=4096, E=128
}

CANARY = -768.0  # written around outputs; must be there after the run (exact in bf16 and fp16)
CPU_DTYPES = (torch.float32, torch.float16)  # bf16 tl.dot is garbage in the interpreter


def rel_err(tri: torch.Tensor, ref: torch.Tensor) -> float:
    ref64 = ref.detach().double()
    denom = ref64.norm().item()
    assert denom > 0, "reference is all zeros: the case tests nothing"
    return (tri.detach().double() - ref64).norm().item() / denom


def assert_close(tri: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, *, kind: str = "gemm") -> None:
    assert tri.shape == ref.shape, f"shape {tuple(tri.shape)} != reference {tuple(ref.shape)}"
    assert torch.isfinite(tri).all(), "output has non-finite values (read past an operand?)"
    tol = getattr(TOLERANCE[dtype], kind)
    err = rel_err(tri, ref)
    assert err <= tol, f"relative error {err:.3e} > {tol:.0e} ({dtype}, {kind})"


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
    base = [m // e] * e
    base[-1] += m - sum(base)
    return tuple(base)


def poisoned_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str):
    """An output view full of NaN inside a buffer full of CANARY; returns (view, buffer, mask)."""
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
# The case table (forward and dx). x_view applies to the 2-D operand (x, or dy for dx), w_view
# to the weights; sizes None means spread evenly over the experts.
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


CASES: tuple[GemmCase, ...] = (
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


def case_id(case: GemmCase) -> str:
    return case.edge


def make_operands(case: GemmCase, dtype: torch.dtype, device: torch.device | str = "cpu", *, n_first: bool = False):
    """(a, w, m_sizes) for a case: a is (M, K) for the forward, (M, N) when ``n_first`` (dx)."""
    gen = torch.Generator().manual_seed(zlib.crc32(case.edge.encode()))
    a_cols = case.n if n_first else case.k
    a = torch.randn(case.m, a_cols, generator=gen).to(device=device, dtype=dtype)
    w = (torch.randn(case.e, case.n, case.k, generator=gen) / case.k**0.5).to(device=device, dtype=dtype)
    return make_view(a, case.x_view), make_view(w, case.w_view), case.m_sizes(device)


# --------------------------------------------------------------------------------------------
# Tests.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_forward_matches_reference(case: GemmCase) -> None:
    x, w, m_sizes = make_operands(case, torch.float32)
    tri = moe_grouped_gemm(x, w, m_sizes, config=case.config)
    ref = moe_grouped_gemm_torch(x.double(), w.double(), m_sizes)
    assert_close(tri, ref, torch.float32)
    covered = case.covered_rows()
    assert (tri[covered:] == 0).all(), "rows no expert covers must be zeros"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_forward_writes_every_element_and_nothing_else(case: GemmCase) -> None:
    """y starts as NaN inside a CANARY buffer: every element written, no canary touched."""
    x, w, m_sizes = make_operands(case, torch.float32)
    y, buf, inside = poisoned_output((case.m, case.n), torch.float32, "cpu")
    cfg = case.config or pick_config(case.m, case.n, case.k, case.e, x.device, x.dtype)
    launch_grouped_gemm(x, w, y, m_sizes, cfg, grid_size(case.m, case.n, case.e, cfg, x.device))
    assert_close(y, moe_grouped_gemm_torch(x.double(), w.double(), m_sizes), torch.float32)
    assert_canary_intact(buf, inside)


FP16_CASES = [c for c in CASES if c.edge in ("prime-mnk", "empty-experts", "x-sliced-columns")]


@pytest.mark.parametrize("case", FP16_CASES, ids=case_id)
def test_forward_float16(case: GemmCase) -> None:
    x, w, m_sizes = make_operands(case, torch.float16)
    tri = moe_grouped_gemm(x, w, m_sizes)
    assert tri.dtype == torch.float16
    assert_close(tri, moe_grouped_gemm_torch(x.double(), w.double(), m_sizes), torch.float16)


def test_forward_out_dtype() -> None:
    case = CASES[0]
    x, w, m_sizes = make_operands(case, torch.float16)
    tri = moe_grouped_gemm(x, w, m_sizes, out_dtype=torch.float32)
    assert tri.dtype == torch.float32
    assert_close(tri, moe_grouped_gemm_torch(x.double(), w.double(), m_sizes), torch.float16)


@pytest.mark.parametrize(
    "edge, m, n, k",
    [("no-rows", 0, 8, 16), ("no-columns", 8, 0, 16), ("k-zero-gives-zeros", 8, 8, 0)],
)
def test_forward_degenerate_shapes(edge: str, m: int, n: int, k: int) -> None:
    x = torch.randn(m, k)
    w = torch.randn(2, n, k)
    m_sizes = torch.tensor([m, 0], dtype=torch.int32)
    tri = moe_grouped_gemm(x, w, m_sizes)
    assert tri.shape == (m, n)
    assert (tri == 0).all()


def test_twin_matches_row_by_row_definition() -> None:
    """The reference itself, against the definition written per row (y[m] = x[m] @ w[e(m)].T)."""
    x = torch.randn(12, 5, dtype=torch.float64)
    w = torch.randn(3, 4, 5, dtype=torch.float64)
    m_sizes = torch.tensor([-2, 7, 9])  # clamped to (0, 7, 5)
    expert_of_row = [1] * 7 + [2] * 5
    want = torch.stack([x[r] @ w[expert_of_row[r]].T for r in range(12)])
    assert torch.allclose(moe_grouped_gemm_torch(x, w, m_sizes), want)


# --------------------------------------------------------------------------------------------
# The benchmark script's CPU smoke run (it benchmarks these kernels; it lives in benchmarks/).
# --------------------------------------------------------------------------------------------


def test_bench_kernels_tiny_runs(tmp_path: Path) -> None:
    """``--tiny`` runs every row in the interpreter, prints the table and writes the JSON."""
    out = tmp_path / "bench.json"
    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_kernels", "--tiny", "--json-out", str(out)],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no speed claims" in proc.stdout
    report = json.loads(out.read_text())
    assert report["schema_version"] == 1 and report["timed"] is False
    rows = {(r["op"], r["impl"]): r for r in report["rows"]}
    for op in ("forward", "dx", "dw"):
        for impl in ("qmoe", "torch._grouped_mm", "per-expert loop", "dense (same FLOPs)"):
            assert (op, impl) in rows, (op, impl)
        assert rows[(op, "qmoe")]["rel_err"] < TOLERANCE[torch.float32].gemm
    assert rows[("block-forward", "qmoe MoEBlock")]["rel_err"] < TOLERANCE[torch.float32].block
    assert not [r for r in report["rows"] if r["impl"].startswith("qmoe") and r["note"]]
