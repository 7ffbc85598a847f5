"""The baseline decides what a kernel's other cells may say (``diagnose/baseline.py``, docs/cells.md).

* A kernel that raises on every call is never healthy: its baseline cell (``single``) raised on
  the canonical inputs, so it cannot be used as given (exit 2, its error quoted), and none of its
  cells is ``rejected``.
* A refusal of any exception type before the first launch, the baseline passing, is
  ``rejected``, quoting the exception; the same exception after a launch is a failing cell.
* A kernel that needs CUDA on every call is not checked on the CPU tier (exit 4), never a fault,
  never a refusal.
* A kernel whose import kills or hangs the probe child cannot be used (exit 2, how it ended
  named); a kernel that hangs on every call costs one timeout, and its other cells are not run.

The first part reads outcomes as the probes record them (synthetic, field for field what the CPU
tier wrote for the fixture kernels); the second runs the fixture kernels
(``tests/fixtures/kernels/``) through the real CLI on the CPU tier, as a user would.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from qmoe_doctor.cli.render.scan import could_not_run
from qmoe_doctor.core.error_kind import classify_error
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.options import ScanOptions
from qmoe_doctor.core.records import (
    CPU_PLACEMENT,
    Condition,
    ErrorKind,
    Outcome,
    Phase,
    Placement,
    ProbeSpec,
    Shape,
    Status,
)
from qmoe_doctor.core.reports import ScanReport, TierResult
from qmoe_doctor.diagnose.baseline import import_death, stop_reason, unusable
from qmoe_doctor.diagnose.check_verdicts import cell_results, count_verdicts, judge_kernel
from qmoe_doctor.diagnose.matrix import build_matrix, describe
from qmoe_doctor.diagnose.scan_rules import classify
from qmoe_doctor.isolate.worker_pool import run_session
from qmoe_doctor.plan.scan import plan_scan
from qmoe_doctor.workflows.scan import coverage, nothing_ran

REPO = Path(__file__).resolve().parents[2]
KERNELS = REPO / "tests" / "fixtures" / "kernels"
CPU_SHAPE = Shape(m=64, e=4, n=32, k=32, dtype="float32", routing="random")
UNPACK = "not enough values to unpack (expected 3, got 2)"
VIEW = (
    "view size is not compatible with input tensor's size and stride (at least one dimension spans "
    "across two contiguous subspaces). Use .reshape(...) instead."
)


def cell(
    cond: Condition,
    status: Status = Status.PASS,
    *,
    variant: str = "",
    kind: ErrorKind | None = None,
    error_type: str | None = None,
    message: str | None = None,
    facts: dict[str, Any] | None = None,
    placement: Placement = CPU_PLACEMENT,
    phase: Phase = Phase.DONE,
    exit_code: int | None = None,
    timeout_s: float = 180.0,
) -> Outcome:
    where = dataclasses.replace(placement, variant=variant)
    spec = ProbeSpec(
        probe_id=where.probe_id(cond),
        kernel="k.py:fn",
        condition=cond,
        placement=where,
        device=None if where.group == "CPU" else 0,
        shape=CPU_SHAPE,
        params={"variant": variant} if variant else {},
        timeout_s=timeout_s,
    )
    return Outcome(
        probe_id=spec.probe_id,
        spec=spec,
        status=status,
        phase=phase if status is not Status.PASS else Phase.DONE,
        error_kind=kind,
        error_type=error_type,
        error_message=message,
        rel_error=1e-7 if status is Status.PASS else None,
        facts=dict(facts or {}),
        exit_code=exit_code,
    )


def raised(
    cond: Condition,
    error_type: str,
    message: str,
    *,
    kind: ErrorKind,
    variant: str = "",
    launches: int | None = 0,
    raised_in: str = "kernel",
    in_call: bool = True,
    site: str = "k.py:14",
    **facts: Any,
) -> Outcome:
    """A cell that ended in an exception out of the kernel's call, as the probe records it."""
    recorded: dict[str, Any] = {"raised_in": raised_in, "raise_site": site, "raised_in_call": in_call, **facts}
    if launches is not None:
        recorded["kernel_launches"] = launches
    return cell(cond, Status.ERROR, variant=variant, kind=kind, error_type=error_type, message=message,
                facts=recorded, phase=Phase.LAUNCH)


def report_of(outcomes: list[Outcome]) -> ScanReport:
    result = classify(outcomes, kernel="k.py:fn")
    return ScanReport(
        kernel="k.py:fn", tier="cpu", started="2026-12-07T00:00:00", wall_s=1.0, gpus=(), sessions=(),
        outcomes=tuple(outcomes), diagnoses=result.diagnoses, explanations=result.explanations,
        unexplained=result.unexplained, hardening=result.hardening, coverage=coverage(outcomes),
    )


def interpreter_check() -> Outcome:
    return cell(Condition.INTERPRETER_CHECK)


# --------------------------------------------------------------------------------------------
# A kernel that raises on every call
# --------------------------------------------------------------------------------------------


def every_cell_raising(error_type: str, message: str, kind: ErrorKind, source: str | None = None) -> list[Outcome]:
    """The CPU tier's cells of a kernel whose first line raises, as the probes record them: the
    invalid-routing cells end in their own valid-routing call (``baseline_ok`` false)."""
    extra = {"raise_source": source} if source else {}
    out = [interpreter_check()]
    for cond in (Condition.REPEAT_CALL, Condition.SINGLE):
        out.append(raised(cond, error_type, message, kind=kind, **extra))
    for cond in (Condition.OVER_ROUTED, Condition.NEGATIVE_SIZES):
        out.append(raised(cond, error_type, message, kind=kind, baseline_ok=False, baseline_raised=True, **extra))
    for variant in ("storage-offset-1", "padded-rows", "transposed-w", "hot-expert"):
        out.append(raised(Condition.OFFSETS, error_type, message, kind=kind, variant=variant, **extra))
    return out


@pytest.mark.parametrize(
    ("error_type", "message", "source", "quoted"),
    [
        ("ValueError", UNPACK, "M, K, _ = x.shape", f"ValueError: {UNPACK} at k.py:14, before any launch"),
        ("AssertionError", "AssertionError()", "assert False", "AssertionError: `assert False` at k.py:14"),
    ],
)
def test_a_kernel_raising_on_every_call_is_unusable_and_no_cell_is_rejected(
    error_type: str, message: str, source: str, quoted: str
) -> None:
    outcomes = every_cell_raising(error_type, message, ErrorKind.BAD_INPUT, source)
    labels = {c.outcome.probe_id: c.label for c in build_matrix(outcomes).cells.values()}
    assert "rejected" not in labels.values(), labels  # it refused the canonical inputs too
    single = next(o for o in outcomes if o.spec.condition is Condition.SINGLE)
    why = unusable(single)
    assert why is not None and quoted in why and "CPU/single" in why
    assert why.startswith("it raises on the canonical inputs (CPU/single: x (64, 32), w (4, 32, 32), m_sizes (4,)")
    # only the baseline cell says so; a variant that raised is not the kernel's whole story
    assert all(unusable(o) is None for o in outcomes if o.spec.condition is not Condition.SINGLE)
    report = report_of(outcomes)
    assert not report.healthy and report.coverage is not None and report.coverage.rejected == ()
    # what the check makes of the same cells when they get that far: failures, never a pass
    cells = cell_results(report, "cpu")
    assert count_verdicts(cells)["fail"] == len(outcomes) - 1
    code, _ = judge_kernel(None, [TierResult(tier="cpu", gpus=(), wall_s=1.0, counts={})], cells, faults=True)
    assert code is ExitCode.FAULT


# --------------------------------------------------------------------------------------------
# Refusals: any exception type, before the first launch, the baseline passing
# --------------------------------------------------------------------------------------------


def test_a_runtime_error_before_any_launch_is_rejected_quoting_it() -> None:
    """``offsets:transposed-w`` through a wrapper that flattens w: torch's view refuses the
    strided w before any launch, while ``single`` passed in the same session."""
    refused = raised(Condition.OFFSETS, "RuntimeError", VIEW, kind=ErrorKind.OTHER, variant="transposed-w",
                     site="flat_w.py:73")
    outcomes = [interpreter_check(), cell(Condition.SINGLE), refused]
    got = build_matrix(outcomes).get("CPU", Condition.OFFSETS, "transposed-w")
    assert got is not None and got.label == "rejected"
    assert describe(got).startswith(
        "the kernel refuses w before launch (RuntimeError: view size is not compatible with input tensor's"
    )
    report = report_of(outcomes)
    assert report.healthy and report.unexplained == () and report.coverage is not None
    assert report.coverage.rejected == ("CPU/offsets:transposed-w",)
    (note,) = [e for e in report.explanations if "refused" in e]
    assert "offsets:transposed-w: w (RuntimeError: view size is not compatible" in note


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"launches": 1}, "raised after a launch"),
        ({"launches": None}, "launches not observed"),
        ({"in_call": False}, "the exception was not the one out of the kernel's call"),
        ({"raised_in": "doctor"}, "the probe's own code raised"),
    ],
)
def test_the_same_runtime_error_is_a_failing_cell_unless_observed_before_any_launch(
    change: dict[str, Any], why: str
) -> None:
    refused = raised(Condition.OFFSETS, "RuntimeError", VIEW, kind=ErrorKind.OTHER, variant="transposed-w", **change)
    outcomes = [cell(Condition.SINGLE), refused]
    got = build_matrix(outcomes).get("CPU", Condition.OFFSETS, "transposed-w")
    assert got is not None and got.label == "other" and got.failed, why
    report = report_of(outcomes)
    assert [e.probe_id for e in report.unexplained] == ["CPU/offsets:transposed-w"]


@pytest.mark.parametrize("baseline", [Status.WRONG, Status.ERROR, None])
def test_no_refusal_without_a_baseline_that_passed(baseline: Status | None) -> None:
    refused = raised(Condition.OFFSETS, "AssertionError", "w must be contiguous", kind=ErrorKind.BAD_INPUT,
                     variant="transposed-w")
    outcomes = [refused] + ([cell(Condition.SINGLE, baseline)] if baseline else [])
    got = build_matrix(outcomes).get("CPU", Condition.OFFSETS, "transposed-w")
    assert got is not None and got.label == "bad-input"


def test_an_invalid_routing_cell_whose_own_valid_call_raised_is_not_a_refusal() -> None:
    """The over-routed probe calls the kernel with valid routing first; when that call raises,
    the cell says nothing about m_sizes (the issue's "the kernel refuses m_sizes (AssertionError:
    Torch not compiled with CUDA enabled)")."""
    own_call = raised(Condition.OVER_ROUTED, "ValueError", "m_sizes must sum to M", kind=ErrorKind.BAD_INPUT,
                      baseline_ok=False, baseline_raised=True)
    outcomes = [cell(Condition.SINGLE), own_call]
    assert build_matrix(outcomes).get("CPU", Condition.OVER_ROUTED).label == "bad-input"  # type: ignore[union-attr]
    variant = dataclasses.replace(own_call, facts={**own_call.facts, "baseline_ok": True})
    assert build_matrix([cell(Condition.SINGLE), variant]).get("CPU", Condition.OVER_ROUTED).label == "rejected"  # type: ignore[union-attr]


# --------------------------------------------------------------------------------------------
# A kernel that needs CUDA: not checked on the CPU tier
# --------------------------------------------------------------------------------------------

#: What torch and Triton raise when a call asks for CUDA in a process that has none (sources
#: cited in core/error_kind.py): (exception type, message, kind before NEEDS_CUDA existed).
NO_CUDA = [
    ("AssertionError", "Torch not compiled with CUDA enabled", ErrorKind.BAD_INPUT),
    (
        "RuntimeError",
        "Found no NVIDIA driver on your system. Please check that you have an NVIDIA GPU and installed a "
        "driver from http://www.nvidia.com/Download/index.aspx",
        ErrorKind.OTHER,
    ),
    ("RuntimeError", "No CUDA GPUs are available", ErrorKind.OTHER),
    ("RuntimeError", "CUDA driver initialization failed, you might not have a CUDA gpu.", ErrorKind.OTHER),
    ("RuntimeError", "0 active drivers ([]). There should only be one.", ErrorKind.OTHER),
    ("AssertionError", "libcuda.so cannot found!\nPlease make sure GPU is set up", ErrorKind.BAD_INPUT),
]


@pytest.mark.parametrize(("error_type", "message", "_before"), NO_CUDA)
def test_needs_cuda_texts_are_their_own_kind(error_type: str, message: str, _before: ErrorKind) -> None:
    assert classify_error(error_type, message) is ErrorKind.NEEDS_CUDA


@pytest.mark.parametrize(
    ("error_type", "message", "kind"),
    [
        ("AssertionError", "x must be contiguous", ErrorKind.BAD_INPUT),
        ("RuntimeError", "CUDA error: out of memory", ErrorKind.OOM),
        ("torch.AcceleratorError", "CUDA error: an illegal memory access was encountered", ErrorKind.ILLEGAL_ADDRESS),
        ("RuntimeError", "expected 2 active drivers", ErrorKind.OTHER),
    ],
)
def test_other_texts_do_not_read_as_needing_cuda(error_type: str, message: str, kind: ErrorKind) -> None:
    assert classify_error(error_type, message) is kind


@pytest.mark.parametrize("recorded_kind", [True, False], ids=["needs-cuda", "recorded-before-the-kind"])
@pytest.mark.parametrize(("error_type", "message", "before"), NO_CUDA)
def test_a_cuda_only_kernel_is_not_checked_on_the_cpu_tier(
    error_type: str, message: str, before: ErrorKind, recorded_kind: bool
) -> None:
    """The issue's CPU scan of a kernel that reads the SM count on every call: every cell ended in
    the needs-CUDA error, two of them were called refusals of m_sizes, the scan said "9
    unexplained failing cell(s)". Not checked (exit 4), no refusal, no fault; a recording from
    before the kind (bad-input / other) reads the same."""
    kind = ErrorKind.NEEDS_CUDA if recorded_kind else before
    outcomes = every_cell_raising(error_type, message, kind)
    outcomes = [dataclasses.replace(o, facts={**o.facts, "raised_in": "torch"}) for o in outcomes]
    labels = {c.label for c in build_matrix(outcomes).cells.values() if c.outcome.spec.condition is not Condition.INTERPRETER_CHECK}
    assert labels == {"skipped"}
    report = report_of(outcomes)
    assert report.unexplained == () and report.diagnoses == ()
    assert report.coverage is not None and report.coverage.rejected == () and report.coverage.cells_ran == 0
    assert nothing_ran(report)
    line = could_not_run(report)
    assert line is not None and line.startswith("the kernel needs CUDA (") and "a GPU runner is needed" in line
    assert message.splitlines()[0] in line
    cells = cell_results(report, "cpu")
    assert {c.verdict for c in cells if not c.name.startswith("interpreter")} == {"skip"}
    code, problem = judge_kernel(None, [TierResult(tier="cpu", gpus=(), wall_s=1.0, counts={})], cells, faults=False)
    assert code is ExitCode.CHECK_BROKEN and "the kernel needs CUDA" in problem and "GPU runner" in problem
    assert all(unusable(o) is None for o in outcomes)  # not a usage error either


def test_explain_says_a_needs_cuda_traceback_asked_for_cuda_not_that_arguments_were_rejected() -> None:
    """Before the kind, "AssertionError: Torch not compiled with CUDA enabled" read as an
    AssertionError of the kernel's argument checks: "the code rejected its arguments"."""
    from qmoe_doctor.diagnose.explain import explain_text

    text = (
        "Traceback (most recent call last):\n"
        '  File "/work/k.py", line 17, in persistent\n'
        '    num_sms = torch.cuda.get_device_properties("cuda").multi_processor_count\n'
        '  File "/venv/lib/python3.12/site-packages/torch/cuda/__init__.py", line 522, in _lazy_init\n'
        '    raise AssertionError("Torch not compiled with CUDA enabled")\n'
        "AssertionError: Torch not compiled with CUDA enabled\n"
    )
    got = explain_text(text)
    assert got.headline.startswith("the code asked for CUDA in a process that has none")


def test_needs_cuda_on_a_gpu_tier_is_a_failing_cell() -> None:
    """On a GPU the child has CUDA: "No CUDA GPUs are available" there is a failure, not a skip."""
    gpu = Placement(group="GPU 0", gpu_b=0)
    got = cell(Condition.OFFSETS, Status.ERROR, variant="hot-expert", kind=ErrorKind.NEEDS_CUDA, placement=gpu,
               error_type="RuntimeError", message="No CUDA GPUs are available", phase=Phase.LAUNCH)
    labelled = build_matrix([cell(Condition.SINGLE, placement=gpu), got]).get("GPU 0", Condition.OFFSETS, "hot-expert")
    assert labelled is not None and labelled.label == "needs-cuda" and labelled.failed
    assert stop_reason(got) is None


# --------------------------------------------------------------------------------------------
# Import deaths and hangs: what ends the session, and how it is said
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "exit_code", "said"),
    [
        (ErrorKind.SIGNAL, -11, "its import ended the probe child: killed by SIGSEGV (signal 11) at import"),
        (ErrorKind.OTHER, 0, "its import ended the probe child: exited with status 0 at import"),
        (ErrorKind.OTHER, 3, "its import ended the probe child: exited with status 3 at import"),
        (ErrorKind.TIMEOUT, None, "its import never finished: the probe child timed out at import after 8 s"),
    ],
)
def test_a_child_that_died_importing_the_kernel_makes_it_unusable(
    kind: ErrorKind, exit_code: int | None, said: str
) -> None:
    died = cell(Condition.REPEAT_CALL, Status.ERROR, kind=kind, error_type="exit", message="worker 2 ...",
                facts={"step": "kernel"}, phase=Phase.IMPORT, exit_code=exit_code, timeout_s=8.0)
    assert import_death(died) is not None and said in (unusable(died) or "")
    ours = dataclasses.replace(died, facts={})  # the probe's own imports (torch, triton): not the kernel's
    assert import_death(ours) is None and unusable(ours) is None


def test_a_timeout_calling_the_kernel_on_the_canonical_inputs_ends_the_session() -> None:
    hung = cell(Condition.REPEAT_CALL, Status.ERROR, kind=ErrorKind.TIMEOUT, error_type="timeout",
                phase=Phase.LAUNCH, timeout_s=8.0)
    why = stop_reason(hung)
    assert why is not None and why.startswith("not run: the kernel hung on the canonical inputs")
    assert "CPU/repeat-call timed out at launch after 8 s" in why
    variant = dataclasses.replace(hung, spec=dataclasses.replace(hung.spec, condition=Condition.OVER_ROUTED))
    assert stop_reason(variant) is None  # a variant that hangs says nothing about the others
    at_setup = dataclasses.replace(hung, phase=Phase.SETUP)
    assert stop_reason(at_setup) is None


def test_a_session_runs_no_spec_after_the_one_that_stops_it(tmp_path: Path) -> None:
    """``run_session(stop_after=...)``: the specs after the stopping outcome are not sent to any
    child; they come back skipped with the reason and the probe that stopped them."""
    specs = [
        ProbeSpec(probe_id=f"p{i}", kernel="builtin", condition=Condition.SELFTEST_OK, shape=CPU_SHAPE)
        for i in range(3)
    ]
    outcomes = run_session(specs, base_env={}, log_dir=tmp_path, stop_after=lambda o: "stop" if o.probe_id == "p0" else None)
    assert [(o.probe_id, o.status) for o in outcomes] == [
        ("p0", Status.PASS), ("p1", Status.SKIPPED), ("p2", Status.SKIPPED)
    ]
    assert outcomes[1].notes == ("stop",) and outcomes[2].facts == {"not_run_after": "p0"}
    assert len(list(tmp_path.glob("worker-*.log"))) == 1


def test_a_sweep_plans_the_baseline_it_is_judged_against() -> None:
    for gpus in ([], [type("Gpu", (), {"index": 0, "uuid": "GPU-0"})()]):
        only = plan_scan("k.py:fn", gpus, ScanOptions(conditions=frozenset({Condition.OFFSETS})))
        conds = [s.condition for s in only.specs if s.condition is not Condition.INTERPRETER_CHECK]
        assert conds[0] is Condition.SINGLE and set(conds[1:]) == {Condition.OFFSETS}
        routing = plan_scan("k.py:fn", gpus, ScanOptions(conditions=frozenset({Condition.OVER_ROUTED})))
        # the invalid-routing cells call the kernel with valid routing themselves
        assert {s.condition for s in routing.specs} - {Condition.INTERPRETER_CHECK} == {Condition.OVER_ROUTED}


# --------------------------------------------------------------------------------------------
# The fixture kernels through the real CLI, CPU tier
# --------------------------------------------------------------------------------------------


def _cli(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", COLUMNS="400")  # the CPU tier; lines not wrapped
    return subprocess.run(
        [sys.executable, "-m", "qmoe_doctor", *args, "--log-dir", str(tmp / "logs")],
        capture_output=True, text=True, timeout=600, env=env, cwd=REPO, check=False,
    )


def _flat(text: str) -> str:
    return " ".join(text.split())


def _kernel(ref: str) -> str:
    return str(KERNELS / ref)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ref", "quoted"),
    [
        ("raises_always.py:unpack_3d", f"ValueError: {UNPACK} at raises_always.py:14, before any launch"),
        ("raises_always.py:assert_false", "AssertionError: `assert False"),
    ],
)
def test_scan_and_check_of_a_kernel_raising_on_every_call_exit_2_quoting_it(tmp_path: Path, ref: str, quoted: str) -> None:
    scan = _cli("scan", "--cpu", "--kernel", _kernel(ref), tmp=tmp_path)
    assert scan.returncode == 2, scan.stdout[-2000:] + scan.stderr[-2000:]
    err = _flat(scan.stderr)
    assert "error: the kernel could not be used: it raises on the canonical inputs (CPU/single" in err
    assert quoted in err and "healthy" not in _flat(scan.stdout)
    junit = tmp_path / "check.xml"
    check = _cli("check", "--cpu", "--kernel", _kernel(ref), "--junit", str(junit), tmp=tmp_path)
    assert check.returncode == 2, check.stdout[-3000:]
    assert quoted in _flat(check.stdout)
    root = ET.parse(junit).getroot()
    assert root.get("errors") == "1" and root.get("failures") == "0"
    (error,) = root.iter("error")
    assert error.get("type") == "usage-error" and quoted in (error.get("message") or "")


@pytest.mark.slow
def test_scan_and_check_of_a_cuda_only_kernel_on_the_cpu_tier_are_not_checked(tmp_path: Path) -> None:
    ref = _kernel("cuda_only.py:persistent")
    save = tmp_path / "scan.json"
    scan = _cli("scan", "--cpu", "--kernel", ref, "--save", str(save), tmp=tmp_path)
    assert scan.returncode == 4, scan.stdout[-3000:] + scan.stderr[-2000:]
    out = _flat(scan.stdout)
    assert "could not run: the kernel needs CUDA (AssertionError: Torch not compiled with CUDA enabled at cuda_only.py:" in out
    assert "a GPU runner is needed" in out and "nothing about the kernel was checked" in out
    report = json.loads(save.read_text())
    assert report["coverage"]["rejected"] == [] and report["coverage"]["cells_ran"] == 0
    assert report["unexplained"] == [] and report["diagnoses"] == []
    ran = [o for o in report["outcomes"] if o["status"] != "skipped" and not o["probe_id"].endswith("interpreter-check")]
    assert [o["probe_id"] for o in ran] == ["CPU/repeat-call", "CPU/single"]  # then the session stopped
    assert {o["error_kind"] for o in ran} == {"needs-cuda"}
    check = _cli("check", "--cpu", "--kernel", ref, "--save", str(tmp_path / "check.json"), tmp=tmp_path)
    assert check.returncode == 4, check.stdout[-3000:]
    (kernel,) = json.loads((tmp_path / "check.json").read_text())["kernels"]
    assert kernel["exit_code"] == 4 and "the kernel needs CUDA" in kernel["problem"]
    assert kernel["summary"]["fail"] == 0 and not any(c["label"] == "rejected" for c in kernel["cells"])


@pytest.mark.slow
def test_a_runtime_error_before_launch_is_rejected_and_after_a_launch_fails(tmp_path: Path) -> None:
    """``flat_w.py``: ``grouped_gemm`` flattens w with ``view`` before its launch (transposed-w
    rejected, quoting torch's RuntimeError, exit 0); ``checks_after_launch`` makes the same
    view after its launch (a failing cell, exit 1)."""
    before = _cli("scan", "--cpu", "--only", "offsets", "--kernel", _kernel("flat_w.py:grouped_gemm"), "--json",
                  tmp=tmp_path)
    assert before.returncode == 0, before.stdout[-3000:] + before.stderr[-2000:]
    report = json.loads(before.stdout)
    cells = {o["probe_id"]: o for o in report["outcomes"]}
    assert cells["CPU/single"]["status"] == "pass"
    refused = cells["CPU/offsets:transposed-w"]
    assert refused["error_type"] == "RuntimeError" and refused["facts"]["kernel_launches"] == 0
    assert refused["facts"]["raised_in_call"] is True
    assert report["coverage"]["rejected"] == ["CPU/offsets:transposed-w"] and report["healthy"] is True
    (note,) = [e for e in report["explanations"] if "refused" in e]
    assert "offsets:transposed-w: w (RuntimeError: view size is not compatible with input tensor's size" in note
    after = _cli("scan", "--cpu", "--only", "offsets", "--kernel", _kernel("flat_w.py:checks_after_launch"), "--json",
                 tmp=tmp_path)
    assert after.returncode == 1, after.stdout[-3000:] + after.stderr[-2000:]
    report = json.loads(after.stdout)
    failing = next(o for o in report["outcomes"] if o["probe_id"] == "CPU/offsets:transposed-w")
    assert failing["facts"]["kernel_launches"] == 1 and failing["error_type"] == "RuntimeError"
    assert [e["probe_id"] for e in report["unexplained"]] == ["CPU/offsets:transposed-w"]
    assert report["coverage"]["rejected"] == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ref", "said"),
    [
        ("import_os_exit.py:kernel", "its import ended the probe child: exited with status 3 at import"),
        ("import_sys_exit.py:kernel", "exited 0 at import: it called sys.exit(0)"),
        ("import_segfault.py:kernel", "its import ended the probe child: killed by SIGSEGV (signal 11) at import"),
        ("import_hang.py:kernel", "its import never finished: the probe child timed out at import after 10 s"),
    ],
)
def test_a_kernel_that_dies_or_hangs_at_import_is_a_usage_error(tmp_path: Path, ref: str, said: str) -> None:
    """One line, exit 2, whatever ended the child: not "1 unexplained failing cell". The
    timeout covers the interpreter check's child start on a loaded runner (the kernel's import
    then runs in that warm child)."""
    out = _cli("scan", "--cpu", "--only", "single", "--timeout", "10", "--kernel", _kernel(ref), tmp=tmp_path)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert said in _flat(out.stderr) and "unexplained" not in out.stdout


@pytest.mark.slow
def test_a_kernel_that_hangs_on_every_call_costs_one_timeout(tmp_path: Path) -> None:
    out = _cli("scan", "--cpu", "--timeout", "10", "--kernel", _kernel("hangs.py:spins"), "--json", tmp=tmp_path)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    report = json.loads(out.stdout)
    timed_out = [o["probe_id"] for o in report["outcomes"] if o["error_kind"] == "timeout"]
    assert timed_out == ["CPU/repeat-call"]
    rest = [o for o in report["outcomes"] if o["probe_id"] not in ("CPU/interpreter-check", "CPU/repeat-call")]
    assert rest and all(o["status"] == "skipped" and o["facts"]["not_run_after"] == "CPU/repeat-call" for o in rest)
    assert all(o["notes"][0].startswith("not run: the kernel hung on the canonical inputs") for o in rest)
    assert any(f"{len(rest)} cell(s) after CPU/repeat-call" in e for e in report["explanations"])
    assert [e["probe_id"] for e in report["unexplained"]] == ["CPU/repeat-call"]


def test_a_hang_on_the_canonical_inputs_runs_no_later_session(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Four GPUs, pair sessions in rounds: the guarded cell of the first round's first pair
    times out in the kernel's call. The sessions of that round ran beside it (no wall time
    lost); no session of a later round is started: their cells come back not run, naming it."""
    from qmoe_doctor.workflows import scan as scan_workflow
    from qmoe_doctor.workflows.scan import run_scan

    gpus = [type("Gpu", (), {"index": i, "uuid": f"GPU-{i}"})() for i in range(4)]
    plan = plan_scan("k.py:fn", gpus, ScanOptions(conditions=frozenset({Condition.GUARDED, Condition.PEER})))
    assert len(plan.rounds) > 1
    first = plan.rounds[0][0].specs[0]
    started: list[str] = []

    def run_session(specs: Any, *, base_env: Any, log_dir: Path, on_event: Any = None, stop_after: Any = None) -> list[Outcome]:
        started.append(specs[0].probe_id)
        out = []
        for spec in specs:
            if spec.probe_id == first.probe_id:
                out.append(Outcome(probe_id=spec.probe_id, spec=spec, status=Status.ERROR, phase=Phase.SYNC,
                                   error_kind=ErrorKind.TIMEOUT, error_type="timeout", error_message="timed out"))
                break  # the real session stops here (stop_after); the fake leaves the rest out
            out.append(Outcome(probe_id=spec.probe_id, spec=spec, status=Status.PASS, phase=Phase.DONE))
        return out

    monkeypatch.setattr(scan_workflow, "run_session", run_session)
    monkeypatch.setattr(scan_workflow, "find_compute_sanitizer", lambda: None)
    report = run_scan(plan, gpus=(0, 1, 2, 3), log_dir=tmp_path)
    assert started == [s.specs[0].probe_id for s in plan.rounds[0]]
    later = [spec.probe_id for r in plan.rounds[1:] for s in r for spec in s.specs]
    skipped = {o.probe_id: o for o in report.outcomes if o.status is Status.SKIPPED}
    assert later and set(later) <= set(skipped)
    assert all(skipped[p].facts["not_run_after"] == first.probe_id for p in later)
    assert skipped[later[0]].notes[0].startswith(f"not run: the kernel hung on the canonical inputs ({first.probe_id}")
    assert [e.probe_id for e in report.unexplained] == [first.probe_id]
