"""Forward grouped GEMM (``tri``) against its twin in float64 (``ref``), one row per edge.

The case table, the layouts operands are built in (views with NaN around them), the canaries
and the comparison live in ``qmoe_doctor.kernels.testing``; the tolerances in
``qmoe_doctor.core.tolerances``. On a machine without a GPU the kernels run in the Triton
interpreter (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qmoe_doctor.core.tolerances import tolerance
from qmoe_doctor.kernels.grouped_gemm import (
    grid_size,
    launch_grouped_gemm,
    moe_grouped_gemm,
    moe_grouped_gemm_torch,
    pick_config,
)
from qmoe_doctor.kernels.testing import (
    GEMM_CASES,
    GemmCase,
    assert_canary_intact,
    assert_close,
    case_id,
    gemm_operands,
    poisoned_output,
    rel_err,
)

# --------------------------------------------------------------------------------------------
# Tests.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", GEMM_CASES, ids=case_id)
def test_forward_matches_reference(case: GemmCase) -> None:
    x, w, m_sizes = gemm_operands(case, torch.float32)
    tri = moe_grouped_gemm(x, w, m_sizes, config=case.config)
    ref = moe_grouped_gemm_torch(x.double(), w.double(), m_sizes)
    assert_close(ref, tri, torch.float32)
    covered = case.covered_rows()
    assert (tri[covered:] == 0).all(), "rows no expert covers must be zeros"


@pytest.mark.parametrize("case", GEMM_CASES, ids=case_id)
def test_forward_writes_every_element_and_nothing_else(case: GemmCase) -> None:
    """y starts as NaN inside a CANARY buffer: every element written, no canary touched."""
    x, w, m_sizes = gemm_operands(case, torch.float32)
    y, buf, inside = poisoned_output((case.m, case.n), torch.float32, "cpu")
    cfg = case.config or pick_config(case.m, case.n, case.k, case.e, x.device, x.dtype)
    launch_grouped_gemm(x, w, y, m_sizes, cfg, grid_size(case.m, case.n, case.e, cfg, x.device))
    assert_close(moe_grouped_gemm_torch(x.double(), w.double(), m_sizes), y, torch.float32)
    assert_canary_intact(buf, inside)


FP16_CASES = [c for c in GEMM_CASES if c.edge in ("prime-mnk", "empty-experts", "x-sliced-columns")]


@pytest.mark.parametrize("case", FP16_CASES, ids=case_id)
def test_forward_float16(case: GemmCase) -> None:
    x, w, m_sizes = gemm_operands(case, torch.float16)
    tri = moe_grouped_gemm(x, w, m_sizes)
    assert tri.dtype == torch.float16
    assert_close(moe_grouped_gemm_torch(x.double(), w.double(), m_sizes), tri, torch.float16)


def test_forward_out_dtype() -> None:
    case = GEMM_CASES[0]
    x, w, m_sizes = gemm_operands(case, torch.float16)
    tri = moe_grouped_gemm(x, w, m_sizes, out_dtype=torch.float32)
    assert tri.dtype == torch.float32
    assert_close(moe_grouped_gemm_torch(x.double(), w.double(), m_sizes), tri, torch.float16)


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


def test_the_comparison_and_the_canaries_can_fail() -> None:
    """kernels.testing's checks, on tensors made to fail them."""
    ref = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert_close(ref, ref.float(), torch.float32)
    with pytest.raises(AssertionError, match="relative error"):
        assert_close(ref, (ref * 1.01).float(), torch.float32)  # 1e-2 > the float32 tolerance
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close(ref, torch.full((8, 4), float("nan")), torch.float32)
    with pytest.raises(AssertionError, match="tests nothing"):
        assert_close(torch.zeros(8, 4), torch.zeros(8, 4), torch.float32)
    assert rel_err(torch.zeros(3), torch.tensor([0.0, -2.0, 0.0])) == 2.0  # every expert empty
    view, buf, inside = poisoned_output((3, 2), torch.float32, "cpu")
    assert torch.isnan(view).all()
    view.fill_(1.0)
    assert_canary_intact(buf, inside)
    buf[0, 0] = 0.0
    with pytest.raises(AssertionError, match="1 canary elements overwritten"):
        assert_canary_intact(buf, inside)


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
        assert rows[(op, "qmoe")]["rel_err"] < tolerance("float32")
    assert rows[("block-forward", "qmoe MoEBlock")]["rel_err"] < tolerance("float32", "block")
    assert not [r for r in report["rows"] if r["impl"].startswith("qmoe") and r["note"]]
