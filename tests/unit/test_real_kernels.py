"""Kernels as users bring them, through the real CLI on the CPU tier: the verdict each must get.

Each case runs ``python3 -m qmoe_doctor scan --cpu --kernel K --json`` (or ``check``) in a
child, as a user would, and reads the versioned JSON report. The kernels: the specimens written
in the style of the public fused-MoE kernels (``kernels/specimens/``: running_row_mask,
contiguous_only, autotuned, cached_sms; the persistent TMA-descriptor twin and the two faults
planted in it), the existing specimens whose CPU verdict must not
change, our builtin, the ``torch:grouped_mm`` control, and two small user kernels
(``tests/fixtures/kernels/``: a plain PyTorch per-expert loop, a wrapper that returns None).
The verdicts are the CPU column of the calibration table (docs/validation/scan-specimens.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
FIXTURE_KERNELS = REPO / "tests" / "fixtures" / "kernels"
TORCH_LOOP = f"{FIXTURE_KERNELS / 'torch_loop.py'}:moe_loop"
RETURNS_NONE = f"{FIXTURE_KERNELS / 'returns_none.py'}:forgot_return"


def _cli(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU tier, whatever this machine has
    return subprocess.run(
        [sys.executable, "-m", "qmoe_doctor", *args, "--log-dir", str(tmp / "logs")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=REPO,
        check=False,
    )


def _scan(kernel: str, tmp: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    out = _cli("scan", "--cpu", "--kernel", kernel, "--json", *extra, tmp=tmp)
    assert out.stdout.lstrip().startswith("{"), f"rc={out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    return out.returncode, json.loads(out.stdout)


def _cells(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {o["probe_id"].split("/", 1)[1]: o for o in report["outcomes"]}


def _causes(report: dict[str, Any]) -> set[str]:
    return {d["cause"] for d in report["diagnoses"]}


# --------------------------------------------------------------------------------------------
# The specimens in the public kernels' style
# --------------------------------------------------------------------------------------------


def test_running_row_mask_writes_past_its_own_y_and_is_a_fault(tmp_path: Path) -> None:
    rc, report = _scan("specimen:running_row_mask", tmp_path)
    assert rc == 1
    assert _causes(report) == {"invalid-routing"} and report["unexplained"] == []
    (diag,) = report["diagnoses"]
    assert diag["severity"] == "fault" and diag["confidence"] == "high"
    over = _cells(report)["over-routed"]
    assert over["status"] == "wrong" and over["canary_hits"] == ["after y"]
    assert over["facts"]["output_guard"] is True and over["facts"]["rows_written_after_y"] == 64
    assert any("over-routed" in e["probe_id"] and "after y" in e["detail"] for e in diag["evidence"])
    # its -1 sentinel shifts rows inside y: reported apart, as hardening
    assert any(e.startswith("hardening (reported, exit 0): invalid-routing") for e in report["explanations"])
    (hardening,) = report["hardening"]
    assert (hardening["cause"], hardening["severity"]) == ("invalid-routing", "hardening")
    assert {e["probe_id"] for e in hardening["evidence"] if e["label"] != "pass"} == {"CPU/negative-sizes"}


def test_contiguous_only_is_healthy_and_its_strided_cells_are_rejected(tmp_path: Path) -> None:
    rc, report = _scan("specimen:contiguous_only", tmp_path)
    assert rc == 0, report["unexplained"]
    assert report["diagnoses"] == [] and report["unexplained"] == [] and report["healthy"] is True
    cells = _cells(report)
    for variant, operand in (("padded-rows", "x"), ("transposed-w", "w")):
        cell = cells[f"offsets:{variant}"]
        assert (cell["status"], cell["error_kind"], cell["error_type"]) == ("error", "bad-input", "AssertionError")
        assert cell["facts"]["raised_in"] == "kernel" and cell["facts"]["kernel_launches"] == 0
        assert cell["facts"]["raise_source"].startswith(f"assert {operand}.is_contiguous()")
    (note,) = [e for e in report["explanations"] if "refused" in e]
    assert "offsets:padded-rows: x (`assert x.is_contiguous()`)" in note
    assert "offsets:transposed-w: w (AssertionError: w must be contiguous (E, N, K))" in note
    # contiguous views with a storage offset are computed like any other input
    assert cells["offsets:storage-offset-8"]["status"] == "pass"


def test_contiguous_only_verdict_line_says_what_it_covers(tmp_path: Path) -> None:
    out = _cli("scan", "--cpu", "--kernel", "specimen:contiguous_only", tmp=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:]
    text = " ".join(out.stdout.split())  # rich wraps the lines
    assert "healthy in what ran: no fault in the 12 cells that ran; 2 rejected by the kernel's contract" in text
    assert "not covered: placement, peer-access and cross-device stream conditions (they need two GPUs" in text
    assert "rejected" in text and "healthy: every cell passed" not in text


def test_autotuned_is_healthy_and_only_repeat_call_benchmarks(tmp_path: Path) -> None:
    rc, report = _scan("specimen:autotuned", tmp_path)
    assert rc == 0 and report["diagnoses"] == [] and report["unexplained"] == []
    cells = _cells(report)
    repeat = cells.pop("repeat-call")
    assert repeat["status"] == "pass" and repeat["facts"]["first_call_autotune_benchmarked"] is True
    tuned = [c for c in cells.values() if "autotuned_launches" in c["facts"]]
    assert tuned and all(c["facts"]["autotune_policy"] == "first" for c in tuned)
    assert not any(c["facts"]["autotune_benchmarked"] for c in tuned)  # the default policy
    assert all(len(c["facts"]["autotune_configs"]) == 1 for c in tuned)


def test_autotune_full_policy_lets_every_new_key_benchmark(tmp_path: Path) -> None:
    """The policy travels in each spec's params: with ``full`` the kernel's autotuner runs as
    written. (The planner sets the param from ``--autotune``; this scan sets no option, so it
    drives one probe directly.)"""
    code = (
        "import json\n"
        "from qmoe_doctor.core.records import Condition, ProbeSpec, Shape, to_json\n"
        "from qmoe_doctor.probes.worker import execute\n"
        "for policy in ('full', 'first'):\n"
        "    spec = ProbeSpec(probe_id='CPU/single', kernel='specimen:autotuned', condition=Condition.SINGLE,\n"
        "                     shape=Shape(m=40 + len(policy), e=4, n=32, k=32, dtype='float32'), params={'autotune': policy})\n"
        "    outcome, _ = execute(spec)\n"
        "    print(json.dumps({'policy': policy, 'status': str(outcome.status), 'bench': outcome.facts.get('autotune_benchmarked')}))\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    runs = {d["policy"]: d for d in map(json.loads, (ln for ln in out.stdout.splitlines() if ln.startswith("{")))}
    assert runs["full"] == {"policy": "full", "status": "pass", "bench": True}
    assert runs["first"] == {"policy": "first", "status": "pass", "bench": False}


def test_cached_sms_passes_every_cpu_cell_and_check_names_its_cause_by_lint(tmp_path: Path) -> None:
    rc, report = _scan("specimen:cached_sms", tmp_path)
    assert rc == 0 and report["diagnoses"] == []  # no cell can see it on the CPU (or identical GPUs)
    out = _cli("check", "--cpu", "--kernel", "specimen:cached_sms", "--save", str(tmp_path / "check.json"), tmp=tmp_path)
    assert out.returncode == 1, out.stdout[-3000:]
    doc = json.loads((tmp_path / "check.json").read_text())
    (kernel,) = doc["kernels"]
    assert kernel["lint"]["files"] and kernel["lint"]["files"][0].endswith("cached_sms.py")
    assert {f["cause"] for f in kernel["lint"]["findings"]} == {"per-device-state-cached"}
    assert "covers: lint and the CPU tier only" in " ".join(out.stdout.split())


# The persistent TMA-descriptor design: the interpreter (triton 3.9) runs device-side descriptors,
# so the CPU tier checks the twin and both planted faults like any kernel.


def test_tma_persistent_twin_is_healthy_on_the_cpu_tier(tmp_path: Path) -> None:
    rc, report = _scan("specimen:tma_persistent", tmp_path)
    assert rc == 0 and report["healthy"] is True
    assert report["diagnoses"] == [] and report["unexplained"] == [] and report["hardening"] == []
    cells = _cells(report)
    ran = {name for name, cell in cells.items() if cell["status"] != "skipped"}
    assert {"single", "over-routed", "negative-sizes", "offsets:storage-offset-1", "offsets:transposed-w"} <= ran
    assert all(cells[name]["status"] == "pass" for name in ran if name != "interpreter-check")
    assert cells["over-routed"]["facts"]["output_guard"] is True  # its y is one the guard served


def test_tma_unmasked_rows_tma_stores_past_y_are_an_invalid_routing_fault(tmp_path: Path) -> None:
    rc, report = _scan("specimen:tma_unmasked_rows", tmp_path, "--no-sweeps")
    assert rc == 1
    assert _causes(report) == {"invalid-routing"} and report["unexplained"] == []
    (diag,) = report["diagnoses"]
    assert diag["severity"] == "fault" and diag["confidence"] == "high"
    over = _cells(report)["over-routed"]
    assert over["status"] == "wrong" and over["canary_hits"] == ["after y"]
    assert over["facts"]["rows_written_after_y"] == 64  # the last expert's descriptor, 64 rows past M


def test_tma_misaligned_fails_the_storage_offset_cell_alone(tmp_path: Path) -> None:
    """On the CPU the interpreter's descriptor check refuses the misaligned x inside the launch
    (the GPU faults with `misaligned address` there), read as misaligned-address: the cell fails,
    the aligned storage-offset-8 cell and single pass, and misaligned-operand explains it."""
    rc, report = _scan("specimen:tma_misaligned", tmp_path, "--only", "single,offsets")
    assert rc == 1 and report["healthy"] is False
    cells = _cells(report)
    failing = {name for name, cell in cells.items() if cell["status"] not in ("pass", "skipped")}
    assert failing == {"offsets:storage-offset-1"}, failing
    cell = cells["offsets:storage-offset-1"]
    assert "base must be 16-byte aligned" in cell["error_message"] and cell["facts"]["kernel_launches"] == 1
    assert cell["error_kind"] == "misaligned-address"
    assert _causes(report) == {"misaligned-operand"} and not report["unexplained"]


# --------------------------------------------------------------------------------------------
# Existing specimens keep their CPU verdicts; our kernel and the control
# --------------------------------------------------------------------------------------------

#: The CPU verdicts from before the public-style specimens (exit code, causes).
EXISTING = [
    ("specimen:unmasked_rows", 1, {"invalid-routing"}),
    ("specimen:autotune_inplace", 1, {"autotune-inplace-rerun"}),
    ("specimen:unguarded", 0, set()),  # placement: needs two GPUs (lint names it)
    ("specimen:default_buffer", 0, set()),
    ("specimen:wrong_stream", 0, set()),  # a side stream: needs a GPU
    ("specimen:int32_offsets", 0, set()),  # a >4 GiB stack: needs a GPU
    ("builtin", 0, set()),
]


@pytest.mark.parametrize(("kernel", "code", "causes"), EXISTING, ids=[k for k, _, _ in EXISTING])
def test_existing_kernels_keep_their_cpu_verdict(kernel: str, code: int, causes: set[str], tmp_path: Path) -> None:
    rc, report = _scan(kernel, tmp_path, "--no-sweeps")
    assert (rc, _causes(report)) == (code, causes), report["unexplained"]
    assert report["unexplained"] == []
    if kernel == "specimen:unmasked_rows":  # now caught by the over-routed cell itself
        (diag,) = report["diagnoses"]
        assert diag["severity"] == "fault"
        assert any(e["probe_id"] == "CPU/over-routed" and "after y" in e["detail"] for e in diag["evidence"])
    if kernel == "builtin":
        over = _cells(report)["over-routed"]
        assert over["status"] == "pass" and over["facts"]["canary_after_output"] is True  # checked, not blind


def test_torch_control_on_the_cpu_is_skipped_with_the_reason(tmp_path: Path) -> None:
    rc, report = _scan("torch:grouped_mm", tmp_path, "--no-sweeps")
    assert rc == 4  # nothing was checked: exit 4, never "2 unexplained failing cells"
    assert report["unexplained"] == [] and report["diagnoses"] == []
    kernel_cells = [o for o in report["outcomes"] if o["spec"]["condition"] != "interpreter-check"]
    assert kernel_cells and all(o["status"] == "skipped" for o in kernel_cells)
    assert all("needs a CUDA GPU" in " ".join(o["notes"]) for o in kernel_cells)


# --------------------------------------------------------------------------------------------
# Kernels users write
# --------------------------------------------------------------------------------------------


def test_plain_pytorch_loop_gets_hardening_not_invalid_routing(tmp_path: Path) -> None:
    rc, report = _scan(TORCH_LOOP, tmp_path, "--no-sweeps")
    assert rc == 0 and report["diagnoses"] == [] and report["unexplained"] == []
    cells = _cells(report)
    sentinel = cells["negative-sizes"]
    assert sentinel["status"] == "wrong" and sentinel["canary_hits"] == []  # wrong rows, in bounds
    assert sentinel["facts"]["canary_after_output"] is True  # the guard rows surrounded y
    assert cells["over-routed"]["status"] == "pass"  # slicing clamps at M
    assert any(e.startswith("hardening (reported, exit 0): invalid-routing") for e in report["explanations"])
    (hardening,) = report["hardening"]
    assert hardening["severity"] == "hardening" and hardening["confidence"] == "high"
    assert report["coverage"]["cells_ran"] == 4 and report["coverage"]["unchecked"] == []


def test_plain_pytorch_loop_passes_check_with_the_hardening_reported(tmp_path: Path) -> None:
    """check follows the same exit policy as scan: a hardening finding is reported, exit 0; its
    cell is no JUnit failure, and its detail says why."""
    junit = tmp_path / "check.xml"
    out = _cli(
        "check", "--cpu", "--kernel", TORCH_LOOP, "--only", "single,negative-sizes",
        "--save", str(tmp_path / "check.json"), "--junit", str(junit), tmp=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:]
    (kernel,) = json.loads((tmp_path / "check.json").read_text())["kernels"]
    assert kernel["diagnoses"] == [] and [h["cause"] for h in kernel["hardening"]] == ["invalid-routing"]
    cell = next(c for c in kernel["cells"] if c["name"] == "negative-sizes")
    assert (cell["label"], cell["verdict"], cell["cause"]) == ("wrong", "pass", None)
    assert cell["detail"].startswith("hardening finding, not a fault (exit 0): rel. error")
    assert 'failures="0"' in junit.read_text()
    assert "note: hardening (reported, exit 0): invalid-routing" in " ".join(out.stdout.split())


def test_a_kernel_returning_none_is_reported_as_such(tmp_path: Path) -> None:
    rc, report = _scan(RETURNS_NONE, tmp_path, "--only", "single,repeat-call")
    assert rc == 1
    details = {e["probe_id"]: e["detail"] for e in report["unexplained"]}
    assert details == {
        "CPU/repeat-call": "the kernel returned None, not the (M, N) output tensor",
        "CPU/single": "the kernel returned None, not the (M, N) output tensor",
    }
    assert all(o["facts"].get("returned") == "NoneType" for o in report["outcomes"][1:])
