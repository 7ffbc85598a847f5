"""The per-card benchmark (``benchmarks/side_by_side.py``) and its peer
(``benchmarks/public_peer.py``) on the CPU: the peer computes what the twins compute, the tiny
run goes through every step and writes its files, and the verdicts follow the numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.public_peer import TINY_TILE, peer_dw, peer_forward
from benchmarks.side_by_side import ROOFLINE_SHARE, add_roofline, verdicts
from qmoe_doctor.kernels.backward import moe_grouped_gemm_dw_torch, moe_grouped_gemm_dx_torch
from qmoe_doctor.kernels.grouped_gemm import moe_grouped_gemm_torch
from qmoe_doctor.kernels.testing import rel_err

REPO = Path(__file__).resolve().parents[2]


def test_the_public_design_peer_matches_the_twins() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w, dy = torch.randn(70, 64, generator=gen), torch.randn(4, 48, 64, generator=gen), torch.randn(70, 48, generator=gen)
    sizes = torch.tensor([10, 0, 35, 25], dtype=torch.int32)
    assert rel_err(peer_forward(x, w, sizes, TINY_TILE), moe_grouped_gemm_torch(x.double(), w.double(), sizes)) < 1e-5
    dx = peer_forward(dy, w.transpose(1, 2), sizes, TINY_TILE)
    assert rel_err(dx, moe_grouped_gemm_dx_torch(dy.double(), w.double(), sizes)) < 1e-5
    assert rel_err(peer_dw(dy, x, sizes, TINY_TILE), moe_grouped_gemm_dw_torch(dy.double(), x.double(), sizes)) < 1e-5


def test_tiny_run_goes_through_every_step(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.side_by_side", "--tiny", "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "side_by_side.json").read_text())
    assert {r["op"] for r in report["rows"]} == {"forward", "dx", "dw"} and all(r["ok"] for r in report["rows"])
    assert all(p["rel_err"] is not None and p["rel_err"] < 1e-5 for r in report["rows"] for p in r["peer_tiles"])
    assert report["block"]["rel_diff"] < 1e-4 and report["timed"] is False
    assert done.stdout.rstrip().endswith("n/a   every target: nothing timed (--tiny)")  # the verdicts, last
    assert "| point (M, E, N, K) |" in (tmp_path / "side_by_side.md").read_text()


def _row(op: str, ours: float, gmm: float, peer: float, *, dense: float = 700.0, gbytes: float = 1.0) -> dict[str, Any]:
    return {
        "point": "30b-gate_up", "tokens": 128, "m": 1024, "e": 128, "n": 1536, "k": 2048, "op": op,
        "ours": ours, "grouped_mm": gmm, "peer": peer, "dense": dense, "flops": 2.0 * 1024 * 1536 * 2048,
        "bytes": gbytes * 1e9, "ok": True, "config": "c", "peer_tile": "t",
    }  # fmt: skip


def test_verdicts_follow_the_numbers() -> None:
    rows = [_row("forward", 30.0, 25.0, 28.0), _row("dx", 27.0, 25.0, 28.0)]
    add_roofline(rows, bandwidth=1.0e11)  # 6.4 GFLOP over 1 GB at 0.1 TB/s: a 0.64 TFLOP/s roofline
    assert all(r["memory_bound"] for r in rows) and rows[0]["roofline"] == pytest.approx(0.644, rel=1e-2)
    got = {target: (verdict, detail) for target, verdict, detail in verdicts(rows, None, [])}
    behind = got["ours >= max(grouped_mm, public best tile), every point"]
    assert behind[0] == "FAIL" and "dx 30b-gate_up:128 0.96x" in behind[1]
    assert got[f"memory-bound points >= {ROOFLINE_SHARE:.0%} of the copy roofline"][0] == "PASS"
    rows[1]["ours"] = 29.0
    host = [{"op": "forward", "ours": 24.0, "grouped_mm": 20.0}, {"op": "dw", "ours": 31.0, "grouped_mm": 20.0}]
    block = {"tokens": 2048, "ours": 150.0, "grouped_mm": 140.0}
    got = {target: verdict for target, verdict, _ in verdicts(rows, block, host)}
    assert got["ours >= max(grouped_mm, public best tile), every point"] == "PASS"
    assert got["eager block forward at 2048 tokens >= with grouped_mm"] == "PASS"
    assert got["host time per call <= 25 us"] == "FAIL"
    # a compute-bound point (the bandwidth term above the fastest dense GEMM) is no memory-bound point
    fast = [_row("forward", 500.0, 400.0, 450.0, dense=700.0, gbytes=0.001)]
    add_roofline(fast, bandwidth=3.0e12)
    assert fast[0]["memory_bound"] is False and fast[0]["roofline"] == 700.0
