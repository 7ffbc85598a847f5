"""The CLI is a skin: each command validates, calls the library, renders. See --help.

Commands live in ``qmoe_doctor/cli/commands/<name>.py``; this module only wires them.
Importing it must never import torch (a unit test checks).
"""

from __future__ import annotations

import typer

from qmoe_doctor import __version__
from qmoe_doctor.cli.commands import audit as _audit
from qmoe_doctor.cli.commands import bench as _bench
from qmoe_doctor.cli.commands import check as _check
from qmoe_doctor.cli.commands import env as _env
from qmoe_doctor.cli.commands import explain as _explain
from qmoe_doctor.cli.commands import lint as _lint
from qmoe_doctor.cli.commands import parallel as _parallel
from qmoe_doctor.cli.commands import repro as _repro
from qmoe_doctor.cli.commands import scan as _scan
from qmoe_doctor.cli.commands import specimens as _specimens

app = typer.Typer(
    name="qmoe-doctor",
    help=(
        "Find which cross-GPU pointer or synchronization mistake makes a fused MoE kernel fail, "
        "prove it from differential evidence, and say how to fix it.\n\n"
        "Start with [bold]qmoe-doctor scan[/bold]; [bold]qmoe-doctor env[/bold] shows the GPUs."
    ),
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"qmoe-doctor {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """qmoe-doctor: a doctor for multi-GPU memory faults in fused MoE kernels."""


app.command("scan")(_scan.scan_command)
app.command("check")(_check.check_command)
app.command("repro")(_repro.repro_command)
app.command("parallel")(_parallel.parallel_command)
app.command("env")(_env.env_command)
app.command("specimens")(_specimens.specimens_command)
app.command("audit")(_audit.audit_command)
app.command("lint")(_lint.lint_command)
app.command("explain")(_explain.explain_command)
app.command("bench")(_bench.bench_command)


def main() -> None:
    app()
