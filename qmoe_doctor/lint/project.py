"""The project: every module of one run, with cross-file kernel and caller lookup.

Files of one run are one project: a kernel or a launch helper imported from another linted
file is recognised, and imported files found next to a linted one are read as *context*
(resolved against, never reported). The project also holds the findings: rules call
:meth:`Project.add`, which applies ``# qmoe-doctor: ignore[...]`` comments, and
:meth:`Project.findings` returns them deduplicated and sorted.

    launch kernel[grid](...) in f  --callers(f)-->  calls of f in the linted files  --> ...
    guarded(node): lexically, after set_device, or every caller (up to 8 calls up) guarded
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence

from qmoe_doctor.lint.devices import lexical_guard
from qmoe_doctor.lint.findings import RULES, LintFinding, Rule
from qmoe_doctor.lint.module import Module
from qmoe_doctor.lint.nodes import FuncDef, dotted, src

_MAX_CALL_DEPTH = 8  # callers followed up the call graph from a launch (deep chains are not)
_IGNORE_COMMENT = re.compile(r"#\s*qmoe-doctor:\s*ignore(?:\[([^\]]*)\])?")

Site = tuple[Module, ast.AST]  # a node and the module it is in


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
        for m in self.modules:
            found: list[ast.Call] = []
            for node in m.calls:
                callee = node.func.id if isinstance(node.func, ast.Name) else None
                if isinstance(node.func, ast.Attribute):
                    callee = node.func.attr
                if callee:
                    self.calls_by_name.setdefault(callee, []).append((m, node))
                if self.kernel_name(m, node) is not None:
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

    def kernel_name(self, m: Module, call: ast.Call) -> str | None:
        """The launched kernel's name when ``call`` is ``kernel[grid](...)``."""
        if isinstance(call.func, ast.Subscript) and self.is_kernel_ref(m, call.func.value):
            return dotted(call.func.value) or src(call.func.value)
        return None

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


__all__ = ["Project", "Site"]
