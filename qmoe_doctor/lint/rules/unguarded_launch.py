"""``unguarded-launch``: a Triton launch outside a device guard and not after
``torch.cuda.set_device``, in every form the project model recognises
(:meth:`~qmoe_doctor.lint.project.Project.kernels_of`): ``kernel[grid](...)``,
``fn[grid](...)`` with ``fn = kernel_ws if ws else kernel`` (or bound in an if/else),
``KERNELS[name][grid](...)``, ``getattr(module, name)[grid](...)``, ``kernel.run(..., grid=...)``
and ``launch = kernel[grid]; launch(...)``.

A launch helper is followed up to its callers ("callers hold the guard"): the finding lands on
each call without a guard, or on the launch itself when the helper has no caller in the linted
files. Test functions and ``if __name__ == "__main__":`` blocks stay silent.
"""

from __future__ import annotations

import ast

from qmoe_doctor.lint.devices import in_torch_device_cm
from qmoe_doctor.lint.findings import Rule
from qmoe_doctor.lint.module import Module
from qmoe_doctor.lint.nodes import src
from qmoe_doctor.lint.project import Project

_NOT_A_GUARD = " (`with torch.device(...)` only sets the default device of factories)"


def check(project: Project, m: Module) -> None:
    for launch in project.launches[m]:
        info = project.launch_site(launch)
        kernel = info.describe() if info is not None else "`kernel`"
        for site_module, site in project.unguarded_sites(m, launch):
            if site is launch:
                _report_launch(project, m, launch, kernel)
            elif isinstance(site, ast.Call):
                _report_call_site(project, site_module, site, kernel, f"{m.path}:{launch.lineno}")


def _first_tensor(call: ast.Call) -> str:
    first = call.args[0] if call.args else None
    return src(first) if isinstance(first, (ast.Name, ast.Attribute)) else "x"


def _report_launch(project: Project, m: Module, launch: ast.Call, kernel: str) -> None:
    """The launch is in an entry point: nothing above it could hold the guard."""
    func = m.func_of(launch)
    msg = (
        f"Triton launch of {kernel} is not inside a device guard: it runs on the current "
        "CUDA device and that device's stream, not on the device of its tensors"
    )
    if in_torch_device_cm(m, launch):
        msg += _NOT_A_GUARD
    if func is not None:
        msg += f"; no caller of `{func.name}` in the linted files holds one"
    fix = f"with torch.cuda.device({_first_tensor(launch)}.device):\n    {src(launch.func)}(...)"
    project.add(m, launch, Rule.UNGUARDED_LAUNCH, msg, fix)


def _report_call_site(project: Project, m: Module, call: ast.Call, kernel: str, launch_at: str) -> None:
    """A call of a launch helper without a guard, the launch at ``launch_at``."""
    callee = src(call.func)
    msg = (
        f"`{callee}(...)` is called outside a device guard and launches the Triton kernel "
        f"{kernel} ({launch_at}) without one: it runs on the current CUDA device and that "
        "device's stream, not on the device of its tensors"
    )
    if in_torch_device_cm(m, call):
        msg += _NOT_A_GUARD
    fix = f"with torch.cuda.device({_first_tensor(call)}.device):\n    {callee}(...)"
    project.add(m, call, Rule.UNGUARDED_LAUNCH, msg, fix)
