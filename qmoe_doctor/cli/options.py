"""Every option two commands share, declared once as an ``Annotated`` alias with one help text
(huggingface_hub ``cli/_cli_utils.py``; pip's ``cmdoptions``: "define options once"). A command
gives the default where it declares the parameter::

    def scan_command(kernel: KernelOpt = "builtin", gpus: GpusOpt = None, json_out: JsonOpt = False): ...

The convention, the same in every command:

* ``--json`` is a flag: the versioned JSON document (``schema_version``, ``kind``) to stdout,
  instead of the tables. ``--save FILE`` writes the same document to FILE (checked before the run
  starts), wherever a command makes a report. ``check --junit FILE`` adds the JUnit XML.
* ``--gpus`` takes NVML indices (``0,1``) or ``all``; an empty value, or ``--gpus`` with
  ``--cpu``, is refused (exit 2), never silently ignored.
* An option that cannot apply is refused (exit 2) when the command line itself rules it out, and
  warned about on stderr when the machine does (no GPU found: the CPU tier runs).

The parsers beside the aliases (:func:`conditions`, :func:`preset`) raise ``CliError``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated

import typer

from qmoe_doctor.cli.errors import CliError
from qmoe_doctor.cli.output import quoted
from qmoe_doctor.core import knobs
from qmoe_doctor.core.autotune import DEFAULT_AUTOTUNE, AutotunePolicy
from qmoe_doctor.core.conditions import (
    CPU_CONDITIONS,
    DEFAULT_CONDITIONS,
    PAIR_ORDER,
    ROUTED_CPU,
    ROUTED_ORDER,
    SINGLE_ORDER,
    SWEEP_CONDITIONS,
)
from qmoe_doctor.core.kernel_ref import KernelRef
from qmoe_doctor.core.records import Condition
from qmoe_doctor.core.shapes import PRESETS

#: The scan's conditions in run order, as --only takes them.
CONDITION_NAMES = tuple(c.value for c in (*SINGLE_ORDER, *SWEEP_CONDITIONS, *PAIR_ORDER, *ROUTED_ORDER))
PRESET_NAMES = ", ".join(PRESETS)

KERNEL_HELP = (
    "Kernel, called as fn(x, w, m_sizes) -> y: 'builtin' (ours), 'torch:grouped_mm' (a control), "
    "'specimen:NAME' (`qmoe-doctor specimens`), 'module.path:function', 'path/to/file.py:function', "
    "or 'adapter:NAME[:TARGET]' for a kernel with another signature ('adapter:flat-weights:TARGET': "
    "TARGET takes w flattened to (E*N, K); docs/ci.md; 'adapter:routed[:TARGET]': TARGET takes the router's "
    "ids, fn(hidden_states, w, topk_ids, topk_weights[, expert_map]), docs/cells.md). Checked before "
    "anything runs: every command accepts and refuses the same references."
)
GPUS_HELP = (
    "GPUs as NVML / nvidia-smi number them, in order, e.g. 0,1, or 'all' (default: all). The report "
    "says which CUDA ordinal each became. Refused when empty or together with --cpu."
)
CPU_HELP = (
    "Run on the CPU even when GPUs exist: the Triton interpreter, float32, small shapes (parallel "
    "ranks: gloo processes)."
)
PRESET_HELP = f"Shape preset: {PRESET_NAMES}."
ROWS_HELP = (
    "Rows (tokens x top-k) of the main GPU cells. The CPU tier runs its own small shape: refused "
    "with --cpu, a warning when no GPU is found."
)
ONLY_HELP = (
    f"Comma-separated conditions to run (default: all that apply): {', '.join(CONDITION_NAMES)}. "
    f"The CPU tier can run {', '.join(c.value for c in CPU_CONDITIONS)} and the "
    f"{' and '.join(c.value for c in SWEEP_CONDITIONS)} sweeps; a routed kernel (adapter:routed:TARGET) runs "
    f"{', '.join(c.value for c in ROUTED_CPU)} there instead of the m_sizes routing edges."
)
TIMEOUT_HELP = "Seconds each probe may take (parallel runs: each launch)."
LOG_DIR_HELP = (
    "Folder for the children's logs (default: a temp folder, said in the report). Checked before "
    "the run starts."
)
JSON_HELP = "Write the versioned JSON document to stdout instead of the tables."
AUTOTUNE_HELP = (
    "How the kernel's own autotuner (@triton.autotune) runs in the probes. 'first' (default): each "
    "probe runs the first config the autotuner keeps after its own pruning, without benchmarking: "
    "one compile per shape, the fastest; the cells see that config, not the one it would pick. "
    "'cached': the autotuner benchmarks as written, its results kept on disk in a Triton cache of "
    "the scan's own (under the log folder) and shared by every probe process: each shape is "
    "benchmarked once per scan, from a cold compile cache; the cells see the autotuner's choice. "
    "'full': every probe process autotunes every new shape, as a fresh process of yours does: the "
    "slowest (minutes for a kernel with a thousand configs). Under every policy the repeat-call "
    "probe autotunes for real on the caller's buffers (the autotune-inplace-rerun cause needs it). "
    "Kernels without an autotuner run the same under all three."
)
SAVE_HELP = "Also write the versioned JSON document to FILE (checked before the run starts)."
SARIF_HELP = (
    "Also write a SARIF 2.1.0 log to FILE (GitHub code scanning and other CI systems read it): each "
    "finding with its rule id, cause id, file, line and column, the fix, and its docs page."
)

KernelOpt = Annotated[str, typer.Option("--kernel", "-k", help=KERNEL_HELP)]
KernelsOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--kernel", "-k", help=KERNEL_HELP + " Repeatable; default: builtin, unless only --lint is given."
    ),
]
GpusOpt = Annotated[str | None, typer.Option("--gpus", help=GPUS_HELP)]
CpuOpt = Annotated[bool, typer.Option("--cpu", help=CPU_HELP)]
PresetOpt = Annotated[str, typer.Option("--preset", help=PRESET_HELP)]
RowsOpt = Annotated[int, typer.Option("--rows", min=1, help=ROWS_HELP)]
OnlyOpt = Annotated[str | None, typer.Option("--only", help=ONLY_HELP)]
#: The longest --timeout taken: a week. 1e400 reads as infinity, which no child would ever reach.
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MIN_TIMEOUT_S = 1.0


def timeout_seconds(value: float) -> float:
    """``--timeout``'s check: a finite number of seconds from 1 to a week. (click's own range check
    read ``nan`` as "should be <= 604800".)"""
    if not (math.isfinite(value) and MIN_TIMEOUT_S <= value <= MAX_TIMEOUT_S):
        raise typer.BadParameter(
            f"{value} is not a number of seconds from {MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S:g} (a week)"
        )
    return value


TimeoutOpt = Annotated[
    float,
    typer.Option(
        "--timeout", callback=timeout_seconds, help=TIMEOUT_HELP + f" From 1 to {MAX_TIMEOUT_S:g} (a week)."
    ),
]
LogDirOpt = Annotated[Path | None, typer.Option("--log-dir", help=LOG_DIR_HELP)]
JsonOpt = Annotated[bool, typer.Option("--json", help=JSON_HELP)]
SaveOpt = Annotated[Path | None, typer.Option("--save", metavar="FILE", help=SAVE_HELP)]
SarifOpt = Annotated[Path | None, typer.Option("--sarif", metavar="FILE", help=SARIF_HELP)]
AutotuneOpt = Annotated[AutotunePolicy, typer.Option("--autotune", case_sensitive=False, help=AUTOTUNE_HELP)]

DEFAULT_PRESET = "qwen3-30b-a3b"
DEFAULT_TIMEOUT_S = knobs.DEFAULT_PROBE_TIMEOUT_S


def kernel_ref(text: str) -> KernelRef:
    """``--kernel`` parsed and checked in the parent (KernelRefError: exit 2, one line)."""
    return KernelRef.parse(text).validate()


def preset(name: str, *, option: str = "--preset") -> str:
    if name not in PRESETS:
        raise CliError(f"{option}: unknown preset {quoted(name)}; known: {PRESET_NAMES}")
    return name


def conditions(text: str | None) -> frozenset[Condition]:
    """``--only``: None gives every condition; a value must name at least one."""
    if text is None:
        return DEFAULT_CONDITIONS
    chosen: set[Condition] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        condition = next((c for c in DEFAULT_CONDITIONS if c.value == part), None)
        if condition is None:
            raise CliError(
                f"--only {quoted(text)}: unknown condition {quoted(part)}; known: {', '.join(CONDITION_NAMES)}"
            )
        chosen.add(condition)
    if not chosen:
        raise CliError(
            f"--only {quoted(text)} names no condition; give one or more of {', '.join(CONDITION_NAMES)}"
        )
    return frozenset(chosen)


def given(ctx: typer.Context, name: str) -> bool:
    """Whether the user set parameter ``name`` (not its default). The source enum is compared by
    name: typer vendors its own click in recent versions."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name != "DEFAULT"


__all__ = [
    "AUTOTUNE_HELP",
    "CONDITION_NAMES",
    "DEFAULT_AUTOTUNE",
    "AutotuneOpt",
    "CpuOpt",
    "GpusOpt",
    "JsonOpt",
    "KERNEL_HELP",
    "KernelOpt",
    "KernelsOpt",
    "LogDirOpt",
    "MAX_TIMEOUT_S",
    "MIN_TIMEOUT_S",
    "OnlyOpt",
    "PresetOpt",
    "RowsOpt",
    "SarifOpt",
    "SaveOpt",
    "TimeoutOpt",
    "conditions",
    "given",
    "kernel_ref",
    "preset",
    "timeout_seconds",
]
