"""The README's written promises under hostile input, beside tests/unit/test_hostile_cases.py:
usage errors are one line and exit 2 before any work (click's own included), a value the user
gave is never echoed whole, control characters never reach the terminal, the one bounded reader
reads gzip, a byte-order mark and standard input alike and keeps memory bounded, a run names every
folder it keeps and leaves nothing in the temp folder, an interrupted scan keeps every finished
probe, and a check that checked nothing does not pass.

The CLI runs in-process (CliRunner) where no child is needed, and for real (``python -m
qmoe_doctor``) where the terminal, the temp folder or the process boundary is what is tested.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from test_hostile_cases import _capped, assert_refused, doctor, error_lines, flat
from typer.testing import CliRunner

from qmoe_doctor.cli import parallel_runs
from qmoe_doctor.cli.app import app
from qmoe_doctor.cli.commands import bench as bench_cmd
from qmoe_doctor.cli.commands import scan as scan_cmd
from qmoe_doctor.cli.output import escape_controls
from qmoe_doctor.core import knobs
from qmoe_doctor.core.events import kept_logs
from qmoe_doctor.isolate import process
from qmoe_doctor.isolate.logs import CHILD_TMP, LogDir

runner = CliRunner()
REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
QWEN3 = FIXTURES / "configs" / "qwen3-30b-a3b.json"
SANITIZER_LOG = FIXTURES / "sanitizer" / "2026-11-22-2xh200-7ada31c" / "memcheck-unmasked-overrouted-nocache.log"
ESC = "\x1b"

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(autouse=True)
def _cpu_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.setenv("COLUMNS", "200")
    for name in (knobs.QMOE_CHILD_PYTHON, knobs.QMOE_SANITIZER, knobs.QMOE_RESULT_FD):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every engine that would start a child fails the test: refusals come before any work."""

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("work started before the options were checked")

    monkeypatch.setattr(scan_cmd, "run_scan", forbidden)
    monkeypatch.setattr(bench_cmd, "run_bench", forbidden)
    monkeypatch.setattr(parallel_runs, "run_parallel", forbidden)


# =================================================================================================
# Usage errors: one line, exit 2, before any work
# =================================================================================================

CLICK_ERRORS = [
    (["scan", "--cpu", "--timeout", "abc"], "Invalid value for '--timeout'"),
    (["scan", "--cpu", "--no-such-option"], "No such option: --no-such-option"),
    (["no-such-command"], "No such command 'no-such-command'"),
    (["check", "--cpu", "--require-gpus", "x"], "Invalid value for '--require-gpus'"),
    (["lint"], "Missing argument"),
]


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize(("args", "says"), CLICK_ERRORS, ids=[" ".join(a) for a, _ in CLICK_ERRORS])
def test_a_usage_error_click_finds_is_one_line(args: list[str], says: str) -> None:
    """click's boxed multi-line message becomes the one ``error:`` line every refusal is."""
    line = assert_refused(runner.invoke(app, args), 2, says)
    assert "╭" not in line and "Usage:" not in line and "--help" in line


@pytest.mark.usefixtures("no_work")
def test_a_value_given_is_never_echoed_whole() -> None:
    huge = "x" * 100_000
    for args in (["scan", "--cpu", "--preset", huge], ["scan", "--cpu", "--only", huge], ["scan", "--kernel", huge]):
        result = runner.invoke(app, args)
        said = assert_refused(result, 2)
        assert len(said) < 1_000 and "characters" in said, said[:300]


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize("value", ["a", "-1", "0-1", "0.5", "0,,1", "²"])
def test_gpus_syntax_is_checked_on_a_machine_without_gpus(value: str) -> None:
    """--gpus is a list of NVML indices whatever the machine has; this one has no GPU."""
    assert_refused(runner.invoke(app, ["scan", "--gpus", value]), 2, "--gpus")


def test_gpus_all_is_the_default_spelt_out_without_gpus() -> None:
    result = runner.invoke(app, ["env", "--gpus", "all", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["gpus"] == []


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0.5", "1e400"])
def test_a_timeout_out_of_range_says_its_range(value: str) -> None:
    said = assert_refused(runner.invoke(app, ["scan", "--cpu", "--timeout", value]), 2, "--timeout")
    assert "from 1 to 604800" in said and "should be <=" not in said


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize("tokens", ["", "1,,2", "12345678901234567890", "٣", "0"])
def test_bench_tokens_that_name_no_count_are_refused(tokens: str, tmp_path: Path) -> None:
    out = tmp_path / "bench-out"
    assert_refused(runner.invoke(app, ["bench", "--tiny", "--tokens", tokens, "--out", str(out)]), 2, "--tokens")
    assert not out.exists()


PARALLEL_REFUSALS = [
    (["parallel", "--cpu", "--modes", "ep"], {"QMOE_EP_DISPATCH": "garbage"}, "QMOE_EP_DISPATCH"),
    (["parallel", "--cpu", "--modes", "dp,ep"], {"QMOE_EP_TRANSPORT": "x"}, "QMOE_EP_TRANSPORT"),
    (["parallel", "--cpu", "--modes", "ep"], {"QMOE_EP_MICRO_BATCHES": "0"}, "QMOE_EP_MICRO_BATCHES"),
    (["parallel", "--cpu", "--backend", "nccl"], {}, "--backend nccl needs GPUs"),
    (["parallel", "--cpu", "--rdzv-endpoint", "[/]:notaport"], {}, "--rdzv-endpoint"),
    (["parallel", "--cpu", "--rdzv-endpoint", "[/]:29500"], {}, "is not a host name"),
    (["parallel", "--cpu", "--rdzv-endpoint", "host:70000"], {}, "port from 1 to 65535"),
]


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize(("args", "env", "says"), PARALLEL_REFUSALS, ids=[p[2] for p in PARALLEL_REFUSALS])
def test_parallel_usage_errors_come_before_any_rank(
    args: list[str], env: dict[str, str], says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    t0 = time.monotonic()
    assert_refused(runner.invoke(app, args), 2, says)
    assert time.monotonic() - t0 < 10


def test_parallel_endpoints_that_are_fine_pass_the_check() -> None:
    from qmoe_doctor.plan.parallel import check_endpoint

    for endpoint in ("localhost:29500", "10.0.0.2:1", "[::1]:29500", "node-7.cluster.local:65535"):
        check_endpoint(endpoint)


LONG = "a" * 300


def _over_long(tmp_path: Path) -> dict[str, str]:
    return {"component": str(tmp_path / LONG), "path": str(tmp_path) + "/a" * 50_000}


PATH_OPTIONS = [
    (["scan", "--cpu", "--log-dir"], "", "--log-dir"),
    (["bench", "--tiny", "--out"], "", "--out"),
    (["check", "--cpu", "--save"], "", "--save"),
    (["scan", "--cpu", "--kernel"], ".py:fn", "--kernel"),
    (["audit", "--config"], "", "--config"),
]


@pytest.mark.usefixtures("no_work")
@pytest.mark.parametrize("kind", ["component", "path"])
@pytest.mark.parametrize(("args", "suffix", "option"), PATH_OPTIONS, ids=[p[2] for p in PATH_OPTIONS])
def test_an_over_long_path_is_a_usage_error_naming_the_option(
    args: list[str], suffix: str, option: str, kind: str, tmp_path: Path
) -> None:
    """[Errno 36] File name too long was exit 4 without the option; now exit 2, one short line."""
    path = _over_long(tmp_path)[kind] + suffix
    said = assert_refused(runner.invoke(app, [*args, path]), 2, option)
    assert len(said) < 1_000 and "name too long" in said.lower(), said[:300]


def test_a_symlink_loop_is_said_as_such(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    loop = str(tmp_path / "a")
    for args in (["scan", "--cpu", "--kernel", f"{loop}:fn"], ["audit", "--config", loop], ["explain", loop]):
        said = assert_refused(runner.invoke(app, args), 2, "levels of symbolic links")
        assert "does not exist" not in said


# =================================================================================================
# One bounded reader, for every input
# =================================================================================================


def test_audit_reads_a_gzip_and_a_byte_order_mark(tmp_path: Path) -> None:
    bom = tmp_path / "config.json"
    bom.write_bytes(b"\xef\xbb\xbf" + QWEN3.read_bytes())
    gz = tmp_path / "config.json.gz"
    gz.write_bytes(gzip.compress(bom.read_bytes()))
    for path in (bom, gz):
        result = runner.invoke(app, ["audit", "--config", str(path), "--json"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["reports"][0]["shape"]["num_experts"] == 128


def test_audit_reads_a_mixtral_config_by_its_architecture(tmp_path: Path) -> None:
    """Mixtral's experts are intermediate_size wide (no moe_intermediate_size); a config without
    any expert width says which architectures are read."""
    config = {
        "architectures": ["MixtralForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
    }
    path = tmp_path / "mixtral.json"
    path.write_text(json.dumps(config))
    result = runner.invoke(app, ["audit", "--config", str(path), "--json"])
    assert result.exit_code == 0, result.output
    shape = json.loads(result.stdout)["reports"][0]["shape"]
    assert (shape["num_experts"], shape["top_k"], shape["intermediate"]) == (8, 2, 14336)
    del config["architectures"]
    path.write_text(json.dumps(config))
    assert_refused(runner.invoke(app, ["audit", "--config", str(path)]), 2, "MixtralForCausalLM", "(intermediate_size)")


def test_lint_reads_standard_input() -> None:
    source = (REPO / "kernels" / "specimens" / "int32_offsets.py").read_text()
    result = runner.invoke(app, ["lint", "-", "--plain"], input=source)
    assert result.exit_code == 1, result.output
    assert "<stdin>:" in result.stdout and "int32-offset" in result.stdout


def test_explain_json_of_a_large_log_keeps_memory_and_output_bounded(tmp_path: Path) -> None:
    """A log of ~100,000 identical faults (one per thread: every address distinct), read with the
    address space capped: the records are folded into their group as they are read (a 59 MiB log
    of 330,000 records took 5.4 GB and ended in MemoryError), and the JSON stays small."""
    record = (
        "========= Invalid __global__ write of size 16 bytes\n"
        "=========     at _k+0x3390 in k.py:111\n"
        "=========     by thread ({t},0,0) in block (14,0,0)\n"
        "=========     Access to {a:#x} is out of bounds\n"
        "=========     and is 1 bytes after the nearest allocation at 0x7f7cc49a0000 of size 131,072 bytes\n"
    )
    n = 100_000
    log = tmp_path / "big.log"
    with open(log, "w") as fh:
        fh.write("========= COMPUTE-SANITIZER\n")
        for i in range(n):
            fh.write(record.format(t=i % 1024, a=0x7F7CC49C0000 + 16 * i))
        fh.write(f"========= ERROR SUMMARY: {n} errors\n")
    proc = subprocess.run(
        [sys.executable, "-m", "qmoe_doctor", "explain", "--json", str(log)],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
        preexec_fn=_capped,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]  # a fault shown: causes fit
    assert len(proc.stdout) < 2_000_000
    doc = json.loads(proc.stdout)
    report = json.dumps(doc)
    assert f'"count": {n}' in report and '"errors_folded"' in report


# =================================================================================================
# Nothing printed raw
# =================================================================================================


def test_control_characters_from_a_log_are_printed_escaped(tmp_path: Path) -> None:
    """The terminal's title (OSC 0 ... BEL) and a clear screen (CSI 2J) inside a log line."""
    log = tmp_path / "evil.log"
    text = SANITIZER_LOG.read_text().replace("unmasked_rows.py:111", f"k.py:111{ESC}]0;PWNED\x07{ESC}[2J")
    log.write_text(text)
    proc = doctor("explain", str(log))
    out = proc.stdout + proc.stderr
    assert ESC not in out and "\x07" not in out
    assert "\\x1b]0;PWNED" in out or "\\x1b[2J" in out


def test_control_characters_from_the_environment_are_printed_escaped(tmp_path: Path) -> None:
    proc = doctor("scan", "--cpu", "--only", "single", env={knobs.QMOE_CHILD_PYTHON: f"py{ESC}[2Jthon"}, cwd=tmp_path)
    assert ESC not in proc.stdout + proc.stderr
    assert "py\\x1b[2Jthon" in proc.stdout + proc.stderr


def test_escaping_keeps_text_newlines_and_tabs() -> None:
    assert escape_controls("a\tb\nc\x1b[0m\x9b\x00") == "a\tb\nc\\x1b[0m\\x9b\\x00"


# =================================================================================================
# Nothing left behind, or said where
# =================================================================================================


def test_a_kernel_that_does_not_import_names_the_logs_it_kept(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import no_such_module_at_all\n\ndef fn(x, w, m_sizes):\n    return x\n")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = doctor("scan", "--cpu", "--only", "single", "--kernel", f"{bad}:fn", env={"TMPDIR": str(tmp)}, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    kept = [p for p in tmp.iterdir() if p.name.startswith("qmoe-doctor-")]
    assert len(kept) == 1 and f"the run's logs are kept in {kept[0]}" in flat(proc.stderr)


def test_bench_with_a_kernel_that_does_not_import_leaves_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import no_such_module_at_all\n")
    proc = doctor("bench", "--tiny", "--kernel", f"{bad}:fn", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.py"]


def test_a_childs_temp_files_go_with_the_runs_logs_and_are_removed(tmp_path: Path) -> None:
    """torchrun's torchelastic_* and torch's torchinductor_* are made in TMPDIR: a child of the
    doctor gets a folder inside the run's log folder, removed when the run ends (kept or not)."""
    with LogDir.open(tmp_path / "logs") as logs:
        child = process.spawn(
            [sys.executable, "-c", "import tempfile; print(tempfile.mkdtemp(prefix='torchelastic_'))"],
            env=dict(os.environ),
            log_path=logs.path / "worker-000.log",
        )
        assert child.proc.wait(timeout=60) == 0
        made = Path((logs.path / "worker-000.log").read_text().split()[-1])
        assert made.parent == logs.path / CHILD_TMP and made.is_dir()
    assert not (logs.path / CHILD_TMP).exists()
    assert (logs.path / "worker-000.log").exists()  # the log asked for stays


def test_a_folder_named_child_tmp_the_run_did_not_make_is_left_alone(tmp_path: Path) -> None:
    """--log-dir ~ (or any folder of the user's): only the children's temp folder this run made is
    removed, never another folder of that name below it."""
    theirs = tmp_path / "logs" / "project" / CHILD_TMP
    theirs.mkdir(parents=True)
    (theirs / "precious.txt").write_text("keep me")
    beside = tmp_path / "logs" / CHILD_TMP
    beside.mkdir()  # where the run's children would put theirs: already there, so not the run's
    with LogDir.open(tmp_path / "logs") as logs:
        for folder in (logs.path, logs.path / "run"):
            folder.mkdir(exist_ok=True)
            child = process.spawn([sys.executable, "-c", "pass"], env=dict(os.environ), log_path=folder / "w.log")
            assert child.proc.wait(timeout=60) == 0
        assert (logs.path / "run" / CHILD_TMP).is_dir()
    assert (theirs / "precious.txt").read_text() == "keep me" and beside.is_dir()
    assert not (logs.path / "run" / CHILD_TMP).exists()  # the one the run made


def test_a_run_ended_by_an_exception_names_the_folder_it_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    with pytest.raises(KeyboardInterrupt) as caught, LogDir.open(None) as logs:
        raise KeyboardInterrupt
    assert kept_logs(caught.value) == [str(logs.path)] and logs.path.is_dir()
    with pytest.raises(ValueError) as asked, LogDir.open(tmp_path / "mine"):
        raise ValueError("x")
    assert kept_logs(asked.value) == []  # --log-dir: the user knows where


# =================================================================================================
# Nothing finished is lost
# =================================================================================================


def test_an_interrupted_scan_keeps_the_probes_its_session_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU tier is one session: interrupted after two of its probes, --save holds those two
    (complete: false), not nothing."""
    from test_scan_cli import _passing  # a session stand-in that passes every probe

    from qmoe_doctor.core.events import Event, EventKind
    from qmoe_doctor.workflows import scan as scan_wf

    def two_then_sigint(session: Any, *, watch: Any, **kw: Any) -> list[Any]:
        done = _passing(session.specs)[:2]
        for outcome in done:
            watch(Event(kind=EventKind.OUTCOME, outcome=outcome))
        raise KeyboardInterrupt

    monkeypatch.setattr(scan_wf, "_run_one", two_then_sigint)
    out = tmp_path / "partial.json"
    result = runner.invoke(app, ["scan", "--cpu", "--save", str(out), "--log-dir", str(tmp_path / "logs")])
    assert result.exit_code == 130, result.output
    saved = json.loads(out.read_text())
    assert saved["complete"] is False and len(saved["outcomes"]) == 2 and saved["not_run"] == ["CPU"]
    assert "complete: false) is in" in flat(result.output)


# =================================================================================================
# A check that checked nothing does not pass
# =================================================================================================


def test_lint_of_an_empty_folder_is_not_a_pass(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert_refused(runner.invoke(app, ["lint", str(tmp_path / "empty")]), 2, "nothing was linted")


def test_lint_says_what_it_skipped(tmp_path: Path) -> None:
    folder = tmp_path / "src"
    folder.mkdir()
    (folder / "ok.py").write_text("X = 1\n")
    os.mkfifo(folder / "pipe.py")
    result = runner.invoke(app, ["lint", str(folder), "--plain"])
    assert result.exit_code == 0, result.output
    assert "pipe.py: skipped: a FIFO" in flat(result.stderr)
    summary = flat(result.stdout)
    assert "No findings in 1 file (" in summary and "rules); 1 entry skipped" in summary, summary
    os.unlink(folder / "ok.py")
    assert_refused(runner.invoke(app, ["lint", str(folder)]), 2, "nothing was linted", "1 entries skipped")


# =================================================================================================
# Wording
# =================================================================================================


def test_a_kernel_that_returns_nan_wrote_nan_it_did_not_leave_it_unwritten() -> None:
    """The poison is all-ones bits; a computed NaN is not (0x7fc0... / 0xffc0... / 0x7fff...)."""
    import torch

    from qmoe_doctor.probes.conditions import _poison_bits

    y = torch.full((4,), float("nan"))
    assert not bool(_poison_bits(y).any())
    y.view(torch.int32)[:2] = -1
    assert _poison_bits(y).tolist() == [True, True, False, False]
    # computed NaNs in half precision too (torch's CPU conversion to bfloat16 gives 0xffff, which is
    # why the CPU tier runs float32; Triton's conversion on a GPU gives 0x7fff)
    assert _poison_bits((torch.zeros(3) * float("inf")).to(torch.float16)).tolist() == [False] * 3


def test_help_reads_as_paragraphs_and_flags_show_no_type() -> None:
    result = runner.invoke(app, ["scan", "--help"], terminal_width=300)
    assert result.exit_code == 0
    lines = [ln.strip() for ln in result.stdout.splitlines()]
    first = next(i for i, ln in enumerate(lines) if ln.startswith("Run the kernel under"))
    assert lines[first].endswith("failure."), lines[first : first + 3]  # one paragraph, one line
    json_row = next(ln for ln in lines if "--json" in ln)
    assert "<bool>" not in json_row and "<bool>" not in result.stdout


def test_env_without_a_driver_says_so() -> None:
    result = runner.invoke(app, ["env"])
    assert result.exit_code == 0, result.output
    first = result.stdout.splitlines()[0]
    assert "NVIDIA driver: none found" in first and "driver -" not in first


def test_every_error_line_is_one_line(tmp_path: Path) -> None:
    """A kernel error whose message holds newlines (a child's traceback) is folded to one line."""
    kernel = tmp_path / "multi.py"
    kernel.write_text('raise ImportError("first line of the reason\\nsecond line\\nthird line")\n')
    proc = doctor("scan", "--cpu", "--kernel", f"{kernel}:fn", cwd=tmp_path)
    assert proc.returncode == 2 and len(error_lines(proc.stderr)) == 1, proc.stderr
    (line,) = error_lines(proc.stderr)
    assert "first line of the reason second line third line" in line  # the child's message, folded


# =================================================================================================
# A badly declared adapter is a usage error
# =================================================================================================


class _Declared:
    def __init__(self, **attrs: Any) -> None:
        self.__dict__.update(attrs)

    def adapt(self, target: Any) -> Any:
        return target


class _RaisingDtypes:
    @property
    def dtypes(self) -> Any:
        raise RuntimeError("boom")


@pytest.mark.parametrize(
    ("adapter", "says"),
    [
        (_Declared(dtypes=5), "dtypes must be None or a collection"),
        (_Declared(dtypes="bfloat16"), "dtypes must be None or a collection"),
        (_Declared(dtypes=["float8"]), "names no dtype the probes run"),
        (_Declared(needs_contiguous="yes"), "needs_contiguous must be True or False"),
        (_RaisingDtypes(), "reading its 'dtypes' raised RuntimeError: boom"),
    ],
    ids=["int", "a string", "unknown dtype", "not a bool", "a property that raises"],
)
def test_a_badly_declared_adapter_cannot_be_used(adapter: object, says: str) -> None:
    from qmoe_doctor.probes.adapters import limits_of
    from qmoe_doctor.probes.loader import KernelResolutionError

    with pytest.raises(KernelResolutionError, match=says.replace("(", r"\(").replace(")", r"\)")):
        limits_of(adapter, "mine")


def test_a_badly_declared_adapter_is_exit_2_through_the_cli(tmp_path: Path) -> None:
    (tmp_path / "myadapt.py").write_text(
        "class Bad:\n    dtypes = 5\n\n    def adapt(self, target):\n        return target\n\n\nBAD = Bad()\n"
    )
    kernel = FIXTURES / "kernels" / "torch_loop.py"
    proc = doctor(
        "scan", "--cpu", "--only", "single", "--kernel", f"adapter:myadapt.BAD:{kernel}:moe_loop",
        env={"PYTHONPATH": str(tmp_path)}, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = error_lines(proc.stderr)
    assert "dtypes must be None or a collection" in line
