"""sanitizer.py: finding compute-sanitizer, building its command, parsing its output, and
attributing addresses to tensors.

Every parsed log is a real recording from a public issue (tests/fixtures/sanitizer/, sources in
tests/fixtures/SOURCES.md). Truncated and interleaved variants are made here by cutting and mixing
those files, never by writing new log text. Tensor tables for attribution are our own data.
"""

from __future__ import annotations

import os
import random
import shlex
import stat
from pathlib import Path

import pytest

from qmoe_doctor import knobs
from qmoe_doctor.records import TensorInfo
from qmoe_doctor.sanitizer import (
    NearestAllocation,
    SanitizerInfo,
    SanitizerReport,
    SanitizerTool,
    attribute,
    attribute_address,
    find_compute_sanitizer,
    parse_location,
    parse_sanitizer_log,
    parse_sanitizer_xml,
    sanitizer_command,
    short_function_name,
)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
SANITIZER = FIXTURES / "sanitizer"
TRACEBACKS = FIXTURES / "tracebacks"
ALL_LOGS = sorted(SANITIZER.glob("*.log"))


def load(name: str) -> str:
    return (SANITIZER / name).read_text(encoding="utf-8")


def parse(name: str) -> SanitizerReport:
    return parse_sanitizer_log(load(name))


def test_fixtures_present_and_listed_in_sources() -> None:
    sources = (FIXTURES / "SOURCES.md").read_text(encoding="utf-8")
    assert len(ALL_LOGS) >= 10
    for path in ALL_LOGS + sorted(TRACEBACKS.glob("*.txt")):
        assert path.name in sources, f"{path.name} has no entry in tests/fixtures/SOURCES.md"


# --- one table row per recorded log: what the parser must read from it --------------------------

# file, tool, records, categories, ERROR SUMMARY, truncated, program lines
CASES = [
    ("triton_viz_158_memcheck_access_to.log", "memcheck", 1, {"invalid-access"}, None, True, 0),
    ("sglang_2599_fused_moe_memcheck.log", "memcheck", 1, {"invalid-access"}, None, True, 0),
    ("hecbench_132_memcheck_access_at.log", "memcheck", 1, {"invalid-access"}, None, True, 0),
    ("quicksilver_48_cuda_memcheck_address.log", "memcheck", 1, {"invalid-access"}, None, True, 3),
    ("concrete_core_332_memcheck_repeated.log", "memcheck", 3, {"invalid-access"}, None, True, 2),
    ("pytorch_196209_memcheck_interleaved.log", "memcheck", 1, {"invalid-access"}, None, True, 5),
    ("kokkos_6217_racecheck_summary.log", "racecheck", 1, {"race"}, None, False, 1),
    ("hecbench_264_racecheck_lines.log", "racecheck", 2, {"race"}, None, True, 0),
    ("hecbench_126_racecheck_multi.log", "racecheck", 1, {"race"}, None, True, 1),
    ("cucollections_539_program_hit.log", "memcheck", 1, {"api-error"}, None, True, 0),
    ("cccl_8288_memcheck_shared_summary.log", "memcheck", 1, {"invalid-access"}, 1, False, 0),
    ("cudf_8873_initcheck.log", "initcheck", 3, {"uninitialized"}, None, True, 2),
]


def test_every_fixture_has_a_case() -> None:
    assert {c[0] for c in CASES} == {p.name for p in ALL_LOGS}


@pytest.mark.parametrize(("name", "tool", "n", "cats", "summary", "truncated", "program"), CASES)
def test_fixture_overview(
    name: str, tool: str, n: int, cats: set[str], summary: int | None, truncated: bool, program: int
) -> None:
    r = parse(name)
    assert r.tool == tool
    assert len(r.errors) == n
    assert {e.category for e in r.errors} == cats
    assert r.error_summary == summary
    assert r.truncated is truncated
    assert r.program_lines == program
    assert r.has_findings
    assert not r.clean


def test_access_to_form_with_nearest_allocation_after() -> None:
    (e,) = parse("triton_viz_158_memcheck_access_to.log").errors
    assert (e.space, e.access, e.size) == ("global", "read", 16)
    assert e.kernel == "matmul_kernel"
    assert e.location is not None
    assert (e.location.pc, e.location.file, e.location.line) == (0xEC0, "matmul_triton2.py", 43)
    assert (e.thread, e.block) == ((18, 0, 0), (0, 0, 0))
    assert e.address == 0x74505BCCCCA0 and e.out_of_bounds
    assert e.nearest == NearestAllocation(relation="after", distance=161, base=0x74505BCCC800, size=1024)
    # the last line ("Saved host backtrace up") was cut mid-line: not trusted, record marked cut
    assert e.backtrace_at is None and not e.complete


def test_older_address_form_before_a_large_allocation_with_python_host_frames() -> None:
    r = parse("sglang_2599_fused_moe_memcheck.log")
    (e,) = r.errors
    assert e.kernel == "fused_moe_kernel"
    assert e.location is not None and e.location.pc == 0xDA0 and e.location.line == 175
    assert e.location.file is not None and e.location.file.endswith("fused_moe_triton/fused_moe.py")
    assert e.address == 0x763995F9F000
    assert e.nearest == NearestAllocation(
        relation="before", distance=1_241_911_296, base=0x7639E0000000, size=5_033_164_800
    )
    assert e.backtrace_at == "kernel launch time"
    # "Host Frame: [0x2f26f0]" + "in /usr/lib/.../libcuda.so.1": the module line joins its frame;
    # the cut last frame ("_PyObject_Call_Prepend [0x2301") is dropped
    assert len(e.host_frames) == 7
    assert e.host_frames[0].module == "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
    assert e.host_frames[1].module is not None and e.host_frames[1].module.endswith("__triton_launcher.so")
    assert [h.function for h in e.host_frames[3:]] == [
        "PyObject_Call",
        "_PyEval_EvalFrameDefault",
        "_PyFunction_Vectorcall",
        "_PyObject_FastCallDictTstate",
    ]
    assert r.partial_last_line is not None and r.partial_last_line.endswith("[0x2301")


def test_access_at_form_and_2025_host_frames() -> None:
    (e,) = parse("hecbench_132_memcheck_access_at.log").errors
    assert e.address == 0x7F698BA00144
    assert e.nearest is not None and (e.nearest.relation, e.nearest.distance, e.nearest.size) == (
        "after",
        1,
        324,
    )
    assert e.location is not None and e.location.pc == 0xB0
    assert short_function_name(e.kernel or "") == "compress"
    assert [(h.function, h.module, h.file, h.line) for h in e.host_frames] == [
        ("cudaLaunchKernel", "main", None, None),
        ("main", "main", "main.cu", 688),
    ]


def test_legacy_cuda_memcheck_record_with_device_frame() -> None:
    (e,) = parse("quicksilver_48_cuda_memcheck_address.log").errors
    assert e.size == 8  # "of size 8" without "bytes"
    assert e.address == 0x7F153E0002E8 and e.out_of_bounds and e.nearest is None
    assert e.location is not None and e.location.pc == 0x2E8
    assert short_function_name(e.location.function or "") == "CycleTrackingGuts"
    # the outermost device frame is the __global__ kernel
    assert short_function_name(e.kernel or "") == "CycleTrackingKernel"
    assert e.device_frames[0].pc == 0xA0
    assert (e.host_frames[0].function, e.host_frames[0].module) == ("cuLaunchKernel", "/lib64/libcuda.so.1")
    assert (e.host_frames[1].function, e.host_frames[1].module) == (None, "./qs")
    assert len(e.host_frames) == 8


def test_identical_errors_are_grouped_with_counts_and_distinct_addresses() -> None:
    r = parse("concrete_core_332_memcheck_repeated.log")
    first, cut = r.groups
    assert first.count == 2 and first.distinct_addresses == 1 and first.threads == 2
    assert first.addresses == (0x964000008,)
    assert short_function_name(first.kernel or "") == "device_bootstrap_amortized"
    assert first.location is not None and first.location.pc == 0x3B0
    # the third record is cut before its location line: kept, marked, not merged
    assert cut.count == 1 and cut.kernel is None and not cut.complete


def test_program_output_mixed_into_the_log_and_inside_nearest_allocation() -> None:
    r = parse("pytorch_196209_memcheck_interleaved.log")
    (e,) = r.errors
    assert (e.access, e.size) == ("write", 256)
    assert e.nearest is not None and e.nearest.relation == "inside" and e.nearest.size == 20_971_520
    assert r.program_lines == 5  # "Offset ...:" / "Success!" lines
    assert len(e.host_frames) == 3  # the fourth frame is cut mid-line


def test_racecheck_warning_with_summary_and_program_line() -> None:
    r = parse("kokkos_6217_racecheck_summary.log")
    (e,) = r.errors
    assert e.severity == "warning"
    first, second = e.race_accesses
    assert (first.access, first.location.pc, first.location.line) == ("read", 0x1F20, 249)
    assert first.location.file is not None and first.location.file.endswith("Kokkos_Cuda_Parallel_Range.hpp")
    assert (second.access, second.location.pc, second.location.line, second.hazards) == (
        "write",
        0x14B0,
        349,
        4,
    )
    assert r.racecheck_summary is not None
    assert (r.racecheck_summary.displayed, r.racecheck_summary.errors, r.racecheck_summary.warnings) == (
        1,
        0,
        1,
    )
    assert r.program_lines == 1  # "Test complete"


def test_racecheck_errors_with_source_lines() -> None:
    a, b = parse("hecbench_264_racecheck_lines.log").errors
    assert a.severity == b.severity == "error"
    assert [(x.access, x.location.line, x.hazards) for x in a.race_accesses] == [
        ("read", 205, None),
        ("write", 261, 12),
    ]
    assert [(x.access, x.location.line, x.hazards) for x in b.race_accesses] == [
        ("write", 268, None),
        ("read", 273, 4),
    ]
    assert short_function_name(a.kernel or "") == "SSSP_gpu"


def test_racecheck_several_conflicting_accesses() -> None:
    r = parse("hecbench_126_racecheck_multi.log")
    (e,) = r.errors
    assert len(e.race_accesses) == 5
    assert e.hazards == 288 + 10515 + 288 + 10944
    assert r.partial_last_line == "========= Warning: Race r"


def test_program_hit_api_error_in_a_log_that_starts_mid_record() -> None:
    r = parse("cucollections_539_program_hit.log")
    assert r.starts_mid_record
    (e,) = r.errors
    assert (e.cuda_error, e.cuda_error_code, e.cuda_error_text, e.api_call) == (
        "cudaErrorLaunchFailure",
        719,
        "unspecified launch failure",
        "cudaStreamSynchronize",
    )
    assert e.backtrace_at == "error"
    assert [h.function for h in e.host_frames] == [None, "cudaStreamSynchronize"]


def test_indented_log_with_error_summary_and_shared_space() -> None:
    r = parse("cccl_8288_memcheck_shared_summary.log")
    (e,) = r.errors
    assert (e.space, e.access, e.size, e.address) == ("shared", "read", 16, 0x400)
    assert e.location is not None
    assert (e.location.function, e.location.pc, e.location.file, e.location.line) == (
        "cp_async_bulk_cp_mask",
        None,
        "cp_async_bulk.h",
        236,
    )
    assert r.error_summary == 1 and not r.truncated
    assert e.complete  # closed by the separator line before the summary
    assert "in function decode_page_headers ..." in e.extra


def test_initcheck_uninitialized_reads() -> None:
    r = parse("cudf_8873_initcheck.log")
    a, b, cut = r.errors
    assert (a.category, a.space, a.access, a.size) == ("uninitialized", "global", "read", 1)
    assert a.address == b.address == 0x7FC406200400 and not a.out_of_bounds
    assert (
        a.location is not None and b.location is not None and (a.location.pc, b.location.pc) == (0x150, 0x290)
    )
    assert "count_set_bits_kernel" in short_function_name(a.kernel or "")
    assert len(r.groups) == 3  # different pcs are different errors
    assert not cut.complete


def test_location_forms() -> None:
    assert parse_location("0xda0 in /x/fused_moe.py:175:fused_moe_kernel").function == "fused_moe_kernel"
    loc = parse_location("matmul_kernel+0xec0 in matmul_triton2.py:43")
    assert (loc.function, loc.pc, loc.file, loc.line) == ("matmul_kernel", 0xEC0, "matmul_triton2.py", 43)
    assert short_function_name("void cub::Foo<int, (int)1>::bar<(bool)0>(T1, int)") == "cub::Foo::bar"


# --- truncated variants: real files cut programmatically ------------------------------------------


@pytest.mark.parametrize("path", ALL_LOGS, ids=lambda p: p.name)
def test_any_cut_of_a_real_log_parses(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    full = parse_sanitizer_log(text)
    step = max(1, len(text) // 53)
    for cut in range(0, len(text), step):
        r = parse_sanitizer_log(text[:cut])
        assert len([e for e in r.errors if e.complete]) <= len(full.errors)
        for e in r.errors:
            # a value read from a line cut mid-way would be wrong: every address kept is one of
            # the full log's addresses
            if e.address is not None:
                assert e.address in {x.address for x in full.errors}
        if cut and not text[:cut].endswith("\n"):
            assert r.partial_last_line is not None or r.error_summary is not None
        # and cut at the front: never raises, never invents records
        tail = parse_sanitizer_log(text[cut:])
        assert len(tail.errors) <= len(full.errors) + 1


def test_address_line_cut_mid_number_is_not_read() -> None:
    text = load("sglang_2599_fused_moe_memcheck.log")
    cut = text.index("0x763995f9f000") + len("0x763995")
    (e,) = parse_sanitizer_log(text[:cut]).errors
    assert e.address is None and not e.complete
    assert e.kernel == "fused_moe_kernel"


def test_log_cut_at_a_line_boundary_keeps_the_record_marked_cut() -> None:
    lines = load("triton_viz_158_memcheck_access_to.log").splitlines(keepends=True)
    (e,) = parse_sanitizer_log("".join(lines[:4])).errors
    assert e.address == 0x74505BCCCCA0 and e.nearest is None and not e.complete


def test_log_starting_mid_record_is_flagged() -> None:
    lines = load("concrete_core_332_memcheck_repeated.log").splitlines(keepends=True)
    r = parse_sanitizer_log("".join(lines[3:]))
    assert r.starts_mid_record
    assert [e.thread for e in r.errors if e.complete] == [(252, 0, 0)]


# --- interleaved variants: real files mixed programmatically -------------------------------------


def _records(r: SanitizerReport) -> list[tuple[object, ...]]:
    return [(e.category, e.kernel, e.address, e.size, e.thread, e.nearest) for e in r.errors]


@pytest.mark.parametrize("path", ALL_LOGS, ids=lambda p: p.name)
def test_program_output_interleaved_at_random_lines(path: Path) -> None:
    """Lines of a real traceback dropped between the sanitizer's lines change nothing."""
    text = path.read_text(encoding="utf-8")
    noise = (TRACEBACKS / "pylate_75_triton_illegal_address.txt").read_text(encoding="utf-8").splitlines()
    noise = [ln for ln in noise if "=========" not in ln]
    rng = random.Random(path.name)
    lines = text.splitlines(keepends=True)
    mixed: list[str] = []
    for i, line in enumerate(lines):
        if i % 2 == 0 or rng.random() < 0.3:
            mixed.append(rng.choice(noise) + "\n")
        mixed.append(line)
    r = parse_sanitizer_log("".join(mixed))
    full = parse_sanitizer_log(text)
    assert _records(r) == _records(full)
    assert r.program_lines > full.program_lines


def test_two_processes_interleaved_line_by_line_with_rank_prefixes() -> None:
    a_text = load("triton_viz_158_memcheck_access_to.log") + "\n"
    b_text = load("concrete_core_332_memcheck_repeated.log")
    a = ["[rank0]: " + ln for ln in a_text.splitlines()]
    b = ["[rank1]: " + ln for ln in b_text.splitlines()]
    mixed: list[str] = []
    for i in range(max(len(a), len(b))):
        mixed += a[i : i + 1] + b[i : i + 1]
    r = parse_sanitizer_log("\n".join(mixed))  # no final newline: the last line is partial
    assert set(r.streams) == {"[rank0]:", "[rank1]:"}
    by_stream = {s: [e for e in r.errors if e.stream == s] for s in r.streams}
    assert [e.kernel for e in by_stream["[rank0]:"]] == ["matmul_kernel"]
    assert by_stream["[rank0]:"][0].nearest is not None
    rank1 = [e for e in by_stream["[rank1]:"] if e.complete]
    assert [e.thread for e in rank1] == [(251, 0, 0), (252, 0, 0)]
    assert {e.address for e in rank1} == {0x964000008}


def test_worker_prefixes_with_equals_signs() -> None:
    """vLLM tags worker lines "(VllmWorker rank=2 pid=3748461) " (vllm-project/vllm #13392)."""
    lines = load("kokkos_6217_racecheck_summary.log").splitlines()
    tagged = [f"(VllmWorker rank={i % 2} pid=374846{i % 2}) {ln}" for i, ln in enumerate(lines)]
    tagged = [ln for i, ln in enumerate(tagged) if i % 2 == 0] + [ln for i, ln in enumerate(tagged) if i % 2]
    r = parse_sanitizer_log("\n".join(tagged) + "\n")
    assert len(r.streams) == 2
    assert r.racecheck_summary is not None and r.racecheck_summary.displayed == 1


def test_longer_rules_of_equals_signs_are_not_sanitizer_lines() -> None:
    text = "=" * 30 + " 3 passed " + "=" * 30 + "\n" + load("cccl_8288_memcheck_shared_summary.log")
    r = parse_sanitizer_log(text)
    assert r.program_lines == 1 and r.error_summary == 1


def test_collector_timestamps_do_not_split_one_process() -> None:
    lines = load("cccl_8288_memcheck_shared_summary.log").splitlines()
    stamped = [f"2026-01-17T18:48:10.{i:09d}+01:00 stderr F {ln}" for i, ln in enumerate(lines)]
    r = parse_sanitizer_log("\n".join(stamped) + "\n")
    assert r.streams == ("",)
    assert r.error_summary == 1 and len(r.errors) == 1 and r.errors[0].address == 0x400


def test_xml_reader_reads_record_lines_inside_elements() -> None:
    """No recorded XML report yet: wrap a real text log's record lines in elements."""
    from xml.sax.saxutils import escape

    body = "".join(
        f"<line>{escape(ln.split('=========', 1)[1])}</line>"
        for ln in load("cccl_8288_memcheck_shared_summary.log").splitlines()
        if "=========" in ln
    )
    r = parse_sanitizer_xml(f"<ComputeSanitizerOutput>{body}</ComputeSanitizerOutput>")
    assert r.error_summary == 1
    (e,) = r.errors
    assert (e.space, e.size, e.address) == ("shared", 16, 0x400)
    cut = parse_sanitizer_xml(f"<ComputeSanitizerOutput>{body}"[: len(body) // 2])
    assert cut.truncated


def test_empty_and_foreign_text() -> None:
    r = parse_sanitizer_log("")
    assert not r.recognized and not r.errors
    r = parse_sanitizer_log((TRACEBACKS / "triton_5205_pointer_argument.txt").read_text(encoding="utf-8"))
    assert not r.recognized and r.program_lines > 0


# --- command construction -----------------------------------------------------------------------

INFO = SanitizerInfo(path="/opt/cs/compute-sanitizer", version="2025.3.1.0", found_via="PATH")


def test_command_with_every_option() -> None:
    cmd = sanitizer_command(
        INFO,
        SanitizerTool.MEMCHECK,
        ["python", "-m", "qmoe_doctor.probes.worker"],
        kernel_regex="grouped_gemm.*",
        launch_count=1,
        launch_skip=2,
        xml_path=Path("/tmp/r.xml"),
        log_path="/tmp/r.log",
        print_limit=100,
        error_exitcode=9,
        target_processes_all=True,
    )
    assert cmd == [
        "/opt/cs/compute-sanitizer",
        "--tool",
        "memcheck",
        "--kernel-name",
        "regex=grouped_gemm.*",
        "--launch-count",
        "1",
        "--launch-skip",
        "2",
        "--print-limit",
        "100",
        "--error-exitcode",
        "9",
        "--target-processes",
        "all",
        "--xml",
        "yes",
        "--save",
        "/tmp/r.xml",
        "--log-file",
        "/tmp/r.log",
        "python",
        "-m",
        "qmoe_doctor.probes.worker",
    ]
    assert "--kernel-regex" not in cmd


def test_command_minimal_and_tool_names() -> None:
    assert sanitizer_command(INFO, "racecheck", ["./a"]) == [INFO.path, "--tool", "racecheck", "./a"]
    for tool in ("memcheck", "racecheck", "synccheck", "initcheck"):
        assert sanitizer_command(INFO, tool, ["x"])[2] == tool


@pytest.mark.parametrize(
    "kwargs",
    [
        {"kernel_regex": "a,b"},
        {"kernel_regex": ""},
        {"launch_count": 0},
        {"launch_skip": -1},
        {"print_limit": -1},
    ],
)
def test_command_rejects_bad_values(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        sanitizer_command(INFO, "memcheck", ["x"], **kwargs)  # type: ignore[arg-type]


def test_command_rejects_unknown_tool_and_empty_argv() -> None:
    with pytest.raises(ValueError):
        sanitizer_command(INFO, "leakcheck", ["x"])
    with pytest.raises(ValueError):
        sanitizer_command(INFO, "memcheck", [])


# --- finding the binary -------------------------------------------------------------------------


def _fake_sanitizer(directory: Path, version_line: str | None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    exe = directory / "compute-sanitizer"
    banner = "NVIDIA (R) Compute Sanitizer\nCopyright (c) 2020-2025 NVIDIA Corporation\n"
    if version_line:
        banner += version_line + "\n"
    lines = ["#!/bin/sh", 'if [ "$1" = "--version" ]; then']
    lines += [f"  echo {shlex.quote(line)}" for line in banner.splitlines()]
    lines += ["fi", ""]
    exe.write_text("\n".join(lines))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return exe


def test_finds_binary_on_path_and_reads_version(tmp_path: Path) -> None:
    exe = _fake_sanitizer(tmp_path / "bin", "Version 2025.3.1.0 (build 36400806) (public-release)")
    info = find_compute_sanitizer(env={"PATH": str(tmp_path / "bin")}, search_dirs=[])
    assert info is not None
    assert (info.path, info.version, info.found_via) == (str(exe), "2025.3.1.0", "PATH")
    assert info.version_tuple == (2025, 3, 1, 0)


def test_env_knob_wins_and_a_wrong_one_is_not_papered_over(tmp_path: Path) -> None:
    on_path = _fake_sanitizer(tmp_path / "bin", "Version 2024.3.0.0")
    explicit = _fake_sanitizer(tmp_path / "other", "Version 2025.1.0.0")
    env = {"PATH": str(on_path.parent), knobs.QMOE_SANITIZER: str(explicit)}
    info = find_compute_sanitizer(env=env, search_dirs=[])
    assert info is not None and info.path == str(explicit) and info.version == "2025.1.0.0"
    assert info.found_via == knobs.QMOE_SANITIZER
    env[knobs.QMOE_SANITIZER] = str(tmp_path / "missing" / "compute-sanitizer")
    assert find_compute_sanitizer(env=env, search_dirs=[]) is None


def test_falls_back_to_cuda_home_then_search_dirs(tmp_path: Path) -> None:
    home = tmp_path / "cuda-12.8"
    exe = _fake_sanitizer(home / "bin", "Version 2025.1.0.0")
    info = find_compute_sanitizer(env={"PATH": "", "CUDA_HOME": str(home)}, query_version=False)
    assert (
        info is not None and info.path == str(exe) and info.found_via == "CUDA_HOME" and info.version is None
    )
    other = _fake_sanitizer(tmp_path / "opt" / "bin", None)
    info = find_compute_sanitizer(env={"PATH": ""}, search_dirs=[(str(other.parent), "opt")])
    assert info is not None and info.path == str(other) and info.version is None


def test_not_found(tmp_path: Path) -> None:
    assert find_compute_sanitizer(env={"PATH": str(tmp_path)}, search_dirs=[]) is None
    plain = tmp_path / "compute-sanitizer"
    plain.write_text("not executable")
    os.chmod(plain, 0o644)
    assert find_compute_sanitizer(env={"PATH": str(tmp_path)}, search_dirs=[]) is None


# --- attribution --------------------------------------------------------------------------------

MB = 2**20


def tensor(name: str, device: str, ptr: int, shape: tuple[int, ...], dtype: str = "bfloat16") -> TensorInfo:
    size = {"bfloat16": 2, "float32": 4, "int32": 4}[dtype]
    strides: list[int] = []
    acc = 1
    for d in reversed(shape):
        strides.insert(0, acc)
        acc *= d
    return TensorInfo(
        name=name,
        device=device,
        data_ptr=ptr,
        nbytes=acc * size,
        shape=shape,
        strides=tuple(strides),
        dtype=dtype,
    )


X0 = tensor("x", "cuda:0", 0x7F00_0000_0000, (4096, 2048))
W0 = tensor("w", "cuda:0", 0x7F00_4000_0000, (128, 1536, 2048))
SIZES0 = tensor("m_sizes", "cuda:0", 0x7F00_3000_0000, (128,), "int32")
X1 = tensor("x", "cuda:1", 0x7E00_0000_0000, (4096, 2048))


def test_one_byte_past_x_is_row_m() -> None:
    a = attribute_address(X0.data_ptr + X0.nbytes, {"cuda:0": [X0, W0, SIZES0]}, access="read of 16 bytes")
    best = a.matches[0]
    assert (best.tensor, best.relation, best.distance, best.row) == ("x", "after", 1, 4096)
    assert a.sentences[0].startswith("read 1 byte past the end of x (4096 x 2048 bf16) on cuda:0: row 4096")
    assert "m_sizes summing past M" in a.sentences[0]
    assert not a.cross_device


def test_address_inside_the_weight_stack_names_expert_and_row() -> None:
    itemsize, n, k = 2, 1536, 2048
    addr = W0.data_ptr + (17 * n * k + 3 * k + 5) * itemsize
    a = attribute_address(addr, {"cuda:0": [X0, W0]})
    m = a.matches[0]
    assert (m.tensor, m.relation, m.expert, m.row) == ("w", "inside", 17, 3)
    assert "expert 17, row 3" in a.sentences[0]


def test_past_the_weight_stack_is_an_expert_id_out_of_range() -> None:
    a = attribute_address(W0.data_ptr + W0.nbytes + 64, {"cuda:0": [W0]}, access="read of 16 bytes")
    m = a.matches[0]
    assert (m.relation, m.distance, m.expert) == ("after", 65, 128)
    assert "expert 128 of 128" in a.sentences[0] and "expert id >= 128" in a.sentences[0]


def test_before_the_start_gives_a_negative_row() -> None:
    a = attribute_address(X0.data_ptr - 3, {"cuda:0": [X0]})
    m = a.matches[0]
    assert (m.relation, m.distance, m.row) == ("before", 3, -1)


def test_cross_device_address_is_flagged() -> None:
    """The address is x on cuda:1; compute-sanitizer measured it against cuda:0's allocation."""
    addr = X1.data_ptr + 4096
    nearest = NearestAllocation(relation="before", distance=123, base=X0.data_ptr, size=X0.nbytes)
    a = attribute_address(addr, {"cuda:0": [X0, W0], "cuda:1": [X1]}, nearest=nearest)
    assert a.inside_devices == ("cuda:1",)
    assert a.sanitizer_device == "cuda:0"
    assert a.cross_device
    assert a.matches[0].device == "cuda:1" and a.matches[0].relation == "inside"
    assert {m.device for m in a.matches} == {"cuda:0", "cuda:1"}  # the nearest on every device
    assert any("inside a live tensor on another GPU (cuda:1)" in s for s in a.sentences)
    assert any("ran on cuda:0" in s for s in a.sentences)


def test_cross_device_without_the_sanitizer_allocation() -> None:
    a = attribute_address(X1.data_ptr, {"cuda:0": [X0], "cuda:1": [X1]})
    assert a.cross_device and a.sanitizer_device is None


def test_no_tensors_known() -> None:
    a = attribute_address(0x1234, {})
    assert not a.matches and "no tensor is known" in a.sentences[0]


def test_attribute_a_real_report_matches_the_sanitizer_distance() -> None:
    """Our byte distance uses compute-sanitizer's convention: an access at base+size is 1 after."""
    r = parse("triton_viz_158_memcheck_access_to.log")
    b = TensorInfo(
        name="b",
        device="cuda:0",
        data_ptr=0x74505BCCC800,
        nbytes=1024,
        shape=(16, 16),
        strides=(16, 1),
        dtype="float32",
    )
    (a,) = attribute(r, {"cuda:0": [b]})
    (e,) = r.errors
    assert e.nearest is not None
    assert a.matches[0].distance == e.nearest.distance == 161
    assert a.kernel == "matmul_kernel" and a.access == "read of 16 bytes"
    assert a.sentences[0].startswith("read 161 bytes past the end of b (16 x 16 fp32) on cuda:0: row 18")


def test_attribute_a_real_report_before_a_weight_stack() -> None:
    r = parse("sglang_2599_fused_moe_memcheck.log")
    e = r.errors[0]
    assert e.nearest is not None
    # a bf16 expert stack that fills the allocation compute-sanitizer measured against
    w = TensorInfo(
        name="w",
        device="cuda:0",
        data_ptr=e.nearest.base,
        nbytes=e.nearest.size,
        shape=(160, 5120, 3072),
        strides=(5120 * 3072, 3072, 1),
        dtype="bfloat16",
    )
    assert w.nbytes == 160 * 5120 * 3072 * 2
    (a,) = attribute(r, {"cuda:0": [w]})
    m = a.matches[0]
    assert (m.relation, m.distance) == ("before", 1_241_911_296)
    assert m.expert is not None and m.expert < 0
    assert "int32 product that wrapped negative" in a.sentences[0]


# --- our own recordings (compute-sanitizer 2025.3.1 on 2x H200, tests/fixtures/recorded/) -------

RECORDED = FIXTURES / "recorded" / "h200x2-run1" / "sanitizer"


def recorded(name: str) -> SanitizerReport:
    return parse_sanitizer_log((RECORDED / name).read_text(encoding="utf-8"))


def test_recorded_over_routed_run_with_print_limit_and_python_frames() -> None:
    r = recorded("memcheck-unmasked-far-overrouted.log")
    assert r.error_summary == 2667 and r.errors_not_printed == 2617  # 50 printed
    assert len(r.errors) == 50 and all(e.complete for e in r.errors) and not r.truncated
    (g,) = r.groups
    assert g.count == 50 and g.distinct_addresses == 50 and g.kernel == "_grouped_gemm_kernel_unmasked"
    assert g.location is not None and (g.location.file, g.location.line) == ("unmasked_rows.py", 111)
    e = r.errors[0]
    assert (e.access, e.size) == ("write", 16)
    assert e.nearest == NearestAllocation(relation="after", distance=129_937, base=0x7F8B00A55400, size=112)
    frames = [(h.function, h.file, h.line) for h in e.host_frames if h.file]
    assert frames[:3] == [("__call__", "driver.py", 713), ("run", "jit.py", 744), ("<lambda>", "jit.py", 370)]
    assert ("moe_grouped_gemm", "unmasked_rows.py", 29) in frames
    assert e.host_frames[0].function == "launch"
    assert e.host_frames[0].module == "__triton_launcher.cpython-312-x86_64-linux-gnu.so"


def test_recorded_one_byte_past_an_allocation_without_caching() -> None:
    r = recorded("memcheck-unmasked-overrouted-nocache.log")
    assert r.error_summary == 450 and r.errors_not_printed == 400
    assert r.errors[0].nearest is not None
    assert (r.errors[0].nearest.relation, r.errors[0].nearest.distance) == ("after", 1)


@pytest.mark.parametrize(
    ("name", "tool"),
    [
        ("memcheck-builtin-clean.log", None),
        ("memcheck-unmasked-overrouted-cached.log", None),  # the caching allocator hid the writes
        ("racecheck-builtin-clean.log", "racecheck"),
    ],
)
def test_recorded_clean_runs(name: str, tool: str | None) -> None:
    r = recorded(name)
    assert r.clean and not r.has_findings and r.tool == tool
