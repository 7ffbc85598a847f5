"""The CLI is a skin: each command validates, calls the library, renders. See --help.

Commands live in ``qmoe_doctor/cli/commands/<name>.py``; this module only wires them, each
inside ``cli.errors.guarded`` (one table from exceptions to messages and exit codes). Importing
it must never import torch or triton (tests/unit/test_cli_contracts.py).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import typer
import typer.core

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
from qmoe_doctor.cli.output import error

#: The click typer runs on (its own vendored copy in recent typer releases, click itself before).
_click: Any = getattr(typer.core, "_click", None) or __import__("click")
#: How long a value the user gave may be when a message quotes it back.
_QUOTED_CHARS = 200


class _Group(typer.core.TyperGroup):
    """The app's group: every usage error click finds (a bad option value, an unknown option, a
    missing argument) is one line on stderr, ``error: ...``, exit 2, as the refusals of our own
    code are, instead of click's boxed, multi-line one; and a flag (``--json``, ``--cpu``) shows
    no ``<bool>`` type in ``--help``: it takes no value."""

    def main(  # type: ignore[override]
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        _hide_flag_types(self)
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _click.exceptions.NoArgsIsHelpError as exc:  # no command: the help, as asked
            exc.show()
            sys.exit(exc.exit_code)
        except _click.exceptions.ClickException as exc:
            error(_usage_line(exc))
            sys.exit(exc.exit_code)
        except typer.Abort:
            error("aborted")
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


def _usage_line(exc: Any) -> str:
    """click's message on one line, the value it quotes clipped, and where --help is."""
    text = " ".join(str(exc.format_message()).split()).rstrip(".")
    if len(text) > 2 * _QUOTED_CHARS:
        text = text[:_QUOTED_CHARS] + f"... ({len(text)} characters)"
    ctx = getattr(exc, "ctx", None)
    where = f"; see {ctx.command_path} --help" if ctx is not None else ""
    return text + where


def _hide_flag_types(group: Any) -> None:
    for command in [group, *getattr(group, "commands", {}).values()]:
        for param in command.params:
            _no_type(param)
        if not getattr(command, "_qmoe_help_flag", False):  # --help is made on demand, once
            made = command.get_help_option
            command.get_help_option = lambda ctx, made=made: _no_type(made(ctx))
            command._qmoe_help_flag = True


def _no_type(param: Any) -> Any:
    if param is not None and getattr(param, "is_flag", False) and param.metavar is None:
        param.metavar = ""  # a flag takes no value: no "<bool>" beside it in --help
    return param


def _help(command: Callable[..., Any]) -> str:
    """A command's docstring as --help shows it: each paragraph one line that the terminal
    wraps, not the docstring's hard line breaks."""
    paragraphs = inspect.cleandoc(command.__doc__ or "").split("\n\n")
    return "\n\n".join(" ".join(p.split()) for p in paragraphs)


app = typer.Typer(
    cls=_Group,
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
    app.command(_name, context_settings=_EXTRA_ARGS.get(_name), help=_help(_command))(guarded(_command))
# its own parser: -- COMMAND
app.command("run", help=_help(_run.run_command), **_run.REGISTRATION)(guarded(_run.run_command))


def main() -> None:
    app()
