"""`qmoe-doctor specimens`: list the deliberately faulty kernels that calibrate the doctor."""

from __future__ import annotations

from typing import Any

import typer
from rich import box
from rich.table import Table

from qmoe_doctor.cli.output import emit_json, stdout_console
from qmoe_doctor.core.causes import get_cause
from qmoe_doctor.core.specimens import SPECIMENS, SpecimenInfo


def _as_dict(spec: SpecimenInfo) -> dict[str, Any]:
    return {
        "name": spec.name,
        "cause": spec.cause,
        "summary": spec.summary,
        "trigger": spec.trigger,
        "kernel": spec.kernel_option,  # what --kernel takes
        "ref": spec.ref,  # module:function
        "misbehaves_under": [str(c) for c in spec.misbehaves_under],
        "docs": get_cause(spec.cause).docs,
    }


def specimens_command(
    json_output: bool = typer.Option(False, "--json", help="Write one JSON document to stdout."),
) -> None:
    """List the specimens: deliberately faulty kernels, one per cause, that calibrate the doctor.

    Scan one with [bold]qmoe-doctor scan --kernel specimen:NAME[/bold]: the doctor must name its
    cause and no other.
    """
    if json_output:
        emit_json("specimens", {"specimens": [_as_dict(s) for s in SPECIMENS]})
        return
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("--kernel", no_wrap=True, style="bold")
    table.add_column("cause", no_wrap=True)
    table.add_column("what it does wrong / when it misbehaves")
    for spec in SPECIMENS:
        table.add_row(spec.kernel_option, spec.cause, f"{spec.summary}\n[dim]when: {spec.trigger}[/dim]")
    console = stdout_console()
    console.print(table)
    console.print(
        "Each is qmoe_doctor.kernels.specimens.<name>:moe_grouped_gemm; docs: docs/causes/<cause>.md"
    )
