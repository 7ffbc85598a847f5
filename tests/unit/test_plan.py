"""Planning: which probes run, in which child, in which order, with which environment."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from qmoe_doctor.core.conditions import PAIR_ORDER
from qmoe_doctor.core.options import ScanOptions
from qmoe_doctor.core.records import Condition
from qmoe_doctor.plan.scan import boundary_shape, debug_rerun, plan_scan


@dataclass(frozen=True)
class G:
    index: int
    uuid: str


GPUS = [G(0, "GPU-aaa"), G(1, "GPU-bbb"), G(2, "GPU-ccc"), G(3, "GPU-ddd")]


def test_no_gpu_plans_the_cpu_tier_and_says_why() -> None:
    plan = plan_scan("builtin", [])
    (session,) = plan.sessions
    assert session.env["TRITON_INTERPRET"] == "1"
    assert session.env["CUDA_VISIBLE_DEVICES"] == ""
    assert session.specs[0].condition is Condition.INTERPRETER_CHECK  # the environment first
    assert {s.condition for s in session.specs} == {
        Condition.INTERPRETER_CHECK, Condition.REPEAT_CALL, Condition.SINGLE, Condition.OVER_ROUTED, Condition.NEGATIVE_SIZES,
        Condition.OFFSETS, Condition.LAUNCH_CONFIG,
    }
    assert all(s.device is None and s.shape.dtype == "float32" for s in session.specs)
    assert plan.skipped and "no GPU" in plan.skipped[0]


def test_one_gpu_runs_single_cells_and_explains_the_rest() -> None:
    plan = plan_scan("builtin", GPUS[:1])
    (session,) = plan.sessions
    assert session.env["CUDA_VISIBLE_DEVICES"] == "GPU-aaa"
    assert not any(s.condition.is_pair for s in session.specs)
    assert any(s.condition is Condition.INT32_BOUNDARY for s in session.specs)
    assert "two GPUs" in plan.skipped[0]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_ordered_pair_gets_one_session(n: int) -> None:
    plan = plan_scan("builtin", GPUS[:n])
    assert len(plan.sessions) == n * (n - 1)
    labels = {s.label for s in plan.sessions}
    assert labels == {f"GPU {a} -> GPU {b}" for a in range(n) for b in range(n) if a != b}
    # single-device cells run once per GPU, the int32 boundary once per scan
    singles = [s for s in plan.specs if s.condition is Condition.SINGLE]
    assert sorted(s.probe_id for s in singles) == sorted(f"GPU {i}/single" for i in range(n))
    assert sum(s.condition is Condition.INT32_BOUNDARY for s in plan.specs) == 1
    # probe ids are unique: they key the matrix
    assert len({s.probe_id for s in plan.specs}) == len(plan.specs)


def test_pair_session_pins_a_as_ordinal_0_and_b_as_1() -> None:
    plan = plan_scan("builtin", [GPUS[2], GPUS[0]])  # --gpus 2,0
    first = plan.sessions[0]
    assert first.label == "GPU 2 -> GPU 0"
    assert first.env["CUDA_VISIBLE_DEVICES"] == "GPU-ccc,GPU-aaa"
    assert first.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert first.gpu_of_ordinal == {0: 2, 1: 0}
    pair_specs = [s for s in first.specs if s.condition.is_pair]
    assert all(s.current == 0 and s.device == 1 for s in pair_specs)


def test_order_inside_a_session_goes_from_least_to_most_state() -> None:
    session = plan_scan("builtin", GPUS[:2]).sessions[0]
    conds = [s.condition for s in session.specs]
    assert conds[0] is Condition.REPEAT_CALL  # must be the process's first kernel call
    pair = [c for c in conds if c.is_pair]
    assert pair == list(PAIR_ORDER)
    assert conds.index(Condition.NO_PEER) < conds.index(Condition.PEER)


def test_untouched_cell_gets_a_child_of_its_own() -> None:
    plan = plan_scan("builtin", GPUS[:2])
    fresh = [s for s in plan.specs if s.fresh_process]
    assert fresh and all(s.condition is Condition.UNTOUCHED for s in fresh)


def test_only_restricts_conditions() -> None:
    opts = ScanOptions(conditions=frozenset({Condition.PEER, Condition.GUARDED}))
    plan = plan_scan("specimen:unguarded", GPUS[:2], opts)
    assert {s.condition for s in plan.specs} == {Condition.PEER, Condition.GUARDED}
    assert all(s.kernel == "specimen:unguarded" for s in plan.specs)


def test_boundary_shape_routes_rows_to_the_first_wrapping_expert() -> None:
    shape = boundary_shape(ScanOptions())
    assert shape is not None
    # 480B fused gate_up: 5120 x 6144 per expert, first wrapping expert 69
    assert (shape.n, shape.k, shape.e, shape.routing) == (5120, 6144, 70, "expert:69")
    assert 69 * shape.n * shape.k > 2**31 - 1 >= 68 * shape.n * shape.k


def test_boundary_skipped_when_the_preset_never_wraps() -> None:
    assert boundary_shape(ScanOptions(boundary_preset="qwen3-30b-a3b")) is None


def test_debug_rerun_is_fresh_with_triton_debug() -> None:
    spec = plan_scan("builtin", GPUS[:1]).sessions[0].specs[0]
    again = debug_rerun(spec)
    assert again.env["TRITON_DEBUG"] == "1" and again.fresh_process
    assert again.probe_id == spec.probe_id + "+debug"


def test_sweeps_run_on_the_first_gpu_only_with_unique_variants() -> None:
    plan = plan_scan("builtin", GPUS[:3])
    sweeps = [s for s in plan.specs if s.condition in (Condition.OFFSETS, Condition.LAUNCH_CONFIG)]
    assert sweeps and {s.probe_id.split("/")[0] for s in sweeps} == {"GPU 1"}
    variants = [s.params["variant"] for s in sweeps]
    assert len(variants) == len(set(variants))
    m_odd = next(s for s in sweeps if s.params["variant"] == "m-not-multiple")
    assert m_odd.shape.m % 64 != 0
    cfgs = [s for s in sweeps if s.condition is Condition.LAUNCH_CONFIG]
    assert all({"block_m", "block_n", "block_k", "num_warps", "num_stages"} <= s.params.keys() for s in cfgs)
    assert not any("interpreter" in s.params["variant"] for s in cfgs)  # 32x32x32-w4-s1 is CPU only


def test_explicit_launch_configs_replace_the_table() -> None:
    from qmoe_doctor.core.launch_configs import parse_config

    cfg = parse_config("128x256x64-w8-s3")
    plan = plan_scan("builtin", GPUS[:1], ScanOptions(launch_configs=(cfg,)))
    cfgs = [s for s in plan.specs if s.condition is Condition.LAUNCH_CONFIG]
    assert [s.params["variant"] for s in cfgs] == ["128x256x64-w8-s3"]


@pytest.mark.parametrize("bad", ["128x256-w8-s3", "axbxc-w1-s1", "128x256x64-8-3", "0x1x1-w1-s1"])
def test_parse_config_rejects_malformed(bad: str) -> None:
    from qmoe_doctor.core.launch_configs import parse_config

    with pytest.raises(ValueError, match="launch config"):
        parse_config(bad)


# --- placements: the planners write them, nobody reads probe ids apart ----------------------------


@pytest.mark.parametrize("gpus", [[], GPUS[:1], GPUS[:3]], ids=["cpu", "one-gpu", "three-gpus"])
def test_every_planned_spec_carries_its_placement(gpus: list[G]) -> None:
    plan = plan_scan("builtin", gpus)
    for session in plan.sessions:
        for s in session.specs:
            p = s.placement
            assert s.probe_id == p.probe_id(s.condition)  # the id is made from the placement
            assert p.variant == str(s.params.get("variant", ""))
            if s.condition.is_pair:
                assert p.is_pair and session.gpu_of_ordinal == {0: p.gpu_a, 1: p.gpu_b}
                assert session.label == p.label == f"GPU {p.gpu_a} -> GPU {p.gpu_b}"
            elif gpus:
                assert p.group == f"GPU {p.gpu_b}" and session.gpu_of_ordinal[s.device or 0] == p.gpu_b
            else:
                assert p.group == "CPU" and p.gpu_b is None


def test_debug_rerun_is_placed_as_a_rerun_of_its_cell() -> None:
    plan = plan_scan("builtin", GPUS[:1])
    cell = next(s for s in plan.specs if s.condition is Condition.INT32_BOUNDARY)
    rerun = debug_rerun(cell)
    assert rerun.placement.rerun == "debug" and rerun.placement.group == cell.placement.group
    assert rerun.probe_id == f"{cell.probe_id}+debug"


def test_parallel_and_repro_plans_place_their_specs() -> None:
    from qmoe_doctor.core.modes import Mode
    from qmoe_doctor.core.options import ParallelOptions
    from qmoe_doctor.plan.parallel import plan_parallel
    from qmoe_doctor.plan.repro import plan_repro

    parallel = plan_parallel("builtin", [], ParallelOptions(modes=(Mode.DP, Mode.EP)), cpu=True)
    assert [(r.spec.placement.group, r.spec.probe_id) for r in parallel.runs] == [("dp", "dp"), ("ep", "ep")]
    repro = plan_repro("builtin", GPUS[:2])
    assert repro.pipeline.placement.group == "pipeline"
    assert {s.placement.group for s in repro.first_session} == {"0->1", "GPU 1", "pipeline"}
    assert repro.ladder.names == {"0->1": "GPU 0 -> GPU 1", "GPU 1": "GPU 1"}


def test_pair_sessions_run_from_least_to_most_process_state() -> None:
    """The run order is a fact the planner depends on (peer access and a context, once made,
    stay): pinned here, so reordering ``Condition`` cannot change it silently."""
    assert [c.value for c in PAIR_ORDER] == [
        "guarded",
        "untouched",
        "no-peer",
        "peer",
        "producer-race",
        "sizes-race",
    ]
