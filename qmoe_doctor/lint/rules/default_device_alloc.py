"""``default-device-alloc``: ``device="cuda"`` (or ``.cuda()``, ``.to("cuda")``,
``new_empty(device=0)``) outside a guard in a kernel wrapper: the buffer lands on the current
device, not on its inputs' device. A *kernel wrapper* launches a Triton kernel or takes tensor
arguments; under a guard, ``"cuda"`` is the guarded device and stays silent.
"""

from __future__ import annotations

import ast

from qmoe_doctor.lint.devices import undeviced
from qmoe_doctor.lint.findings import Rule
from qmoe_doctor.lint.module import Module
from qmoe_doctor.lint.nodes import FuncDef, arg, dotted, kwarg, last, src, text
from qmoe_doctor.lint.project import Project

# torch.<factory>(..., device=...)
_FACTORIES = frozenset(
    {
        "empty",
        "zeros",
        "ones",
        "full",
        "arange",
        "tensor",
        "as_tensor",
        "rand",
        "randn",
        "randint",
        "randperm",
        "empty_strided",
        "linspace",
        "logspace",
        "eye",
        "empty_like",
        "zeros_like",
        "ones_like",
        "full_like",
        "rand_like",
        "randn_like",
    }
)
_NEW_METHODS = frozenset({"new_empty", "new_zeros", "new_ones", "new_full", "new_tensor"})


def check(project: Project, m: Module) -> None:
    wrappers: dict[ast.AST, bool] = {}
    for node in m.calls:
        func = m.func_of(node)
        if func is None or m.exempt(node):
            continue
        desc = _default_device_of(m, node)
        if desc is None:
            continue
        if func not in wrappers:
            wrappers[func] = _is_wrapper(project, m, func)
        if not wrappers[func] or project.guarded(m, node):
            continue  # under a guard, "cuda" is the guarded device
        tensor = _tensor_param(func)
        project.add(
            m,
            node,
            Rule.DEFAULT_DEVICE_ALLOC,
            f"`{src(node)}` allocates on {desc} inside the kernel wrapper `{func.name}`: "
            "outside a device guard the buffer lands on the current device, not on its inputs' device",
            f"device={tensor}.device  # allocate where the inputs live",
        )


def _is_wrapper(project: Project, m: Module, func: FuncDef) -> bool:
    """A kernel wrapper: it launches a Triton kernel or takes tensor arguments."""
    if any(m.func_of(c) is func for c in project.launches[m]):
        return True
    args = [*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs]
    return any(a.annotation is not None and "Tensor" in text(a.annotation) for a in args)


def _tensor_param(func: FuncDef) -> str:
    """The parameter to take the device from in the fix (the first tensor, else the first)."""
    args = [*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs]
    for a in args:
        if a.annotation is not None and "Tensor" in text(a.annotation):
            return a.arg
    plain = [a.arg for a in args if a.arg not in ("self", "cls", "ctx")]
    return plain[0] if plain else "x"


def _default_device_of(m: Module, call: ast.Call) -> str | None:
    """How ``call`` allocates on a device not taken from a tensor; None when it does not."""
    name = m.canon(call.func) or ""
    if name.startswith("torch.") and name.count(".") == 1 and last(name) in _FACTORIES:
        desc = undeviced(m, kwarg(call, "device"))
        return f"device={desc}" if desc else None
    if isinstance(call.func, ast.Attribute):
        attr = call.func.attr
        if dotted(call.func.value) in ("torch", "torch.cuda", "tl", "triton"):
            return None
        if attr in _NEW_METHODS:
            desc = undeviced(m, kwarg(call, "device"))
            return f"device={desc}" if desc else None
        if attr == "cuda":
            device = arg(call, 0, "device")
            if device is None:
                return "`.cuda()` (the current device)"
            desc = undeviced(m, device)
            return f".cuda({desc})" if desc else None
        if attr == "to":
            device = arg(call, 0, "device")
            if isinstance(device, ast.Constant) and isinstance(device.value, int):
                return None  # .to(0) is rare and ambiguous next to dtypes
            desc = undeviced(m, device)
            return f".to({desc})" if desc else None
    return None
