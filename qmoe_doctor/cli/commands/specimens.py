"""`qmoe-doctor specimens`: list the deliberately faulty kernels that calibrate the doctor."""

from __future__ import annotations

from typing import Any

from qmoe_doctor.cli import options as opt
from qmoe_doctor.cli.output import emit_json, stdout_console
from qmoe_doctor.cli.render.specimens import render_specimens
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


def specimens_command(json_out: opt.JsonOpt = False) -> None:
    """List the specimens: deliberately faulty kernels, one per cause, that calibrate the doctor.

    Scan one with [bold]qmoe-doctor scan --kernel specimen:NAME[/bold]: the doctor must name its
    cause and no other. A catalogue, not a report: no --save.
    """
    if json_out:
        emit_json("specimens", {"specimens": [_as_dict(s) for s in SPECIMENS]})
        return
    render_specimens(stdout_console(), SPECIMENS)
