"""`qmoe-doctor run --blocking` and `--sanitize` on the CPU.

A program that meets a CUDA error stands in for a faulting kernel: without CUDA_LAUNCH_BLOCKING
it raises the error after its launches (as a CUDA fault surfaces at a later call); with it, the
error comes out of a launch (its grid function raises it), as a blocking launch of a faulting
kernel does. compute-sanitizer is a stand-in script (``QMOE_DOCTOR_COMPUTE_SANITIZER``) that runs
the command, then reads the monitor's record of that run and reports an address 64 bytes past
the end of the last launch's first tensor, in compute-sanitizer's own log format.
"""

from __future__ import annotations

import io
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
from rich.console import Console
from signal_dispositions import default_dispositions

from qmoe_doctor.cli.render.run import render_run
from qmoe_doctor.core import knobs
from qmoe_doctor.core.launches import EndKind
from qmoe_doctor.core.records import to_jsonable
from qmoe_doctor.workflows.run import RunOptions, run_program

pytestmark = pytest.mark.timeout(240)

PROGRAM = """\
import os
import torch
import triton
import triton.language as tl


@triton.jit
def scale_rows(x_ptr, y_ptr, stride_xm, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    x = tl.load(x_ptr + row * stride_xm + tl.arange(0, BLOCK), mask=tl.arange(0, BLOCK) < N)
    tl.store(y_ptr + row * stride_xm + tl.arange(0, BLOCK), x * 2, mask=tl.arange(0, BLOCK) < N)


def fault(meta):
    raise RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")


x = torch.randn(4, 16)
y = torch.empty_like(x)
for _ in range(3):
    scale_rows[(4,)](x, y, x.stride(0), 16, BLOCK=16)
if os.environ.get("CUDA_LAUNCH_BLOCKING") == "1":
    scale_rows[fault](x, y, x.stride(0), 16, BLOCK=16)
elif os.environ.get("FAULT", "1") == "1":
    raise RuntimeError("CUDA error: an illegal memory access was encountered")
"""

FAKE_SANITIZER = """\
#!{python}
import glob, json, os, subprocess, sys

args = sys.argv[1:]
if args == ["--version"]:
    print("NVIDIA (R) Compute Sanitizer\\nVersion 2025.3.1.0")
    sys.exit(0)
flags, log, i = [], None, 0
while i < len(args) and args[i].startswith("--"):
    if args[i] in ("--xml",):
        flags.append([args[i]])
        i += 1
        continue
    flags.append([args[i], args[i + 1]])
    if args[i] == "--log-file":
        log = args[i + 1]
    i += 2
code = subprocess.call(args[i:])
json.dump({{"flags": flags, "caching": os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING")}}, open(os.environ["FAKE_SEEN"], "w"))
(path,) = glob.glob(os.path.join(os.environ["QMOE_DOCTOR_RUN_DIR"], "process-*.json"))
record = json.load(open(path))
t = record["ring"][-1]["tensors"][0]
end = t["data_ptr"] + t["nbytes"]
counted = any(f[0] == "--launch-count" for f in flags)
if os.environ.get("FAKE_LOG") and (counted or not os.environ.get("FAKE_LOG_ONLY_COUNTED")):
    # a recorded log, verbatim (with FAKE_LOG_ONLY_COUNTED: only where --launch-count is given)
    open(log.replace("%p", str(os.getpid())), "w").write(open(os.environ["FAKE_LOG"]).read())
    sys.exit(code)
if os.environ.get("FAKE_PLACES"):
    # one 16-byte write per place, "NAME+N" N bytes after that argument's region (the last
    # launch's), "NAME-N" before its start, "NAME@N" inside it
    tensors = {{a["name"]: a for a in record["ring"][-1]["tensors"]}}
    records = []
    for place in os.environ["FAKE_PLACES"].split(","):
        sign = next(s for s in "+-@" if s in place)
        name, n = place.split(sign)
        a = tensors[name]
        start, end = a["data_ptr"], a["data_ptr"] + a["nbytes"]
        at = {{"+": end + int(n), "-": start - int(n), "@": start + int(n)}}[sign]
        records.append(
            "========= Invalid __global__ write of size 16 bytes\\n"
            "=========     at %s+0x1b0 in ops.py:9\\n"
            "=========     by thread (0,0,0) in block (0,0,0)\\n"
            "=========     Access to 0x%x is out of bounds\\n"
            "========= \\n" % (record["ring"][-1]["kernel"], at)
        )
    open(log.replace("%p", str(os.getpid())), "w").write(
        "========= COMPUTE-SANITIZER\\n" + "".join(records) + "========= ERROR SUMMARY: %d errors\\n" % len(records)
    )
    sys.exit(code)
open(log.replace("%p", str(os.getpid())), "w").write(
    "========= COMPUTE-SANITIZER\\n"
    "========= Invalid __global__ read of size 4 bytes\\n"
    "=========     at scale_rows+0x1b0 in prog.py:10\\n"
    "=========     by thread (3,0,0) in block (0,0,0)\\n"
    "=========     Access to 0x%x is out of bounds\\n"
    "=========     and is 65 bytes after the nearest allocation at 0x%x of size %d bytes\\n"
    "========= \\n"
    "========= ERROR SUMMARY: 1 error\\n" % (end + 64, t["data_ptr"], t["nbytes"])
)
sys.exit(code)
"""


def setup(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(FAKE_SANITIZER.format(python=sys.executable))
    fake.chmod(0o755)
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        knobs.QMOE_SANITIZER: str(fake),
        "FAKE_SEEN": str(tmp_path / "seen.json"),
    }
    env.pop(knobs.CUDA_LAUNCH_BLOCKING, None)
    return prog, env


def test_blocking_reruns_after_a_cuda_error_and_names_the_faulting_kernel(tmp_path: Path) -> None:
    prog, env = setup(tmp_path)
    report = run_program([sys.executable, str(prog)], RunOptions(blocking=True, log_dir=tmp_path / "r"), environ=env)
    first, blocking = report.passes
    assert blocking.label == "blocking" and blocking.env == {knobs.CUDA_LAUNCH_BLOCKING: "1"}
    (guess,) = first.cuda_errors
    assert not guess.exact and [launch.seq for launch in guess.last_launches] == [1, 2, 3]
    (exact,) = blocking.cuda_errors
    assert exact.exact and exact.faulting == "scale_rows" and exact.last_launches[-1].seq == 4
    assert exact.last_launches[-1].raised.startswith("RuntimeError: Triton Error [CUDA]")
    (record,) = blocking.processes
    assert record.end is not None and record.end.kind is EndKind.CUDA_ERROR
    assert report.exit_code == 1 and report.command_exit == 1


def test_blocking_without_a_cuda_error_reruns_nothing(tmp_path: Path) -> None:
    prog, env = setup(tmp_path)
    report = run_program(
        [sys.executable, str(prog)], RunOptions(blocking=True, log_dir=tmp_path / "r"), environ={**env, "FAULT": "0"}
    )
    assert [p.label for p in report.passes] == ["run"] and report.exit_code == 0
    assert report.notes == ("--blocking: the run met no CUDA error, so it was not rerun",)


def test_sanitize_reruns_under_memcheck_and_places_the_address_in_a_recorded_tensor(tmp_path: Path) -> None:
    prog, env = setup(tmp_path)
    report = run_program(
        [sys.executable, str(prog)], RunOptions(blocking=True, sanitize=True, log_dir=tmp_path / "r"), environ=env
    )
    assert [p.label for p in report.passes] == ["run", "blocking", "sanitize"]
    s = report.sanitizer
    assert s is not None and s.ran and s.version == "2025.3.1.0"
    # aimed at a CUDA error: every launch of the kernel up to the fault, no --launch-count
    assert s.kernels == ("scale_rows",) and s.launch_count is None
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["caching"] == "1"  # the caching allocator off
    flags = {f[0]: f[1:] for f in seen["flags"]}
    assert flags["--tool"] == ["memcheck"] and flags["--kernel-name"] == ["regex=^scale_rows$"]
    assert "--launch-count" not in flags and flags["--target-processes"] == ["all"]
    assert s.errors == 1
    (address,) = s.addresses
    assert address.tensor is not None and address.tensor.startswith("x_ptr of scale_rows #")
    assert address.relation == "after" and address.device == "cpu" and address.kernel == "scale_rows"
    assert (address.gap, address.region) == (64, 4 * 16 * 4)  # the log's "65 bytes after", as ASan counts it
    assert address.sentences[0].startswith("read 64 bytes after the 256-byte region of x_ptr of scale_rows #")


def test_sanitize_says_when_compute_sanitizer_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prog, env = setup(tmp_path)
    del env[knobs.QMOE_SANITIZER]
    monkeypatch.setattr("qmoe_doctor.workflows.run.find_compute_sanitizer", lambda env=None: None)
    report = run_program([sys.executable, str(prog)], RunOptions(sanitize=True, log_dir=tmp_path / "r"), environ=env)
    assert [p.label for p in report.passes] == ["run"]
    s = report.sanitizer
    assert s is not None and not s.ran and "compute-sanitizer was not found" in s.note
    assert s.kernels == ("scale_rows",)  # what it would have checked


def test_a_sanitizer_variable_naming_nothing_is_refused_before_the_command_runs(tmp_path: Path) -> None:
    prog, env = setup(tmp_path)
    marker = tmp_path / "ran"
    prog.write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    env[knobs.QMOE_SANITIZER] = str(tmp_path / "no-such-sanitizer")
    with pytest.raises(ValueError, match="no such file"):
        run_program([sys.executable, str(prog)], RunOptions(sanitize=True, log_dir=tmp_path / "r"), environ=env)
    assert not marker.exists()


def test_sigint_to_the_doctor_is_passed_to_the_command_which_writes_its_record(tmp_path: Path) -> None:
    """The doctor's own SIGINT (Ctrl-C) goes to the command's group; the command's monitor writes
    its record; the run reports it and exits 130."""
    import signal
    import threading

    prog = tmp_path / "slow.py"
    ready = tmp_path / "ready"
    prog.write_text(
        PROGRAM.split("def fault")[0]
        + textwrap.dedent(
            f"""
            import time
            x = torch.randn(4, 16)
            scale_rows[(4,)](x, x, x.stride(0), 16, BLOCK=16)
            open({str(ready)!r}, "w").write("x")
            time.sleep(60)
            """
        )
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}

    def interrupt() -> None:
        for _ in range(600):
            if ready.exists():
                break
            threading.Event().wait(0.1)
        os.kill(os.getpid(), signal.SIGINT)

    with default_dispositions():  # SIGINT is Ctrl-C's, even when the suite runs as a background job
        threading.Thread(target=interrupt, daemon=True).start()
        report = run_program(
            [sys.executable, str(prog)], RunOptions(log_dir=tmp_path / "r", blocking=True), environ=env
        )
    (first,) = report.passes  # no rerun after an interruption
    assert report.exit_code == 130 and "SIGINT passed on" in first.end
    (record,) = first.processes
    assert record.end is not None and record.end.kind is EndKind.SIGNAL and record.launches == 1
    assert report.notes[0] == "the command was interrupted: the reruns asked for were not made"


#: compute-sanitizer 2025.3.1 giving up inside the run (one H100 80GB HBM3, 2026-11-25: memcheck of
#: `qmoe-doctor run --sanitize` on the Transformers example with specimen:unmasked_rows over-routed)
INTERNAL_ERROR_LOG = (
    Path(__file__).resolve().parents[1]
    / "fixtures" / "sanitizer" / "2026-11-25-h100-e9d91ec" / "memcheck-unmasked-overrouted-internal-error.log"
)


def test_a_sanitizer_that_fails_inside_the_run_is_reported_as_failed_never_clean(tmp_path: Path) -> None:
    prog, env = setup(tmp_path)
    report = run_program(
        [sys.executable, str(prog)],
        RunOptions(sanitize=True, log_dir=tmp_path / "r"),
        environ={**env, "FAKE_LOG": str(INTERNAL_ERROR_LOG)},
    )
    s = report.sanitizer
    assert s is not None and s.ran and not s.addresses
    # aimed at the CUDA error the pass had no launch count already: no second pass
    assert [p.label for p in report.passes] == ["run", "sanitize"]
    assert s.note.startswith("compute-sanitizer failed: Internal Sanitizer Error"), s.note
    assert "not clean" in s.note and "0 errors" not in s.note
    assert s.kernels == ("scale_rows",) and s.launch_count is None


def test_a_bounded_memcheck_that_fails_inside_compute_sanitizer_is_run_again_on_every_launch(tmp_path: Path) -> None:
    # No CUDA error to aim at: the pass is bounded by --launch-count. The fake answers such a pass
    # with the H100 log of 2026-11-25 (compute-sanitizer's own failure) and places the address
    # in the pass without the count, as every pass without it did on that machine.
    prog, env = setup(tmp_path)
    report = run_program(
        [sys.executable, str(prog)],
        RunOptions(sanitize=True, log_dir=tmp_path / "r"),
        environ={**env, "FAULT": "0", "FAKE_LOG": str(INTERNAL_ERROR_LOG), "FAKE_LOG_ONLY_COUNTED": "1"},
    )
    assert [p.label for p in report.passes] == ["run", "sanitize", "sanitize"]
    s = report.sanitizer
    assert s is not None and s.ran and s.kernels == ("scale_rows",) and s.launch_count is None
    flags = {f[0]: f[1:] for f in json.loads((tmp_path / "seen.json").read_text())["flags"]}
    assert flags["--kernel-name"] == ["regex=^scale_rows$"] and "--launch-count" not in flags  # the second pass
    (address,) = s.addresses
    assert address.tensor is not None and address.tensor.startswith("x_ptr of scale_rows #")
    assert s.note.startswith("memcheck with --launch-count "), s.note
    assert "failed inside compute-sanitizer (Internal Sanitizer Error" in s.note
    assert s.note.endswith(
        "on every launch: 1 error; 1 of the 1 distinct invalid addresses read from the log placed against recorded tensors"
    ), s.note


def test_a_bounded_memcheck_that_finishes_is_not_run_again(tmp_path: Path) -> None:
    prog, env = setup(tmp_path)
    report = run_program(
        [sys.executable, str(prog)], RunOptions(sanitize=True, log_dir=tmp_path / "r"), environ={**env, "FAULT": "0"}
    )
    assert [p.label for p in report.passes] == ["run", "sanitize"]
    s = report.sanitizer
    assert s is not None and s.launch_count is not None and s.launch_count > 0
    flags = {f[0]: f[1:] for f in json.loads((tmp_path / "seen.json").read_text())["flags"]}
    assert flags["--launch-count"] == [str(s.launch_count)]


#: A pip-installed library (a folder named site-packages on the program's path) whose layer calls
#: its wrapper ``grouped_gemm(x, w, m_sizes)``, which launches through a helper of another
#: signature; the user's program calls the layer from its own ``step``.
LIBRARY = """\
import torch
import triton
import triton.language as tl


@triton.jit
def grouped_rows(x_ptr, w_ptr, y_ptr, sizes_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + row * N + offs, tl.load(x_ptr + row * N + offs) * 2)


def _launch(x, w, y, m_sizes):
    grouped_rows[(x.shape[0],)](x, w, y, m_sizes, x.shape[1], BLOCK=16)


def grouped_gemm(x, w, m_sizes, *, out=None):
    y = torch.empty_like(x) if out is None else out
    _launch(x, w, y, m_sizes)
    return y


class Layer:
    def forward(self, x, w, m_sizes):
        return grouped_gemm(x, w, m_sizes)
"""
USER_PROGRAM = """\
import os
import sys

sys.path.insert(0, {site!r})
import torch
from moe_lib.ops import Layer


def step(layer, x, w, m_sizes):
    return layer.forward(x, w, m_sizes)


x, w = torch.randn(4, 16), torch.randn(2, 16, 16)
m_sizes = torch.tensor([2, 2], dtype=torch.int32)
for _ in range(2):
    step(Layer(), x, w, m_sizes)
raise RuntimeError("CUDA error: an illegal memory access was encountered")
"""
USER_LINE = USER_PROGRAM.splitlines().index("    return layer.forward(x, w, m_sizes)") + 1
LIBRARY_LINE = LIBRARY.splitlines().index("    grouped_rows[(x.shape[0],)](x, w, y, m_sizes, x.shape[1], BLOCK=16)") + 1


def library_program(tmp_path: Path) -> tuple[Path, Path]:
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    (site / "moe_lib").mkdir(parents=True)
    (site / "moe_lib" / "__init__.py").write_text("")
    (site / "moe_lib" / "ops.py").write_text(LIBRARY)
    prog = tmp_path / "train.py"
    prog.write_text(USER_PROGRAM.format(site=str(site)))
    return prog, site / "moe_lib" / "ops.py"


def test_a_library_launch_records_the_librarys_line_the_users_line_and_the_wrapper(tmp_path: Path) -> None:
    prog, ops = library_program(tmp_path)
    _, env = setup(tmp_path)
    # 8 writes after y (4 x 16 fp32): rows 4 and 5 of a 4-row output, as over-routing writes
    places = ",".join(f"y_ptr+{16 * i}" for i in range(8))
    report = run_program(
        [sys.executable, str(prog)], RunOptions(sanitize=True, log_dir=tmp_path / "r"), environ={**env, "FAKE_PLACES": places}
    )
    launch = report.passes[0].processes[0].ring[0]
    assert launch.kernel == "grouped_rows"
    # the call site is the library's line (the first frame outside torch, triton and the doctor) ...
    assert launch.call_site is not None and (launch.call_site.file, launch.call_site.line) == (str(ops), LIBRARY_LINE)
    # ... and the user's own line is the first outside site-packages too
    assert launch.user_site is not None
    assert (launch.user_site.file, launch.user_site.line, launch.user_site.function) == (str(prog), USER_LINE, "step")
    # the helper takes four arguments, the layer's forward is a method: the wrapper is grouped_gemm
    assert launch.wrapper == "moe_lib.ops:grouped_gemm"
    s = report.sanitizer
    assert s is not None and [a.gap for a in s.addresses] == [16 * i for i in range(8)]
    assert s.agreement.startswith("8 of 8 invalid addresses agree: after the end of y_ptr of grouped_rows")
    (d,) = report.diagnoses
    assert (d.cause, d.seen_in, str(d.confidence)) == ("invalid-routing", "sanitize", "medium")
    assert d.repro == "qmoe-doctor scan --kernel moe_lib.ops:grouped_gemm --only over-routed"
    assert d.finding.launch is not None and d.finding.launch.user_site == launch.user_site
    # the report shows both lines, and the JSON keeps them
    console = Console(file=io.StringIO(), width=400, color_system=None)
    render_run(console, report)
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert f"  called at: {ops}:{LIBRARY_LINE} in _launch" in text
    assert f"  your line: {prog}:{USER_LINE} in step" in text
    assert "  prove it: qmoe-doctor scan --kernel moe_lib.ops:grouped_gemm --only over-routed" in text
    doc = json.loads(json.dumps(to_jsonable(report)))
    first = doc["passes"][0]["processes"][0]["ring"][0]
    assert first["user_site"]["file"] == str(prog) and first["wrapper"] == "moe_lib.ops:grouped_gemm"
    assert doc["diagnoses"][0]["basis"].startswith("placed by memcheck, 8 of 8 addresses after the end of y_ptr")


def test_disagreeing_placements_in_a_run_give_no_diagnosis_and_the_report_says_why(tmp_path: Path) -> None:
    prog, _ = library_program(tmp_path)
    _, env = setup(tmp_path)
    places = ",".join([*(f"y_ptr+{16 * i}" for i in range(4)), *(f"x_ptr@{16 * i}" for i in range(4))])
    report = run_program(
        [sys.executable, str(prog)], RunOptions(sanitize=True, log_dir=tmp_path / "r"), environ={**env, "FAKE_PLACES": places}
    )
    assert report.diagnoses == () and report.cuda_errors
    s = report.sanitizer
    assert s is not None and s.agreement.startswith(
        "the 8 invalid addresses disagree (4 after the end of y_ptr, 4 inside x_ptr): no diagnosis"
    )
