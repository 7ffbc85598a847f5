"""`check` and `scan` lint what the kernel reference reaches, not only the file it names.

From the reference's function the lint follows the names it uses through the imports (parsed,
never imported) to the modules whose @triton.jit functions it launches and those between, lints
them as one project and lists every file. The issue's case: a three-line wrapper around a
third-party persistent grouped GEMM with device-side TMA descriptors
(tests/fixtures/lint/tma_wrapped/, hand-written): the wrapper alone lints clean when the module
lives elsewhere; reached through it, the module's faults are found.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from test_sarif import validate
from typer.testing import CliRunner

from qmoe_doctor.cli.app import app
from qmoe_doctor.core.kernel_ref import KernelRef
from qmoe_doctor.lint import LintReport, Rule, lint_paths, lint_reached
from qmoe_doctor.plan.check import lint_entry
from qmoe_doctor.reports.sarif import lint_sarif
from qmoe_doctor.workflows.check import kernel_lint, lint_result

REPO = Path(__file__).resolve().parents[2]
TMA = REPO / "tests" / "fixtures" / "lint" / "tma_wrapped"
WRAP, MODULE = TMA / "wrap.py", TMA / "persistent_tma_gemm.py"
FAULT_MARK = re.compile(r"#\s*FAULT:\s*([a-z0-9, -]+)")
runner = CliRunner()


@pytest.fixture(autouse=True)
def _cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def _marks(*paths: Path) -> set[tuple[str, int, str]]:
    out = set()
    for path in paths:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            hit = FAULT_MARK.search(line)
            if hit and not line.lstrip().startswith(("#", '"')):
                out |= {(path.name, i, r.strip()) for r in hit.group(1).split(",") if r.strip()}
    return out


def _found(report: LintReport) -> set[tuple[str, int, str]]:
    return {(Path(f.path).name, f.line, f.rule.value) for f in report.findings}


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))


# --- the reach ---------------------------------------------------------------------------------


def test_the_wrapper_reaches_the_module_and_its_faults() -> None:
    report = lint_reached(WRAP, "grouped_gemm")
    assert [Path(p).name for p in report.files] == ["wrap.py", "persistent_tma_gemm.py"]
    assert report.errors == () and report.notes == ()
    assert report.reached_from == f"{WRAP}:grouped_gemm"
    # the unguarded launch (at the wrapper's call: nothing above it holds a guard), the SM count
    # of the current device sizing the persistent grid, the scratch allocator's "cuda"
    assert _found(report) == _marks(WRAP, MODULE)
    assert {r for _, _, r in _marks(WRAP, MODULE)} == {
        "unguarded-launch",
        "current-device-property",
        "default-device-alloc",
    }


def test_a_wrapper_around_a_module_installed_elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's case: the module is found through the import path (as a site-packages one
    is), not beside the wrapper. Linting the wrapper's file, as check did, finds nothing."""
    lib, user = tmp_path / "lib" / "thirdparty_gemm", tmp_path / "user"
    lib.mkdir(parents=True)
    user.mkdir()
    (lib / "__init__.py").write_text("from .ops import grouped_gemm_persistent\n")
    shutil.copy(MODULE, lib / "ops.py")
    (user / "wrap.py").write_text(
        "from thirdparty_gemm import grouped_gemm_persistent\n\n\n"
        "def grouped_gemm(x, w, m_sizes):\n"
        "    E, N, K = w.shape\n"
        "    return grouped_gemm_persistent(x, w.reshape(E * N, K), m_sizes)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "lib"))
    alone = lint_paths([user / "wrap.py"])
    assert alone.clean and len(alone.files) == 1
    reached = lint_reached(user / "wrap.py", "grouped_gemm", search=())
    names = [Path(p).as_posix().rsplit("/", 2)[-2:] for p in reached.files]
    assert names == [["user", "wrap.py"], ["thirdparty_gemm", "__init__.py"], ["thirdparty_gemm", "ops.py"]]
    assert {f.rule for f in reached.findings} == {
        Rule.UNGUARDED_LAUNCH,
        Rule.CURRENT_DEVICE_PROPERTY,
        Rule.DEFAULT_DEVICE_ALLOC,
    }
    assert "thirdparty_gemm" not in sys.modules  # found by the finders, never imported


def test_findings_outside_what_the_function_reaches_are_left_out_and_counted(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "kern.py": """
            import torch
            import triton
            import triton.language as tl

            @triton.jit
            def copy_kernel(x_ptr, n, BLOCK: tl.constexpr):
                offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
                tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)

            def guarded(x):
                with torch.cuda.device(x.device):
                    copy_kernel[(1,)](x, x.numel(), BLOCK=8)

            def other(x):
                copy_kernel[(1,)](x, x.numel(), BLOCK=8)
            """,
            "wrap.py": """
            from kern import guarded

            def fn(x, w, m_sizes):
                return guarded(x)
            """,
        },
    )
    report = lint_reached(tmp_path / "wrap.py", "fn")
    assert report.findings == ()
    (note,) = report.notes
    assert "1 finding(s)" in note and "`other`" in note and "qmoe-doctor lint" in note
    assert [f.rule for f in lint_paths([tmp_path / "kern.py"]).findings] == [Rule.UNGUARDED_LAUNCH]


def test_what_is_not_followed_is_said(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "wrap.py": """
            import missing_library
            from star_pkg import helper
            from a import step_a
            from broken import oops

            def fn(x, w, m_sizes):
                missing_library.run(x)
                helper(x)
                oops(x)
                return step_a(x)
            """,
            "star_pkg/__init__.py": "from .impl import *\n",
            "star_pkg/impl.py": "def helper(x):\n    return x\n",
            "a.py": "from b import step_b\n\ndef step_a(x):\n    return step_b(x)\n",
            "b.py": "from c import step_c\n\ndef step_b(x):\n    return step_c(x)\n",
            "c.py": "def step_c(x):\n    return x\n",
            "broken.py": "def oops(:\n",
        },
    )
    report = lint_reached(tmp_path / "wrap.py", "fn", max_depth=2)
    notes = "\n".join(report.notes)
    assert "`missing_library.run`" in notes and "not found as Python source without importing it" in notes
    assert "does not define `helper` at its top (a star import" in notes
    assert "broken.py (`broken.oops`): syntax error" in notes  # a reached file: a note, never exit 2
    assert "not followed past 2 references from the kernel: 1 name(s), e.g. `c.step_c`" in notes
    assert report.errors == ()
    names = {Path(p).name for p in report.files}
    assert {"wrap.py", "a.py", "b.py"} <= names and "c.py" not in names and "broken.py" not in names
    # SARIF: the notes are notifications of level "note", which leave the run successful
    log = validate(lint_sarif(lint_result(report), exit_code=0))["runs"][0]
    (invocation,) = log["invocations"]
    levels = {n["level"] for n in invocation["toolExecutionNotifications"]}
    assert levels == {"note"} and invocation["executionSuccessful"] is True
    assert len(log["artifacts"]) == len(report.files)
    capped = lint_reached(tmp_path / "wrap.py", "fn", max_files=2)
    assert len(capped.files) == 2
    assert any("past the 2 files the lint reads for a kernel" in n for n in capped.notes)


def test_the_entry_file_that_cannot_be_read_is_an_error_and_a_missing_function_lints_it_whole(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def fn(:\n")
    report = lint_reached(bad, "fn")
    assert [e.kind for e in report.errors] == ["syntax"] and report.files == ()
    _write(tmp_path, {"ok.py": "import torch\n\ndef other(x: torch.Tensor):\n    return torch.empty(1, device='cuda')\n"})
    whole = lint_reached(tmp_path / "ok.py", "nowhere")
    assert any("`nowhere` is not defined at the top of" in n for n in whole.notes)
    assert [f.rule for f in whole.findings] == [Rule.DEFAULT_DEVICE_ALLOC]


def test_reached_sources_are_never_executed(tmp_path: Path) -> None:
    sentinel = tmp_path / "executed"
    _write(
        tmp_path,
        {
            "wrap.py": "from boom import f\n\ndef fn(x, w, m_sizes):\n    return f(x)\n",
            "boom.py": f"open({str(sentinel)!r}, 'w').write('x')\nraise SystemExit(3)\n\ndef f(x):\n    return x\n",
        },
    )
    report = lint_reached(tmp_path / "wrap.py", "fn")
    assert [Path(p).name for p in report.files] == ["wrap.py", "boom.py"]
    assert not sentinel.exists() and "boom" not in sys.modules


# Each specimen, reached from its reference, still names exactly its own rule: the files of our
# kernels it reaches (grouped_gemm.py, _details/, launch.py, ...) add no finding.
SPECIMEN_RULES = [
    ("builtin", []),
    ("specimen:unguarded", [Rule.UNGUARDED_LAUNCH]),
    ("specimen:int32_offsets", [Rule.INT32_OFFSET]),
    ("specimen:default_buffer", [Rule.DEFAULT_DEVICE_ALLOC]),
    ("specimen:wrong_stream", [Rule.STREAM_WITHOUT_DEVICE]),
    ("specimen:autotune_inplace", [Rule.AUTOTUNE_INPLACE]),
    ("specimen:cached_sms", [Rule.CACHED_DEVICE_PROPERTY]),
    ("specimen:autotuned", []),
    ("specimen:contiguous_only", []),
    ("specimen:unmasked_rows", []),
    ("specimen:running_row_mask", []),
    ("specimen:global_expert_ids", []),
]


@pytest.mark.parametrize(("ref", "rules"), SPECIMEN_RULES, ids=[r for r, _ in SPECIMEN_RULES])
def test_our_kernels_reached_from_each_reference_name_exactly_its_rule(ref: str, rules: list[Rule]) -> None:
    entry = lint_entry(ref)
    assert entry is not None and entry.search == ()
    report = lint_reached(entry.source, entry.function, search=entry.search)
    assert report.errors == ()
    assert [f.rule for f in report.findings] == rules, [f.as_line() for f in report.findings]
    assert len(report.files) > 1 and Path(report.files[0]) == KernelRef.parse(ref).source_path()


def test_lint_entry_of_each_reference_form(tmp_path: Path) -> None:
    src = tmp_path / "k.py"
    src.write_text("def fn(x, w, m_sizes):\n    return x\n")
    file_entry = lint_entry(f"{src}:fn")
    assert file_entry is not None and file_entry.function == "fn"
    assert file_entry.search == (str(tmp_path.resolve()),)  # the probe child's sys.path[0]
    adapted = lint_entry(f"adapter:some.module.ADAPTER:{src}:fn")
    assert adapted is not None and (adapted.source, adapted.function) == (str(src), "fn")
    builtin = lint_entry("builtin")
    assert builtin is not None and builtin.function == "moe_grouped_gemm" and builtin.search == ()
    assert lint_entry("torch:grouped_mm") is None and lint_entry("not a ref") is None


# --- check and scan ----------------------------------------------------------------------------


def test_check_lints_the_wrapper_and_the_module_it_reaches(tmp_path: Path) -> None:
    save, junit, sarif = tmp_path / "r.json", tmp_path / "r.xml", tmp_path / "r.sarif"
    ref = f"{WRAP}:grouped_gemm"
    result = runner.invoke(
        app,
        ["check", "--cpu", "-k", ref, "--only", "single", "--save", str(save), "--junit", str(junit),
         "--sarif", str(sarif), "--log-dir", str(tmp_path / "logs")],
    )
    assert result.exit_code == 1, result.output  # lint findings are a fault
    (kernel,) = json.loads(save.read_text())["kernels"]
    lint = kernel["lint"]
    assert [Path(p).name for p in lint["files"]] == ["wrap.py", "persistent_tma_gemm.py"]
    assert lint["reached_from"] == ref
    assert {(Path(f["path"]).name, f["line"], f["rule"]) for f in lint["findings"]} == _marks(WRAP, MODULE)
    # the terminal names the reach and every file
    assert f"lint: 2 file(s) reached from {ref}, 3 finding(s)" in result.stdout
    assert f"linted: {WRAP}" in result.stdout and "linted: " + lint["files"][1] in result.stdout
    # JUnit: a failing case per finding, where the reach started
    root = ET.fromstring(junit.read_text())
    lint_cases = [c for c in root.iter("testcase") if c.get("classname") == f"{ref}.lint"]
    assert sum(1 for c in lint_cases if c.find("failure") is not None) == 3
    props = {p.get("name"): p.get("value") for p in root.iter("property")}
    assert props["lint_reached_from"] == ref
    # SARIF, valid against the published schema: both files are artifacts, the rules results
    log = validate(json.loads(sarif.read_text()))["runs"][0]
    assert sorted(Path(a["location"]["uri"]).name for a in log["artifacts"]) == ["persistent_tma_gemm.py", "wrap.py"]
    assert {r["ruleId"] for r in log["results"]} >= {
        "unguarded-launch",
        "current-device-property",
        "default-device-alloc",
    }


def test_scan_shows_the_lint_as_notes_and_keeps_its_exit_code(tmp_path: Path) -> None:
    """The unguarded specimen computes right on the CPU tier (one device): the scan is healthy,
    exit 0, and still shows what the lint found in what the kernel reaches."""
    save = tmp_path / "r.json"
    result = runner.invoke(
        app,
        ["scan", "--cpu", "-k", "specimen:unguarded", "--only", "single", "--save", str(save),
         "--log-dir", str(tmp_path / "logs")],
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(save.read_text())
    assert doc["healthy"] is True
    assert [f["rule"] for f in doc["lint"]["findings"]] == ["unguarded-launch"]
    assert doc["lint"]["files"][0].endswith("specimens/unguarded.py") and len(doc["lint"]["files"]) > 1
    assert "lint (notes, not part of the scan's verdict):" in result.stdout
    assert "unguarded-launch [missing-device-guard]" in result.stdout


def test_a_kernel_without_a_source_to_find_says_it_was_not_linted() -> None:
    """What check notes and scan lists under "skipped" (no child needed to see it)."""
    assert kernel_lint("torch:grouped_mm") == (
        None,
        ("no lint: the source of torch:grouped_mm could not be found without importing it",),
    )
    result, notes = kernel_lint(f"{WRAP}:grouped_gemm")
    assert notes == () and result is not None and len(result.files) == 2
