"""Parallel modes (issue 7) on the CPU: planning, launch, collection, classification, and the
expert- and tensor-parallel arithmetic.

End-to-end cases launch real ranks: ``torch.distributed.run`` with two CPU processes, the gloo
backend, our Triton kernels under ``TRITON_INTERPRET=1`` in float32 (bf16 ``tl.dot`` is broken in
the interpreter), the ``tiny`` preset and 8 tokens. Each takes 5-25 s on a 2-core machine; the
rest are pure and take milliseconds. Device placement, NCCL and timings need GPUs:
``tools/gpu/parallel.sh``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from qmoe_doctor.cli.app import app
from qmoe_doctor.core import knobs
from qmoe_doctor.core.modes import Mode
from qmoe_doctor.core.options import ParallelOptions
from qmoe_doctor.core.records import (
    Condition,
    Confidence,
    ErrorKind,
    Outcome,
    Phase,
    ProbeSpec,
    Shape,
    Status,
    rank_spec,
    to_json,
)
from qmoe_doctor.core.reports import ModeResult
from qmoe_doctor.diagnose.parallel_rules import classify_parallel
from qmoe_doctor.isolate.process import child_env
from qmoe_doctor.isolate.torchrun import collect_run, parse_torchrun_failures
from qmoe_doctor.plan.parallel import ParallelPlanError, PlannedRun, parse_modes, plan_parallel
from qmoe_doctor.probes.parallel import ep, tp
from qmoe_doctor.probes.parallel.hooks import hooks_for
from qmoe_doctor.workflows.parallel import LaunchRecord, build_command, run_parallel, summarize, with_scaling

runner = CliRunner()

#: Small enough for the interpreter: 8 tokens, 4 per rank under dp and ep.
E2E = {"tokens": 8, "timeout_s": 120.0}


@pytest.fixture(autouse=True)
def _cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


# ---------------------------------------------------------------------------------------------
# Planning (pure)
# ---------------------------------------------------------------------------------------------


class FakeGpu:
    def __init__(self, index: int) -> None:
        self.index = index
        self.uuid = f"GPU-{index:04d}"


def test_parse_modes() -> None:
    assert parse_modes("dp,pp,tp,ep") == (Mode.DP, Mode.PP, Mode.TP, Mode.EP)
    assert parse_modes(" ep , dp,ep") == (Mode.EP, Mode.DP)
    for bad in ("", "dp,zz", ","):
        with pytest.raises(ParallelPlanError):
            parse_modes(bad)


def test_cpu_plan_defaults() -> None:
    plan = plan_parallel("builtin", [], ParallelOptions(), cpu=True)
    assert plan.tier == "cpu" and plan.gpus == ()
    assert [r.mode for r in plan.runs] == [Mode.DP, Mode.PP, Mode.TP, Mode.EP]  # no baseline on the CPU
    for run in plan.runs:
        p = run.spec.params
        assert (p["preset"], p["tokens"], p["backend"], p["steps"]) == ("tiny", 16, "gloo", 0)
        assert run.spec.shape.dtype == "float32"
        assert run.env == {knobs.TRITON_INTERPRET: "1", knobs.CUDA_VISIBLE_DEVICES: ""}
        assert p["devices"] == [None, None]
        assert run.torchrun == (run.mode is not Mode.PP)
        assert run.nproc == (1 if run.mode is Mode.PP else 2)
    assert plan.runs[1].spec.params["layers"] == 4  # pp: two layers per device


def test_gpu_plan_pins_the_gpus_and_times_one_gpu_first() -> None:
    gpus = [FakeGpu(3), FakeGpu(1)]
    plan = plan_parallel("specimen:global_expert_ids", gpus, ParallelOptions(modes=(Mode.EP, Mode.PP)))
    assert [r.mode for r in plan.runs] == [Mode.SINGLE, Mode.EP, Mode.PP]
    assert plan.gpus == (3, 1) and plan.gpu_of_ordinal == {0: 3, 1: 1}
    single, ep_run, pp_run = plan.runs
    assert single.spec.params["devices"] == [0] and single.devices_used == 1
    assert ep_run.spec.params["devices"] == [0, 1] and ep_run.world_size == 2
    assert ep_run.spec.condition is Condition.PARALLEL_EP
    assert ep_run.env[knobs.CUDA_VISIBLE_DEVICES] == "GPU-0003,GPU-0001"  # --gpus order
    assert ep_run.env[knobs.CUDA_DEVICE_ORDER] == "PCI_BUS_ID"
    p = ep_run.spec.params
    assert (p["preset"], p["tokens"], p["backend"]) == ("qwen3-30b-a3b", 16384, "nccl")
    assert ep_run.spec.shape.dtype == "bfloat16"
    assert pp_run.devices_used == 2 and not pp_run.torchrun
    env = child_env(ep_run.env)  # what the launcher really gets: NVLink multicast stays off
    for name, value in knobs.NVLS_OFF.items():
        assert env[name] == value


def test_torchrun_command(tmp_path: Path) -> None:
    plan = plan_parallel("builtin", [], ParallelOptions(modes=(Mode.EP,)), cpu=True)
    (run,) = plan.runs
    cmd = build_command(run, tmp_path / "spec.json", tmp_path, python="py", opts=plan.options, port=29777)
    assert cmd[:3] == ["py", "-m", "torch.distributed.run"]
    text = " ".join(cmd)
    assert "--nproc-per-node 2" in text and "--nnodes 1" in text
    assert "--rdzv-backend c10d --rdzv-endpoint localhost:29777" in text
    assert text.endswith(
        f"-m qmoe_doctor.probes.parallel.rank --spec {tmp_path / 'spec.json'} --out {tmp_path}"
    )
    opts = ParallelOptions(modes=(Mode.DP,), nnodes=2, rdzv_endpoint="node0:29500", rdzv_id="job7")
    plan = plan_parallel("builtin", [], opts, cpu=True)
    cmd = build_command(plan.runs[0], tmp_path / "s", tmp_path, python="py", opts=plan.options)
    text = " ".join(cmd)
    assert "--nnodes 2" in text and "--rdzv-endpoint node0:29500" in text and "--rdzv-id job7-dp" in text
    assert plan.runs[0].world_size == 4 and plan.runs[0].nproc == 2


@pytest.mark.parametrize(
    ("opts", "needle"),
    [
        (ParallelOptions(modes=(Mode.DP,), tokens=15), "15 tokens do not split"),
        (ParallelOptions(modes=(Mode.EP,), nproc_per_node=3, tokens=6), "8 experts do not split"),
        (ParallelOptions(modes=(Mode.TP,), nproc_per_node=3), "moe_intermediate_size 32"),
        (ParallelOptions(modes=(Mode.DP,), nnodes=2), "--rdzv-endpoint"),
        (ParallelOptions(modes=(Mode.DP,), preset="nope"), "unknown preset"),
        (ParallelOptions(modes=(Mode.DP,), dtype="int8"), "dtype"),
    ],
)
def test_plan_refuses_what_cannot_split(opts: ParallelOptions, needle: str) -> None:
    with pytest.raises(ParallelPlanError, match=needle):
        plan_parallel("builtin", [], opts, cpu=True)


def test_one_gpu_skips_what_needs_two() -> None:
    plan = plan_parallel("builtin", [FakeGpu(0)], ParallelOptions())
    assert [r.mode for r in plan.runs] == [Mode.SINGLE]
    assert {s.split(":")[0] for s in plan.skipped} == {"dp", "pp", "tp", "ep"}


# ---------------------------------------------------------------------------------------------
# Expert-parallel arithmetic (pure)
# ---------------------------------------------------------------------------------------------


def _topk(tokens: int, experts: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(tokens)])


def test_owner_and_first_expert() -> None:
    assert ep.experts_per_rank(128, 4) == 32
    with pytest.raises(ValueError):
        ep.experts_per_rank(10, 4)
    assert ep.owner_of(torch.tensor([0, 31, 32, 127]), 32).tolist() == [0, 0, 1, 3]
    assert [ep.first_expert(r, 32) for r in range(4)] == [0, 32, 64, 96]


def _plans(ids: list[torch.Tensor], experts: int, micro: int) -> list[list[ep.MicroPlan]]:
    """Every rank's micro-batch plans, the count exchange done by the all-to-all twin."""
    world = len(ids)
    spans = [ep.micro_spans(int(i.shape[0]), micro) for i in ids]
    tables = [ep.dispatch_counts(i, experts, world, sp) for i, sp in zip(ids, spans, strict=True)]
    per = [len(sp) * 2 for sp in spans]
    received = ep.all_to_all_torch(
        [t[1].reshape(-1) for t in tables], [[per[s]] * world for s in range(world)]
    )
    return [
        ep.micro_plans(
            tables[r][0],
            spans[r],
            tables[r][1].tolist(),
            received[r].reshape(world, len(spans[r]), 2).tolist(),
        )
        for r in range(world)
    ]


def test_one_micro_batch_is_one_pair_per_token_and_rank() -> None:
    ids = torch.tensor([[0, 1], [5, 6], [1, 7], [3, 2]])  # E=8 over W=2: experts 0-3 | 4-7
    other = torch.tensor([[4, 5], [0, 7], [2, 3], [6, 1]])
    (plan,), (peer,) = _plans([ids, other], 8, micro=1)
    # (token, rank) pairs by rank, then token: rank 0 gets tokens 0, 2, 3; rank 1 gets 1, 2
    assert plan.tokens.tolist() == [0, 2, 3, 1, 2] and plan.send_counts == (3, 2)
    assert plan.span == (0, 4) and plan.recv_counts == (3, peer.send_counts[0])
    # owned slots received by rank 0: its own tokens 0, 2, 3 (2 + 1 + 2) and the peer's 1, 2, 3 (1 + 2 + 1)
    assert plan.recv_slots == 9


def test_local_slots_and_the_remap_hooks() -> None:
    ids = torch.tensor([[0, 5], [6, 7], [2, 3]])
    pair, slot = ep.local_slots(ids, rank=1, per_rank=4)
    assert list(zip(pair.tolist(), slot.tolist(), strict=True)) == [(0, 1), (1, 0), (1, 1)]
    global_ids = ids[pair, slot]
    default = hooks_for(object())  # no module hooks: the correct defaults
    assert default.local_expert_ids(global_ids, 4, 4).tolist() == [1, 2, 3]
    from qmoe_doctor.kernels.specimens import global_expert_ids, rank_no_set_device

    planted = hooks_for(global_expert_ids.moe_grouped_gemm)
    assert planted.overridden == ("qmoe_local_expert_ids",)
    local = planted.local_expert_ids(global_ids, 4, 4)
    assert local.tolist() == [5, 6, 7]  # global ids, unremapped
    assert int(ep.out_of_range(local, 4).sum()) == 3
    no_set = hooks_for(rank_no_set_device.moe_grouped_gemm)
    assert no_set.overridden == ("qmoe_set_rank_device",)
    no_set.set_device(torch.device("cpu"))  # does nothing, as planted


def test_micro_spans_cover_the_tokens_once() -> None:
    assert ep.micro_spans(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert ep.micro_spans(1, 2) == [(0, 1)]  # never an empty span beside a full one
    assert ep.micro_spans(0, 2) == [(0, 0)]
    with pytest.raises(ValueError):
        ep.micro_spans(4, 0)


def test_dispatch_counts_pairs_and_owned_slots_per_span() -> None:
    ids = torch.tensor([[0, 1], [5, 6], [1, 7], [3, 2]])  # E=8 over W=2: experts 0-3 | 4-7
    spans = ep.micro_spans(4, 2)  # tokens 0-1 | 2-3
    needs, counts = ep.dispatch_counts(ids, 8, 2, spans)
    assert [n.tolist() for n in needs] == [[[True, False], [False, True]], [[True, True], [True, False]]]
    # [rank, span] = (pairs, slots): span 0 sends token 0 (2 slots) to 0, token 1 (2 slots) to 1
    assert counts.tolist() == [[[1, 2], [2, 3]], [[1, 2], [1, 1]]]


def test_micro_plans_from_exchanged_counts() -> None:
    """Two ranks' count tables exchanged by the all-to-all twin give every plan its receive
    counts and owned-slot totals; the pairs are listed by rank, then token, offset by the span."""
    ids = [torch.tensor([[0, 1], [5, 6], [1, 7], [3, 2]]), torch.tensor([[4, 5], [0, 7], [2, 3], [6, 1]])]
    plans = _plans(ids, 8, micro=2)
    assert plans[0][1].tokens.tolist() == [2, 3, 2] and plans[0][1].send_counts == (2, 1)
    assert plans[1][0].tokens.tolist() == [1, 0, 1] and plans[1][0].send_counts == (1, 2)
    # rank 0's span 0 receives token 0 from itself (2 owned slots) and token 1 of rank 1 (1 slot)
    assert plans[0][0].recv_counts == (1, 1) and plans[0][0].recv_slots == 3
    for r in range(2):
        for s, plan in enumerate(plans[r]):
            assert plan.recv_counts == tuple(plans[src][s].send_counts[r] for src in range(2))
            mine = 0
            for src in range(2):
                sp = plans[src][s]
                lo = sum(sp.send_counts[:r])
                to_r = sp.tokens[lo : lo + sp.send_counts[r]]  # the pairs src sent to rank r
                mine += int((ep.owner_of(ids[src][to_r], 4) == r).sum())
            assert plan.recv_slots == mine
            pair, slot = ep.local_slots(
                torch.cat([ids[src][plans[src][s].tokens] for src in range(2)]), r, 4, mine
            )
            assert pair.numel() == mine


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_pack_and_unpack_carry_ids_bit_for_bit_and_gradients(dtype: torch.dtype) -> None:
    hidden = torch.randn(5, 6, dtype=dtype, requires_grad=True)
    weights = torch.rand(5, 3, dtype=dtype, requires_grad=True)
    ids = torch.tensor([[0, 127, 64], [1, 2, 3], [126, 5, 9], [100, 101, 102], [7, 8, 31]])
    packed = ep.pack_tokens(hidden, weights, ids)
    assert packed.shape == (5, 6 + 2 * 3)
    rows, w, got_ids = ep.unpack_pairs(packed, 6, 3)
    assert torch.equal(got_ids, ids) and torch.equal(rows, hidden) and torch.equal(w, weights)
    (rows.float().sum() * 2 + (w.float() * 3).sum()).backward()
    assert torch.equal(hidden.grad, torch.full_like(hidden, 2)) and torch.equal(
        weights.grad, torch.full_like(weights, 3)
    )
    assert ep.max_packed_experts(torch.bfloat16) == 32768
    with pytest.raises(ValueError):
        ep.unpack_pairs(packed, 5, 3)


def test_all_to_all_twin_and_receive_counts() -> None:
    send = [[1, 2], [3, 0]]
    a = torch.tensor([10, 11, 12])  # rank 0: one row to 0, two to 1
    b = torch.tensor([20, 21, 22])  # rank 1: three rows to 0
    got = ep.all_to_all_torch([a, b], send)
    assert got[0].tolist() == [10, 20, 21, 22] and got[1].tolist() == [11, 12]
    assert ep.receive_counts(send, 0) == (1, 3) and ep.receive_counts(send, 1) == (2, 0)


def _expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    g, u = (x @ gate_up.T).chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u) @ down.T


@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_forward_simulated_in_one_process(world: int) -> None:
    """Dispatch, remap, local experts, weighted pair sums, combine: W ranks simulated with the
    all-to-all twin equal the whole block (the stock loop) on every rank's tokens."""
    from qmoe_doctor.kernels.moe_block import MoEBlockTorch

    torch.manual_seed(0)
    full = MoEBlockTorch("tiny", dtype=torch.float64)
    e, per_rank = full.num_experts, full.num_experts // world
    x = torch.randn(6 * world, full.shape.hidden, dtype=torch.float64)
    expected, _ = full(x)
    shards = list(x.chunk(world))
    routed = [full.route(xs)[1:] for xs in shards]
    plans = [p[0] for p in _plans([ids for _, ids in routed], e, micro=1)]
    payload = [
        (xs[plan.tokens], ids[plan.tokens], weights[plan.tokens])
        for xs, (weights, ids), plan in zip(shards, routed, plans, strict=True)
    ]
    counts = [list(p.send_counts) for p in plans]
    x_in, ids_in, w_in = (ep.all_to_all_torch([p[i] for p in payload], counts) for i in range(3))
    sums = []
    for r in range(world):
        pair, slot = ep.local_slots(ids_in[r], r, per_rank)
        local = hooks_for(object()).local_expert_ids(
            ids_in[r][pair, slot], ep.first_expert(r, per_rank), per_rank
        )
        assert not bool(ep.out_of_range(local, per_rank).any())
        out = torch.zeros_like(x_in[r])
        for p, s, j in zip(pair.tolist(), slot.tolist(), local.tolist(), strict=True):
            g = ep.first_expert(r, per_rank) + j
            y = _expert(x_in[r][p : p + 1], full.gate_up_proj[g], full.down_proj[g])
            out[p] += (y * w_in[r][p, s])[0]
        sums.append(out)
    back_counts = [[counts[s][r] for s in range(world)] for r in range(world)]  # swapped splits
    back = ep.all_to_all_torch(sums, back_counts)
    for r, (xs, plan) in enumerate(zip(shards, plans, strict=True)):
        got = torch.zeros_like(xs).index_add_(0, plan.tokens, back[r])
        rows = slice(6 * r, 6 * (r + 1))
        torch.testing.assert_close(got, expected[rows].detach())


# ---------------------------------------------------------------------------------------------
# Tensor-parallel arithmetic (pure)
# ---------------------------------------------------------------------------------------------


def test_tp_shards_are_inverse_and_partials_sum_to_the_block() -> None:
    from qmoe_doctor.kernels.moe_block import MoEBlockTorch, resolve_shape

    torch.manual_seed(1)
    full = MoEBlockTorch("tiny", dtype=torch.float64)
    world = 2
    gu = [tp.shard_gate_up(full.gate_up_proj.detach(), r, world) for r in range(world)]
    dn = [tp.shard_down(full.down_proj.detach(), r, world) for r in range(world)]
    torch.testing.assert_close(tp.gather_gate_up(gu), full.gate_up_proj.detach())
    torch.testing.assert_close(tp.gather_down(dn), full.down_proj.detach())
    half = resolve_shape(full.shape, intermediate=full.shape.intermediate // world)
    x = torch.randn(10, full.shape.hidden, dtype=torch.float64)
    total = torch.zeros_like(x)
    for r in range(world):
        part = MoEBlockTorch(half, dtype=torch.float64)
        part.load_state_dict({"gate.weight": full.gate.weight, "gate_up_proj": gu[r], "down_proj": dn[r]})
        total += part(x)[0].detach()
    torch.testing.assert_close(total, full(x)[0].detach())
    with pytest.raises(ValueError):
        tp.tp_slice(32, 0, 3)


# ---------------------------------------------------------------------------------------------
# Collection and torchrun's failure summary (pure, on files)
# ---------------------------------------------------------------------------------------------

# recorded from torch 2.13.0+cpu: rank 1 called os._exit(3), torchrun stopped rank 0
TORCHRUN_SUMMARY = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
/tmp/t3.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-22_01:48:31
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 31198)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 31198
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_01:48:31
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 3 (pid: 31199)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def test_parse_torchrun_failures() -> None:
    found = parse_torchrun_failures(TORCHRUN_SUMMARY)
    assert found[1].exit_code == 3 and found[1].root_cause and found[1].local_rank == 1
    assert found[0].exit_code == -15 and not found[0].root_cause
    assert parse_torchrun_failures("all good") == {}


def _spec(condition: Condition, device: int | None = None, **params: Any) -> ProbeSpec:
    return ProbeSpec(
        probe_id="x",
        kernel="builtin",
        condition=condition,
        device=device,
        current=device,
        shape=Shape(m=16, e=8, n=64, k=64, dtype="float32"),
        params={"devices": [None, None], **params},
    )


def test_collect_reads_results_and_makes_outcomes_for_dead_ranks(tmp_path: Path) -> None:
    plan = plan_parallel("builtin", [], ParallelOptions(modes=(Mode.DP,)), cpu=True)
    (run,) = plan.runs
    spec = run.spec
    ok = Outcome(probe_id="rank 0/parallel-dp", spec=spec, status=Status.PASS, phase=Phase.DONE)
    (tmp_path / "rank-0.json").write_text(to_json(ok) + "\n")
    crumbs = [
        {"type": "start", "pid": 1, "rank": 1, "local_rank": 1, "world_size": 2, "stage": "start"},
        {"type": "crumb", "phase": "setup", "stage": "init-process-group"},
        {"type": "fact", "key": "parallel.device", "value": "cpu", "stage": "init-process-group"},
    ]
    (tmp_path / "rank-1.crumbs").write_text("\n".join(json.dumps(c) for c in crumbs) + '\n{"type": "fa')
    (tmp_path / "rank-1.log").write_text("Traceback ...\nRuntimeError: boom\n")
    (tmp_path / "launcher.log").write_text(
        TORCHRUN_SUMMARY.replace("rank      : 0 (local_rank: 0)", "rank      : 7 (local_rank: 7)")
    )
    outcomes = collect_run(run, tmp_path, exit_code=1, timed_out=False, timeout_s=60)
    by_id = {o.probe_id: o for o in outcomes}
    assert by_id["rank 0/parallel-dp"].status is Status.PASS
    dead = by_id["rank 1/parallel-dp"]
    assert dead.status is Status.ERROR and dead.exit_code == 3 and dead.error_type == "exit"
    assert dead.phase is Phase.SETUP and dead.facts["parallel.at"] == "init-process-group"
    assert dead.facts["parallel.device"] == "cpu"  # facts survive in the crumbs
    assert "RuntimeError: boom" in dead.stderr_tail
    terminated = by_id["rank 7/parallel-dp"]
    assert terminated.error_type == "terminated" and terminated.facts["parallel.terminated_after"] == 1
    timed_out = collect_run(run, tmp_path, exit_code=-9, timed_out=True, timeout_s=60)
    assert {o.error_kind for o in timed_out if o.status is Status.ERROR} == {ErrorKind.TIMEOUT}


def _record(mode: Mode) -> LaunchRecord:
    return LaunchRecord(mode=mode, command=(), run_dir="", exit_code=0, timed_out=False, wall_s=1.0)


def test_summaries_and_scaling() -> None:
    runs = {
        m: PlannedRun(
            mode=m,
            spec=_spec(Condition.PARALLEL_EP, tokens=1000),
            nproc=n,
            world_size=n,
            devices_used=n,
            env={},
        )
        for m, n in ((Mode.SINGLE, 1), (Mode.EP, 2))
    }

    def ranks(n: int, step_ms: list[float]) -> list[Outcome]:
        return [
            Outcome(
                probe_id=f"rank {r}/x",
                spec=_spec(Condition.PARALLEL_EP),
                status=Status.PASS,
                phase=Phase.DONE,
                rel_error=1e-3 * (r + 1),
                facts={"parallel.step_ms": step_ms[r]},
            )
            for r in range(n)
        ]

    single = summarize(runs[Mode.SINGLE], _record(Mode.SINGLE), ranks(1, [100.0]))
    ep_mode = summarize(runs[Mode.EP], _record(Mode.EP), ranks(2, [52.0, 55.0]))
    assert ep_mode.step_ms == 55.0 and ep_mode.max_rel_error == 2e-3  # the slowest rank, the worst error
    scaled = {r.mode: r for r in with_scaling([single, ep_mode])}
    assert scaled[Mode.SINGLE].tokens_per_s == pytest.approx(10_000)
    assert scaled[Mode.EP].speedup == pytest.approx(100 / 55)
    assert scaled[Mode.EP].efficiency == pytest.approx(100 / 55 / 2)
    never_timed = Outcome(
        probe_id="rank 0/x", spec=_spec(Condition.PARALLEL_EP), status=Status.PASS, phase=Phase.DONE
    )
    untimed = summarize(runs[Mode.EP], _record(Mode.EP), [never_timed])
    assert isinstance(untimed, ModeResult) and untimed.tokens_per_s is None and untimed.step_ms is None


@pytest.fixture
def temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import tempfile

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # gettempdir() caches its first answer
    return tmp


@pytest.mark.parametrize("status", [Status.PASS, Status.WRONG])
def test_rank_logs_are_removed_after_a_healthy_run_and_kept_after_a_failing_one(
    status: Status, temp_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qmoe_doctor.workflows import parallel as workflow

    def launch(run: PlannedRun, run_dir: Path, **_: Any) -> tuple[LaunchRecord, list[Outcome]]:
        run_dir.mkdir(parents=True)
        (run_dir / "rank-0.log").write_text("a rank's log\n")
        spec = rank_spec(run.spec, 0, None)
        ranks = [Outcome(probe_id=spec.probe_id, spec=spec, status=status, phase=Phase.DONE, rel_error=0.5)]
        record = LaunchRecord(mode=run.mode, command=(), run_dir=str(run_dir), exit_code=0, timed_out=False, wall_s=0.1)
        return record, ranks

    monkeypatch.setattr(workflow, "launch_run", launch)
    plan = plan_parallel("builtin", [], ParallelOptions(modes=(Mode.DP,)), cpu=True)
    report = run_parallel(plan)
    kept = list(temp_dir.glob("qmoe-doctor-parallel-*"))
    if status is Status.PASS:
        assert report.healthy and report.log_dir == "" and kept == []
        assert all(m.run_dir == "" for m in report.modes)
    else:
        assert not report.healthy and [report.log_dir] == [str(k) for k in kept]
        assert (kept[0] / "dp" / "rank-0.log").is_file() and report.modes[0].run_dir == str(kept[0] / "dp")


# ---------------------------------------------------------------------------------------------
# The rules, on synthetic per-rank outcomes
# ---------------------------------------------------------------------------------------------

SINGLE_OK = {"parallel.single": {"ok": True, "rel_error": 3e-3, "checks": []}}


def _rank(condition: Condition, rank: int, status: Status, facts: dict[str, Any], **fields: Any) -> Outcome:
    spec = rank_spec(_spec(condition), rank, rank)  # as the rank child writes it
    return Outcome(
        probe_id=spec.probe_id,
        spec=spec,
        status=status,
        phase=fields.pop("phase", Phase.DONE),
        facts={"parallel.rank": rank, **facts},
        tolerance=2e-2,
        **fields,
    )


def test_rule_device_never_set_on_the_rank_that_never_set_it() -> None:
    cond = Condition.PARALLEL_DP
    rank0 = _rank(
        cond,
        0,
        Status.ERROR,
        {
            "parallel.current_device_after_setup": 0,
            "parallel.terminated_after": 1,
            "parallel.at": "parallel-step",
        },
        error_kind=ErrorKind.SIGNAL,
        error_type="terminated",
        error_message="rank 0 killed by SIGTERM",
    )
    rank1 = _rank(
        cond,
        1,
        Status.ERROR,
        {
            **SINGLE_OK,
            "parallel.current_device_after_setup": 0,
            "parallel.kernel_calls": {
                "calls": {"parallel": 1},
                "off_device": {"parallel": 1},
                "misplaced": {},
                "examples": [{"what": "current device differs", "current_device": 0, "x_device": "cuda:1"}],
            },
            "parallel.peak_allocated": {"0": 8192, "1": 1 << 30},
            "parallel.contexts": [0, 1],
        },
        phase=Phase.LAUNCH,
        error_kind=ErrorKind.POINTER_INACCESSIBLE,
        error_type="ValueError",
        error_message="Pointer argument (at 2) cannot be accessed from Triton (cpu tensor?)",
    )
    result = classify_parallel([rank0, rank1], kernel="specimen:rank_no_set_device")
    (d,) = result.diagnoses
    assert d.cause == "device-never-set" and d.confidence is Confidence.HIGH
    assert d.where == ("rank 1 (cuda:1)",)
    detail = " ".join(e.detail for e in d.evidence)
    assert "8,192 bytes on cuda:0" in detail and "current device cuda:0" in detail
    assert result.unexplained == ()  # rank 0 was stopped because of rank 1
    assert any(
        "rank 0" in note and "stopped by torchrun after rank 1" in note for note in result.explanations
    )
    assert d.repro == "qmoe-doctor scan --parallel dp --kernel specimen:rank_no_set_device"


def test_rule_device_never_set_needs_something_to_land() -> None:
    quiet = _rank(
        Condition.PARALLEL_TP, 1, Status.PASS, {**SINGLE_OK, "parallel.current_device_after_setup": 0}
    )
    result = classify_parallel([quiet], kernel="builtin")
    assert result.diagnoses == () and result.unexplained == ()
    assert "nothing of it ran or was allocated there" in result.explanations[0]


def test_rule_invalid_routing_names_the_rank_whose_ids_were_global() -> None:
    cond = Condition.PARALLEL_EP
    checks = [{"name": "out", "rel_error": 0.6, "ok": False}]
    rank0 = _rank(
        cond,
        0,
        Status.WRONG,
        {
            **SINGLE_OK,
            "ep.ids_out_of_range": 0,
            "ep.local_expert_ok": True,
            "ep.local_expert_rel_error": 0.0,
            "parallel.checks": checks,
        },
        rel_error=0.6,
    )
    rank1 = _rank(
        cond,
        1,
        Status.WRONG,
        {
            **SINGLE_OK,
            "ep.ids_out_of_range": 14,
            "ep.recv_rows": 14,
            "ep.experts_per_rank": 4,
            "ep.bad_id_examples": [{"global": 5, "local": 5}],
            "ep.local_expert_ok": False,
            "ep.local_expert_rel_error": 1.0,
            "parallel.checks": checks,
        },
        rel_error=1.0,
    )
    result = classify_parallel([rank0, rank1], kernel="specimen:global_expert_ids")
    (d,) = result.diagnoses
    assert (
        d.cause == "invalid-routing" and d.confidence is Confidence.HIGH and d.where == ("rank 1 (cuda:1)",)
    )
    assert "14 of 14 received rows" in " ".join(e.detail for e in d.evidence)
    assert any(e.probe_id == "rank 0/parallel-ep" and "own experts are right" in e.detail for e in d.evidence)
    assert result.unexplained == ()


def test_rules_leave_what_they_cannot_name_unexplained() -> None:
    cond = Condition.PARALLEL_TP
    wrong = _rank(
        cond,
        0,
        Status.WRONG,
        {
            **SINGLE_OK,
            "parallel.current_device_after_setup": 0,
            "parallel.checks": [{"name": "dx", "rel_error": 0.3, "ok": False}],
        },
        rel_error=0.3,
    )
    single_bad = _rank(
        cond, 1, Status.WRONG, {"parallel.single": {"ok": False, "rel_error": 0.9}}, rel_error=0.0
    )
    ok = _rank(Condition.PARALLEL_DP, 0, Status.PASS, SINGLE_OK)
    result = classify_parallel([wrong, single_bad, ok], kernel="builtin")
    assert result.diagnoses == ()
    assert [e.probe_id for e in result.unexplained] == ["rank 0/parallel-tp", "rank 1/parallel-tp"]
    assert "dx rel. error 0.3" in result.unexplained[0].detail
    assert any("single-device run is wrong too" in n for n in result.explanations)
    assert classify_parallel([ok], kernel="builtin").diagnoses == ()


def test_out_of_resources_goes_through_the_generic_engine() -> None:
    oor = _rank(
        Condition.PARALLEL_EP,
        0,
        Status.ERROR,
        {},
        phase=Phase.LAUNCH,
        error_kind=ErrorKind.OUT_OF_RESOURCES,
        error_type="triton.runtime.errors.OutOfResources",
        error_message="out of resource: shared memory",
    )
    result = classify_parallel([oor], kernel="builtin")
    assert [d.cause for d in result.diagnoses] == ["launch-config-fault"] and result.unexplained == ()


# ---------------------------------------------------------------------------------------------
# End to end: real ranks (torchrun, gloo, two CPU processes, the interpreter)
# ---------------------------------------------------------------------------------------------


def _run(tmp_path: Path, modes: tuple[Mode, ...], kernel: str = "builtin", **opts: Any) -> Any:
    plan = plan_parallel(kernel, [], ParallelOptions(modes=modes, **{**E2E, **opts}), cpu=True)
    return run_parallel(plan, log_dir=tmp_path)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


@pytest.mark.slow
def test_dp_end_to_end_with_timing_against_one_process(tmp_path: Path) -> None:
    report = _run(tmp_path, (Mode.DP,), steps=1, baseline=True)
    assert report.healthy, (report.unexplained, [o.error_message for o in report.outcomes])
    single, dp = report.modes
    assert (single.mode, dp.mode) == (Mode.SINGLE, Mode.DP)
    assert dp.world_size == 2 and dp.status is Status.PASS and dp.max_rel_error is not None
    assert dp.max_rel_error <= dp.tolerance
    assert dp.tokens_per_s and single.tokens_per_s and dp.speedup and dp.efficiency  # the timing path ran
    ranks = [o for o in report.outcomes if o.spec.condition is Condition.PARALLEL_DP]
    assert [o.probe_id for o in ranks] == ["rank 0/parallel-dp", "rank 1/parallel-dp"]
    for o in ranks:
        names = {c["name"] for c in o.facts["parallel.checks"]}
        assert {"out", "dx", "grad:gate.weight", "grad:gate_up_proj", "grad:down_proj"} <= names
        assert o.facts["parallel.single"]["ok"] is True
        assert o.facts["parallel.env"]["NCCL_NVLS_ENABLE"] == "0"  # in every rank
        assert o.facts["parallel.env"]["TRITON_INTERPRET"] == "1"
    assert ranks[0].facts["parallel.tokens"] == [0, 4] and ranks[1].facts["parallel.tokens"] == [4, 8]
    for name in ("spec.json", "launcher.log", "rank-0.json", "rank-1.log", "rank-1.crumbs"):
        assert (tmp_path / "dp" / name).is_file(), name


@pytest.mark.slow
def test_tp_end_to_end(tmp_path: Path) -> None:
    report = _run(tmp_path, (Mode.TP,))
    assert report.healthy, [o.error_message or o.facts.get("parallel.checks") for o in report.outcomes]
    assert {o.facts["tp.intermediate_per_rank"] for o in report.outcomes} == {16}


@pytest.mark.slow
def test_ep_end_to_end(tmp_path: Path) -> None:
    report = _run(tmp_path, (Mode.EP,))
    assert report.healthy, [o.error_message or o.facts.get("parallel.checks") for o in report.outcomes]
    rank0, rank1 = report.outcomes
    assert rank0.facts["ep.first_expert"] == 0 and rank1.facts["ep.first_expert"] == 4
    for o in report.outcomes:
        assert o.facts["ep.ids_out_of_range"] == 0 and o.facts["ep.local_expert_ok"] is True
        lo, hi = o.facts["ep.local_id_range"]
        assert 0 <= lo <= hi < 4


@pytest.mark.slow
def test_ep_micro_batches_match_the_block_under_gloo(tmp_path: Path) -> None:
    """Two gloo ranks: one and three micro-batches (one count exchange for all, packed
    messages) and the gather dispatch (static exchange, own tokens first, weight gradients
    deferred) match the whole block, forward and every gradient; the planted remap does not."""
    worker = Path(__file__).parent / "workers" / "ep_micro.py"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run(
        [*cmd, str(worker), str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for variant in ("micro=1", "micro=3", "gather"):
            worst = max(found[variant].values())
            assert worst < 1e-4, (rank, variant, found[variant])
        assert found["planted"]["out"] > 0.05, (rank, found["planted"])
        assert found["planted gather"]["out"] > 0.05, (rank, found["planted gather"])


@pytest.mark.slow
def test_ep_gather_dispatch_on_four_ranks(tmp_path: Path) -> None:
    """Four gloo ranks (two experts each): the gather dispatch's slot rotation (slot j - 1 of
    rank r holds rank (r + j) % W's rows, so the middle ranks' peers wrap around) still matches
    the whole block on every rank, forward and every gradient; the planted remap does not."""
    worker = Path(__file__).parent / "workers" / "ep_micro.py"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]
    proc = subprocess.run(
        [*cmd, str(worker), str(tmp_path), "gather"], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(4):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(found) == {"gather", "planted", "planted gather"}
        assert max(found["gather"].values()) < 1e-4, (rank, found["gather"])
        assert found["planted gather"]["out"] > 0.05, (rank, found["planted gather"])


def test_gather_slots_rotate() -> None:
    """What rank s sends rank p lands in the slot from which p reads s, for every pair."""
    from qmoe_doctor.probes.parallel.ep_gather import peer_of, slot_of

    for world in range(2, 9):
        for r in range(world):
            assert sorted(peer_of(r, j, world) for j in range(world - 1)) == [
                p for p in range(world) if p != r
            ]
            for p in range(world):
                if p != r:
                    assert 0 <= slot_of(r, p, world) < world - 1
                    assert peer_of(r, slot_of(r, p, world), world) == p


@pytest.mark.slow
def test_pp_in_one_process(tmp_path: Path) -> None:
    report = _run(tmp_path, (Mode.PP,), layers=2)
    assert report.healthy, [o.error_message for o in report.outcomes]
    (o,) = report.outcomes
    assert o.probe_id == "rank 0/parallel-pp" and o.facts["pp.placement"] == [0, 1]
    assert len(o.facts["pp.results"]) == 2 and all(r["ok"] for r in o.facts["pp.results"])


@pytest.mark.slow
def test_scan_parallel_names_invalid_routing_on_rank_1(tmp_path: Path) -> None:
    result = runner.invoke(
        app,
        [
            "scan",
            "--parallel",
            "ep",
            "--cpu",
            "--kernel",
            "specimen:global_expert_ids",
            "--json",
            "--log-dir",
            str(tmp_path),
        ],
    )
    assert result.exit_code == 1, result.output
    doc = json.loads(result.stdout)
    assert doc["kind"] == "parallel" and doc["preset"] == "tiny" and doc["tier"] == "cpu"
    (d,) = doc["diagnoses"]
    assert d["cause"] == "invalid-routing" and d["confidence"] == "high" and d["where"] == ["rank 1"]
    rank1 = next(o for o in doc["outcomes"] if o["probe_id"] == "rank 1/parallel-ep")
    assert rank1["facts"]["ep.ids_out_of_range"] > 0 and rank1["facts"]["parallel.single"]["ok"] is True
    assert doc["unexplained"] == []


def test_rank_that_exits_is_an_outcome(tmp_path: Path) -> None:
    inject = {"rank": 1, "stage": "start", "action": "exit", "code": 3}
    report = _run(tmp_path, (Mode.DP,), inject=inject)
    by_id = {o.probe_id: o for o in report.outcomes}
    dead = by_id["rank 1/parallel-dp"]
    assert dead.status is Status.ERROR and dead.exit_code == 3 and dead.phase is Phase.SPAWN
    assert "exited with status 3" in (dead.error_message or "")
    assert "injected exit" in dead.stderr_tail
    peer = by_id["rank 0/parallel-dp"]
    assert peer.status is Status.ERROR and peer.facts.get("parallel.terminated_after") == 1
    assert [e.probe_id for e in report.unexplained] == ["rank 1/parallel-dp"]  # the root cause only


@pytest.mark.slow
def test_rank_that_raises_writes_its_own_outcome(tmp_path: Path) -> None:
    inject = {"rank": 1, "stage": "setup", "action": "raise", "message": "injected failure in setup"}
    report = _run(tmp_path, (Mode.TP,), inject=inject)
    by_id = {o.probe_id: o for o in report.outcomes}
    raised = by_id["rank 1/parallel-tp"]
    assert raised.error_type == "RuntimeError" and raised.error_message == "injected failure in setup"
    assert raised.phase is Phase.SETUP and raised.facts["parallel.backend"] == "gloo"
    assert "Traceback" in raised.stderr_tail
    assert (tmp_path / "tp" / "rank-1.json").is_file()
    assert by_id["rank 0/parallel-tp"].status is Status.ERROR


@pytest.mark.slow
def test_timeout_kills_every_rank(tmp_path: Path) -> None:
    inject = {"rank": 1, "stage": "start", "action": "hang"}
    t0 = time.monotonic()
    report = _run(tmp_path, (Mode.DP,), inject=inject, timeout_s=6.0)
    assert time.monotonic() - t0 < 30
    (mode,) = report.modes
    assert mode.timed_out
    assert {o.error_kind for o in report.outcomes} == {ErrorKind.TIMEOUT}
    assert len(report.outcomes) == 2
    pids = []
    for path in (tmp_path / "dp").glob("rank-*.crumbs"):
        start = json.loads(path.read_text().splitlines()[0])
        pids.append(int(start["pid"]))
    assert pids
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.1)
    assert all(_gone(p) for p in pids), pids
    hung = (tmp_path / "dp" / "rank-1.log").read_text()
    assert "in inject" in hung  # faulthandler's stack, asked for with SIGUSR1 before the kill


# ---------------------------------------------------------------------------------------------
# CLI and the parent's imports
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["scan", "--parallel", "dp,zz", "--cpu"], "unknown parallel mode"),
        (["parallel", "--cpu", "--modes", "dp", "--tokens", "15"], "do not split"),
        (["parallel", "--cpu", "--backend", "mpi"], "nccl or gloo"),
        (["parallel", "--cpu", "--nnodes", "2"], "--rdzv-endpoint"),
    ],
)
def test_usage_errors(args: list[str], needle: str) -> None:
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert needle in result.output


def test_rel_error_of_nothing_is_infinite() -> None:
    from qmoe_doctor.probes.parallel.modes import Check, compare

    assert math.isinf(compare("out", None, torch.ones(2), 1e-2).rel_error)
    assert not Check("x", float("nan"), 1e-2).ok


_INTERRUPTED_PARENT = """
import sys
from pathlib import Path
from qmoe_doctor.core.modes import Mode
from qmoe_doctor.core.options import ParallelOptions
from qmoe_doctor.workflows.parallel import plan_parallel, run_parallel
inject = {"rank": 1, "stage": "start", "action": "hang"}
plan = plan_parallel("builtin", [], ParallelOptions(modes=(Mode.DP,), inject=inject, timeout_s=120), cpu=True)
run_parallel(plan, log_dir=Path(sys.argv[1]))
"""


@pytest.mark.slow
def test_an_interrupted_parent_leaves_no_rank_behind(tmp_path: Path) -> None:
    import signal

    from signal_dispositions import restore_defaults

    # SIGINT raises KeyboardInterrupt in the parent even when the suite runs as a background job
    proc = subprocess.Popen([sys.executable, "-c", _INTERRUPTED_PARENT, str(tmp_path)], preexec_fn=restore_defaults)
    crumbs = tmp_path / "dp" / "rank-1.crumbs"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (crumbs.is_file() and crumbs.read_text().strip()):
        time.sleep(0.1)
    assert crumbs.is_file(), "rank 1 never started"
    proc.send_signal(signal.SIGINT)  # KeyboardInterrupt in the parent, mid-launch
    assert proc.wait(timeout=20) != 0
    pid = int(json.loads(crumbs.read_text().splitlines()[0])["pid"])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not _gone(pid):
        time.sleep(0.1)
    assert _gone(pid)


# ---------------------------------------------------------------------------------------------
# Recorded on 2, 4 and 8 H200s (2026-11-22): the per-rank outcomes, classified again here
# ---------------------------------------------------------------------------------------------

RECORDED = Path(__file__).resolve().parents[1] / "fixtures" / "reports" / "parallel"


@pytest.mark.parametrize(
    ("name", "cause"),
    [
        ("2026-11-22-4xh200-fc8a1a7/parallel-builtin-4gpu.json", None),
        ("2026-11-22-4xh200-fc8a1a7/parallel-specimen-rank_no_set_device-4gpu.json", "device-never-set"),
        ("2026-11-22-4xh200-fc8a1a7/parallel-specimen-global_expert_ids-4gpu.json", "invalid-routing"),
        # the gather dispatch (commit 859cfc6: ep by copy-engine pushes, the specimen's remap still caught)
        ("2026-11-22-4xh200-859cfc6/parallel-builtin-4gpu.json", None),
        ("2026-11-22-4xh200-859cfc6/parallel-specimen-global_expert_ids-4gpu.json", "invalid-routing"),
        ("2026-11-22-4xh200-859cfc6/parallel-builtin-2gpu.json", None),
        ("2026-11-22-4xh200-859cfc6/parallel-specimen-global_expert_ids-2gpu.json", "invalid-routing"),
        # the final gather dispatch on 2 GPUs (commit e60e57e)
        ("2026-11-22-2xh200-e60e57e/parallel-builtin.json", None),
        ("2026-11-22-2xh200-e60e57e/parallel-specimen-rank_no_set_device.json", "device-never-set"),
        ("2026-11-22-2xh200-e60e57e/parallel-specimen-global_expert_ids.json", "invalid-routing"),
        # eight ranks at the 235B preset (commit c1a2d84, issue 9)
        ("2026-11-22-8xh200-c1a2d84/parallel-builtin.json", None),
        ("2026-11-22-8xh200-c1a2d84/parallel-specimen-rank_no_set_device.json", "device-never-set"),
        ("2026-11-22-8xh200-c1a2d84/parallel-specimen-global_expert_ids.json", "invalid-routing"),
    ],
)
def test_recorded_gpu_outcomes_classify_to_the_recorded_verdict(name: str, cause: str | None) -> None:
    """The ranks' outcomes of each recorded run give the verdict the run printed: nothing for our
    kernel (dp, pp, tp, ep all passing), else the specimen's cause on every rank but 0 and never
    on rank 0 (rank 0 sets cuda:0 / owns experts starting at 0: the planted fault cannot show
    there)."""
    from qmoe_doctor.core.records import from_jsonable

    report = json.loads((RECORDED / name).read_text())
    world = len(report["gpus"]) if report.get("gpus") else 4
    outcomes = [from_jsonable(Outcome, o) for o in report["outcomes"]]
    got = classify_parallel(outcomes, kernel=report["kernel"])
    causes = [d.cause for d in got.diagnoses]
    assert causes == [d["cause"] for d in report["diagnoses"]]
    if cause is None:
        assert causes == [] and all(o.status is Status.PASS for o in outcomes)
        assert {m["mode"] for m in report["modes"]} >= {"single", "dp", "pp", "tp", "ep"}
        assert all(m["world_size"] == world for m in report["modes"] if m["mode"] in ("dp", "tp", "ep"))
        return
    (d,) = got.diagnoses
    assert d.cause == cause and d.confidence is Confidence.HIGH
    ranks = sorted(w.split()[1] for w in d.where)
    assert ranks == [str(r) for r in range(1, world)], d.where


@pytest.mark.parametrize(
    "name",
    ["parallel-specimen-rank_no_set_device.json", "parallel-specimen-global_expert_ids.json"],
)
def test_a_rank_that_waited_for_diagnosed_ranks_is_explained_not_unexplained(name: str) -> None:
    """8x H200 (2026-11-22, commit c1a2d84): ranks 1-7 failed with the specimen's cause and rank 0, whose own
    single-device run was correct, hung in the step until the parent's timeout. The run
    reported rank 0 as unexplained (the 2-rank runs never hit this: torchrun stopped rank 0
    first). Re-classified, rank 0 is explained by the diagnosed ranks; without them (rank 0's
    outcome alone) its timeout stays unexplained: a hang of its own is never hidden."""
    from qmoe_doctor.core.records import from_jsonable

    report = json.loads((RECORDED / "2026-11-22-8xh200-c1a2d84" / name).read_text())
    assert [u["probe_id"] for u in report["unexplained"]] == [f"rank 0/{report['outcomes'][0]['spec']['condition']}"]
    outcomes = [from_jsonable(Outcome, o) for o in report["outcomes"]]
    rank0 = next(o for o in outcomes if o.facts.get("parallel.rank") == 0)
    assert rank0.error_kind is ErrorKind.TIMEOUT
    got = classify_parallel(outcomes, kernel=report["kernel"])
    assert got.unexplained == ()
    assert any(e.startswith("rank 0 ") and "timed out" in e for e in got.explanations), got.explanations
    alone = classify_parallel([rank0], kernel=report["kernel"])
    assert [u.probe_id for u in alone.unexplained] == [rank0.probe_id] and alone.diagnoses == ()


def test_recorded_gather_runs_used_the_copy_engine_transport() -> None:
    """The gather runs (commit 859cfc6) recorded which ep dispatch and transport every rank ran: gather over symmetric
    memory on the GPUs (no silent fallback to the collective transport)."""
    report = json.loads((RECORDED / "2026-11-22-4xh200-859cfc6" / "parallel-ep-131072-tokens-2gpu.json").read_text())
    ep_ranks = [o for o in report["outcomes"] if o["facts"].get("parallel.mode") == "ep"]
    assert len(ep_ranks) == 2
    assert {(o["facts"]["ep.dispatch"], o["facts"]["ep.transport"]) for o in ep_ranks} == {("gather", "symm")}


# ---------------------------------------------------------------------------------------------
# Two "nodes" on one machine: two launchers meeting at one c10d rendezvous (gloo, CPU ranks)
# ---------------------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["builtin", "specimen:global_expert_ids"])
def test_two_nodes_meet_at_one_rendezvous_and_report_their_own_ranks(kernel: str, tmp_path: Path) -> None:
    """What docs/parallel.md tells users to run on each node, run twice here: each launcher starts
    one rank, the rendezvous numbers them 0 and 1 across the "nodes", every mode runs with world
    size 2, and each node's report holds its own rank (which launcher gets rank 0 is the
    rendezvous' choice). With the planted specimen the node that holds rank 1 names
    invalid-routing there; the other node's rank 0 fails (its tokens came back wrong) and no rule
    names a cause on it."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    procs = []
    for node in (0, 1):
        cmd = [
            sys.executable, "-m", "qmoe_doctor", "parallel", "--cpu", "--modes", "ep", "--kernel", kernel,
            "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"localhost:{port}",
            "--rdzv-id", "two-nodes", "--no-baseline", "--timeout", "200",
            "--log-dir", str(tmp_path / f"logs{node}"), "--save", str(tmp_path / f"node{node}.json"),
        ]  # fmt: skip
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    outs = [p.communicate(timeout=280)[0] for p in procs]
    reports = [json.loads((tmp_path / f"node{n}.json").read_text()) for n in (0, 1)]
    held = [[o["probe_id"] for o in r["outcomes"]] for r in reports]
    # the rendezvous numbers the ranks in arrival order: either launcher may hold rank 0
    assert sorted(held) == [["rank 0/parallel-ep"], ["rank 1/parallel-ep"]], outs
    assert all([m["world_size"] for m in r["modes"]] == [2] for r in reports)
    if kernel == "builtin":
        assert [p.returncode for p in procs] == [0, 0], outs
        assert all(r["healthy"] for r in reports)
        return
    assert [p.returncode for p in procs] == [1, 1], outs
    rank0, rank1 = sorted(reports, key=lambda r: r["outcomes"][0]["probe_id"])
    assert rank0["diagnoses"] == []
    assert [(d["cause"], d["where"]) for d in rank1["diagnoses"]] == [("invalid-routing", ["rank 1"])]


def test_ep_dispatch_auto_follows_the_measurements(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: gather on 2 ranks at any batch, on 3-4 ranks only from 32,768 tokens per rank (runs
    24-27), never above 4 ranks or with micro-batches; explicit settings win; bad ones are named."""
    from qmoe_doctor.core.knobs import QMOE_EP_DISPATCH as EP_DISPATCH_ENV
    from qmoe_doctor.core.knobs import QMOE_EP_MICRO_BATCHES as EP_MICRO_ENV
    from qmoe_doctor.core.knobs import QMOE_EP_TRANSPORT as EP_TRANSPORT_ENV
    from qmoe_doctor.probes.parallel.modes import ep_dispatch

    for var in (EP_DISPATCH_ENV, EP_MICRO_ENV, EP_TRANSPORT_ENV):
        monkeypatch.delenv(var, raising=False)
    assert ep_dispatch(2, 8) == ("gather", "auto")
    assert ep_dispatch(4, 8192) == ("a2a", "auto")
    assert ep_dispatch(4, 32768) == ("gather", "auto")
    assert ep_dispatch(8, 1 << 20) == ("a2a", "auto")
    assert ep_dispatch(1, 1 << 20) == ("a2a", "auto")
    monkeypatch.setenv(EP_MICRO_ENV, "2")
    assert ep_dispatch(2, 1 << 20)[0] == "a2a"
    monkeypatch.setenv(EP_DISPATCH_ENV, "gather")
    monkeypatch.setenv(EP_TRANSPORT_ENV, "collective")
    assert ep_dispatch(8, 8) == ("gather", "collective")
    monkeypatch.setenv(EP_DISPATCH_ENV, "alltoall")
    with pytest.raises(ValueError, match="QMOE_EP_DISPATCH"):
        ep_dispatch(2, 8)
    monkeypatch.setenv(EP_DISPATCH_ENV, "a2a")
    monkeypatch.setenv(EP_TRANSPORT_ENV, "nvshmem")
    with pytest.raises(ValueError, match="QMOE_EP_TRANSPORT"):
        ep_dispatch(2, 8)


def test_gather_transport_is_collective_across_nodes_and_on_a_cpu() -> None:
    """Symmetric memory only between the GPUs of one host: several nodes (LOCAL_WORLD_SIZE below
    WORLD_SIZE) or a CPU give the collective transport; an unknown kind is named."""
    from qmoe_doctor.probes.parallel.ep_gather import CollectiveTransport, make_transport, single_host

    assert single_host({"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"})
    assert not single_host({"LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "2"})
    assert single_host({})
    assert isinstance(make_transport("auto", 0, 2, None, torch.device("cpu")), CollectiveTransport)
    with pytest.raises(ValueError, match="needs a GPU"):
        make_transport("symm", 0, 2, None, torch.device("cpu"))
    with pytest.raises(ValueError, match="transport must be one of"):
        make_transport("nvlink", 0, 2, None, torch.device("cpu"))
