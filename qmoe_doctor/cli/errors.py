"""One table from library exceptions to a one-line message and an exit code, applied around
every command (pip's ``status_codes``, huggingface_hub's ``cli/_errors.py``).

No exception a user can provoke escapes as a traceback: a bad ``--kernel``, ``--gpus`` or config
file, an output path that cannot be written, Ctrl-C. A command raises :class:`CliError` for its
own refusals; the library raises its own types and :data:`ERRORS` says what each means. An
exception in no row is a bug of ours: one line, exit 4, and the traceback saved to a file.
"""

from __future__ import annotations

import functools
import signal
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import typer

from qmoe_doctor.cli.output import OutputPathError, error, note
from qmoe_doctor.core.audit import ConfigError
from qmoe_doctor.core.events import Interrupted, kept_logs
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.inputs import InputError
from qmoe_doctor.core.kernel_ref import KernelRefError
from qmoe_doctor.machine.inventory import GpuSelectionError
from qmoe_doctor.workflows.bench import BenchError
from qmoe_doctor.workflows.parallel import ParallelPlanError
from qmoe_doctor.workflows.scan import KernelUnusable

P = ParamSpec("P")
R = TypeVar("R")


class CliError(Exception):
    """A refusal of the CLI itself: one line, and the exit code it means."""

    def __init__(self, message: str, *, code: ExitCode = ExitCode.USAGE, hint: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.hint = hint  # a second line: what to do instead


#: What a kernel must be, said after every "the kernel could not be used".
KERNEL_PARAGRAPH = (
    "qmoe-doctor calls kernels as fn(x, w, m_sizes) -> y with x (M, K) rows sorted by expert, "
    "w (E, N, K) and m_sizes (E,); pass --kernel module:function or path/to/file.py:function naming "
    "such a callable, or adapter:NAME:TARGET for a kernel with another signature (docs/ci.md). The "
    "probe child imports it: same Python, same working directory."
)


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorRule:
    error: type[BaseException]
    code: ExitCode
    when: str  # what the user did to get it (the README's table says the same)
    prefix: str = ""  # before the exception's own message
    hint: str = ""  # a second line: what to do


#: First match wins: specific types before the ValueError and OSError they derive from.
ERRORS: tuple[ErrorRule, ...] = (
    ErrorRule(
        error=KernelRefError, code=ExitCode.USAGE, when="a --kernel that is malformed or names nothing"
    ),
    ErrorRule(
        error=KernelUnusable,
        code=ExitCode.USAGE,
        when="a kernel the probe child could not import, or one with another signature",
        prefix="the kernel could not be used: ",
        hint=KERNEL_PARAGRAPH,
    ),
    ErrorRule(error=GpuSelectionError, code=ExitCode.USAGE, when="a --gpus value that names no usable GPUs"),
    ErrorRule(
        error=InputError, code=ExitCode.USAGE, when="an input file that is missing, special or too big"
    ),
    ErrorRule(error=ConfigError, code=ExitCode.USAGE, when="a model config that is not a usable MoE config"),
    ErrorRule(error=OutputPathError, code=ExitCode.USAGE, when="an output path the run could not write"),
    ErrorRule(
        error=ParallelPlanError, code=ExitCode.USAGE, when="parallel modes that do not fit the devices"
    ),
    ErrorRule(error=BenchError, code=ExitCode.CHECK_BROKEN, when="the benchmark child failed"),
    # a value from the command line or the environment (QMOE_DOCTOR_* variables) the library refused
    ErrorRule(error=ValueError, code=ExitCode.USAGE, when="an option or variable with a value out of range"),
    ErrorRule(error=RecursionError, code=ExitCode.USAGE, when="an input nested too deep to read"),
    ErrorRule(error=OSError, code=ExitCode.CHECK_BROKEN, when="the system refused something the run needs"),
    ErrorRule(error=MemoryError, code=ExitCode.CHECK_BROKEN, when="the run ran out of memory"),
)

#: Passed through untouched: click's own usage errors and the exits commands raise.
_PASS_THROUGH = (typer.Exit, typer.Abort, typer.exceptions.TyperException)


def rule_for(exc: BaseException) -> ErrorRule | None:
    for rule in ERRORS:
        if isinstance(exc, rule.error):
            return rule
    return None


def interrupt_code(exc: KeyboardInterrupt) -> int:
    """128 + the signal: 130 for Ctrl-C (the shell's convention), 143 for SIGTERM."""
    if isinstance(exc, Interrupted):
        return exc.exit_code
    return 128 + int(signal.SIGINT)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 2000 else text[:2000] + " ..."


def _save_traceback(exc: BaseException) -> str:
    try:
        with tempfile.NamedTemporaryFile(
            "w", prefix="qmoe-doctor-crash-", suffix=".txt", delete=False, encoding="utf-8"
        ) as fh:
            fh.write("".join(traceback.format_exception(exc)))
            return fh.name
    except OSError:
        return ""


def say_kept_logs(exc: BaseException) -> None:
    """Name the log folders the run that ``exc`` ended kept (nothing is left behind unsaid)."""
    for folder in kept_logs(exc):
        note(f"the run's logs are kept in {folder}")


def guarded(command: Callable[P, R]) -> Callable[P, R]:
    """Run ``command`` with every exception mapped through :data:`ERRORS` to a one-line message
    on stderr and its exit code (``typer.Exit``)."""

    @functools.wraps(command)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except _PASS_THROUGH:
            raise
        except CliError as exc:
            error(exc.message)
            if exc.hint:
                note(exc.hint, style="")
            say_kept_logs(exc)
            raise typer.Exit(exc.code) from None
        except KeyboardInterrupt as exc:
            error(str(exc) if isinstance(exc, Interrupted) else "interrupted")
            say_kept_logs(exc)
            raise typer.Exit(interrupt_code(exc)) from None
        except Exception as exc:
            rule = rule_for(exc)
            if rule is None:
                saved = _save_traceback(exc)
                error(
                    f"internal error (a bug in qmoe-doctor): {type(exc).__name__}: {_one_line(exc)}"
                    + (f"; the traceback is in {saved}" if saved else "")
                )
                raise typer.Exit(ExitCode.CHECK_BROKEN) from None
            error(rule.prefix + _one_line(exc))
            if rule.hint:
                note(rule.hint, style="")
            say_kept_logs(exc)
            raise typer.Exit(rule.code) from None

    return run


__all__ = [
    "ERRORS",
    "KERNEL_PARAGRAPH",
    "CliError",
    "ErrorRule",
    "guarded",
    "interrupt_code",
    "rule_for",
    "say_kept_logs",
]
