"""The CLI is a skin: each command validates, calls the library, renders. See --help.

Commands live in ``qmoe_doctor/cli/commands/<name>.py``; this module only wires them, each
inside ``cli.errors.guarded`` (one table from exceptions to messages and exit codes). Importing
it must never import torch or triton (tests/unit/test_cli_contracts.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

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
from qmoe_doctor.cli.commands import run as _run
from qmoe_doctor.cli.commands import scan as _scan
from qmoe_doctor.cli.commands import specimens as _specimens
from qmoe_doctor.cli.errors import guarded

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
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """qmoe-doctor: a doctor for multi-GPU memory faults in fused MoE kernels."""


#: name -> command function, in the order --help lists them.
COMMANDS: dict[str, Callable[..., Any]] = {
    "scan": _scan.scan_command,
    "check": _check.check_command,
    "repro": _repro.repro_command,
    "parallel": _parallel.parallel_command,
    "env": _env.env_command,
    "specimens": _specimens.specimens_command,
    "audit": _audit.audit_command,
    "lint": _lint.lint_command,
    "explain": _explain.explain_command,
    "bench": _bench.bench_command,
}
#: `check --json out.json` (when --json took a path) reaches the command, which answers with a
#: hint to use --save, instead of click's bare "unexpected extra argument".
_EXTRA_ARGS = {"check": {"allow_extra_args": True}}

for _name, _command in COMMANDS.items():
    app.command(_name, context_settings=_EXTRA_ARGS.get(_name))(guarded(_command))
app.command("run", **_run.REGISTRATION)(guarded(_run.run_command))  # its own parser: -- COMMAND


def main() -> None:
    app()
