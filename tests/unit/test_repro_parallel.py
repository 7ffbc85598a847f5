"""`qmoe-doctor repro --parallel` on the CPU: the command's usage errors, exit codes and script
writing (a fake launch on synthetic per-rank reports, then real gloo ranks under the Triton
interpreter), and the per-rank scripts: rendering, their helpers in this process, and the
invalid-routing script run by torchrun on two CPU ranks (planted specimen: exit 1; ours: 0).

The end-to-end cases take 6-15 s each on a 2-core machine; the rest take milliseconds.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from qmoe_doctor.cli import devices
from qmoe_doctor.cli.app import app
from qmoe_doctor.cli.commands import repro as repro_cmd
from qmoe_doctor.core.records import (
    Confidence,
    Diagnosis,
    ErrorKind,
    Evidence,
    Outcome,
    Phase,
    Shape,
    Status,
    rank_spec,
)
from qmoe_doctor.core.reports import ModeResult, ParallelReport
from qmoe_doctor.machine.inventory import GpuInfo, Inventory
from qmoe_doctor.plan.parallel import ParallelPlan
from qmoe_doctor.reports.parallel_script import (
    PARALLEL_SCRIPT_CAUSES,
    ParallelScriptSpec,
    UnsupportedCause,
    parallel_script_name,
    render_parallel_script,
    script_specs,
    torchrun_command,
)
from qmoe_doctor.workflows.parallel import LaunchRecord, summarize

runner = CliRunner()
TINY = Shape(m=32, e=8, n=64, k=64, dtype="float32", routing="random")  # the CPU tier's ep launch
STDLIB = {"__future__", "argparse", "importlib", "inspect", "math", "os", "sys", "pathlib"}


@pytest.fixture(autouse=True)
def _cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


def _flat(text: str) -> str:
    return " ".join(text.split())


# ---------------------------------------------------------------------------------------------
# The command, on a fake launch (no rank starts)
# ---------------------------------------------------------------------------------------------


def _gpu(i: int) -> GpuInfo:
    return GpuInfo(index=i, name="NVIDIA H200", uuid=f"GPU-{i:04d}", pci_bus_id=f"00000000:0{i}:00.0")


def _inventory(n: int) -> Inventory:
    return Inventory(
        gpus=tuple(_gpu(i) for i in range(n)), nvml_error=None if n else "NVML Shared Library Not Found"
    )


def _outcome(plan: ParallelPlan, rank: int, status: Status, **fields: Any) -> Outcome:
    run = next(r for r in plan.runs if r.torchrun)
    spec = rank_spec(run.spec, rank, rank)
    return Outcome(
        probe_id=spec.probe_id, spec=spec, status=status, phase=fields.pop("phase", Phase.DONE), **fields
    )


def _diagnosis(plan: ParallelPlan, cause: str, outcome: Outcome) -> Diagnosis:
    ev = Evidence(
        probe_id=outcome.probe_id, condition=outcome.spec.condition, label="wrong", detail="planted"
    )
    return Diagnosis(
        cause=cause,
        confidence=Confidence.HIGH,
        summary="s",
        evidence=(ev,),
        where=(outcome.spec.placement.group,),
    )


def _modes(plan: ParallelPlan) -> tuple[ModeResult, ...]:
    """Each planned launch's summary, as ``run_parallel`` makes it (no rank ran)."""
    return tuple(
        summarize(
            run,
            LaunchRecord(mode=run.mode, command=(), run_dir="", exit_code=0, timed_out=False, wall_s=0.1),
            [],
        )
        for run in plan.runs
    )


def _report(plan: ParallelPlan, outcomes: list[Outcome], diagnoses: list[Diagnosis]) -> ParallelReport:
    o = plan.options
    return ParallelReport(
        kernel=plan.kernel,
        tier=plan.tier,
        started="2025-01-01T00:00:00+00:00",
        wall_s=0.1,
        preset=str(o.preset),
        tokens=int(o.tokens or 0),
        dtype=str(o.dtype),
        backend=str(o.backend),
        gpus=plan.gpus,
        gpu_of_ordinal=dict(plan.gpu_of_ordinal),
        modes=_modes(plan),
        outcomes=tuple(outcomes),
        diagnoses=tuple(diagnoses),
        log_dir="/tmp/nowhere",
    )


class FakeLaunch:
    """Stands in for launch_parallel: records the plan, returns what ``make`` builds from it."""

    def __init__(self, make: Any) -> None:
        self.make = make
        self.plans: list[ParallelPlan] = []

    def __call__(self, plan: ParallelPlan, *, log_dir: Path | None) -> ParallelReport:
        self.plans.append(plan)
        report: ParallelReport = self.make(plan)
        return report


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--parallel", "dp,zz", "--cpu"], "unknown parallel mode 'zz'; known: dp, pp, tp, ep"),
        (["--parallel", ",", "--cpu"], "no parallel mode given"),
        (["--parallel", "dp", "--cpu", "--steps", "3"], "--parallel runs one checked step"),
        (["--parallel", "dp", "--cpu", "--preset", "gpt5"], "unknown preset"),
        (["--parallel", "dp", "--cpu", "--kernel", "specimen:nope"], "nope"),
        (["--parallel", "ep", "--cpu", "--layers", "1"], "--layers"),
        (["--cpu"], "the pipeline repro needs two GPUs"),
        (["--parallel", "dp", "--gpus", "0,1"], "no GPU is visible"),
    ],
)
def test_usage_errors_exit_2_before_any_rank_starts(
    args: list[str], needle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(devices, "collect_inventory", lambda: _inventory(0))
    monkeypatch.setattr(repro_cmd, "launch_parallel", lambda *a, **k: pytest.fail("must not launch"))
    monkeypatch.setattr(repro_cmd, "run_repro", lambda *a, **k: pytest.fail("must not run"))
    result = runner.invoke(app, ["repro", *args], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert needle in _flat(result.output)


@pytest.mark.parametrize("mode", ["pp", "dp"])
def test_one_gpu_has_nothing_to_run(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "collect_inventory", lambda: _inventory(1))
    monkeypatch.setattr(repro_cmd, "launch_parallel", lambda *a, **k: pytest.fail("must not launch"))
    result = runner.invoke(app, ["repro", "--parallel", mode], env={"COLUMNS": "200"})
    assert result.exit_code == 2, result.output
    assert f"nothing to run: {mode}: needs two GPUs" in _flat(result.output)


def test_help_teaches_the_parallel_option() -> None:
    text = _flat(runner.invoke(app, ["repro", "--help"], env={"COLUMNS": "200"}).output)
    for needle in (
        "--parallel",
        "--cpu",
        "device-never-set",
        "invalid-routing",
        "torchrun --nproc-per-node W",
    ):
        assert needle in text, needle


def test_no_gpu_falls_back_to_cpu_ranks_and_writes_the_invalid_routing_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def make(plan: ParallelPlan) -> ParallelReport:
        rank0, rank1 = _outcome(plan, 0, Status.PASS), _outcome(plan, 1, Status.WRONG, rel_error=1.0)
        return _report(plan, [rank0, rank1], [_diagnosis(plan, "invalid-routing", rank1)])

    fake = FakeLaunch(make)
    monkeypatch.setattr(devices, "collect_inventory", lambda: _inventory(0))
    monkeypatch.setattr(repro_cmd, "launch_parallel", fake)
    out = tmp_path / "out"
    args = ["repro", "--parallel", "ep", "--kernel", "specimen:global_expert_ids", "--out", str(out)]
    result = runner.invoke(app, args, env={"COLUMNS": "300"})
    assert result.exit_code == 1, result.output
    assert "no GPU found" in result.stderr and "CPU processes" in result.stderr
    (plan,) = fake.plans
    assert plan.tier == "cpu" and [r.mode.value for r in plan.runs] == ["ep"]
    o = plan.options
    assert (o.preset, o.steps, o.warmup, o.baseline) == ("tiny", 0, 0, False)  # small, untimed
    assert o.timeout_s == 300.0  # the launches' default, not the probes'
    path = out / "qmoe-repro-parallel-invalid-routing.py"
    assert path.is_file() and os.access(path, os.X_OK)
    text = _flat(result.stdout)
    assert f"script {path} (invalid-routing)" in text
    assert f"run: torchrun --standalone --nproc-per-node 2 {path} --device cpu" in text
    assert f"on GPUs: torchrun --standalone --nproc-per-node 2 {path}" in text
    src = path.read_text()
    assert "M, E, N, K = 32, 8, 64, 64" in src and "Seen:    ep: rank 1" in src


def test_gpu_plan_writes_the_device_never_set_script_with_the_ranks_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def make(plan: ParallelPlan) -> ParallelReport:
        rank1 = _outcome(
            plan, 1, Status.ERROR, error_kind=ErrorKind.POINTER_INACCESSIBLE, error_type="ValueError"
        )
        other = dataclasses.replace(_diagnosis(plan, "missing-device-guard", rank1))
        return _report(
            plan,
            [_outcome(plan, 0, Status.PASS), rank1],
            [_diagnosis(plan, "device-never-set", rank1), other],
        )

    fake = FakeLaunch(make)
    monkeypatch.setattr(devices, "collect_inventory", lambda: _inventory(4))
    monkeypatch.setattr(repro_cmd, "launch_parallel", fake)
    args = [
        "repro",
        "--parallel",
        "dp,ep",
        "--gpus",
        "3,1",
        "--timeout",
        "42",
        "--out",
        str(tmp_path),
        "--json",
    ]
    args += ["--kernel", "specimen:rank_no_set_device"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    (plan,) = fake.plans
    assert plan.tier == "gpu" and plan.gpus == (3, 1) and plan.options.timeout_s == 42.0
    assert [r.mode.value for r in plan.runs] == ["dp", "ep"]  # no one-GPU baseline
    doc = json.loads(result.stdout)
    assert doc["kind"] == "repro-parallel" and doc["faulty"] is True
    (script,) = doc["scripts"]  # none for missing-device-guard
    assert script["cause"] == "device-never-set" and script["cpu_command"] is None
    assert (
        script["command"]
        == f"CUDA_VISIBLE_DEVICES=GPU-0003,GPU-0001 torchrun --standalone --nproc-per-node 2 {script['path']}"
    )
    src = Path(script["path"]).read_text()
    assert "DTYPE = 'bfloat16'" in src and "--device cpu" not in src.split('"""')[1]  # no CPU line in its doc
    assert sorted(p.name for p in tmp_path.iterdir()) == ["qmoe-repro-parallel-device-never-set.py"]


@pytest.mark.parametrize(
    ("outcome_fields", "code"),
    [
        ({"status": Status.ERROR, "phase": Phase.SPAWN, "error_kind": ErrorKind.OTHER}, 4),  # nothing ran
        ({"status": Status.PASS}, 0),
    ],
)
def test_exit_codes_could_not_run_and_healthy(
    outcome_fields: dict[str, Any], code: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fields = dict(outcome_fields)
    status = fields.pop("status")
    fake = FakeLaunch(lambda plan: _report(plan, [_outcome(plan, r, status, **fields) for r in (0, 1)], []))
    monkeypatch.setattr(repro_cmd, "launch_parallel", fake)
    result = runner.invoke(app, ["repro", "--parallel", "tp", "--cpu", "--out", str(tmp_path / "o")])
    assert result.exit_code == code, result.output
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


# ---------------------------------------------------------------------------------------------
# Script specs and rendering (pure, then the helpers in this process)
# ---------------------------------------------------------------------------------------------


def _spec(cause: str, kernel: str = "specimen:global_expert_ids", **kw: Any) -> ParallelScriptSpec:
    return ParallelScriptSpec(cause=cause, kernel=kernel, shape=TINY, seed=5, world=2, **kw)


def _imports(src: str, *, nested: bool = False) -> set[str]:
    """Modules the script imports at the top (``nested``: anywhere, functions included)."""
    nodes = ast.walk(ast.parse(src)) if nested else iter(ast.parse(src).body)
    return {
        n.module if isinstance(n, ast.ImportFrom) and n.module else alias.name
        for n in nodes
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for alias in n.names
    }


@pytest.mark.parametrize("cause", PARALLEL_SCRIPT_CAUSES)
def test_script_compiles_imports_only_torch_triton_and_holds_the_constants(cause: str) -> None:
    spec = _spec(cause, "builtin", seen="ep: rank 1 (cuda:1, GPU 3)", cuda_visible_devices="GPU-a,GPU-b")
    src = render_parallel_script(spec, tool_version="9.9")
    compile(src, parallel_script_name(cause), "exec")
    top = {name.split(".")[0] for name in _imports(src)}
    assert top <= STDLIB | {"torch", "triton"}, top
    # qmoe-doctor only through its loader, for the kernel refs that need it (USE_QMOE_LOADER)
    assert {n for n in _imports(src, nested=True) if n.startswith("qmoe_doctor")} == {
        "qmoe_doctor.probes.loader"
    }
    for line in (
        "KERNEL = 'qmoe_doctor.kernels.grouped_gemm:moe_grouped_gemm'",
        "USE_QMOE_LOADER = False",
        f"CAUSE = {cause!r}",
        "WORLD = 2",
        "M, E, N, K = 32, 8, 64, 64",
        "DTYPE = 'float32'",
        "SEED = 5",
        "CUDA_VISIBLE_DEVICES=GPU-a,GPU-b torchrun --standalone --nproc-per-node 2 "
        + parallel_script_name(cause),
        "Seen:    ep: rank 1 (cuda:1, GPU 3)",
        "written by qmoe-doctor 9.9",
    ):
        assert line in src, line
    # TRITON_INTERPRET is chosen before triton is imported, or the interpreter is not used
    assert src.index('os.environ["TRITON_INTERPRET"] = "1"') < src.index("import triton")


def test_script_refuses_other_causes_and_one_rank() -> None:
    with pytest.raises(UnsupportedCause):
        render_parallel_script(_spec("missing-device-guard"))
    with pytest.raises(ValueError, match="two ranks"):
        render_parallel_script(dataclasses.replace(_spec("invalid-routing"), world=1))


def test_script_kernel_refs_follow_reproscript(tmp_path: Path) -> None:
    src = render_parallel_script(_spec("invalid-routing", "adapter:vllm"))
    assert "USE_QMOE_LOADER = True" in src and "qmoe-doctor's loader" in src
    src = render_parallel_script(_spec("invalid-routing", "rel/k.py:fn"))
    assert f"KERNEL = {str(Path('rel/k.py').resolve()) + ':fn'!r}" in src
    compile(render_parallel_script(_spec("device-never-set", 'we"""ird\\dir/k.py:fn')), "odd.py", "exec")


def test_torchrun_command() -> None:
    assert torchrun_command("s.py", 4) == "torchrun --standalone --nproc-per-node 4 s.py"
    assert torchrun_command("s.py", 2, cpu=True, cuda_visible_devices="0,1") == (
        "torchrun --standalone --nproc-per-node 2 s.py --device cpu"
    )


def test_script_specs_take_the_launch_that_showed_the_cause() -> None:
    from qmoe_doctor.core.modes import Mode
    from qmoe_doctor.core.options import ParallelOptions
    from qmoe_doctor.plan.parallel import plan_parallel

    plan = plan_parallel(
        "specimen:rank_no_set_device", [], ParallelOptions(modes=(Mode.PP, Mode.EP)), cpu=True
    )
    ep_rank = dataclasses.replace(
        _outcome(plan, 1, Status.WRONG), spec=rank_spec(next(r.spec for r in plan.runs if r.mode is Mode.EP), 1, 1)
    )
    report = _report(plan, [ep_rank], [_diagnosis(plan, "invalid-routing", ep_rank)])
    (spec,) = script_specs(report)
    assert (spec.cause, spec.world, spec.shape.m, spec.shape.e) == ("invalid-routing", 2, 32, 8)
    assert spec.seen == "ep: rank 1" and spec.cuda_visible_devices is None
    assert spec.cause_title  # from the cause catalogue
    assert script_specs(_report(plan, [ep_rank], [])) == []


def _load(src: str) -> dict[str, Any]:
    ns: dict[str, Any] = {"__name__": "repro_under_test"}
    exec(compile(src, "repro_under_test.py", "exec"), ns)
    return ns


_FAKE_KERNEL = '''
import torch


def moe_grouped_gemm(x, w, m_sizes):
    """The torch twin: rows past sum(m_sizes) stay zero."""
    y = torch.zeros((x.shape[0], w.shape[1]), dtype=x.dtype)
    row = 0
    for e, n in enumerate(m_sizes.tolist()):
        y[row : row + n] = x[row : row + n] @ w[e].T
        row += n
    return y
'''


@pytest.mark.parametrize(("planted", "expect_bad"), [(False, False), (True, True)])
def test_invalid_routing_rank_logic_in_this_process(planted: bool, expect_bad: bool, tmp_path: Path) -> None:
    """Rank 1 of 2 with a torch kernel: the correct remap passes, a planted one (global ids as
    local) fails with every row out of range. Rank 0 passes either way."""
    module = tmp_path / "fake_kernel.py"
    hook = "\n\ndef qmoe_local_expert_ids(ids, first, per):\n    return ids\n" if planted else ""
    module.write_text(_FAKE_KERNEL + hook)
    ns = _load(render_parallel_script(_spec("invalid-routing", f"{module}:moe_grouped_gemm")))
    kernel = ns["load_kernel"](ns["KERNEL"])
    problems, detail = ns["run"](kernel, 1, 1, 2, "cpu")
    assert bool(problems) is expect_bad, (problems, detail)
    assert "experts [4, 8) of 8" in detail
    if expect_bad:
        assert "rows carry local expert ids outside [0, 4)" in problems[0] and "rel. error" in problems[-1]
        assert " 0 local id(s)" not in detail
    else:
        assert " 0 local id(s) out of range" in detail
    problems0, _ = ns["run"](kernel, 0, 0, 2, "cpu")
    assert problems0 == []  # rank 0's global ids are its local ones


def test_script_helpers_match_the_doctors_kernels() -> None:
    from qmoe_doctor.kernels.grouped_gemm import moe_grouped_gemm_torch

    ns = _load(render_parallel_script(_spec("device-never-set")))
    x, w, ids = ns["make_batch"](torch.device("cpu"), torch.float32)
    x2, w2, ids2 = ns["make_batch"](torch.device("cpu"), torch.float32)
    assert torch.equal(x, x2) and torch.equal(w, w2) and torch.equal(ids, ids2)  # the same in every rank
    assert x.shape == (32, 64) and w.shape == (8, 64, 64) and int(ids.max()) < 8
    order = torch.sort(ids, stable=True).indices
    m_sizes = torch.bincount(ids, minlength=8).to(torch.int32)
    ref = ns["expert_loop"](x[order], w, ids[order])
    assert torch.allclose(
        ref, moe_grouped_gemm_torch(x[order], w, m_sizes, out_dtype=torch.float32), atol=1e-5
    )
    assert ns["wants_cpu"](["--device", "cpu"]) and ns["wants_cpu"](["--device=cpu"])
    assert not ns["wants_cpu"](["--device", "cuda"]) and not ns["wants_cpu"](["cpu"])


@pytest.mark.parametrize(
    ("cause", "env", "argv", "needle"),
    [
        ("invalid-routing", {}, [], "SKIP: run me with one process per rank: torchrun"),
        ("invalid-routing", {"LOCAL_RANK": "0", "WORLD_SIZE": "1"}, ["--device", "cpu"], "needs two ranks"),
        (
            "invalid-routing",
            {"LOCAL_RANK": "0", "WORLD_SIZE": "3"},
            ["--device", "cpu"],
            "8 experts do not split",
        ),
        ("invalid-routing", {"LOCAL_RANK": "1", "WORLD_SIZE": "2"}, [], "needs cuda:1; torch sees 0"),
        (
            "device-never-set",
            {"LOCAL_RANK": "1", "WORLD_SIZE": "2"},
            ["--device", "cpu"],
            "CPU ranks do not have",
        ),
        ("device-never-set", {"LOCAL_RANK": "0", "WORLD_SIZE": "2"}, [], "needs cuda:0; torch sees 0"),
    ],
)
def test_scripts_say_when_they_cannot_run_and_exit_2(
    cause: str,
    env: dict[str, str],
    argv: list[str],
    needle: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    if torch.cuda.is_available():
        pytest.skip("the CUDA cases assume no GPU")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    ns = _load(render_parallel_script(_spec(cause, "builtin")))
    assert ns["main"](argv) == 2
    assert needle in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# End to end: real ranks
# ---------------------------------------------------------------------------------------------


def _torchrun_cpu(args: list[str], cwd: Path) -> tuple[int, str]:
    """torchrun with two CPU ranks (no GPU visible); (exit code, stdout + stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TRITON_INTERPRET", None)  # the script sets it itself for --device cpu
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=cwd)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(("kernel", "code"), [("specimen:global_expert_ids", 1), ("builtin", 0)])
def test_invalid_routing_script_under_torchrun_on_two_cpu_ranks(
    kernel: str, code: int, tmp_path: Path
) -> None:
    path = tmp_path / parallel_script_name("invalid-routing")
    path.write_text(render_parallel_script(_spec("invalid-routing", kernel)))
    code_got, out = _torchrun_cpu([str(path), "--device", "cpu"], tmp_path)
    assert code_got == code, out[-3000:]
    if code:
        assert "rank 1: FAIL (" in out and "rows carry local expert ids outside [0, 4)" in out, out[-3000:]
        assert "rank 0: PASS (" in out  # rank 1's exit waits for it (torchrun would stop it)
    else:
        assert "rank 0: PASS (" in out and "rank 1: PASS (" in out and "0 local id(s) out of range" in out


WRAPPER = """
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("repro_script", sys.argv[1])
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)
check = script.run
def slow_rank_0(*args, **kwargs):
    if os.environ["RANK"] == "0":
        time.sleep(3)  # rank 1 fails and exits long before rank 0 has a verdict (torchrun polls every 0.1 s)
    return check(*args, **kwargs)
script.run = slow_rank_0
sys.exit(script.main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_a_failing_rank_waits_for_a_slower_one_to_print(tmp_path: Path) -> None:
    """A run on 4 H200s (2026-11-22) lost rank 2's line: torchrun stopped it when rank 3 exited 1. Rank 0
    here is three seconds slower than the failing rank 1 and still prints its PASS."""
    path = tmp_path / parallel_script_name("invalid-routing")
    path.write_text(render_parallel_script(_spec("invalid-routing", "specimen:global_expert_ids")))
    wrapper = tmp_path / "slow_rank_0.py"
    wrapper.write_text(WRAPPER)
    code, out = _torchrun_cpu([str(wrapper), str(path), "--device", "cpu"], tmp_path)
    assert code == 1, out[-3000:]
    assert "rank 1: FAIL (" in out and "rank 0: PASS (" in out, out[-3000:]
    assert out.index("rank 1: FAIL (") < out.index("rank 0: PASS (")  # rank 1 really was first


@pytest.mark.slow
def test_repro_parallel_ep_names_invalid_routing_on_rank_1_and_writes_the_script(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["repro", "--parallel", "ep", "--kernel", "specimen:global_expert_ids", "--cpu"]
    args += ["--out", str(out), "--log-dir", str(tmp_path / "logs")]
    result = runner.invoke(app, args, env={"COLUMNS": "300"})
    assert result.exit_code == 1, result.output
    text = _flat(result.stdout)
    assert "invalid-routing" in text and "where: rank 1 " in text
    path = out / "qmoe-repro-parallel-invalid-routing.py"
    assert path.is_file()
    assert f"run: torchrun --standalone --nproc-per-node 2 {path} --device cpu" in text
    src = path.read_text()
    assert "KERNEL = 'qmoe_doctor.kernels.specimens.global_expert_ids:moe_grouped_gemm'" in src
    assert "M, E, N, K = 32, 8, 64, 64" in src and "DTYPE = 'float32'" in src  # the launch's shape
    assert (tmp_path / "logs" / "ep" / "rank-1.json").is_file()


@pytest.mark.slow
def test_repro_parallel_dp_with_our_kernel_is_healthy_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = [
        "repro",
        "--parallel",
        "dp",
        "--cpu",
        "--json",
        "--out",
        str(out),
        "--log-dir",
        str(tmp_path / "l"),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["kind"] == "repro-parallel" and doc["faulty"] is False and doc["healthy"] is True
    assert doc["scripts"] == [] and doc["diagnoses"] == [] and doc["preset"] == "tiny"
    assert [m["mode"] for m in doc["modes"]] == ["dp"] and len(doc["outcomes"]) == 2
    assert not out.exists() or not any(out.iterdir())
