"""The one GPU-selection helper of every command: ``--gpus`` and ``--cpu`` read, NVML asked (no
CUDA context), the GPUs picked, and every way that fails said once with its exit code.

Rules, the same for every command:

* ``--gpus ''`` names no GPU, ``--gpus a`` / ``-1`` / ``0-1`` is no list of indices, and ``--gpus``
  with ``--cpu`` contradicts itself: exit 2, whatever the machine has.
* ``--gpus all`` is the default spelt out: the same as leaving it out, GPUs or not.
* ``--gpus`` given on a machine where NVML sees no GPU: exit 2 (the GPUs named do not exist).
* No GPU and no ``--gpus``: the command's CPU fallback runs with a note on stderr, or, for a
  command that needs GPUs, its shortage code (2, or 3 where the README says "too few GPUs").
* Fewer GPUs selected than the command needs: the shortage code, with what was found.
* A command that needs GPUs on a machine whose NVML is there but broken: exit 4 (it could not
  count them), not a shortage.
"""

from __future__ import annotations

from dataclasses import dataclass

from qmoe_doctor.cli.errors import CliError
from qmoe_doctor.cli.output import note
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.machine.inventory import GpuInfo, Inventory, collect_inventory, parse_gpu_spec, select_gpus

# NVML errors that mean "no NVIDIA driver on this machine" (so: zero GPUs, a shortage) rather
# than "the driver is there and NVML is broken" (exit 4: the GPUs could not be counted).
_NO_DRIVER = ("Shared Library Not Found", "Driver Not Loaded", "cannot be imported")


@dataclass(frozen=True, slots=True, kw_only=True)
class Devices:
    gpus: tuple[GpuInfo, ...]  # in --gpus order; (): the CPU
    inventory: Inventory | None  # None: --cpu (NVML was not asked)
    fallback: str = ""  # no GPU was found and the CPU fallback runs: why, as said on stderr

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(g.index for g in self.gpus)


@dataclass(frozen=True, slots=True, kw_only=True)
class Need:
    """What a command needs beyond the CPU: ``count`` GPUs, or it ends with ``code``."""

    count: int
    code: ExitCode = ExitCode.USAGE
    why: str = ""  # what it needs them for: "repro needs two CUDA GPUs: ..."
    hint: str = ""  # a second line when no GPU at all is visible
    few_hint: str = ""  # a second line when some are, but too few


def _shown(gpus: str, limit: int = 60) -> str:
    """The --gpus value as a message quotes it: as given when plain (``0,1``), else its repr (a
    newline or a blank stays visible), cut when long (a 5 kB value is not echoed whole)."""
    if len(gpus) > limit:
        return repr(gpus[:limit]) + f"... ({len(gpus)} characters)"
    return gpus if gpus.isprintable() and not any(c.isspace() for c in gpus) and gpus else repr(gpus)


def check_gpus_option(gpus: str | None, *, cpu: bool = False) -> None:
    """What is wrong with ``--gpus`` whatever the machine has: its syntax too (``a``, ``-1``,
    ``0-1``, ``0.5`` are refused before NVML is asked)."""
    if gpus is not None and not gpus.strip():
        raise CliError(
            f"--gpus {_shown(gpus)} names no GPU; give NVML indices such as 0,1 or 'all', or leave --gpus out"
        )
    if gpus is not None and cpu:
        raise CliError(f"--gpus {_shown(gpus)} selects GPUs and --cpu runs on none: give one of them")
    parse_gpu_spec(gpus)  # GpuSelectionError: exit 2 (cli.errors)


def select_devices(
    gpus: str | None,
    *,
    cpu: bool = False,
    cpu_fallback: str | None = None,
    need: Need | None = None,
    first: int | None = None,
    announce: bool = True,
) -> Devices:
    """The GPUs to run on. ``cpu_fallback`` says what runs without a GPU ("the CPU tier"), on
    stderr unless ``announce`` is off (``env`` shows it in its report); None: the command needs
    ``need`` GPUs. ``first``: without --gpus, take the first N in NVML order."""
    check_gpus_option(gpus, cpu=cpu)
    if cpu:
        return Devices(gpus=(), inventory=None)
    if parse_gpu_spec(gpus) is None:  # "all" is the default, and means the same without GPUs
        gpus = None
    inv = collect_inventory()
    why = inv.nvml_error or "NVML lists none"
    needs_gpus = need is not None and (need.count > 0 or cpu_fallback is None)
    if (
        need is not None
        and needs_gpus
        and inv.nvml_error
        and not any(s in inv.nvml_error for s in _NO_DRIVER)
    ):
        raise CliError(f"{need.why}: cannot count GPUs: {inv.nvml_error}", code=ExitCode.CHECK_BROKEN)
    if not inv.gpus:
        if gpus:
            raise CliError(f"--gpus {_shown(gpus)} given but no GPU is visible ({why})")
        if need is not None and needs_gpus:
            raise CliError(f"no GPU found ({why}): {need.why}", code=need.code, hint=need.hint)
        if cpu_fallback is None:
            raise CliError(f"no GPU found ({why})")
        said = f"no GPU found ({why}): {cpu_fallback}"
        if announce:
            note(said)
        return Devices(gpus=(), inventory=inv, fallback=said)
    selected = select_gpus(inv, gpus)  # GpuSelectionError: exit 2 (cli.errors)
    if gpus is None and first is not None:
        selected = selected[:first]
    if need is not None and len(selected) < need.count:
        found = "; ".join(g.describe() for g in selected)
        which = f"selected by --gpus {_shown(gpus)}" if gpus else "visible to NVML"
        hint = "" if gpus else need.few_hint
        raise CliError(f"{need.why}; {len(selected)} GPU(s) {which}: {found}", code=need.code, hint=hint)
    return Devices(gpus=selected, inventory=inv)


__all__ = ["Devices", "Need", "check_gpus_option", "select_devices"]
