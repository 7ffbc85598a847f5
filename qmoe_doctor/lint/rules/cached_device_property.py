"""``cached-device-property``: properties of the *current* device (``get_device_properties()``
with no device, or an undeviced one) cached at module level, in a ``functools.cache`` /
``lru_cache`` function, or in a global: kernels launched for another GPU then get this one's
SM count and limits. A read under a guard, or keyed by a device from the caller, stays silent.
"""

from __future__ import annotations

import ast

from qmoe_doctor.lint.devices import lexical_guard, undeviced
from qmoe_doctor.lint.findings import Rule
from qmoe_doctor.lint.module import Module
from qmoe_doctor.lint.nodes import FuncDef, arg, is_none, last, src
from qmoe_doctor.lint.project import Project

_CACHE_DECORATORS = frozenset({"functools.cache", "functools.lru_cache", "cache", "lru_cache"})


def check(project: Project, m: Module) -> None:
    for node in m.calls:
        if last(m.canon(node.func)) != "get_device_properties":
            continue
        device = arg(node, 0, "device")
        if device is None or is_none(device):
            which = "the current device"
        else:
            desc = undeviced(m, device)
            if desc is None:
                continue  # keyed by a device that comes from the caller
            which = "the current device" if "current device" in desc else desc
        parent = m.parents.get(node)
        prop = parent.attr if isinstance(parent, ast.Attribute) and parent.value is node else None
        shown = src(parent) if prop and isinstance(parent, ast.expr) else src(node)
        what = f"`{shown}` reads {which}; the value"
        if not m.at_module_level(node) and lexical_guard(m, node):
            continue  # read under a guard: the function picks its device itself
        how = cached_how(m, node)
        if how is None:
            continue
        project.add(
            m,
            node,
            Rule.CACHED_DEVICE_PROPERTY,
            f"{what} {how}: kernels launched for another GPU get this one's SM count and limits",
            "@functools.cache\ndef num_sms(device_index: int) -> int:\n"
            "    return torch.cuda.get_device_properties(device_index).multi_processor_count\n"
            "# at the call: num_sms(x.device.index)",
        )


def cached_how(m: Module, node: ast.AST) -> str | None:
    """How the value read at ``node`` is kept for later calls: computed at import, cached by a
    ``functools.cache`` function, or stored in a global; None when it is read afresh."""
    func = m.func_of(node)
    if func is None:
        return "is computed once at import and reused for every device"
    if any(
        (m.canon(d.func if isinstance(d, ast.Call) else d) or "") in _CACHE_DECORATORS for d in func.decorator_list
    ):
        return f"is cached by `{func.name}`, which is not keyed by device"
    if _stored_in_global(m, node, func):
        return f"is stored in a module global by `{func.name}`"
    return None


def _stored_in_global(m: Module, node: ast.AST, func: FuncDef) -> bool:
    """``node`` is assigned to a name ``func`` declares ``global``."""
    declared = {name for n in m.shallow(func) if isinstance(n, ast.Global) for name in n.names}
    if not declared:
        return False
    for anc in m.ancestors(node):
        if isinstance(anc, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = anc.targets if isinstance(anc, ast.Assign) else [anc.target]
            return any(isinstance(t, ast.Name) and t.id in declared for t in targets)
        if isinstance(anc, ast.stmt):
            return False
    return False
