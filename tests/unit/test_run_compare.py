"""`qmoe-doctor run --compare` on the CPU: real programs launching Triton kernels through the
interpreter (TRITON_INTERPRET=1), their launches fingerprinted by the monitor in every pass.

The interpreter has no streams, so no race can appear here: the program below plants its faults.
``in-kernel`` and ``before`` go wrong only while CUDA_LAUNCH_BLOCKING is unset (standing for
what overlap breaks), ``noise`` adds a tiny amount drawn from an unseeded generator inside every
``shift`` launch (standing for an atomic add's order), ``unseeded`` draws its input unseeded.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from qmoe_doctor.cli.app import app
from qmoe_doctor.core.compare import CompareKind
from qmoe_doctor.core.fingerprints import Contents, read_prints, sample_positions
from qmoe_doctor.core.records import from_jsonable
from qmoe_doctor.core.reports import RunReport
from qmoe_doctor.workflows.run import RunOptions, run_program

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
runner = CliRunner()
ENV = {"COLUMNS": "200", "TRITON_INTERPRET": "1"}

PROGRAM = '''\
import os
import random
import sys

import torch
import triton
import triton.language as tl

FAULT = sys.argv[1] if len(sys.argv) > 1 else ""
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
# stands for a race: what goes wrong here goes wrong only while launches may overlap
OVERLAP = os.environ.get("CUDA_LAUNCH_BLOCKING", "0") != "1"
BUMP = tl.constexpr(0.5 if FAULT == "in-kernel" and OVERLAP else 0.0)
NOISE = tl.constexpr(0.0)


@triton.jit
def scale(x_ptr, y_ptr, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 2.0, mask=mask)


@triton.jit
def shift(x_ptr, y_ptr, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0 + BUMP + NOISE, mask=mask)


def step(x, i):
    global NOISE
    y = torch.empty_like(x)
    scale[(1,)](x, y, x.numel(), BLOCK=64)
    if FAULT == "before" and OVERLAP and i == 1:
        y[5] += 1.0  # a torch op between two launches goes wrong
    if FAULT == "noise":
        NOISE = tl.constexpr(random.random() * 1e-4)  # unseeded, per launch
    z = torch.empty_like(y)
    shift[(1,)](y, z, y.numel(), BLOCK=64)
    return z


if FAULT == "nothing":
    sys.exit(0)
if FAULT == "unseeded":
    x = torch.randn(64, generator=torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little")))
else:
    torch.manual_seed(0)
    x = torch.randn(64)
if FAULT == "extra":
    scale[(1,)](x, torch.empty_like(x), x.numel(), BLOCK=64)
for i in range(STEPS):
    x = step(x, i)
'''


@pytest.fixture
def prog(tmp_path: Path) -> Path:
    path = tmp_path / "prog.py"
    path.write_text(PROGRAM)
    return path


def compare_run(tmp_path: Path, argv: list[str], reference: str, repeat: int = 2, **kw: object) -> RunReport:
    options = RunOptions(log_dir=tmp_path / "records", compare=reference, repeat=repeat, **kw)  # type: ignore[arg-type]
    return run_program(argv, options, environ={**os.environ, "TRITON_INTERPRET": "1"})


def test_interpreter_launches_are_fingerprinted_before_and_after(tmp_path: Path) -> None:
    """What a print holds, against the tensors' own values; the autotuner's benchmark launches
    out of the ordinals; a kernel past the limit counted; a plain run prints nothing."""
    body = """
    import sys
    import torch, triton, triton.language as tl
    from qmoe_doctor.core.fingerprints import SAMPLE_HASHED

    @triton.jit
    def scale(x_ptr, y_ptr, ids_ptr, N, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < N) * 2.0, mask=offs < N)

    def _bench(kernel_call, quantiles):
        kernel_call()
        return [1.0, 1.0, 1.0]

    @triton.autotune(configs=[triton.Config({"BLOCK": 16}), triton.Config({"BLOCK": 32})], key=["N"], do_bench=_bench)
    @triton.jit
    def copy(x_ptr, y_ptr, N, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < N), mask=offs < N)

    x = torch.arange(3000, dtype=torch.float32) - 1000.5
    x[7] = float("inf")
    ids = torch.arange(10, dtype=torch.int32)
    y = torch.zeros_like(x)
    for _ in range(3):
        scale[(1,)](x, y, ids, 3000, BLOCK=4096)
    z = torch.zeros(100)
    copy[lambda meta: (triton.cdiv(100, meta["BLOCK"]),)](torch.ones(100), z, 100)
    print("fingerprint module loaded:", "qmoe_doctor.monitor.fingerprint" in sys.modules, file=sys.stderr)
    """
    path = tmp_path / "p.py"
    path.write_text(textwrap.dedent(body))
    report = compare_run(tmp_path, [sys.executable, str(path)], "repeat", repeat=1, compare_launches=2)
    assert report.compare is not None and report.compare.kind is CompareKind.REPEAT
    (prints_file,) = (tmp_path / "records" / "run").glob("prints-*.jsonl")
    prints = read_prints(prints_file.read_text())
    assert [(p.kernel, p.ordinal) for p in prints.launches] == [("scale", 1), ("scale", 2), ("copy", 1)]
    state = prints.state
    assert state is not None and state.final and state.benchmark == 2  # the two configs' benchmark runs
    assert state.past_limit == 1 and state.kernels_at_limit == ("scale",)
    first = prints.launches[0]
    assert first.config == "BLOCK=4096" and first.scalars == "N=3000" and first.grid == (1,)
    x_print, y_print, ids_print = first.tensors
    x = torch.arange(3000, dtype=torch.float64) - 1000.5
    x[7] = float("inf")
    assert (x_print.name, x_print.numel, x_print.dtype, x_print.shape) == ("x_ptr", 3000, "float32", (3000,))
    assert x_print.after is None and x_print.before.nonfinite == 1  # read only; one inf
    assert x_print.before.total == float("inf")
    positions = sample_positions(3000)
    expected = Contents.from_vector([0, 0, 1, *x[positions].tolist()])
    assert x_print.before.sample_hash == expected.sample_hash and x_print.before.sample == expected.sample
    assert y_print.after is not None and y_print.before.total == 0.0  # written: zeros before
    assert y_print.after.total_abs == float("inf") and y_print.after.nonfinite == 1
    assert ids_print.before.total == 45.0 and ids_print.before.total_abs == 45.0 and ids_print.dtype == "int32"
    assert report.compare.verdict.startswith("deterministic")
    plain = run_program([sys.executable, str(path)], RunOptions(log_dir=tmp_path / "plain"), environ={**os.environ, "TRITON_INTERPRET": "1"})
    assert plain.compare is None and not list((tmp_path / "plain" / "run").glob("prints-*"))


def test_blocking_names_the_launch_whose_inputs_already_differ(tmp_path: Path, prog: Path) -> None:
    report = compare_run(tmp_path, [sys.executable, str(prog), "before"], "blocking")
    c = report.compare
    assert c is not None and c.repeat == 2 and c.reference_env == {"CUDA_LAUNCH_BLOCKING": "1"}
    assert [p.env for p in report.reference_passes] == [{"CUDA_LAUNCH_BLOCKING": "1"}] * 2
    d = c.divergence
    assert d is not None and (d.launch.kernel, d.launch.ordinal, d.where) == ("shift", 2, "before")
    assert d.deltas[0].name == "x_ptr" and d.deltas[0].sum_delta == pytest.approx(1.0)
    assert d.previous is not None and (d.previous.kernel, d.previous.ordinal) == ("scale", 2)
    assert d.launch.call_site is not None and d.launch.call_site.file == str(prog)
    assert not report.healthy and report.exit_code == 0  # the command's own status


def test_blocking_names_the_launch_that_diverges_in_the_kernel_and_fails_on_finding(tmp_path: Path, prog: Path) -> None:
    save, junit = tmp_path / "run.json", tmp_path / "run.xml"
    result = runner.invoke(
        app,
        ["run", "--compare", "blocking", "--repeat", "1", "--fail-on-finding", "--save", str(save), "--junit", str(junit),
         "--log-dir", str(tmp_path / "records"), "--", sys.executable, str(prog), "in-kernel"],
        env=ENV,
    )  # fmt: skip
    assert result.exit_code == 1, result.output
    assert "first divergent launch: #2 shift (launch 1 of it) grid (1,) (interpreter)" in result.stdout
    assert "diverged in the kernel: every tensor it only reads was equal" in result.stdout
    assert "last matched launch: #1 scale (launch 1 of it)" in result.stdout
    doc = json.loads(save.read_text())
    assert doc["kind"] == "run" and doc["compare"]["divergence"]["where"] == "in-kernel"
    assert from_jsonable(RunReport, doc).compare is not None
    failure = ET.parse(junit).getroot().find(".//failure")
    assert failure is not None and failure.get("type") == "divergence"  # the interpreter: no cause id


def test_nondeterminism_is_marked_not_a_fault(tmp_path: Path, prog: Path) -> None:
    """repeat: the first launch whose prints differ between runs, placed in the kernel; blocking:
    the same noise in the reference runs is compared within its spread, no divergence."""
    report = compare_run(tmp_path / "repeat", [sys.executable, str(prog), "noise"], "repeat", repeat=1)
    c = report.compare
    assert c is not None and c.divergence is None and report.healthy
    n = c.nondeterminism
    assert n is not None and (n.launch.kernel, n.launch.ordinal, n.where) == ("shift", 1, "in-kernel")
    assert c.verdict.startswith("nondeterministic from `shift` (its launch 1)")
    report = compare_run(tmp_path / "blocking", [sys.executable, str(prog), "noise", "5"], "blocking")
    c = report.compare
    assert c is not None
    assert c.divergence is None and report.healthy, c.verdict
    assert c.processes[0].nondeterministic >= 4 and "within the tolerance" in c.verdict


def test_an_unseeded_program_is_said(tmp_path: Path, prog: Path) -> None:
    report = compare_run(tmp_path, [sys.executable, str(prog), "unseeded"], "repeat", repeat=1)
    c = report.compare
    assert c is not None and c.nondeterminism is not None and c.nondeterminism.where == "before"
    assert c.nondeterminism.position == 1 and any("unseeded random generator" in note for note in c.notes)


def test_another_command_as_reference_and_sequences_that_stop_matching(tmp_path: Path, prog: Path) -> None:
    report = compare_run(tmp_path / "a", [sys.executable, str(prog), "in-kernel"], f"{sys.executable} {prog}", repeat=1)
    c = report.compare
    assert c is not None and c.kind is CompareKind.COMMAND and c.reference == (sys.executable, str(prog))
    assert c.divergence is not None and c.divergence.where == "in-kernel" and c.divergence.launch.kernel == "shift"
    report = compare_run(tmp_path / "b", [sys.executable, str(prog), "extra"], f"{sys.executable} {prog}", repeat=1)
    c = report.compare
    assert c is not None and c.divergence is None
    (proc,) = c.processes
    assert proc.compared == 1 and "the subject launched `scale` (its launch 2), reference run 1 `shift` (its launch 1)" in proc.stop


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--compare", "qmoe-doctor-no-such-program x"], "qmoe-doctor-no-such-program: command not found"),
        (["--compare", "python 'unbalanced"], "No closing quotation"),
        (["--compare", "  "], "--compare needs a reference"),
        (["--compare", "repeat", "--repeat", "0"], "--repeat 0: the reference runs at least once"),
        (["--repeat", "3"], "--repeat counts the runs of a --compare reference"),
    ],
)
def test_bad_references_are_one_line_and_exit_2_before_anything_runs(tmp_path: Path, args: list[str], says: str) -> None:
    marker = tmp_path / "ran"
    prog = tmp_path / "p.py"
    prog.write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    result = runner.invoke(app, ["run", *args, "--", sys.executable, str(prog)], env=ENV)
    assert result.exit_code == 2, result.output
    (line,) = [ln for ln in result.output.splitlines() if ln.startswith("error: ")]
    assert says in line, result.output
    assert not marker.exists()


def test_a_reference_that_launches_nothing_is_refused(tmp_path: Path, prog: Path) -> None:
    result = runner.invoke(
        app,
        ["run", "--compare", f"{sys.executable} {prog} nothing", "--repeat", "1", "--", sys.executable, str(prog), "", "1"],
        env=ENV,
    )
    assert result.exit_code == 2, result.output
    (line,) = [ln for ln in result.output.splitlines() if ln.startswith("error: ")]
    assert "launched no Triton kernel in run 1: nothing to compare with" in line
