"""tools/profile/ep_profile.py's trace analysis (the GPU idle gaps and what launched the work ending
them) on a hand-built chrome trace: CPU-only, no torch.distributed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "profile" / "ep_profile.py"


@pytest.fixture(scope="module")
def ep_profile():
    spec = importlib.util.spec_from_file_location("ep_profile_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def op(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}


def launch(ts, corr, tid=1):
    return {
        "ph": "X",
        "cat": "cuda_runtime",
        "name": "cudaLaunchKernel",
        "ts": ts,
        "dur": 2,
        "tid": tid,
        "args": {"correlation": corr},
    }


def kernel(ts, dur, corr, cat="kernel"):
    return {
        "ph": "X",
        "cat": cat,
        "name": f"k{corr}",
        "ts": ts,
        "dur": dur,
        "tid": 7,
        "args": {"correlation": corr},
    }


def test_gaps_are_charged_to_the_op_that_launched_the_next_work(ep_profile):
    trace = {
        "traceEvents": [
            op("forward", 0, 1000),
            op("aten::mm", 10, 20),
            launch(12, 1),
            op("aten::_local_scalar_dense", 40, 300),  # a sync: the GPU drains, then waits for the host
            op("aten::index", 400, 50),
            launch(420, 2),
            op("aten::add", 465, 10),
            launch(467, 3),
            kernel(20, 100, 1),
            kernel(430, 50, 2),  # 310 us idle before kernel 2
            kernel(482, 10, 3),  # 2 us gap: under the threshold
            kernel(600, 10, 4, cat="gpu_memset"),  # launched by nobody we know: charged to "?"
        ]
    }
    got = ep_profile.gpu_gaps(trace, steps=1)
    gaps = {g["before"]: g for g in got["gpu_idle_gaps"]}
    assert gaps["forward > aten::index"]["ms_per_step"] == pytest.approx(0.310)
    assert gaps["? > ?"]["largest_us"] == pytest.approx(108.0)
    assert got["gpu_idle_ms_per_step"] == pytest.approx(0.418)
    assert [g["before"] for g in got["gpu_idle_gaps"]] == ["forward > aten::index", "? > ?"]


def test_gaps_per_step_and_overlapping_kernels(ep_profile):
    # two streams' kernels overlap: no gap between them; two steps halve the per-step figures
    trace = {
        "traceEvents": [
            op("step", 0, 5000),
            launch(1, 1),
            launch(2, 2),
            launch(3, 3),
            kernel(10, 100, 1),
            kernel(50, 200, 2),
            kernel(450, 10, 3),
        ]
    }
    got = ep_profile.gpu_gaps(trace, steps=2)
    assert got["gpu_idle_ms_per_step"] == pytest.approx(0.1)  # 250 -> 450 only
    assert got["gpu_idle_gaps"][0]["count"] == 0.5


def test_no_device_activity_is_no_figure(ep_profile):
    assert ep_profile.gpu_gaps({"traceEvents": [op("x", 0, 10)]}, steps=1) == {}


def test_allocator_delta_counts_only_known_keys(ep_profile):
    before = {"num_alloc_retries": 1, "num_device_alloc": 10, "other": 5}
    after = {"num_alloc_retries": 3, "num_device_alloc": 12, "num_device_free": 2, "other": 9}
    assert ep_profile.allocator_delta(before, after) == {
        "num_alloc_retries": 2,
        "num_device_alloc": 2,
        "num_device_free": 2,
    }


RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "profiles" / "2026-11-22-4xh200-fc8a1a7"


def test_recorded_trace_reproduces_the_recorded_gap_figures(ep_profile):
    """GPUs 0,1 of a 4x H200 machine (2026-11-22, commit fc8a1a7): the chrome trace of two EP steps, re-analysed here, gives the figures
    the run printed, and the gaps name ops of the EP forward (the count exchange, the row
    gathers) rather than '?' (launches the analysis failed to match)."""
    import gzip
    import json

    trace = json.loads(gzip.decompress((RECORDED / "ep-trace-gpus-0-1-rank0.json.gz").read_bytes()))
    recorded = json.loads((RECORDED / "ep-profile-gpus-0-1-rank0.json").read_text())["variants"]["micro=1"]
    got = ep_profile.gpu_gaps(trace, steps=2)
    assert got["gpu_idle_ms_per_step"] == pytest.approx(recorded["gpu_idle_ms_per_step"], abs=1e-3)
    assert got["gpu_idle_gaps"] == recorded["gpu_idle_gaps"]
    names = [g["before"] for g in got["gpu_idle_gaps"]]
    assert "c10d::alltoall_base_ > record_param_comms" in names
    assert not any(n.startswith("?") for n in names)
    # the idle time is a real share of the step the run measured (12.7 ms), not noise
    assert 0.5 < got["gpu_idle_ms_per_step"] < recorded["step_ms"]


def mark(ts, dur):
    return {"ph": "X", "cat": "user_annotation", "name": "qmoe_profiled_step", "ts": ts, "dur": dur, "tid": 1}


def test_marked_steps_drop_the_first_and_clip_work_to_its_launch(ep_profile):
    """Three marked steps: the first (profiler start-up, a 900 us gap) is not counted; an NCCL
    kernel the profiler dates before its own launch is clipped to the launch; busy, NCCL and
    overlap come from the same cleaned intervals."""
    trace = {
        "traceEvents": [
            mark(0, 1000),
            op("step", 0, 1000),
            launch(10, 1),
            launch(950, 2),
            mark(1000, 1000),
            op("step", 1000, 1000),
            launch(1001, 3),
            launch(1002, 4),
            mark(2000, 1000),
            op("step", 2000, 1000),
            launch(2001, 5),
            kernel(20, 30, 1),
            kernel(950, 40, 2),  # 900 us idle before it: step 1, not counted
            kernel(1010, 400, 3),
            kernel(-500000, 501300, 4, cat="kernel")
            | {"name": "ncclDevKernel_SendRecv"},  # bogus start
            kernel(2100, 100, 5),
        ]
    }
    got = ep_profile.gpu_gaps(trace, steps=2)
    # kept: k3 [1010, 1410], k4 [1002, 1300] (clipped from -500000), k5 [2100, 2200]
    assert got["gpu_busy_ms_per_step"] == pytest.approx((408 + 100) / 2e3)
    assert got["nccl_ms_per_step"] == pytest.approx(298 / 2e3)
    assert got["nccl_overlapped_ms_per_step"] == pytest.approx(290 / 2e3)
    assert got["gpu_idle_ms_per_step"] == pytest.approx(690 / 2e3)  # 1410 -> 2100
    assert [g["before"] for g in got["gpu_idle_gaps"]] == ["step > step"]
