"""One parsed file as the rules see it: import aliases, parents, module constants, its Triton
kernels (``@triton.jit`` functions and their aliases), and the questions asked of its tree
(which function holds a node, is it test or demo code, what was a name last assigned).

Cross-file questions (is this imported name a kernel, who calls this function) belong to
:mod:`qmoe_doctor.lint.project`; what counts as a device or a guard to :mod:`~.devices`.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

from qmoe_doctor.lint.nodes import (
    FUNC_TYPES,
    FuncDef,
    deepest,
    dotted,
    is_main_guard,
    param_names,
    walk_shallow,
)
from qmoe_doctor.lint.source import Source

# Decorators (resolved through the imports) that make a function a Triton kernel.
_JIT_NAMES = frozenset(
    {
        "triton.jit",
        "triton.autotune",
        "triton.heuristics",
        "triton.runtime.jit",
        "triton.runtime.jit.jit",
        "triton.runtime.autotune",
        "triton.runtime.heuristics",
        "triton.runtime.autotuner.autotune",
        "triton.runtime.autotuner.heuristics",
    }
)
_SET_DEVICE = frozenset({"torch.cuda.set_device", "torch.accelerator.set_device_index"})

#: AST levels of a ``@triton.jit`` function that the kernel rules walk. The int32 data flow and
#: the pointer roots of autotune-inplace recurse once or twice a level (plus ~4 frames a level
#: of ``nodes.SHOWN_LEVELS`` to print a node), so a much deeper kernel could exhaust the
#: interpreter's 1000 frames half-way through a rule. Real kernels stay far below: the 174 jit
#: functions of this repository and of the installed torch and triton packages are at most 14
#: deep. Code outside kernels is walked iteratively or to a fixed depth and has no such limit.
MAX_KERNEL_NESTING = 150


class Module:
    """One parsed file and what the rules need to know about it."""

    def __init__(self, source: Source) -> None:
        self.path = source.path
        self.tree = source.tree
        self.lines = source.lines
        self.stem = Path(self.path).stem
        if self.stem == "__init__":
            self.stem = Path(self.path).parent.name  # a package is imported by its folder's name
        self.nodes: list[ast.AST] = list(ast.walk(self.tree))
        self.calls: list[ast.Call] = [n for n in self.nodes if isinstance(n, ast.Call)]
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in self.nodes:
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self._shallow: dict[ast.AST, list[ast.AST]] = {}
        self._exempt: dict[ast.AST, bool] = {}
        self._set_device_lines: dict[ast.AST, list[int]] = {}
        self._attr_bindings: dict[str, list[ast.expr]] | None = None
        self._bindings: dict[ast.AST, dict[str, list[tuple[int, ast.expr]]]] = {}
        self.stored: frozenset[str] = frozenset(  # names bound anywhere in the file
            n.id for n in self.nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
        )
        self.aliases: dict[str, str] = {"tl": "triton.language"}  # the universal convention
        for node in self.nodes:
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        self.aliases[a.asname] = a.name
                    else:
                        top = a.name.split(".", 1)[0]
                        self.aliases[top] = top
            elif isinstance(node, ast.ImportFrom):
                base = "." * node.level + (node.module or "")
                for a in node.names:
                    if a.name != "*":
                        sep = "" if base.endswith(".") or not base else "."
                        self.aliases[a.asname or a.name] = f"{base}{sep}{a.name}"
        self.imports_triton = any(
            (isinstance(n, ast.Import) and any(a.name.split(".")[0] == "triton" for a in n.names))
            or (isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "triton")
            for n in self.nodes
        )
        # module-level single-name assignments (constants such as DEVICE = "cuda")
        self.consts: dict[str, ast.expr] = {}
        for stmt in self.tree.body:
            if (
                isinstance(stmt, ast.Assign)
                and len(stmt.targets) == 1
                and isinstance(stmt.targets[0], ast.Name)
            ):
                self.consts[stmt.targets[0].id] = stmt.value
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value:
                self.consts[stmt.target.id] = stmt.value
        self.defined: set[str] = {
            n.name for n in self.tree.body if isinstance(n, (*FUNC_TYPES, ast.ClassDef))
        } | set(self.consts)
        self.jit_defs: dict[str, FuncDef] = {}
        for node in self.nodes:
            if isinstance(node, FUNC_TYPES) and any(self.is_jit_decorator(d) for d in node.decorator_list):
                self.jit_defs[node.name] = node
        self.kernels: set[str] = set(self.jit_defs)
        for stmt in self.tree.body:  # kernel = triton.jit(fn), kernel = triton.autotune(...)(fn), aliases
            if (
                isinstance(stmt, ast.Assign)
                and len(stmt.targets) == 1
                and isinstance(stmt.targets[0], ast.Name)
            ):
                value = stmt.value
                if (isinstance(value, ast.Name) and value.id in self.kernels) or any(
                    isinstance(n, ast.Call) and self.is_jit_decorator(n.func) for n in ast.walk(value)
                ):
                    self.kernels.add(stmt.targets[0].id)

    @functools.cached_property
    def nesting(self) -> int:
        """AST levels of the file, deepest branch (asked only when a pass ran out of stack)."""
        return deepest(self.tree)[0]

    def deepest_kernel(self) -> tuple[str, int, int] | None:
        """``(name, levels, line)`` of the deepest jit function (None without one)."""
        found = [(deepest(f)[0], -f.lineno, name) for name, f in self.jit_defs.items()]
        if not found:
            return None
        levels, neg_line, name = max(found)
        return name, levels, -neg_line

    # --- names ---

    def canon(self, expr: ast.AST) -> str | None:
        """Dotted name of ``expr`` with its first part resolved through the imports."""
        name = dotted(expr)
        if name is None:
            return None
        head, sep, rest = name.partition(".")
        if head in self.aliases:
            return self.aliases[head] + sep + rest
        return name

    def is_jit_decorator(self, dec: ast.AST) -> bool:
        expr = dec.func if isinstance(dec, ast.Call) else dec
        name = self.canon(expr)
        if name is None:
            return False
        if isinstance(expr, ast.Name) and expr.id in self.consts:
            target = self.canon(self.consts[expr.id])  # jit = triton.jit
            if target is not None:
                name = target
        if name in _JIT_NAMES or (name.startswith("triton.") and name.endswith(".jit")):
            return True
        return name in ("jit", "autotune", "heuristics") and self.imports_triton

    def line(self, node: ast.AST) -> str:
        """The source line ``node`` starts on ("" when it has none)."""
        lineno = getattr(node, "lineno", 0)
        return self.lines[lineno - 1] if 0 < lineno <= len(self.lines) else ""

    # --- tree navigation ---

    def ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        cur = self.parents.get(node)
        while cur is not None:
            yield cur
            cur = self.parents.get(cur)

    def func_of(self, node: ast.AST) -> FuncDef | None:
        for anc in self.ancestors(node):
            if isinstance(anc, FUNC_TYPES):
                return anc
        return None

    def at_module_level(self, node: ast.AST) -> bool:
        """True when ``node`` runs once at import: not inside a function (class bodies count)."""
        return self.func_of(node) is None

    def exempt(self, node: ast.AST) -> bool:
        """Demo and test code creates its own tensors on the current device: launches there are
        consistent by construction, so the device rules stay silent in it."""
        func = self.func_of(node)
        if func is None:
            return any(is_main_guard(anc) for anc in self.ancestors(node))
        if func not in self._exempt:
            self._exempt[func] = func.name.lstrip("_").startswith(("test", "bench")) or self.exempt(func)
        return self._exempt[func]

    def shallow(self, scope: ast.AST) -> list[ast.AST]:
        """The nodes of a function (or the module) outside its nested functions and classes."""
        if scope not in self._shallow:
            self._shallow[scope] = list(walk_shallow(scope))
        return self._shallow[scope]

    def local_value(self, name: ast.Name) -> ast.expr | None:
        """The value last assigned to ``name`` in its function (or module) before its use."""
        scope: ast.AST = self.func_of(name) or self.tree
        best: tuple[int, ast.expr] | None = None
        for node in self.shallow(scope):
            if isinstance(node, ast.Assign) and node.lineno < name.lineno:
                if any(isinstance(t, ast.Name) and t.id == name.id for t in node.targets):
                    if best is None or node.lineno >= best[0]:
                        best = (node.lineno, node.value)
        if best is None and scope is not self.tree:
            return self.consts.get(name.id)
        return best[1] if best else None

    def bindings(self, name: ast.Name) -> list[ast.expr]:
        """Every value bound to ``name`` in its function (or the module) before its use, the
        branches of an if/else alike: ``x = v``, ``x, y = a, b`` (``a``; ``x, y = f()``: all of
        ``f()``), ``x: T = v``, ``(x := v)``, and ``for x in items`` (bound to ``items[...]``).
        A parameter rebound nowhere has none; a name bound nowhere in a function falls back to
        the module constant of that name."""
        scope: ast.AST = self.func_of(name) or self.tree
        if name.id not in self.stored:
            return []  # bound nowhere in the file (a builtin, a parameter, an import)
        out = [value for line, value in self._binding_index(scope).get(name.id, ()) if line < name.lineno]
        if not out and scope is not self.tree:
            if name.id in param_names(scope):  # type: ignore[arg-type]
                return []
            const = self.consts.get(name.id)
            return [const] if const is not None else []
        return out

    def _binding_index(self, scope: ast.AST) -> dict[str, list[tuple[int, ast.expr]]]:
        """Name -> ``(line, value)`` of every binding in ``scope`` (built once per scope)."""
        index = self._bindings.get(scope)
        if index is not None:
            return index
        index = {}
        for node in self.shallow(scope):
            line = getattr(node, "lineno", 0)
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    for n in ast.walk(target):
                        if isinstance(n, ast.Name):
                            index.setdefault(n.id, []).extend((line, v) for v in _bound_in(target, node.value, n.id))
            elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)):
                if isinstance(node.target, ast.Name) and node.value is not None:
                    index.setdefault(node.target.id, []).append((line, node.value))
            elif isinstance(node, (ast.For, ast.AsyncFor)) and isinstance(node.target, ast.Name):
                item = ast.Subscript(value=node.iter, slice=ast.Constant(value=0), ctx=ast.Load())
                index.setdefault(node.target.id, []).append((line, item))
        self._bindings[scope] = index
        return index

    def attribute_bindings(self, attr: str) -> list[ast.expr]:
        """Values assigned to ``self.<attr>`` / ``cls.<attr>`` anywhere in the file, or to
        ``<attr>`` in a class body."""
        if self._attr_bindings is None:
            found: dict[str, list[ast.expr]] = {}
            for node in self.nodes:
                if not isinstance(node, ast.Assign):
                    continue
                for t in node.targets:
                    if (
                        isinstance(t, ast.Attribute)
                        and isinstance(t.value, ast.Name)
                        and t.value.id in ("self", "cls")
                    ):
                        found.setdefault(t.attr, []).append(node.value)
                    elif isinstance(t, ast.Name) and isinstance(self.parents.get(node), ast.ClassDef):
                        found.setdefault(t.id, []).append(node.value)
            self._attr_bindings = found
        return self._attr_bindings.get(attr, [])

    def sets_device_before(self, node: ast.AST) -> bool:
        """``torch.cuda.set_device(...)`` runs earlier in the function (or module) of ``node``."""
        scope: ast.AST = self.func_of(node) or self.tree
        if scope not in self._set_device_lines:
            self._set_device_lines[scope] = [
                n.lineno
                for n in self.shallow(scope)
                if isinstance(n, ast.Call) and self.canon(n.func) in _SET_DEVICE
            ]
        line = getattr(node, "lineno", 0)
        return any(set_at < line for set_at in self._set_device_lines[scope])


def _bound_in(target: ast.expr, value: ast.expr, name: str) -> list[ast.expr]:
    """What assigning ``value`` to ``target`` binds to ``name``: the value, its matching item
    when both sides are tuples of one length, else all of it (flow-insensitive)."""
    if isinstance(target, ast.Name):
        return [value] if target.id == name else []
    if isinstance(target, (ast.Tuple, ast.List)):
        if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
            return [v for t, e in zip(target.elts, value.elts, strict=True) for v in _bound_in(t, e, name)]
        if any(isinstance(n, ast.Name) and n.id == name for t in target.elts for n in ast.walk(t)):
            return [value]
    return []


__all__ = ["MAX_KERNEL_NESTING", "Module"]
