"""`qmoe-doctor run` on the CPU: the launch monitor inside real programs that launch Triton
kernels through the interpreter (TRITON_INTERPRET=1, CPU tensors).

Each test writes a small program, runs it through ``workflows.run.run_program`` (the command's
own process, the bootstrap on its PYTHONPATH) and reads what its processes recorded: the
launches and their tensors, the ring, the call site, the lint at the first launch, and the
record written however the process ends (normal exit, exception, ``sys.exit(3)``, SIGTERM, a
CUDA error, a hard crash); torchrun ranks; a program that never imports Triton; a user's own
sitecustomize.
"""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from qmoe_doctor.core.launches import EndKind, HookPoint, ProcessRecord
from qmoe_doctor.core.reports import RunReport
from qmoe_doctor.workflows.run import RunOptions, run_program

pytestmark = pytest.mark.timeout(180)

#: The kernel every program launches: its lint finds two int32 offset products (lines 10, 11 of
#: the program).
KERNEL = """\
import os, signal, sys
import torch
import triton
import triton.language as tl


@triton.jit
def scale_rows(x_ptr, y_ptr, stride_xm, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    x = tl.load(x_ptr + row * stride_xm + tl.arange(0, BLOCK), mask=tl.arange(0, BLOCK) < N)
    tl.store(y_ptr + row * stride_xm + tl.arange(0, BLOCK), x * 2, mask=tl.arange(0, BLOCK) < N)


def _bench(kernel_call, quantiles):  # the interpreter has no benchmarker: each config runs once
    kernel_call()
    return [1.0, 1.0, 1.0]


@triton.autotune(configs=[triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})], key=["N"], do_bench=_bench)
@triton.jit
def copy_tuned(x_ptr, y_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < N), mask=offs < N)


def scale(x, y):
    scale_rows[(x.shape[0],)](x, y, x.stride(0), x.shape[1], BLOCK=16)


x = torch.randn(4, 16)
y = torch.empty_like(x)
"""
CALL_LINE = KERNEL.splitlines().index("    scale_rows[(x.shape[0],)](x, y, x.stride(0), x.shape[1], BLOCK=16)") + 1
INT32_LINES = (10, 11)


def program(tmp_path: Path, body: str, name: str = "prog.py") -> Path:
    path = tmp_path / name
    path.write_text(KERNEL + textwrap.dedent(body))
    return path


def run(
    tmp_path: Path,
    argv: list[str],
    *,
    options: RunOptions | None = None,
    env: dict[str, str] | None = None,
    keep: bool = True,
) -> RunReport:
    """``argv`` under the monitor; its records in tmp_path/records (``keep``), or in a temporary
    folder the run removes when it was healthy."""
    environ = {**os.environ, "TRITON_INTERPRET": "1", **(env or {})}
    base = options or RunOptions()
    opts = RunOptions(
        ring=base.ring, call_sites=base.call_sites, strict=base.strict, fail_on_finding=base.fail_on_finding,
        log_dir=tmp_path / "records" if keep else None,
    )
    return run_program(argv, opts, environ=environ)


def only_process(report: RunReport) -> ProcessRecord:
    (first,) = report.passes
    (record,) = first.processes
    return record


def test_launches_are_recorded_with_names_ring_call_site_and_lint(tmp_path: Path) -> None:
    prog = program(
        tmp_path,
        """
        for _ in range(5):
            scale(x, y)
        z = torch.empty(100)
        copy_tuned[lambda meta: (triton.cdiv(100, meta["BLOCK"]),)](torch.randn(100), z, 100)
        assert torch.equal(y, 2 * x)
        """,
    )
    report = run(tmp_path, [sys.executable, str(prog)], options=RunOptions(ring=4))
    assert report.exit_code == 0 and report.command_exit == 0
    record = only_process(report)
    assert record.end is not None and record.end.kind is EndKind.EXIT
    assert HookPoint.INTERPRETER in record.hooks and record.interpreter and record.triton_version
    # 5 launches of scale_rows, and the autotuner's 2 benchmark runs + the tuned launch
    assert record.launches == 8 and record.ring_size == 4
    assert [launch.seq for launch in record.ring] == [5, 6, 7, 8]
    assert {k.name: k.launches for k in record.kernels} == {"scale_rows": 5, "copy_tuned": 3}
    first = record.ring[0]
    assert first.kernel == "scale_rows" and first.kernel_seq == 5 and first.grid == (4,)
    assert [(t.name, t.device, t.shape, t.dtype) for t in first.tensors] == [
        ("x_ptr", "cpu", (4, 16), "float32"),
        ("y_ptr", "cpu", (4, 16), "float32"),
    ]
    assert first.tensors[0].nbytes == 4 * 16 * 4 and first.device is None  # the interpreter
    tuned = record.ring[-1]
    assert tuned.kernel == "copy_tuned" and tuned.grid in ((7,), (4,))  # the grid function's result
    # call sites: the first launches of each kernel (--call-sites default 8) in the user's file
    assert first.call_site is not None and first.call_site.file == str(prog) and first.call_site.line == CALL_LINE
    assert first.launch_site == first.call_site and first.call_site.function == "scale"
    # the lint at the first launch: the kernel's int32 products (the unguarded launch is left to
    # the live device checks)
    (scale_rows,) = [k for k in record.kernels if k.name == "scale_rows"]
    assert scale_rows.int32_lines == INT32_LINES and scale_rows.file == str(prog)
    (lint,) = record.lint
    assert lint.path == str(prog) and [f.rule.value for f in lint.findings] == ["int32-offset"] * 2
    assert report.lint == record.lint
    assert report.healthy and not report.diagnoses  # CPU tensors under the interpreter: nothing to flag


def test_call_sites_are_sampled_per_kernel(tmp_path: Path) -> None:
    prog = program(tmp_path, "for _ in range(6):\n    scale(x, y)\n")
    record = only_process(run(tmp_path, [sys.executable, str(prog)], options=RunOptions(call_sites=2)))
    assert [launch.call_site is not None for launch in record.ring] == [True, True, False, False, False, False]


def test_an_exception_writes_the_record_and_the_exit_status_passes_through(tmp_path: Path) -> None:
    prog = program(tmp_path, "scale(x, y)\nraise ValueError('boom in the training loop')\n")
    report = run(tmp_path, [sys.executable, str(prog)])
    record = only_process(report)
    assert report.exit_code == 1 and record.end is not None
    assert record.end.kind is EndKind.EXCEPTION and "ValueError: boom in the training loop" in record.end.detail
    assert record.ring[-1].kernel == "scale_rows"


def test_sys_exit_3_is_the_run_exit_code(tmp_path: Path) -> None:
    prog = program(tmp_path, "scale(x, y)\nsys.exit(3)\n")
    report = run(tmp_path, [sys.executable, str(prog)])
    record = only_process(report)
    assert report.exit_code == 3 and report.passes[0].end == "exited with status 3"
    assert record.end is not None and record.end.kind is EndKind.EXIT and record.launches == 1


def test_sigterm_writes_the_record_then_the_process_dies_of_it(tmp_path: Path) -> None:
    prog = program(tmp_path, "scale(x, y)\nscale(x, y)\nos.kill(os.getpid(), signal.SIGTERM)\nprint('not reached')\n")
    report = run(tmp_path, [sys.executable, str(prog)])
    record = only_process(report)
    assert report.exit_code == 128 + 15 and "SIGTERM" in report.passes[0].end
    assert record.end is not None and record.end.kind is EndKind.SIGNAL and record.end.detail == "SIGTERM"
    assert record.launches == 2 and len(record.ring) == 2


def test_the_users_own_sigterm_handler_still_runs_after_the_record(tmp_path: Path) -> None:
    marker = tmp_path / "handled"
    # installed before triton is imported (the monitor chains it)
    prog = tmp_path / "prog.py"
    prog.write_text(
        "import os, signal, sys\n"
        f"signal.signal(signal.SIGTERM, lambda n, f: (open({str(marker)!r}, 'w').write('yes'), sys.exit(7)))\n"
        + KERNEL
        + "scale(x, y)\nos.kill(os.getpid(), signal.SIGTERM)\n"
    )
    report = run(tmp_path, [sys.executable, str(prog)])
    record = only_process(report)
    assert marker.read_text() == "yes" and report.exit_code == 7
    assert record.end is not None and record.end.kind is EndKind.SIGNAL


def test_a_cuda_error_is_reported_with_the_launches_before_it(tmp_path: Path) -> None:
    prog = program(
        tmp_path,
        """
        for _ in range(3):
            scale(x, y)
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
        """,
    )
    report = run(tmp_path, [sys.executable, str(prog)], options=RunOptions(fail_on_finding=True))
    record = only_process(report)
    assert record.end is not None and record.end.kind is EndKind.CUDA_ERROR
    (error,) = report.cuda_errors
    assert [launch.kernel for launch in error.last_launches] == ["scale_rows"] * 3
    assert not error.exact and "--blocking" in error.note
    assert not report.healthy and report.exit_code == 1


def test_a_hard_crash_leaves_what_was_flushed_and_the_report_says_so(tmp_path: Path) -> None:
    prog = program(tmp_path, "scale(x, y)\nos._exit(9)\n")
    report = run(tmp_path, [sys.executable, str(prog)], keep=False)
    record = only_process(report)
    assert report.exit_code == 9 and record.end is None
    assert record.launches == 1 and record.ring[0].kernel == "scale_rows"  # flushed at its first launch
    (note,) = report.passes[0].notes
    assert f"pid {record.pid}" in note and "final record" in note
    assert report.record_dir and Path(report.record_dir).is_dir()  # kept: the run failed


def test_a_program_that_never_imports_triton_is_left_alone(tmp_path: Path) -> None:
    out = tmp_path / "modules.txt"
    prog = tmp_path / "plain.py"
    prog.write_text(
        "import json, sys\n"
        "loaded = [m for m in ('torch', 'triton', 'qmoe_doctor') if m in sys.modules]\n"
        f"open({str(out)!r}, 'w').write(json.dumps(loaded))\n"
    )
    report = run(tmp_path, [sys.executable, str(prog)], keep=False)
    assert out.read_text() == "[]"  # neither torch nor the monitor was imported into it
    assert report.exit_code == 0 and report.passes[0].processes == ()
    assert report.healthy and report.notes == ("no process of the command imported Triton: no launch was monitored",)
    assert report.record_dir == ""  # a healthy run leaves no folder behind


def test_a_users_sitecustomize_still_runs(tmp_path: Path) -> None:
    theirs = tmp_path / "site"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE_RAN'] = 'yes'\n")
    out = tmp_path / "seen.txt"
    prog = program(
        tmp_path,
        f"""
        import sitecustomize
        scale(x, y)
        open({str(out)!r}, 'w').write(os.environ.get('USER_SITECUSTOMIZE_RAN', 'no') + ' ' + sitecustomize.__file__)
        """,
    )
    report = run(tmp_path, [sys.executable, str(prog)], env={"PYTHONPATH": str(theirs)})
    ran, path = out.read_text().split(" ", 1)
    assert ran == "yes" and path == str(theirs / "sitecustomize.py")
    assert only_process(report).launches == 1  # and the monitor attached too


def test_a_broken_user_sitecustomize_is_reported_as_site_py_would_and_the_run_goes_on(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    theirs = tmp_path / "site"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("raise ImportError('their own bug')\n")
    prog = program(tmp_path, "scale(x, y)\n")
    report = run(tmp_path, [sys.executable, str(prog)], env={"PYTHONPATH": str(theirs)})
    assert "Error in sitecustomize" in capfd.readouterr().err
    assert report.exit_code == 0 and only_process(report).launches == 1


@pytest.mark.skipif(shutil.which("true") is None, reason="no `true` program")
def test_a_program_that_is_not_python_runs_unmonitored(tmp_path: Path) -> None:
    report = run(tmp_path, ["true"])
    assert report.exit_code == 0 and report.passes[0].processes == ()


RANKS = """
import torch.distributed as dist

dist.init_process_group("gloo")
scale(x, y)
dist.barrier()
dist.destroy_process_group()
"""


def test_torchrun_ranks_each_write_a_record_with_their_rank(tmp_path: Path) -> None:
    prog = program(tmp_path, RANKS)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(prog)]
    report = run(tmp_path, argv, env={"OMP_NUM_THREADS": "1"})
    assert report.exit_code == 0, report.passes[0].end
    ranks = [r for r in report.passes[0].processes if r.launches]
    assert sorted((r.rank, r.world_size) for r in ranks) == [(0, 2), (1, 2)]
    assert all(r.end is not None and r.end.kind is EndKind.EXIT for r in ranks)
    assert {r.label for r in ranks} == {f"rank {r.rank} (pid {r.pid})" for r in ranks}


def test_a_forked_child_writes_a_record_of_its_own(tmp_path: Path) -> None:
    prog = program(
        tmp_path,
        """
        scale(x, y)
        pid = os.fork()
        if pid == 0:
            scale(x, y)
            scale(x, y)
            sys.exit(0)
        os.waitpid(pid, 0)
        """,
    )
    report = run(tmp_path, [sys.executable, str(prog)])
    records = sorted(report.passes[0].processes, key=lambda r: r.launches)
    assert [r.launches for r in records] == [1, 2]
    assert records[0].pid != records[1].pid and records[1].ppid == records[0].pid
