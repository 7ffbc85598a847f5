"""`qmoe-doctor specimens`: list the kernels that calibrate the doctor (faulty ones and correct ones)."""

from __future__ import annotations

from typing import Any

from qmoe_doctor.cli import options as opt
from qmoe_doctor.cli.output import emit_json, stdout_console
from qmoe_doctor.cli.render.specimens import adapter_option, render_specimens
from qmoe_doctor.core.causes import get_cause
from qmoe_doctor.core.kernel_ref import BUILTIN_ADAPTERS, BuiltinAdapter
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
        "rejected_under": list(spec.rejected_under),
        "lint_rule": spec.lint_rule,
        "protocol": spec.protocol,  # how the probes call it (core.kernel_ref.Protocol)
        "docs": get_cause(spec.cause).docs if spec.cause is not None else None,  # a correct kernel: none
    }


def _adapter_dict(adapter: BuiltinAdapter) -> dict[str, Any]:
    return {
        "name": adapter.name,
        "kernel": adapter_option(adapter),  # what --kernel takes, TARGET the user's kernel
        "takes": adapter.takes,
        "summary": adapter.summary,
        "default_target": adapter.default_target,  # what adapter:NAME alone runs (None: a target is needed)
        "protocol": adapter.protocol,
    }


def specimens_command(json_out: opt.JsonOpt = False) -> None:
    """List the specimens: kernels that calibrate the doctor, each planting one cause, and
    correct kernels in the style of public ones (cause "none": they must come out healthy).
    Then the built-in adapters, for kernels of another signature.

    Scan one with [bold]qmoe-doctor scan --kernel specimen:NAME[/bold]: the doctor must name its
    cause and no other. A catalogue, not a report: no --save.
    """
    adapters = tuple(BUILTIN_ADAPTERS.values())
    if json_out:
        emit_json(
            "specimens",
            {"specimens": [_as_dict(s) for s in SPECIMENS], "adapters": [_adapter_dict(a) for a in adapters]},
        )
        return
    render_specimens(stdout_console(), SPECIMENS, adapters)
