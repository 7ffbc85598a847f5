"""``qmoe-doctor bench --kernel REF`` on the CPU: the user's kernel, any --kernel form, gets rows in
the same table, JSON and plot as ours; a reference the parent can refuse is refused before any
child starts (exit 2), one the child cannot import ends as the kernel's usage error (exit 2, one
line), never as a broken benchmark; the header names the launch-config table our kernels used.

The --tiny runs are real: a child process, the Triton interpreter, nothing timed. The piped-table
and plot tests draw a synthetic timed report (numbers made up for the test, no speed claimed).
"""

from __future__ import annotations

import importlib.util
import io
import json
import stat
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from qmoe_doctor.cli.app import app
from qmoe_doctor.cli.render.bench import render_report
from qmoe_doctor.core import knobs
from qmoe_doctor.core.bench import (
    BLOCK_GROUPED_MM,
    BLOCK_QMOE,
    DENSE,
    GROUPED_MM,
    KERNEL_UNUSABLE_EXIT,
    QMOE,
    BenchReport,
    BenchRow,
    BenchShape,
    with_fractions,
)
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.tolerances import tolerance

runner = CliRunner()
KERNELS = Path(__file__).resolve().parents[1] / "fixtures" / "kernels"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the child inherits it


def _tiny(tmp_path: Path, kernel: str, *more: str) -> tuple[int, dict[str, Any], str]:
    """``bench --tiny --tokens 8 --kernel KERNEL --json``: (exit code, document, all output)."""
    args = ["bench", "--tiny", "--tokens", "8", "--kernel", kernel, "--json", "--out", str(tmp_path), *more]
    result = runner.invoke(app, args)
    doc = json.loads(result.stdout) if result.exit_code == 0 else {}
    return result.exit_code, doc, result.output


# --------------------------------------------------------------------------------------------
# Every --kernel form gets its rows beside ours (a real child, the interpreter)
# --------------------------------------------------------------------------------------------

FORMS = [
    ("builtin", "kernel builtin"),
    ("specimen:contiguous_only", "kernel specimen:contiguous_only"),
    (f"{KERNELS / 'torch_loop.py'}:moe_loop", "kernel torch_loop.py:moe_loop"),
]


@pytest.mark.parametrize(("kernel", "label"), FORMS, ids=[f[0].rsplit("/", 1)[-1] for f in FORMS])
def test_the_users_kernel_gets_forward_dx_and_block_rows_beside_ours(
    tmp_path: Path, kernel: str, label: str
) -> None:
    code, doc, output = _tiny(tmp_path, kernel)
    assert code == 0, output
    rows = {(r["op"], r["impl"]): r for r in doc["rows"]}
    assert not [r for r in doc["rows"] if r["note"]], [(r["impl"], r["note"]) for r in doc["rows"] if r["note"]]
    gemm_tol, block_tol = tolerance(doc["dtype"]), tolerance(doc["dtype"], "block")
    for op in ("forward", "dx"):
        assert (op, QMOE) in rows and (op, GROUPED_MM) in rows and (op, DENSE) in rows
        mine = rows[(op, label)]
        assert mine["rel_err"] is not None and mine["rel_err"] < gemm_tol, mine
    assert "transpose" in rows[("dx", label)]["config"]  # how its dx was computed, said in the row
    assert ("dw", label) not in rows  # the forward signature has no weight gradient
    block = rows[("block-forward", f"MoEBlock + {label}")]
    assert block["rel_err"] is not None and block["rel_err"] < block_tol, block
    assert ("block-forward-backward", f"MoEBlock + {label}") in rows
    assert ("block-forward", BLOCK_QMOE) in rows and ("block-forward", BLOCK_GROUPED_MM) in rows
    # the report says what was measured beside ours and how to run it again
    assert doc["kernel"] and doc["kernel"] in doc["command"] and "--kernel" in doc["command"]
    assert doc["config_table"] == "interpreter config (CPU smoke run)"


def test_a_kernel_that_fails_on_these_operands_gets_rows_with_its_error(tmp_path: Path) -> None:
    """torch:grouped_mm is the GPU control (it enters the operands' CUDA device): on the CPU its
    rows carry the error as their note, and the run goes on (exit 0), ours measured beside."""
    code, doc, output = _tiny(tmp_path, "torch:grouped_mm", "--no-block")
    assert code == 0, output
    mine = [r for r in doc["rows"] if r["impl"] == "kernel torch:grouped_mm"]
    assert [r["op"] for r in mine] == ["forward", "dx"]
    assert all(r["note"] and r["rel_err"] is None for r in mine), mine
    assert not [r for r in doc["rows"] if r["note"] and r["impl"] != "kernel torch:grouped_mm"]


def test_the_table_names_the_users_rows_and_the_config_table(tmp_path: Path) -> None:
    kernel = f"{KERNELS / 'torch_loop.py'}:moe_loop"
    result = runner.invoke(app, ["bench", "--tiny", "--tokens", "8", "--kernel", kernel, "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "our launch configs: interpreter config (CPU smoke run)" in text
    assert "kernel torch_loop.py:moe_loop" in text and "MoEBlock + kernel torch_loop.py:moe_loop" in text
    assert "…" not in text


def test_without_kernel_there_are_no_user_rows(tmp_path: Path) -> None:
    result = runner.invoke(app, ["bench", "--tiny", "--tokens", "8", "--no-block", "--json", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["kernel"] == "" and "--kernel" not in doc["command"]
    assert not [r for r in doc["rows"] if r["impl"].startswith("kernel ")]


# --------------------------------------------------------------------------------------------
# Refusals: in the parent before any child, or the child's one line
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kernel", "says"),
    [
        ("nope:", "is not a function name"),
        ("", "empty kernel reference"),
        ("specimen:no_such_specimen", "no_such_specimen"),
        ("missing_kernel_file.py:fn", "does not exist"),
        ("no_such_package_xyz.kernels:fn", "no_such_package_xyz"),
        ("adapter:", "adapter"),
    ],
)
def test_a_bad_reference_exits_2_before_any_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel: str, says: str
) -> None:
    from qmoe_doctor.cli.commands import bench as command

    started: list[object] = []
    monkeypatch.setattr(command, "run_bench", lambda *a, **k: started.append(a))
    result = runner.invoke(app, ["bench", "--tiny", "--kernel", kernel, "--out", str(tmp_path / "out")])
    assert result.exit_code == ExitCode.USAGE, result.output
    text = " ".join(result.output.split())
    assert "--kernel" in text and says in text, text
    assert not started, "a child was started for a reference the parent could refuse"
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


def test_a_kernel_the_child_cannot_import_is_the_kernels_usage_error(tmp_path: Path) -> None:
    broken = tmp_path / "broken_kernel.py"
    broken.write_text("import no_such_module_for_bench_xyz\n\ndef fn(x, w, m_sizes):\n    return x\n")
    out = tmp_path / "out"
    result = runner.invoke(app, ["bench", "--tiny", "--tokens", "8", "--kernel", f"{broken}:fn", "--out", str(out)])
    assert result.exit_code == ExitCode.USAGE, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "the kernel could not be used" in errors[0], result.output
    assert "no_such_module_for_bench_xyz" in errors[0]
    assert "Traceback" not in result.output
    assert not out.exists()  # a usage error leaves nothing behind: the line said it all


def test_a_kernel_of_another_signature_is_the_kernels_usage_error(tmp_path: Path) -> None:
    two = tmp_path / "two_args.py"
    two.write_text("def fn(x, w):\n    return x\n")
    result = runner.invoke(app, ["bench", "--tiny", "--tokens", "8", "--kernel", f"{two}:fn", "--out", str(tmp_path / "o")])
    assert result.exit_code == ExitCode.USAGE, result.output
    assert "has signature (x, w)" in " ".join(result.output.split())


def test_status_2_without_the_childs_line_is_still_a_broken_benchmark(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the child's own line makes status 2 the kernel's fault: a Python that exits 2 for
    another reason (a bad interpreter flag) is the benchmark that could not run (exit 4)."""
    assert KERNEL_UNUSABLE_EXIT == ExitCode.USAGE
    path = tmp_path / "exits-2"
    path.write_text("#!/bin/sh\necho 'unknown option' >&2\nexit 2\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv(knobs.QMOE_CHILD_PYTHON, str(path))
    result = runner.invoke(app, ["bench", "--tiny", "--kernel", "builtin", "--out", str(tmp_path / "out")])
    assert result.exit_code == ExitCode.CHECK_BROKEN, result.output
    assert "exited with status 2" in result.output


# --------------------------------------------------------------------------------------------
# Timed reports: the header names the table, the piped table keeps the user's numbers, the plot
# --------------------------------------------------------------------------------------------

USER = "kernel my_moe.py:grouped"
#: Made-up TFLOP/s per (op, impl) at 2048 and 8192 tokens: distinct, so each cell is findable.
SPEEDS = {
    ("forward", QMOE): (301.4, 512.6),
    ("forward", GROUPED_MM): (251.3, 498.7),
    ("forward", USER): (287.9, 533.1),
    ("forward", DENSE): (701.2, 745.5),
    ("dx", QMOE): (290.2, 505.4),
    ("dx", USER): (276.8, 488.2),
    ("dx", DENSE): (702.6, 744.9),
    ("block-forward", BLOCK_QMOE): (150.1, 310.2),
    ("block-forward", f"MoEBlock + {USER}"): (141.7, 296.3),
    ("block-forward", DENSE): (640.4, 702.8),
}
TABLE = "configs-nvidia-h100-80gb-hbm3-sm90-132sm.json (packaged, tuned on NVIDIA H100 80GB HBM3; this device)"


def _timed_report() -> BenchReport:
    rows = [
        BenchRow(
            op=op,  # type: ignore[arg-type]
            impl=impl,
            tokens=tokens,
            m=tokens * 8,
            ms=1.0,
            tflops=speed,
            rel_err=None if impl == DENSE else 1.6e-3,
        )
        for (op, impl), speeds in SPEEDS.items()
        for tokens, speed in zip((2048, 8192), speeds, strict=True)
    ]
    return BenchReport(
        timed=True,
        interpreter=False,
        device="NVIDIA H100 80GB HBM3",
        devices=("NVIDIA H100 80GB HBM3",),
        gpus=(0,),
        torch="2.x",
        triton="3.x",
        preset="qwen3-30b-a3b",
        dtype="bfloat16",
        shape=BenchShape(e=128, n=1536, k=2048, top_k=8, hidden=2048, intermediate=768),
        tokens=(2048, 8192),
        config_table=TABLE,
        kernel="my_moe.py:grouped",
        rows=with_fractions(rows),
    )


def test_piped_the_table_keeps_the_users_numbers_and_names_the_config_table() -> None:
    console = Console(file=io.StringIO(), width=80, soft_wrap=False, highlight=False, markup=False)
    render_report(console, _timed_report())
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "…" not in out
    assert f"our launch configs: {TABLE}" in " ".join(out.split())
    for op, impl in (("forward", USER), ("dx", USER), ("block-forward", f"MoEBlock + {USER}")):
        for speed in SPEEDS[(op, impl)]:
            assert f"{speed:.1f} " in out, (op, impl, speed)  # with its dim fraction of dense after it
    assert "287.9 41%" in out  # 287.9 / 701.2: the user's forward against the dense row


def test_the_command_piped_shows_the_users_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from qmoe_doctor.cli.commands import bench as command

    seen: dict[str, Any] = {}

    def recorded(request: Any, **kwargs: Any) -> BenchReport:
        seen["request"] = request
        return _timed_report()

    monkeypatch.setattr(command, "run_bench", recorded)
    result = runner.invoke(
        app, ["bench", "--tiny", "--kernel", "builtin", "--no-plot", "--out", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    assert seen["request"].kernel == "builtin"
    assert "…" not in result.stdout and "533.1" in result.stdout and "296.3" in result.stdout
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["config_table"] == TABLE and "--kernel builtin" in doc["command"]


def test_the_plot_draws_the_users_kernel(tmp_path: Path) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed (the 'plot' extra)")
    from qmoe_doctor.reports.plot import write_plot

    path = write_plot(_timed_report(), tmp_path / "bench.png")
    assert Path(path).read_bytes().startswith(PNG_MAGIC)


def test_the_child_names_the_device_table_or_says_it_is_unreadable(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the header's line is kernels/tuning.py's own description of cuda:0's table; a
    table that does not parse is said, not a crash of the benchmark."""
    import qmoe_doctor.kernels.tuning as tuning
    from qmoe_doctor.core.launch_configs import ConfigTableError
    from qmoe_doctor.probes.bench import _config_table

    assert _config_table(False) == "interpreter config (CPU smoke run)"
    monkeypatch.setattr(tuning, "describe_device_table", lambda index: f"table of cuda:{index}")
    assert _config_table(True) == "table of cuda:0"

    def broken(index: int) -> str:
        raise ConfigTableError("config table /x/configs-h100.json: unknown op 'fwd'")

    monkeypatch.setattr(tuning, "describe_device_table", broken)
    assert _config_table(True).startswith("unreadable: ConfigTableError: config table /x/configs-h100.json")
