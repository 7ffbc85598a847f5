"""`qmoe-doctor bench` on real GPUs at a small shape: it must run, time every row and, with
--placement, see the remote launch as slower than the guarded one. Speeds are not asserted
(the figures go to docs/performance.md with the device and versions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qmoe_doctor.cli.app import app
from qmoe_doctor.core.bench import BLOCK_GROUPED_MM, BLOCK_QMOE, DENSE, GRAPH_IMPLS, GROUPED_MM, QMOE
from qmoe_doctor.core.tolerances import tolerance

runner = CliRunner()


@pytest.mark.gpu
def test_bench_times_every_row_on_one_gpu(tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["bench", "--gpus", "0", "--tokens", "128,512", "--no-plot", "--json", "--out", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["timed"] is True and doc["interpreter"] is False and doc["gpus"] == [0]
    assert not [r for r in doc["rows"] if r["note"]], [r["note"] for r in doc["rows"] if r["note"]]
    for r in doc["rows"]:
        assert r["ms"] and r["tflops"], r
        if r["impl"] == DENSE:
            assert r["frac_dense"] == pytest.approx(1.0)
        if r["impl"] in (QMOE, GROUPED_MM):
            assert r["rel_err"] < tolerance(doc["dtype"]), r
    # the block forward replayed from a CUDA graph: captured (no host synchronization in the
    # forward) at every token count, for our kernels and for torch._grouped_mm's, and the replay
    # computes what the eager call does (the same error against the float32 reference; the
    # block's error itself is bf16 routing and rounding, the loop twin's too: H200, 2026-11-22, ~0.03-0.05)
    block = {(r["impl"], r["tokens"]): r["rel_err"] for r in doc["rows"] if r["op"] == "block-forward"}
    for graphed, eager in zip(GRAPH_IMPLS, (BLOCK_QMOE, BLOCK_GROUPED_MM), strict=True):
        for t in (128, 512):
            assert block[(graphed, t)] == pytest.approx(block[(eager, t)], rel=1e-6, abs=1e-9), (graphed, t)


@pytest.mark.gpu
def test_bench_times_the_users_kernel_beside_ours_and_names_the_config_table(tmp_path: Path) -> None:
    """--kernel: the user's forward, dx and block rows (eager and CUDA graph) are timed in the same
    run as ours; the header's table is the one kernels/tuning.py chose for this device."""
    user = "kernel torch:grouped_mm"
    result = runner.invoke(
        app,
        ["bench", "--gpus", "0", "--tokens", "512", "--kernel", "torch:grouped_mm", "--no-plot", "--json"]
        + ["--out", str(tmp_path)],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["kernel"] == "torch:grouped_mm" and "--kernel torch:grouped_mm" in doc["command"]
    assert doc["config_table"] and not doc["config_table"].startswith(("unreadable", "interpreter")), doc
    rows = {(r["op"], r["impl"]): r for r in doc["rows"]}
    mine = [
        rows[("forward", user)],
        rows[("dx", user)],
        rows[("block-forward", f"MoEBlock + {user}")],
        rows[("block-forward", f"MoEBlock + {user}, CUDA graph")],
        rows[("block-forward-backward", f"MoEBlock + {user}")],
    ]
    for r in mine:
        assert r["ms"] and r["tflops"] and not r["note"], r
    for r in mine[:2]:
        assert r["rel_err"] < tolerance(doc["dtype"]), r


@pytest.mark.multigpu
def test_bench_placement_sees_the_remote_launch(tmp_path: Path) -> None:
    result = runner.invoke(
        app,
        [
            "bench",
            "--gpus",
            "0,1",
            "--tokens",
            "512",
            "--no-block",
            "--placement",
            "--json",
            "--out",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    rows = {p["placement"]: p for p in doc["placement"]}
    assert set(rows) == {"local", "guarded", "remote"}, doc["placement"]
    assert rows["guarded"]["current"] == 0 and rows["guarded"]["device"] == 1
    assert rows["remote"]["kernel"] == "specimen:unguarded" and rows["remote"]["peer_enabled"] is True
    for p in rows.values():
        assert p["ms"] and p["rel_err"] < tolerance(doc["dtype"]), p
    assert rows["remote"]["slowdown"] > 1.0  # runs on a, reading b's memory over the link
