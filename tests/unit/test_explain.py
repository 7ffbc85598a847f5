"""explain.py and `qmoe-doctor explain`: what a saved log or traceback shows, which causes fit.

Inputs are the real recordings in tests/fixtures/sanitizer/ and tests/fixtures/tracebacks/
(sources in tests/fixtures/SOURCES.md); files mixing both are made by concatenating them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from qmoe_doctor.cli import app
from qmoe_doctor.explain import NothingToExplain, explain_text, parse_traceback
from qmoe_doctor.records import ErrorKind

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
RECORDED = FIXTURES / "recorded" / "h200x2-run1" / "sanitizer"  # ours: 2x H200, compute-sanitizer 2025.3.1
LOGS = sorted((FIXTURES / "sanitizer").glob("*.log"))
TRACEBACKS = sorted((FIXTURES / "tracebacks").glob("*.txt"))
runner = CliRunner()


def tb(name: str) -> str:
    return (FIXTURES / "tracebacks" / name).read_text(encoding="utf-8")


def log(name: str) -> str:
    return (FIXTURES / "sanitizer" / name).read_text(encoding="utf-8")


def causes(text: str) -> list[str]:
    return [f.cause for f in explain_text(text).fits]


# --- tracebacks ---------------------------------------------------------------------------------


def test_pointer_argument_from_a_liger_launch() -> None:
    e = explain_text(tb("triton_5205_pointer_argument.txt"))
    assert e.input_kind == "traceback" and e.findings
    assert e.error_kind is ErrorKind.POINTER_INACCESSIBLE
    assert e.pointer_argument == 0
    assert e.kernel == "_swiglu_forward_kernel"
    assert [f.cause for f in e.fits][:2] == ["missing-device-guard", "default-device-buffer"]
    # the user's frames, not Triton's
    assert e.user_frames == (
        "/home/coder/Liger-Kernel/src/liger_kernel/ops/swiglu.py:111 in forward",
        "/home/coder/Liger-Kernel/src/liger_kernel/ops/swiglu.py:74 in swiglu_forward",
    )
    assert (
        "qmoe-doctor repro --gpus 0,1 --kernel /home/coder/Liger-Kernel/src/liger_kernel/ops/swiglu.py:swiglu_forward"
        " --condition no-peer"
    ) in e.next_steps


def test_pointer_argument_on_several_ranks() -> None:
    text = tb("torchtitan_1225_pointer_argument_ranks.txt")
    r = parse_traceback(text)
    assert r.streams == ("rank3", "rank1")
    assert r.exception is not None and r.exception.stream == "rank3"
    # rank3's frames end in the exception; rank1's traceback (cut) does not mix into them
    assert all("/triton/" in f.file for f in r.frames)
    assert [f.function for f in r.other_user_frames] == ["<module>", "wrapper"]
    assert "device-never-set" in causes(text)


def test_illegal_address_from_an_inductor_kernel() -> None:
    e = explain_text(tb("pylate_75_triton_illegal_address.txt"))
    assert e.error_kind is ErrorKind.ILLEGAL_ADDRESS
    assert e.kernel == "triton_poi_fused__to_copy_0"
    assert e.user_frames == (
        "/workspace/sigrid/ModernBERT/./examples/train_pylate_contrastive.py:72 in <module>",
    )
    assert [f.cause for f in e.fits] == [
        "invalid-routing",
        "cross-device-stream-race",
        "int32-offset-overflow",
        "missing-device-guard",
    ]
    assert any(step.startswith("qmoe-doctor scan --gpus 0,1") for step in e.next_steps)


@pytest.mark.parametrize(
    ("name", "op"),
    [("triton_7945_int32_overflow_assert.txt", "add"), ("pytorch_139489_int32_overflow_mul.txt", "mul")],
)
def test_int32_overflow_assert(name: str, op: str) -> None:
    e = explain_text(tb(name))
    assert e.error_kind is ErrorKind.DEVICE_ASSERT
    assert e.fits[0].cause == "int32-offset-overflow"
    assert (
        e.traceback is not None
        and e.traceback.asserts[0].message == f"int32 overflow detected for operation {op}"
    )
    assert e.fits[0].settle.endswith("--condition int32-boundary")


def test_int32_assert_block_and_thread() -> None:
    e = explain_text(tb("triton_7945_int32_overflow_assert.txt"))
    assert e.traceback is not None
    a = e.traceback.asserts[0]
    assert (a.file, a.function, a.block, a.thread) == (None, None, "130,0,0", "121,0,0")
    assert e.assert_site is None
    assert any("file:line was not printed" in f for f in e.facts)


def test_out_of_resources_required_and_limit() -> None:
    e = explain_text(tb("monkeyocr_86_out_of_resources.txt"))
    assert e.error_kind is ErrorKind.OUT_OF_RESOURCES
    assert e.resources == (126978, 101376)
    assert [f.cause for f in e.fits] == ["launch-config-fault", "per-device-state-cached"]
    assert any("25,602 over" in f for f in e.facts)


def test_device_mismatch_names_the_gpus() -> None:
    e = explain_text(tb("visual_openllm_20_device_mismatch.txt"))
    assert e.error_kind is ErrorKind.DEVICE_MISMATCH
    assert [f.cause for f in e.fits] == ["default-device-buffer", "missing-device-guard"]
    assert all("--gpus 0,1" in s for s in e.next_steps)


# --- sanitizer logs -----------------------------------------------------------------------------


def test_address_far_before_a_huge_allocation_fits_int32_overflow_first() -> None:
    e = explain_text(log("sglang_2599_fused_moe_memcheck.log"))
    assert e.input_kind == "sanitizer-log" and e.findings
    assert e.error_kind is ErrorKind.ILLEGAL_ADDRESS
    assert e.kernel == "fused_moe_kernel"
    assert [f.cause for f in e.fits] == [
        "int32-offset-overflow",
        "missing-device-guard",
        "default-device-buffer",
    ]
    assert any("1,241,911,296 bytes before the nearest allocation" in f for f in e.facts)
    assert any("no ERROR SUMMARY" in c for c in e.caveats)


def test_address_just_past_an_allocation_fits_routing_or_sizes_race() -> None:
    e = explain_text(log("triton_viz_158_memcheck_access_to.log"))
    assert [f.cause for f in e.fits] == ["invalid-routing", "cross-device-stream-race"]
    assert e.fits[0].settle.endswith("--condition over-routed")
    assert e.fits[1].settle.endswith("--condition sizes-race")
    assert any("161 bytes after" in f for f in e.facts)


def test_racecheck_log_fits_no_cause_and_says_global_races_are_invisible() -> None:
    e = explain_text(log("kokkos_6217_racecheck_summary.log"))
    assert e.findings and e.fits == ()
    assert any("racecheck sees shared-memory hazards only" in c for c in e.caveats)
    assert e.next_steps == ("qmoe-doctor scan --gpus 0,1 --kernel path.py:fn",)


def test_shared_memory_access_is_not_a_cross_gpu_cause() -> None:
    e = explain_text(log("cccl_8288_memcheck_shared_summary.log"))
    assert e.fits == ()
    assert any("__shared__" in c for c in e.caveats)


def test_uninitialized_reads_fit_a_missing_wait() -> None:
    assert causes(log("cudf_8873_initcheck.log")) == ["cross-device-stream-race", "wrong-device-stream"]


def test_api_error_headline() -> None:
    e = explain_text(log("cucollections_539_program_hit.log"))
    assert e.headline == "cudaErrorLaunchFailure returned by cudaStreamSynchronize"
    assert any("starts in the middle of a record" in c for c in e.caveats)


def test_user_host_frames_from_the_sanitizer_backtrace() -> None:
    e = explain_text(log("hecbench_132_memcheck_access_at.log"))
    assert e.user_frames == ("main.cu:688 in main",)


def test_file_with_both_log_and_traceback() -> None:
    text = log("sglang_2599_fused_moe_memcheck.log") + "\n" + tb("pylate_75_triton_illegal_address.txt")
    e = explain_text(text)
    assert e.input_kind == "both"
    assert e.error_kind is ErrorKind.ILLEGAL_ADDRESS
    assert e.sanitizer is not None and len(e.sanitizer.errors) == 1
    assert e.traceback is not None and e.traceback.exception is not None
    # the log's specific evidence comes first, the traceback's general fits after, no repeats
    cs = [f.cause for f in e.fits]
    assert cs[0] == "int32-offset-overflow" and len(cs) == len(set(cs))
    assert "invalid-routing" in cs


def test_clean_summary_is_not_a_finding() -> None:
    e = explain_text((RECORDED / "memcheck-builtin-clean.log").read_text(encoding="utf-8"))
    assert not e.findings and e.fits == ()
    assert e.headline.startswith("compute-sanitizer reported no errors")
    assert any("cannot see races across streams or GPUs" in c for c in e.caveats)


def test_nothing_to_explain() -> None:
    with pytest.raises(NothingToExplain):
        explain_text("")
    with pytest.raises(NothingToExplain):
        explain_text((FIXTURES / "SOURCES.md").read_text(encoding="utf-8").split("| File |")[0])


# --- the command --------------------------------------------------------------------------------


def run(*args: str) -> Any:
    return runner.invoke(app, ["explain", *args])


@pytest.mark.parametrize("path", LOGS + TRACEBACKS, ids=lambda p: p.name)
def test_cli_on_every_fixture(path: Path) -> None:
    result = run(str(path))
    assert result.exit_code == 1, result.output  # every recording shows an error or hazard
    assert path.name in result.stdout
    assert "To settle it" in result.stdout
    result = run(str(path), "--json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["kind"] == "explanation" and doc["schema_version"] == 1
    assert doc["input_kind"] in ("sanitizer-log", "traceback")
    assert doc["findings"] is True
    assert doc["next_steps"]
    for fit in doc["fits"]:
        assert fit["cause"] and fit["why"] and fit["settle"].startswith("qmoe-doctor ")


def test_cli_json_fields() -> None:
    doc = json.loads(run(str(FIXTURES / "tracebacks" / "monkeyocr_86_out_of_resources.txt"), "--json").stdout)
    assert doc["error_kind"] == "out-of-resources"
    assert doc["resources"] == [126978, 101376]
    doc = json.loads(
        run(str(FIXTURES / "sanitizer" / "triton_viz_158_memcheck_access_to.log"), "--json").stdout
    )
    (err,) = doc["sanitizer"]["errors"]
    assert err["nearest"] == {"relation": "after", "distance": 161, "base": 0x74505BCCC800, "size": 1024}
    assert doc["sanitizer"]["groups"][0]["count"] == 1


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("memcheck-builtin-clean.log", "no errors"),
        ("memcheck-unmasked-overrouted-cached.log", "no errors"),
        ("racecheck-builtin-clean.log", "no hazards"),
    ],
)
def test_cli_clean_runs_exit_0(name: str, says: str) -> None:
    result = run(str(RECORDED / name))
    assert result.exit_code == 0, result.output
    assert says in result.stdout


def test_cli_recorded_int32_assert_gzipped() -> None:
    result = run(str(RECORDED / "traceback-int32-debug.stderr.gz"), "--json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["error_kind"] == "device-assert"
    assert doc["assert_site"] == "/work/main/kernels/specimens/int32_offsets.py:102"
    assert doc["fits"][0]["cause"] == "int32-offset-overflow"
    assert doc["next_steps"][0].endswith(
        "--kernel /work/main/kernels/specimens/int32_offsets.py:fn --condition int32-boundary"
    )
    assert any("asynchronous" in c for c in doc["caveats"])


@pytest.mark.parametrize(
    ("name", "arg"), [("traceback-unguarded-nopeer.stderr", 0), ("traceback-default-buffer-peer.stderr", 2)]
)
def test_recorded_pointer_check_failures(name: str, arg: int) -> None:
    e = explain_text((RECORDED / name).read_text(encoding="utf-8"))
    assert e.error_kind is ErrorKind.POINTER_INACCESSIBLE and e.pointer_argument == arg
    assert e.kernel == "_grouped_gemm_kernel"
    assert e.next_steps[0] == (
        "qmoe-doctor repro --gpus 0,1 --kernel /work/main/kernels/grouped_gemm.py:launch_grouped_gemm"
        " --condition no-peer"
    )


def test_recorded_sanitizer_log_user_frames_skip_the_launch_path() -> None:
    e = explain_text((RECORDED / "memcheck-unmasked-far-overrouted.log").read_text(encoding="utf-8"))
    assert e.user_frames[0] == "_common.py:35 in launch_kernel"
    assert "unmasked_rows.py:29 in moe_grouped_gemm" in e.user_frames
    assert not any(f.startswith(("driver.py", "jit.py")) for f in e.user_frames)
    assert [f.cause for f in e.fits] == ["invalid-routing", "cross-device-stream-race"]


def test_cli_both_in_one_file(tmp_path: Path) -> None:
    f = tmp_path / "run.txt"
    f.write_text(log("triton_viz_158_memcheck_access_to.log") + "\n" + tb("triton_5205_pointer_argument.txt"))
    doc = json.loads(run(str(f), "--json").stdout)
    assert doc["input_kind"] == "both" and doc["error_kind"] == "pointer-inaccessible"


def test_cli_reads_stdin() -> None:
    result = runner.invoke(app, ["explain", "-", "--json"], input=tb("visual_openllm_20_device_mismatch.txt"))
    assert result.exit_code == 1
    assert json.loads(result.stdout)["error_kind"] == "device-mismatch"


@pytest.mark.parametrize("kind", ["missing", "empty", "directory", "foreign"])
def test_cli_unreadable_inputs_exit_2(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "x.log"
    if kind == "empty":
        path.write_text("")
    elif kind == "directory":
        path.mkdir()
    elif kind == "foreign":
        path.write_text("[project]\nname = 'something'\n")
    result = run(str(path))
    assert result.exit_code == 2
    assert result.stdout == ""
    assert "error:" in result.stderr


def test_cli_help_documents_exit_status() -> None:
    result = run("--help")
    assert result.exit_code == 0
    assert "Exit status" in result.stdout and "ERROR SUMMARY: 0 errors" in result.stdout


def test_explain_does_not_import_torch() -> None:
    code = "import sys, qmoe_doctor.explain, qmoe_doctor.sanitizer, qmoe_doctor.commands.explain; print('torch' in sys.modules or 'triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
