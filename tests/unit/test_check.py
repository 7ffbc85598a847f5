"""`qmoe-doctor check`: exit codes, the GPU-count gate, the fast GPU plan, JSON and JUnit reports.

The CPU-tier tests start real probe children (Triton interpreter) with few conditions; the GPU
paths use fake inventories and a fake scan engine (no GPU needed)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from test_junit import assert_junit_shape
from typer.testing import CliRunner

from qmoe_doctor.cli import devices
from qmoe_doctor.cli.app import app
from qmoe_doctor.core.conditions import ROUTED_ORDER
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.options import GPU_FAST_CONDITIONS, CheckOptions
from qmoe_doctor.core.records import (
    Condition,
    ErrorKind,
    Outcome,
    Phase,
    ProbeSpec,
    Shape,
    Status,
    pair_placement,
)
from qmoe_doctor.core.reports import ScanReport
from qmoe_doctor.diagnose.check_verdicts import cell_results, worst
from qmoe_doctor.machine.inventory import GpuInfo, Inventory
from qmoe_doctor.plan.check import default_lint_paths, plan_check
from qmoe_doctor.plan.scan import ScanPlan
from qmoe_doctor.workflows import check as check_mod

runner = CliRunner()
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
NO_DRIVER = "NVML could not start: NVML Shared Library Not Found"


def _gpu(i: int) -> GpuInfo:
    return GpuInfo(index=i, name="NVIDIA H200", uuid=f"GPU-{i:04d}", pci_bus_id=f"00000000:{i:02x}:00.0")


def _inventory(n: int, nvml_error: str | None = None) -> Inventory:
    return Inventory(gpus=tuple(_gpu(i) for i in range(n)), nvml_error=nvml_error)


@pytest.fixture(autouse=True)
def _cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def _flat(text: str) -> str:
    """Output as one line: rich wraps usage errors in a box."""
    return " ".join(text.replace("│", " ").split())


def _no_probes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Make any attempt to run probes fail the test; returns the kernels it was asked for."""
    asked: list[str] = []

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        asked.append(str(args))
        raise AssertionError("no probe may run")

    monkeypatch.setattr(check_mod, "run_scan", forbidden)
    return asked


# --- CPU tier, real children ------------------------------------------------------------------


def test_builtin_is_healthy_on_the_cpu_tier(tmp_path: Path) -> None:
    junit, report = tmp_path / "report.xml", tmp_path / "report.json"
    result = runner.invoke(
        app,
        ["check", "--cpu", "--only", "single,negative-sizes", "--junit", str(junit), "--save", str(report),
         "--log-dir", str(tmp_path / "logs")],
    )
    assert result.exit_code == 0, result.output
    assert "check: healthy (exit 0)" in result.stdout
    doc = json.loads(report.read_text())
    assert doc["kind"] == "check" and doc["schema_version"] == 1 and doc["exit_code"] == 0 and doc["healthy"]
    (kernel,) = doc["kernels"]
    assert kernel["kernel"] == "builtin" and kernel["exit_code"] == 0
    assert kernel["summary"] == {"pass": 3, "fail": 0, "skip": 0, "error": 0}  # + the interpreter check
    assert kernel["diagnoses"] == []
    # our kernel's own source is found without importing it, and what its function reaches is
    # linted (its @triton.jit kernels are in another file): clean
    files = kernel["lint"]["files"]
    assert files[0].endswith("kernels/grouped_gemm.py") and kernel["lint"]["findings"] == []
    assert any(f.endswith("kernels/_details/grouped_gemm_kernels.py") for f in files)
    assert kernel["lint"]["reached_from"].endswith("grouped_gemm.py:moe_grouped_gemm")
    assert [t["tier"] for t in kernel["tiers"]] == ["cpu"]
    root = assert_junit_shape(junit.read_text())
    (suite,) = list(root)
    assert suite.get("name") == "builtin" and suite.get("tests") == str(3 + len(files))
    assert suite.get("failures") == "0"
    assert {c.get("classname") for c in suite.iter("testcase")} == {"builtin.CPU", "builtin.lint"}
    assert {c.get("name") for c in suite.iter("testcase")} == {"interpreter-check", "single", "negative-sizes", *files}


def test_specimen_fails_the_check_with_its_cause(tmp_path: Path) -> None:
    junit, report = tmp_path / "report.xml", tmp_path / "report.json"
    result = runner.invoke(
        app,
        ["check", "--cpu", "-k", "specimen:unmasked_rows", "--only", "single,over-routed",
         "--junit", str(junit), "--save", str(report), "--log-dir", str(tmp_path / "logs")],
    )
    assert result.exit_code == 1, result.output
    assert "invalid-routing" in result.stdout and "check: FAULT (exit 1)" in result.stdout
    doc = json.loads(report.read_text())
    (kernel,) = doc["kernels"]
    assert [d["cause"] for d in kernel["diagnoses"]] == ["invalid-routing"]
    assert kernel["exit_code"] == 1 and kernel["summary"]["fail"] == 1
    (failed,) = [c for c in kernel["cells"] if c["verdict"] == "fail"]
    assert failed["name"] == "over-routed" and failed["cause"] == "invalid-routing"
    root = assert_junit_shape(junit.read_text())
    (failure,) = list(root.iter("failure"))
    assert failure.get("type") == "invalid-routing"
    assert (failure.get("message") or "").startswith("wrong: ")


def test_kernel_that_does_not_import_is_a_usage_error_with_a_paragraph(tmp_path: Path) -> None:
    src = tmp_path / "broken.py"
    src.write_text("import module_that_is_not_there\ndef fn(x, w, m_sizes):\n    return x\n")
    report = tmp_path / "report.json"
    result = runner.invoke(
        app,
        ["check", "--cpu", "-k", f"{src}:fn", "--only", "single", "--save", str(report),
         "--log-dir", str(tmp_path / "logs")],
    )
    assert result.exit_code == 2, result.output
    assert "module_that_is_not_there" in result.stderr
    assert "fn(x, w, m_sizes) -> y" in result.stderr and "adapter:NAME:TARGET" in result.stderr
    assert "Traceback" not in result.output
    doc = json.loads(report.read_text())
    assert doc["kernels"][0]["exit_code"] == 2
    assert doc["kernels"][0]["lint"]["files"] == [str(src)]  # a path kernel: its source is linted


# --- usage errors and the GPU-count gate (nothing runs) -----------------------------------------


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["-k", "no_colon_here"], "module:function"),
        (["-k", "specimen:nope"], "unknown specimen"),
        (["-k", "missing/kernel.py:fn"], "does not exist"),
        (["-k", "adapter:"], "adapter:NAME"),
        (["-k", "adapter:not_installed_anywhere"], "no adapter named"),
        (["-k", "adapter:mod.ADAPTER:missing/k.py:fn"], "does not exist"),
        (["--lint", "no/such/dir"], "no such file"),
        (["--only", "bogus"], "unknown condition"),
        (["--preset", "nope"], "unknown preset"),
        (["--require-gpus", "2"], "--cpu"),
    ],
)
def test_usage_errors_exit_2_before_running_anything(
    args: list[str], needle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = _no_probes(monkeypatch)
    result = runner.invoke(app, ["check", "--cpu", *args])
    assert result.exit_code == 2, result.output
    assert needle in _flat(result.output), result.output
    assert not asked


@pytest.mark.parametrize(
    ("inventory", "args", "code", "needle"),
    [
        (_inventory(0, NO_DRIVER), ["--require-gpus", "2"], ExitCode.TOO_FEW_GPUS, "no GPU found"),
        (_inventory(0), ["--require-gpus", "1"], ExitCode.TOO_FEW_GPUS, "--require-gpus 1"),
        (_inventory(1), ["--require-gpus", "2"], ExitCode.TOO_FEW_GPUS, "1 GPU(s) visible"),
        (_inventory(4), ["--require-gpus", "2", "--gpus", "3"], ExitCode.TOO_FEW_GPUS, "1 GPU(s) selected"),
        (_inventory(0, "NVML could not start: Unknown Error"), ["--require-gpus", "2"], ExitCode.CHECK_BROKEN,
         "cannot count GPUs"),
        (_inventory(2), ["--gpus", "7"], ExitCode.USAGE, "no GPU 7"),
        (_inventory(0, NO_DRIVER), ["--gpus", "0,1"], ExitCode.USAGE, "no GPU"),
    ],
)
def test_gpu_gate(
    inventory: Inventory, args: list[str], code: ExitCode, needle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked = _no_probes(monkeypatch)
    monkeypatch.setattr(devices, "collect_inventory", lambda: inventory)
    result = runner.invoke(app, ["check", *args])
    assert result.exit_code == code, result.output
    assert needle in _flat(result.output), result.output
    assert not asked


def test_lint_only_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--lint without --kernel lints and runs no probe; findings are a fault."""
    asked = _no_probes(monkeypatch)
    junit, report = tmp_path / "r.xml", tmp_path / "r.json"
    target = FIXTURES / "lint" / "public_grouped_gemm.py"
    result = runner.invoke(app, ["check", "--cpu", "--lint", str(target), "--junit", str(junit), "--save", str(report)])
    assert result.exit_code == 1, result.output
    assert not asked
    doc = json.loads(report.read_text())
    assert doc["kernels"] == [] and doc["lint"]["findings"]
    root = assert_junit_shape(junit.read_text())
    (suite,) = list(root)
    assert suite.get("name") == "lint" and int(suite.get("failures") or 0) == len(doc["lint"]["findings"])


# --- the GPU subset, with a fake inventory and a fake scan engine --------------------------------


def test_fast_gpu_plan_is_one_pair_and_a_few_cells() -> None:
    (cpu, cpu_plan), (gpu, gpu_plan) = plan_check("builtin", [_gpu(0), _gpu(1), _gpu(2)])
    assert (cpu, gpu) == ("cpu", "gpu")
    assert [s.label for s in cpu_plan.sessions] == ["CPU"]
    (session,) = gpu_plan.sessions
    assert session.label == "GPU 0 -> GPU 1"
    m_sizes_fast = GPU_FAST_CONDITIONS - set(ROUTED_ORDER)  # the routed cells: a routed kernel's
    assert {s.condition for s in session.specs} == m_sizes_fast
    assert len(session.specs) == len(m_sizes_fast) <= 10  # ~0.3-1 s each, one child start
    assert not any(s.fresh_process or s.env for s in session.specs)  # no extra child starts
    assert session.specs[0].condition is Condition.REPEAT_CALL  # the child's first call
    assert any("1 of 6 ordered GPU pairs" in note for note in gpu_plan.skipped)
    # a routed kernel: its routed cells instead of over-routed and negative-sizes
    (_, _), (_, routed_plan) = plan_check("adapter:routed", [_gpu(0), _gpu(1)])
    routed = {s.condition for s in routed_plan.specs}
    assert set(ROUTED_ORDER) <= routed and not routed & {Condition.OVER_ROUTED, Condition.NEGATIVE_SIZES}


def test_fast_gpu_plan_on_one_gpu_and_with_only() -> None:
    (_, cpu_plan), (_, gpu_plan) = plan_check("builtin", [_gpu(0)])
    assert not any(s.condition.is_pair for s in gpu_plan.specs)
    opts = CheckOptions(conditions=frozenset({Condition.PEER, Condition.GUARDED}), cpu_tier=False)
    ((tier, plan),) = plan_check("builtin", [_gpu(0), _gpu(1)], opts)
    assert tier == "gpu" and {s.condition for s in plan.specs} == {Condition.PEER, Condition.GUARDED}


def _fake_scan(fail: dict[str, Status]) -> Any:
    """A run_scan that passes every planned probe, except those named in ``fail``."""

    def run_scan(plan: ScanPlan, *, gpus: tuple[int, ...] = (), log_dir: Path | None = None, **_: Any) -> ScanReport:
        outcomes = tuple(
            Outcome(
                probe_id=s.probe_id,
                spec=s,
                status=fail.get(s.probe_id, Status.PASS),
                phase=Phase.DONE,
                error_kind=ErrorKind.ILLEGAL_ADDRESS if fail.get(s.probe_id) is Status.ERROR else None,
                error_message="an illegal memory access was encountered" if fail.get(s.probe_id) else None,
                wall_s=0.5,
            )
            for s in plan.specs
        )
        return ScanReport(
            kernel=plan.kernel, tier="gpu" if gpus else "cpu", started="2026-11-22T00:00:00+00:00", wall_s=1.0,
            gpus=gpus, sessions=(), outcomes=outcomes, diagnoses=(), skipped=plan.skipped, log_dir=str(log_dir),
        )

    return run_scan


def test_gpu_machine_runs_cpu_tier_and_gpu_subset(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "collect_inventory", lambda: _inventory(2))
    monkeypatch.setattr(check_mod, "run_scan", _fake_scan({"0->1/producer-race": Status.ERROR}))
    junit, report = tmp_path / "r.xml", tmp_path / "r.json"
    result = runner.invoke(
        app, ["check", "--require-gpus", "2", "--junit", str(junit), "--save", str(report), "--log-dir", str(tmp_path)]
    )
    assert result.exit_code == 1, result.output  # a failing cell no rule explains is a fault
    doc = json.loads(report.read_text())
    (kernel,) = doc["kernels"]
    assert [t["tier"] for t in kernel["tiers"]] == ["cpu", "gpu"] and doc["gpus"] == [0, 1]
    (failed,) = [c for c in kernel["cells"] if c["verdict"] == "fail"]
    assert failed["group"] == "GPU 0 -> GPU 1" and failed["name"] == "producer-race" and failed["cause"] is None
    assert "illegal memory access" in failed["log"]
    root = assert_junit_shape(junit.read_text())
    classes = {c.get("classname") for c in root.iter("testcase")}
    assert classes == {"builtin.CPU", "builtin.GPU 1", "builtin.GPU 0 -> GPU 1", "builtin.lint"}
    failure = next(root.iter("failure"))
    assert failure.get("type") == "unexplained" and (failure.get("message") or "").startswith("illegal-address")


def test_unchecked_cells_are_skipped_with_the_reason_and_rejected_ones_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A blind over-routed cell (no canary after the kernel's own output, no sanitizer) is never
    a pass: JUnit shows it skipped, with the reason. A kernel refusing the -1 sentinel before
    launch honours its contract: a pass whose detail names the refused input."""
    blind = {"canary_after_output": False, "memcheck": "unavailable", "memcheck_reason": "compute-sanitizer was not found"}

    def scan(plan: ScanPlan, **kw: Any) -> ScanReport:
        report: ScanReport = _fake_scan({})(plan, **kw)
        outcomes = []
        for o in report.outcomes:
            if o.probe_id == "GPU 1/over-routed":
                o = replace(o, facts=blind)
            elif o.probe_id == "GPU 1/negative-sizes":
                o = replace(
                    o,
                    status=Status.ERROR,
                    phase=Phase.SETUP,
                    error_kind=ErrorKind.BAD_INPUT,
                    error_type="ValueError",
                    error_message="m_sizes must be non-negative",
                    facts={"raised_in": "kernel", "kernel_launches": 0},
                )
            else:  # every other cell's canary followed the output
                o = replace(o, facts={"canary_after_output": True})
            outcomes.append(o)
        return replace(report, outcomes=tuple(outcomes))

    monkeypatch.setattr(devices, "collect_inventory", lambda: _inventory(2))
    monkeypatch.setattr(check_mod, "run_scan", scan)
    junit, saved = tmp_path / "r.xml", tmp_path / "r.json"
    result = runner.invoke(
        app, ["check", "--gpus", "0,1", "--junit", str(junit), "--save", str(saved), "--log-dir", str(tmp_path / "l")]
    )
    assert result.exit_code == 0, result.output
    (kernel,) = json.loads(saved.read_text())["kernels"]
    cells = {c["probe_id"]: c for c in kernel["cells"]}
    over, sentinel = cells["GPU 1/over-routed"], cells["GPU 1/negative-sizes"]
    assert (over["label"], over["verdict"]) == ("unchecked", "skip")
    assert "writes past y were not checked" in over["detail"] and "compute-sanitizer was not found" in over["detail"]
    assert (sentinel["label"], sentinel["verdict"]) == ("rejected", "pass")
    assert "the kernel refuses m_sizes before launch (ValueError: m_sizes must be non-negative)" in sentinel["detail"]
    assert kernel["coverage"]["unchecked"] == ["GPU 1/over-routed"]
    assert kernel["coverage"]["rejected"] == ["GPU 1/negative-sizes"]
    root = assert_junit_shape(junit.read_text())
    case = next(c for c in root.iter("testcase") if c.get("name") == "over-routed" and "GPU 1" in (c.get("classname") or ""))
    (skipped,) = list(case.iter("skipped"))
    assert "writes past y were not checked" in (skipped.get("message") or "")
    text = _flat(result.stdout)
    assert "unchecked GPU 1/over-routed" in text and "rejected GPU 1/negative-sizes" in text
    assert "covers: lint, the CPU tier and the GPU subset;" in text and "1 unchecked (GPU 1/over-routed)" in text


def test_every_probe_failing_to_spawn_is_exit_4(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def spawn_failed(plan: ScanPlan, **kw: Any) -> ScanReport:
        report: ScanReport = _fake_scan({})(plan, **kw)
        outcomes = tuple(
            replace(o, status=Status.ERROR, phase=Phase.SPAWN, error_kind=ErrorKind.OTHER, error_message="no python")
            for o in report.outcomes
        )
        return replace(report, outcomes=outcomes)

    monkeypatch.setattr(check_mod, "run_scan", spawn_failed)
    result = runner.invoke(app, ["check", "--cpu", "-k", "builtin", "-k", "specimen:unguarded", "--log-dir", str(tmp_path)])
    assert result.exit_code == 4, result.output
    assert "COULD NOT CHECK" in result.stdout and "could start" in _flat(result.stdout)


# --- library pieces -----------------------------------------------------------------------------


def test_worst_exit_code_precedence() -> None:
    assert worst([]) is ExitCode.HEALTHY
    assert worst([0, 1, 0]) is ExitCode.FAULT
    assert worst([1, 4]) is ExitCode.CHECK_BROKEN
    assert worst([4, 2, 1]) is ExitCode.USAGE


def test_slow_cells_fail_only_when_a_diagnosis_cites_them() -> None:
    from qmoe_doctor.core.records import Confidence, Diagnosis, Evidence

    def outcome(cond: Condition, ms: float) -> Outcome:
        spec = ProbeSpec(probe_id=f"0->1/{cond}", kernel="k", condition=cond, placement=pair_placement(0, 1),
                         device=1, current=0, shape=Shape(m=8, e=2, n=8, k=8))
        return Outcome(probe_id=spec.probe_id, spec=spec, status=Status.PASS, phase=Phase.DONE, kernel_ms=ms)

    outs = (outcome(Condition.GUARDED, 1.0), outcome(Condition.PEER, 12.0))
    base = ScanReport(kernel="k", tier="gpu", started="", wall_s=0.0, gpus=(0, 1), sessions=(), outcomes=outs,
                      diagnoses=())
    assert [c.verdict for c in cell_results(base, "gpu")] == ["pass", "pass"]
    diag = Diagnosis(cause="missing-device-guard", confidence=Confidence.MEDIUM, summary="s",
                     evidence=(Evidence(probe_id="0->1/peer", condition=Condition.PEER, label="slow", detail="12x"),))
    cells = cell_results(replace(base, diagnoses=(diag,)), "gpu")
    assert [(c.verdict, c.label, c.cause) for c in cells] == [
        ("pass", "pass", None), ("fail", "slow", "missing-device-guard"),
    ]
    assert cells[1].group == "GPU 0 -> GPU 1" and cells[1].detail == "12x"


def test_default_lint_paths_are_the_kernel_refs_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """check lints each kernel's own source, found by KernelRef.source_path (tests/unit/
    test_kernel_refs.py has every form); nothing for a reference with no source to find."""
    pkg = tmp_path / "qd_lint_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('imported!')\n")
    (pkg / "moe.py").write_text("def fn(x, w, m_sizes):\n    return x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert default_lint_paths("qd_lint_pkg.moe:fn") == (str(pkg / "moe.py"),)
    assert default_lint_paths("specimen:unguarded")[0].endswith("unguarded.py")
    for ref in ("torch:grouped_mm", "adapter:lib", "qd_lint_pkg.nothing:fn", "not a ref"):
        assert default_lint_paths(ref) == (), ref


# --- progress, the lint note and the log folder -------------------------------------------------


def test_check_reports_progress_after_every_tier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A report of everything so far after each tier (complete: false, never healthy, the
    kernels not checked yet listed), so that a check that is stopped leaves its work behind."""
    monkeypatch.setattr(check_mod, "run_scan", _fake_scan({}))
    seen: list[Any] = []
    final = check_mod.run_check(
        ["builtin", "specimen:unguarded"],
        gpus=[_gpu(0), _gpu(1)],
        lint=[_clean_source(tmp_path)],  # linted once, on its own: the kernels' sources are not
        log_dir=tmp_path,
        on_progress=seen.append,
    )
    assert [(len(r.kernels), [len(k.tiers) for k in r.kernels], r.not_run) for r in seen] == [
        (1, [1], ("specimen:unguarded",)),  # builtin's CPU tier
        (1, [2], ("specimen:unguarded",)),  # builtin done
        (2, [2, 1], ()),  # the second kernel's CPU tier
    ]
    assert all(not r.complete and not r.healthy for r in seen)
    assert final.complete and final.healthy and [len(k.tiers) for k in final.kernels] == [2, 2]


def test_interrupted_check_saves_the_report_so_far(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C in the second kernel: exit 130, and --save holds the first kernel's check,
    marked incomplete."""
    fake = _fake_scan({})
    calls: list[str] = []

    def interrupted(plan: ScanPlan, **kw: Any) -> ScanReport:
        calls.append(plan.kernel)
        if len(calls) == 2:
            raise KeyboardInterrupt
        report: ScanReport = fake(plan, **kw)
        return report

    monkeypatch.setattr(check_mod, "run_scan", interrupted)
    out = tmp_path / "r.json"
    result = runner.invoke(
        app, ["check", "--cpu", "-k", "builtin", "-k", "specimen:unguarded", "--save", str(out),
              "--log-dir", str(tmp_path / "logs")],
    )
    assert result.exit_code == 130, result.output
    assert "interrupted" in result.output and str(out) in "".join(result.output.split())
    doc = json.loads(out.read_text())
    assert doc["complete"] is False and doc["healthy"] is False and doc["not_run"] == ["specimen:unguarded"]
    assert [k["kernel"] for k in doc["kernels"]] == ["builtin"]


def test_a_kernel_whose_source_cannot_be_found_says_it_was_not_linted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(check_mod, "run_scan", _fake_scan({}))
    report = check_mod.run_check(["torch:grouped_mm", "builtin"], log_dir=tmp_path)
    nameless, ours = report.kernels
    assert nameless.lint is None
    assert nameless.notes == ("no lint: the source of torch:grouped_mm could not be found without importing it",)
    assert ours.lint is not None and ours.notes == ()


def _clean_source(folder: Path) -> str:
    path = folder / "clean.py"
    path.write_text("x = 1\n")
    return str(path)


@pytest.fixture
def temp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import tempfile

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # gettempdir() caches its first answer
    return tmp


def test_healthy_check_removes_its_logs_a_failing_one_keeps_them(
    temp_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clean = [_clean_source(tmp_path)]
    monkeypatch.setattr(check_mod, "run_scan", _fake_scan({}))
    healthy = check_mod.run_check(["builtin"], lint=clean)
    assert healthy.healthy and healthy.log_dir == "" and list(temp_dir.iterdir()) == []
    assert all(t.log_dir == "" for k in healthy.kernels for t in k.tiers)
    monkeypatch.setattr(check_mod, "run_scan", _fake_scan({"CPU/single": Status.WRONG}))
    faulty = check_mod.run_check(["builtin"], lint=clean)
    (kept,) = temp_dir.glob("qmoe-doctor-check-*")
    assert faulty.exit_code == ExitCode.FAULT and faulty.log_dir == str(kept)
    assert faulty.kernels[0].tiers[0].log_dir == str(kept / "builtin" / "cpu")
