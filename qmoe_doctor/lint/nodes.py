"""Small questions about one AST node, asked by every rule: its dotted name, an argument, its
text for a message. No knowledge of a file or of the project here (see ``module`` and
``project``)."""

from __future__ import annotations

import ast
from collections.abc import Iterator

FuncDef = ast.FunctionDef | ast.AsyncFunctionDef
FUNC_TYPES = (ast.FunctionDef, ast.AsyncFunctionDef)


def dotted(expr: ast.AST) -> str | None:
    """``a.b.c`` for a chain of names and attributes; None for anything else."""
    if isinstance(expr, ast.Name):
        return expr.id  # the common case, first
    parts: list[str] = []
    while isinstance(expr, ast.Attribute):  # a loop, not recursion: chains can be long
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    parts.append(expr.id)
    return ".".join(reversed(parts))


def last(name: str | None) -> str:
    """The last part of a dotted name (``""`` for None)."""
    return (name or "").rsplit(".", 1)[-1]


def kwarg(call: ast.Call, name: str) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def arg(call: ast.Call, index: int, name: str) -> ast.expr | None:
    """The argument at ``index`` or passed as ``name=`` (None when absent)."""
    if len(call.args) > index and not any(isinstance(a, ast.Starred) for a in call.args[: index + 1]):
        return call.args[index]
    return kwarg(call, name)


def is_none(expr: ast.expr | None) -> bool:
    return isinstance(expr, ast.Constant) and expr.value is None


#: Levels of a node shown in a message. ``ast.unparse`` recurses ~4 frames a level, so a node
#: unparsed whole could exhaust the stack; deeper parts print as ``...`` (such text passes the
#: 80 characters of ``src`` anyway).
SHOWN_LEVELS = 64


def text(expr: ast.AST) -> str:
    """The node as source text, parts deeper than ``SHOWN_LEVELS`` shown as ``...``."""
    levels, _ = deepest(expr)
    return ast.unparse(expr if levels <= SHOWN_LEVELS else _pruned(expr, SHOWN_LEVELS))


def src(expr: ast.AST) -> str:
    """The node as source text for a message, cut to 80 characters."""
    shown = text(expr)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def _pruned(tree: ast.AST, levels: int) -> ast.AST:
    """A copy of ``tree`` whose expressions below ``levels`` are replaced by ``...``.
    Iterative, like ``deepest``: it is called on trees too deep to recurse over."""
    root = type(tree)()
    stack: list[tuple[ast.AST, ast.AST, int]] = [(tree, root, 1)]
    while stack:
        old, new, depth = stack.pop()
        for field, value in ast.iter_fields(old):
            if isinstance(value, list):
                setattr(new, field, [_copy_field(v, depth + 1, levels, stack) for v in value])
            else:
                setattr(new, field, _copy_field(value, depth + 1, levels, stack))
    return root


def _copy_field(value: object, depth: int, levels: int, stack: list[tuple[ast.AST, ast.AST, int]]) -> object:
    """One field of a node being copied: kept as it is (not a node, or a leaf such as ``Load``
    or a constant), ``...`` for an expression below ``levels``, else a fresh node whose own
    fields are queued on ``stack``."""
    if not isinstance(value, ast.AST) or next(ast.iter_child_nodes(value), None) is None:
        return value
    if depth > levels and isinstance(value, ast.expr):
        return ast.Name(id="...", ctx=ast.Load())
    copy = type(value)()
    stack.append((value, copy, depth))
    return copy


def param_names(func: FuncDef | ast.Lambda) -> list[str]:
    a = func.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
    return names


def factors(expr: ast.expr) -> list[ast.Name]:
    """The names multiplied together in ``expr`` (``stride_we``, ``N * K``, ``s[None, :]``)."""
    if isinstance(expr, ast.Name):
        return [expr]
    if isinstance(expr, ast.Subscript):
        return factors(expr.value)
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Mult):
        return factors(expr.left) + factors(expr.right)
    return []


def is_main_guard(node: ast.AST) -> bool:
    """``if __name__ == "__main__":``."""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    parts = [node.test.left, *node.test.comparators]
    names = {p.id for p in parts if isinstance(p, ast.Name)}
    consts = {p.value for p in parts if isinstance(p, ast.Constant)}
    return "__name__" in names and "__main__" in consts


def walk_shallow(node: ast.AST) -> Iterator[ast.AST]:
    """Like ast.walk, but does not enter nested function or class bodies."""
    stack = list(ast.iter_child_nodes(node))
    while stack:
        item = stack.pop()
        yield item
        if not isinstance(item, (*FUNC_TYPES, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(item))


def deepest(tree: ast.AST) -> tuple[int, int]:
    """``(levels, line)``: how many nodes deep ``tree`` goes, and the line where it does.
    Iterative, so it answers for trees too deep for the recursive passes of the rules."""
    best, best_line = 0, 1
    stack: list[tuple[ast.AST, int, int]] = [(tree, 1, 1)]
    while stack:
        node, depth, line = stack.pop()
        line = getattr(node, "lineno", line)
        if depth > best:
            best, best_line = depth, line
        stack.extend((child, depth + 1, line) for child in ast.iter_child_nodes(node))
    return best, best_line


__all__ = [
    "FUNC_TYPES",
    "FuncDef",
    "SHOWN_LEVELS",
    "arg",
    "deepest",
    "dotted",
    "factors",
    "is_main_guard",
    "is_none",
    "kwarg",
    "last",
    "param_names",
    "src",
    "text",
    "walk_shallow",
]
