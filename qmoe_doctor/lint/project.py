"""The project: every module of one run, with cross-file kernel and caller lookup.

Files of one run are one project: a kernel or a launch helper imported from another linted
file is recognised, and imported files found next to a linted one are read as *context*
(resolved against, never reported). The project also holds the findings: rules call
:meth:`Project.add`, which applies ``# qmoe-doctor: ignore[...]`` comments, and
:meth:`Project.findings` returns them deduplicated and sorted.

    launch kernel[grid](...) in f  --callers(f)-->  calls of f in the linted files  --> ...
    guarded(node): lexically, after set_device, or every caller (up to 8 calls up) guarded

A launch is any of the forms real code uses (``LaunchSite``, ``kernels_of``): ``kernel[grid](...)``,
``fn[grid](...)`` with ``fn`` bound to one of several kernels, ``KERNELS[key][grid](...)``,
``getattr(module, name)[grid](...)``, ``kernel.run(..., grid=...)``, and ``launch = kernel[grid]``
called later.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from qmoe_doctor.lint.devices import lexical_guard
from qmoe_doctor.lint.findings import RULES, LintFinding, Rule
from qmoe_doctor.lint.module import Module
from qmoe_doctor.lint.nodes import FuncDef, dotted, src

_MAX_CALL_DEPTH = 8  # callers followed up the call graph from a launch (deep chains are not)
_MAX_BINDING_HOPS = 6  # name -> value -> container -> item ... followed to find a launched kernel
_IGNORE_COMMENT = re.compile(r"#\s*qmoe-doctor:\s*ignore(?:\[([^\]]*)\])?")

Site = tuple[Module, ast.AST]  # a node and the module it is in


@dataclass(frozen=True, slots=True)
class LaunchSite:
    """One launch: the call, the kernels it may launch (one, or several when the launched
    expression is picked at run time), how the launched expression reads, and its grid."""

    call: ast.Call
    kernels: tuple[str, ...]
    shown: str
    grid: ast.expr | None

    def describe(self) -> str:
        """```k``` or ```fn`` (one of ``a``, ``b``)` for a message."""
        if self.kernels == (self.shown,):
            return f"`{self.shown}`"
        return f"`{self.shown}` (one of " + ", ".join(f"`{k}`" for k in self.kernels) + ")"


def _union(groups: Iterable[tuple[str, ...]]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(k for g in groups for k in g))


def _shown(expr: ast.expr) -> str:
    return dotted(expr) or src(expr)


class Project:
    def __init__(self, modules: Sequence[Module], context: Sequence[Module] = ()) -> None:
        self.linted = {m.path for m in modules}
        self.modules = [*modules, *context]  # context: imported files, read for resolution only
        self.kernels_by_stem: dict[str, set[str]] = {}
        for m in self.modules:
            self.kernels_by_stem.setdefault(m.stem, set()).update(m.kernels)
        self.all_kernels: set[str] = (
            set().union(*(m.kernels for m in self.modules)) if self.modules else set()
        )
        self.calls_by_name: dict[str, list[tuple[Module, ast.Call]]] = {}
        self.launches: dict[Module, list[ast.Call]] = {}
        self.launch_sites: dict[ast.Call, LaunchSite] = {}
        for m in self.modules:
            found: list[ast.Call] = []
            for node in m.calls:
                callee = node.func.id if isinstance(node.func, ast.Name) else None
                if isinstance(node.func, ast.Attribute):
                    callee = node.func.attr
                if callee:
                    self.calls_by_name.setdefault(callee, []).append((m, node))
                site = self._launch_site(m, node)
                if site is not None:
                    self.launch_sites[node] = site
                    found.append(node)
            self.launches[m] = found
        self._callers: dict[ast.AST, list[tuple[Module, ast.Call]]] = {}
        self._guarded_memo: dict[ast.AST, bool] = {}
        self._sites_memo: dict[ast.AST, list[Site] | None] = {}
        self._busy: set[ast.AST] = set()
        self._launching: set[str] | None = None
        self._findings: list[LintFinding] = []

    # --- kernels and launches ---

    def is_kernel_ref(self, m: Module, expr: ast.expr) -> bool:
        """``expr`` names a Triton kernel itself (a jit function, an alias of one, an imported
        one); see :meth:`kernels_of` for the expressions that may hold one."""
        if isinstance(expr, ast.Name):
            if expr.id in m.kernels:
                return True
            full = m.aliases.get(expr.id)
            if full is not None:
                modpart, _, orig = full.rpartition(".")
                stem = modpart.rsplit(".", 1)[-1]
                if orig in self.kernels_by_stem.get(stem, ()) or orig in self.all_kernels:
                    return True
            name = expr.id
        elif isinstance(expr, ast.Attribute):
            base = m.canon(expr.value) or ""
            if expr.attr in self.kernels_by_stem.get(base.rsplit(".", 1)[-1], ()):
                return True
            if base in ("self", "cls") and expr.attr in m.kernels:
                return True
            name = expr.attr
        else:
            return False
        # A kernel from outside the linted files: trust the naming convention in Triton code.
        return m.imports_triton and name.lower().endswith("kernel")

    def kernels_of(self, m: Module, expr: ast.expr, depth: int = 0) -> tuple[str, ...]:
        """The kernels ``expr`` may hold, as named in the source; () when it holds none. Beyond a
        kernel's own name: ``a if c else b`` (and ``a or b``), a local or module name bound to
        one of several kernels (a conditional expression, an if/else of assignments),
        ``self.attr`` assigned a kernel in the file, an item of a container of kernels
        (``KERNELS[name]``, ``KERNELS.get(name)``) and ``getattr(module, name)``."""
        if depth > _MAX_BINDING_HOPS:
            return ()
        if isinstance(expr, (ast.Name, ast.Attribute)):
            bound = self._bound_kernels(m, expr, depth)
            if bound:
                return bound
            if self.is_kernel_ref(m, expr):
                return (dotted(expr) or src(expr),)
            return ()
        if isinstance(expr, ast.IfExp):
            return _union(self.kernels_of(m, e, depth + 1) for e in (expr.body, expr.orelse))
        if isinstance(expr, ast.BoolOp):
            return _union(self.kernels_of(m, e, depth + 1) for e in expr.values)
        if isinstance(expr, ast.NamedExpr):
            return self.kernels_of(m, expr.value, depth + 1)
        if isinstance(expr, ast.Subscript):  # KERNELS[name], globals()[name]
            return _union(self.kernels_of(m, e, depth + 1) for e in self._items(m, expr.value, depth + 1))
        if isinstance(expr, ast.Call):
            if isinstance(expr.func, ast.Attribute) and expr.func.attr == "get" and expr.args:
                items = self._items(m, expr.func.value, depth + 1)  # KERNELS.get(name)
                return _union(self.kernels_of(m, e, depth + 1) for e in items)
            if isinstance(expr.func, ast.Name) and expr.func.id == "getattr" and len(expr.args) >= 2:
                return self._getattr_kernels(m, expr, depth)
        return ()

    def _bound_kernels(self, m: Module, expr: ast.Name | ast.Attribute, depth: int) -> tuple[str, ...]:
        """The kernels a name (or ``self.attr``) is bound to where it is not a kernel's own name."""
        if isinstance(expr, ast.Name):
            if expr.id in m.kernels or expr.id in m.aliases:
                return ()
            values = m.bindings(expr)
        elif isinstance(expr.value, ast.Name) and expr.value.id in ("self", "cls"):
            values = m.attribute_bindings(expr.attr)
        else:
            return ()
        return _union(self.kernels_of(m, v, depth + 1) for v in values)

    def _items(self, m: Module, container: ast.expr, depth: int) -> list[ast.expr]:
        """The values a container expression holds: a dict, list, tuple or set display, a
        ``dict(...)`` call or a comprehension, directly or through the names bound to them;
        ``globals()`` holds the file's kernels."""
        if depth > _MAX_BINDING_HOPS:
            return []
        if isinstance(container, ast.Dict):
            return [v for v in container.values if v is not None]
        if isinstance(container, (ast.List, ast.Tuple, ast.Set)):
            return [e.value if isinstance(e, ast.Starred) else e for e in container.elts]
        if isinstance(container, (ast.DictComp,)):
            return [container.value]
        if isinstance(container, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
            return [container.elt]
        if isinstance(container, ast.Call):
            name = m.canon(container.func) or ""
            if name == "globals":
                return [ast.Name(id=k, ctx=ast.Load()) for k in sorted(m.kernels)]
            if name == "dict":
                return [kw.value for kw in container.keywords] + [
                    v for a in container.args for v in self._items(m, a, depth + 1)
                ]
            return []
        if isinstance(container, ast.Name):
            return [v for b in m.bindings(container) for v in self._items(m, b, depth + 1)]
        if isinstance(container, ast.Attribute):
            if isinstance(container.value, ast.Name) and container.value.id in ("self", "cls"):
                return [v for b in m.attribute_bindings(container.attr) for v in self._items(m, b, depth + 1)]
            base = m.canon(container.value) or ""
            for other in self._modules_named(base):  # module.KERNELS
                value = other.consts.get(container.attr)
                if value is not None:
                    return self._items(other, value, depth + 1)
        return []

    def _getattr_kernels(self, m: Module, call: ast.Call, depth: int) -> tuple[str, ...]:
        """``getattr(obj, name)``: the kernel of that name when it is a constant; every kernel of
        the module ``obj`` names when it is not; ``getattr(...)`` itself when the module is not
        in the project, in Triton code (subscripting and calling the result is a launch)."""
        obj, name = call.args[0], call.args[1]
        const = name.value if isinstance(name, ast.Constant) and isinstance(name.value, str) else None
        modules = self._modules_named(m.canon(obj) or "") if isinstance(obj, (ast.Name, ast.Attribute)) else []
        if isinstance(obj, ast.Name) and obj.id in ("self", "cls"):
            modules = []
        kernels = sorted(set().union(*(o.kernels for o in modules))) if modules else []
        if const is not None and (const in kernels or (not modules and const in m.kernels)):
            return (const,)
        if const is None and kernels:
            return tuple(kernels)
        return (src(call),) if m.imports_triton and not kernels else ()

    def _modules_named(self, dotted_name: str) -> list[Module]:
        """Modules of the project a dotted module name (as an import resolved it) may be."""
        if not dotted_name or dotted_name in ("self", "cls"):
            return []
        stem = dotted_name.rsplit(".", 1)[-1]
        return [o for o in self.modules if o.stem == stem]

    def _launch_site(self, m: Module, call: ast.Call) -> LaunchSite | None:
        """The launch ``call`` makes, in any of its forms: ``kernel[grid](...)``,
        ``kernel.run(..., grid=...)``, and ``launch(...)`` where ``launch = kernel[grid]``."""
        func = call.func
        if isinstance(func, ast.Subscript):
            kernels = self.kernels_of(m, func.value)
            if kernels:
                return LaunchSite(call=call, kernels=kernels, shown=_shown(func.value), grid=func.slice)
            return None
        if isinstance(func, ast.Attribute) and func.attr == "run":
            grid = next((kw.value for kw in call.keywords if kw.arg == "grid"), None)
            kernels = self.kernels_of(m, func.value) if grid is not None else ()
            if kernels:
                return LaunchSite(call=call, kernels=kernels, shown=_shown(func.value), grid=grid)
            return None
        if isinstance(func, ast.Name) and func.id not in m.aliases and func.id not in m.defined:
            for value in m.bindings(func):  # launch = kernel[grid]; launch(...)
                if isinstance(value, ast.Subscript):
                    kernels = self.kernels_of(m, value.value)
                    if kernels:
                        return LaunchSite(
                            call=call, kernels=kernels, shown=_shown(value.value), grid=value.slice
                        )
        return None

    def kernel_name(self, m: Module, call: ast.Call) -> str | None:
        """How the launched kernel reads in a message when ``call`` is a launch (any form)."""
        site = self.launch_sites.get(call)
        return site.shown if site is not None else None

    def launch_site(self, call: ast.Call) -> LaunchSite | None:
        return self.launch_sites.get(call)

    def function_launches(self, name: str) -> bool:
        """A function of this name launches a kernel somewhere in the project."""
        if self._launching is None:
            self._launching = {
                func.name for m, calls in self.launches.items() for c in calls if (func := m.func_of(c))
            }
        return name in self._launching

    # --- the call graph ---

    def callers(self, m: Module, func: FuncDef) -> list[tuple[Module, ast.Call]]:
        """Calls that may reach ``func`` (tests and demos left out), resolved through imports: a
        bare name in its own module or imported from a module of its name; ``mod.func(...)``
        through a module alias; ``obj.func(...)`` on anything but a module for a method."""
        if func in self._callers:
            return self._callers[func]
        is_method = isinstance(m.parents.get(func), ast.ClassDef)
        out = []
        for cm, call in self.calls_by_name.get(func.name, []):
            if cm is m and any(a is func for a in m.ancestors(call)):
                continue  # recursion
            if self._may_call(m, func, is_method, cm, call) and not cm.exempt(call):
                out.append((cm, call))
        self._callers[func] = out
        return out

    def _may_call(self, m: Module, func: FuncDef, is_method: bool, cm: Module, call: ast.Call) -> bool:
        if isinstance(call.func, ast.Attribute):
            owner = call.func.value
            if is_method:  # obj.method(...), but not module.function(...)
                return not (isinstance(owner, ast.Name) and owner.id in cm.aliases)
            head = (dotted(owner) or "").partition(".")[0]
            if head not in cm.aliases:
                return False  # self.launch(...), plan.run(...): an object's attribute, not this function
            return self._names_module(cm.canon(owner) or "", m, func.name)
        if is_method:
            return False
        if cm is m:
            return call.func.id not in cm.aliases if isinstance(call.func, ast.Name) else False
        full = cm.aliases.get(call.func.id) if isinstance(call.func, ast.Name) else None
        if full is None:
            return False  # a local name of another module
        return self._names_module(full.rpartition(".")[0], m, func.name)

    def _names_module(self, module: str, m: Module, name: str) -> bool:
        """Whether the dotted ``module`` may be ``m``: its last part is ``m``'s name, or no
        module of that name here defines ``name`` (a package re-export, an unread file)."""
        stem = module.rsplit(".", 1)[-1]
        if stem == m.stem:
            return True
        same = [o for o in self.modules if o.stem == stem]
        return not any(name in o.defined for o in same)

    # --- device guards through the call graph ---

    def guarded(self, m: Module, node: ast.AST, depth: int = 0) -> bool:
        """Inside a device guard: lexically, after set_device in the same function, or in a
        function whose every caller in the linted files is itself guarded."""
        if lexical_guard(m, node) or m.sets_device_before(node):
            return True
        func = m.func_of(node)
        return func is not None and self._callers_guarded(m, func, depth)

    def _callers_guarded(self, m: Module, func: FuncDef, depth: int = 0) -> bool:
        if func in self._guarded_memo:
            return self._guarded_memo[func]
        if func in self._busy or depth > _MAX_CALL_DEPTH:
            return True  # a call cycle or a deep chain: the callers nearer the entry decide
        self._busy.add(func)
        calls = self.callers(m, func)
        result = bool(calls) and all(self.guarded(cm, c, depth + 1) for cm, c in calls)
        self._busy.discard(func)
        self._guarded_memo[func] = result
        return result

    def unguarded_sites(self, m: Module, node: ast.AST, depth: int = 0) -> list[Site]:
        """Where a guard is missing for ``node``: the node itself when its function has no caller
        in the linted files (an entry point), else each caller's call site without a guard,
        followed up the call graph."""
        if m.exempt(node) or lexical_guard(m, node) or m.sets_device_before(node):
            return []
        func = m.func_of(node)
        if func is None:
            return [(m, node)]
        sites = self._caller_sites(m, func, depth)
        return [(m, node)] if sites is None else sites

    def _caller_sites(self, m: Module, func: FuncDef, depth: int = 0) -> list[Site] | None:
        """Unguarded sites reached through the callers of ``func``; None when it has none."""
        if func in self._sites_memo:
            return self._sites_memo[func]
        if func in self._busy or depth > _MAX_CALL_DEPTH:
            return []  # a call cycle or a deep chain: not followed further
        self._busy.add(func)
        calls = self.callers(m, func)
        result: list[Site] | None = None
        if calls:
            unique: dict[int, Site] = {}
            for cm, call in calls:
                for site in self.unguarded_sites(cm, call, depth + 1):
                    unique.setdefault(id(site[1]), site)
            result = list(unique.values())
        self._busy.discard(func)
        self._sites_memo[func] = result
        return result

    # --- findings ---

    def add(self, m: Module, node: ast.AST, rule: Rule, message: str, fix: str) -> None:
        """Record a finding at ``node`` unless its line carries an ignore comment for ``rule``."""
        line = getattr(node, "lineno", 1)
        text = m.lines[line - 1] if 0 < line <= len(m.lines) else ""
        # ast counts UTF-8 bytes; editors and SARIF count characters
        col = len(text.encode()[: getattr(node, "col_offset", 0)].decode(errors="ignore")) + 1
        hit = _IGNORE_COMMENT.search(text)
        if hit and (hit.group(1) is None or rule.value in {s.strip() for s in hit.group(1).split(",")}):
            return
        self._findings.append(
            LintFinding(
                path=m.path,
                line=line,
                col=col,
                rule=rule,
                cause=RULES[rule].cause,
                message=message,
                fix=fix,
                source=text.strip(),
            )
        )

    def findings(self) -> tuple[LintFinding, ...]:
        """The findings in linted files (not context), the first at a place winning (the nearest
        launch), sorted by path, line, column and rule."""
        unique: dict[tuple[str, int, int, Rule], LintFinding] = {}
        for f in self._findings:
            if f.path in self.linted:
                unique.setdefault((f.path, f.line, f.col, f.rule), f)
        return tuple(sorted(unique.values(), key=lambda f: (f.path, f.line, f.col, f.rule.value)))


__all__ = ["LaunchSite", "Project", "Site"]
