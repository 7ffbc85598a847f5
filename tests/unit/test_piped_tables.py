"""Tables printed to a pipe or a CI log keep every character (``qmoe_doctor.cli.output.print_table``).

Off a terminal rich assumes 80 columns and cut what did not fit to "…": the env table's headers
("Uncor…", "Retir…") and the code of a lint finding's fix, as a recorded H100 run's log showed.
The bench table's numbers have their own tests (test_bench_render.py)."""

from __future__ import annotations

import io
import re

from rich.console import Console
from typer.testing import CliRunner

from qmoe_doctor.cli.app import app
from qmoe_doctor.cli.render.env import render_inventory
from qmoe_doctor.core.specimens import SPECIMENS
from qmoe_doctor.machine.inventory import GpuInfo, Inventory

#: The one GPU of the 2026-12-06 H100 run's `qmoe-doctor env`, as NVML reported it there.
H100 = GpuInfo(
    index=0, name="NVIDIA H100 80GB HBM3", uuid="GPU-c108d953-bf50-9f16-82c0-874a4b3d8ce3",
    pci_bus_id="00000000:00:06.0", memory_total=85520809984, memory_free=85017493504,
    compute_capability=(9, 0), mig_current=False, mig_pending=False, ecc_current=True, ecc_pending=True,
    ecc_volatile_uncorrected=0, ecc_aggregate_uncorrected=0, remapped_rows_correctable=0,
    remapped_rows_uncorrectable=0, remap_pending=False, remap_failure=False,
)  # fmt: skip


def _piped() -> Console:
    """What rich sees on a pipe: not a terminal, 80 columns."""
    return Console(file=io.StringIO(), width=80, soft_wrap=False, highlight=False, markup=False)


def _stdout(args: list[str]) -> str:
    result = CliRunner().invoke(app, args)  # CliRunner's output is not a terminal
    assert result.exit_code in (0, 1), result.output
    return result.stdout


def test_env_piped_keeps_the_gpu_table_whole() -> None:
    console = _piped()
    render_inventory(console, Inventory(gpus=(H100,)))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "…" not in out
    for text in ("NVIDIA H100 80GB HBM3", "00000000:00:06.0", "Mem free/total", "Uncorr. ECC vol/agg", "Retired", "79/80 GiB"):
        assert text in out, text


def test_lint_piped_keeps_the_fix_code_whole_and_wraps_the_prose() -> None:
    out = _stdout(["lint", "kernels/specimens/cached_sms.py"])
    assert "…" not in out
    assert "    return torch.cuda.get_device_properties(device_index).multi_processor_count" in out
    assert max(len(line) for line in out.splitlines()) <= 140  # the message wraps rather than running on


def test_lint_on_a_narrow_terminal_folds_the_fix_code_rather_than_cutting_it() -> None:
    from qmoe_doctor.cli.render.lint import render_table
    from qmoe_doctor.workflows.lint import run_lint

    console = Console(file=io.StringIO(), width=80, force_terminal=True, color_system=None)
    render_table(console, run_lint(["kernels/specimens/cached_sms.py"]))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "…" not in out
    cells = "".join(line.split("│")[3].strip() for line in out.splitlines() if line.count("│") >= 4)
    assert "torch.cuda.get_device_properties(device_index).multi_processor_count" in cells


def test_specimens_piped_keeps_each_summary_on_its_line() -> None:
    out = _stdout(["specimens"])
    assert "…" not in out
    for spec in SPECIMENS:
        assert any(spec.summary in line for line in out.splitlines()), spec.name


def test_audit_piped_keeps_the_role_column() -> None:
    """On a terminal narrower than 130 columns the audit leaves the role column out; a pipe gets
    it, every row whole, at the table's natural width."""
    out = _stdout(["audit", "--preset", "qwen3-coder-480b-a35b"])
    assert "…" not in out
    assert "role" in out and "fused gate_up weight stack" in out
    assert re.search(r"gate_up\.w\s+│\s+160 x 5120 x 6144\s+│\s+5,033,164,799\s+│\s+WRAPS\s+│\s+expert 69", out)
