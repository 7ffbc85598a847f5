"""``current-device-property``: a property of the *current* device, read outside a device guard
on every call, sizes a launch: its grid (the persistent grid of ``multi_processor_count``
programs) or an argument (a ``NUM_SMS: tl.constexpr``, a capability switch). With the tensors on
another GPU the value is the current device's, not theirs: a grid sized for another GPU model
(tiles skipped or programs idle) or a constexpr that picks the other device's code path.

A *read* is ``get_device_properties`` / ``get_device_capability`` of no device, ``"cuda"``,
``current_device()`` or a hard-coded index, or ``current_device()`` itself; it *sizes* a launch
when it flows, through the names it is assigned to and the return values of functions of the
project, into the launch's grid or arguments (every launch form of
:meth:`~qmoe_doctor.lint.project.Project.kernels_of`). Silent when the read runs under a device
guard (lexically, after ``set_device``, or in every caller: "cuda" is then the guarded device)
or takes its device from a tensor (``x.device``). A hard-coded index is reported under a guard
too: the guard does not change it. Reads computed once (at import, in a ``functools.cache``
function, into a global) are ``cached-device-property``'s.
"""

from __future__ import annotations

import ast

from qmoe_doctor.lint.devices import undeviced
from qmoe_doctor.lint.findings import Rule
from qmoe_doctor.lint.module import Module
from qmoe_doctor.lint.nodes import FUNC_TYPES, arg, is_none, last, src
from qmoe_doctor.lint.project import LaunchSite, Project
from qmoe_doctor.lint.rules.cached_device_property import cached_how
from qmoe_doctor.lint.rules.default_device_alloc import FACTORIES, NEW_METHODS

_PROPERTY_READS = frozenset({"get_device_properties", "get_device_capability"})
_CURRENT = frozenset({"current_device", "get_active_torch_device"})
_MAX_HOPS = 6  # names and helper returns followed back from a launch argument

Read = tuple[Module, ast.Call, str]  # the module, the read, what it reads


def check(project: Project, m: Module) -> None:
    for launch in project.launches[m]:
        site = project.launch_site(launch)
        if site is None or m.exempt(launch):
            continue
        for role, expr in _inputs(site):
            for rm, read, which in _reads(project, m, expr):
                hard_coded = "hard-coded" in which
                if rm.at_module_level(read) or cached_how(rm, read) is not None:
                    continue  # computed once: cached-device-property
                if rm.exempt(read) or (not hard_coded and project.guarded(rm, read)):
                    continue
                _report(project, rm, read, which, role, site, m)


def _inputs(site: LaunchSite) -> list[tuple[str, ast.expr]]:
    """What sizes a launch: its grid and its arguments, each with how a message names it."""
    out: list[tuple[str, ast.expr]] = []
    if site.grid is not None:
        out.append(("the grid", site.grid))
    for a in site.call.args:
        out.append(("an argument", a.value if isinstance(a, ast.Starred) else a))
    for kw in site.call.keywords:
        if kw.arg != "grid":
            out.append((f"`{kw.arg}=`" if kw.arg else "an argument", kw.value))
    return out


def _reads(project: Project, m: Module, expr: ast.expr) -> list[Read]:
    """The device reads ``expr`` depends on, followed back through assignments and the return
    values of the project's functions (flow-insensitive, a few hops)."""
    found: dict[int, Read] = {}
    seen: set[int] = set()
    stack: list[tuple[Module, ast.AST, int]] = [(m, expr, 0)]
    while stack:
        mod, node, hops = stack.pop()
        if id(node) in seen or hops > _MAX_HOPS:
            continue
        seen.add(id(node))
        if isinstance(node, ast.Call):
            which = _read_of(mod, node)
            if which is not None:
                found.setdefault(id(node), (mod, node, which))
                continue  # its own argument (current_device()) is part of this read
            if _allocates(node):
                continue  # a buffer on the current device is default-device-alloc's
            for fm, func in _project_functions(project, mod, node):
                for ret in ast.walk(func):
                    if isinstance(ret, ast.Return) and ret.value is not None and fm.func_of(ret) is func:
                        stack.append((fm, ret.value, hops + 1))
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            stack.extend((mod, value, hops + 1) for value in mod.bindings(node))
        elif isinstance(node, ast.IfExp) and _index_fallback(node):
            stack.append((mod, node.body, hops))  # d.index if d.index is not None else current_device()
            continue
        stack.extend((mod, child, hops) for child in ast.iter_child_nodes(node))
    return list(found.values())


def _allocates(call: ast.Call) -> bool:
    name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
    return name in FACTORIES or name in NEW_METHODS or name in ("to", "cuda")


def _index_fallback(node: ast.IfExp) -> bool:
    """``a.index if a.index is not None else <anything>`` (or the reverse): the fallback only
    runs for a device without an index, which a tensor's device never is."""
    test = node.test
    return isinstance(test, ast.Compare) and any(
        isinstance(part, ast.Attribute) and part.attr == "index" for part in (test.left, *test.comparators)
    )


def _read_of(m: Module, call: ast.Call) -> str | None:
    """What ``call`` reads when it reads the current (or a hard-coded) device; None otherwise."""
    name = last(m.canon(call.func))
    if name in _CURRENT:
        return "the current device"
    if name not in _PROPERTY_READS:
        return None
    device = arg(call, 0, "device")
    if device is None or is_none(device):
        return "the current device"
    desc = undeviced(m, device)
    if desc is None:
        return None  # a device from a tensor or from the caller
    return "the current device" if "current device" in desc else desc


def _project_functions(project: Project, m: Module, call: ast.Call) -> list[tuple[Module, ast.AST]]:
    """The project's functions ``call`` may call: ``f(...)`` defined in ``m`` or imported from a
    module of the project, ``mod.f(...)`` through a module alias."""
    func = call.func
    out: list[tuple[Module, ast.AST]] = []
    if isinstance(func, ast.Name):
        if func.id in m.defined:
            out += [(m, n) for n in m.tree.body if isinstance(n, FUNC_TYPES) and n.name == func.id]
        elif func.id in m.aliases:
            module, _, name = m.aliases[func.id].rpartition(".")
            out += _defs_in(project, module, name)
    elif isinstance(func, ast.Attribute):
        base = m.canon(func.value)
        if base and isinstance(func.value, ast.Name) and func.value.id in m.aliases:
            out += _defs_in(project, base, func.attr)
    return out


def _defs_in(project: Project, module: str, name: str) -> list[tuple[Module, ast.AST]]:
    stem = module.rsplit(".", 1)[-1].lstrip(".")
    return [
        (o, n)
        for o in project.modules
        if o.stem == stem
        for n in o.tree.body
        if isinstance(n, FUNC_TYPES) and n.name == name
    ]


def _report(project: Project, m: Module, read: ast.Call, which: str, role: str, site: LaunchSite, lm: Module) -> None:
    parent = m.parents.get(read)
    shown = src(parent) if isinstance(parent, ast.Attribute) and parent.value is read else src(read)
    guard = "" if "hard-coded" in which else " outside a device guard"
    project.add(
        m,
        read,
        Rule.CURRENT_DEVICE_PROPERTY,
        f"`{shown}` reads {which}{guard} and sizes {role} of the launch of {site.describe()} "
        f"({lm.path}:{site.call.lineno}): with the tensors on another GPU it is that device's value, "
        "not theirs (a persistent grid or a constexpr sized for the wrong GPU)",
        "sms = torch.cuda.get_device_properties(x.device).multi_processor_count  # the tensors' device\n"
        "# or read it inside `with torch.cuda.device(x.device):`, with the launch",
    )
