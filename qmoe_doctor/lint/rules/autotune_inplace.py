"""``autotune-inplace``: an autotuned kernel that writes memory it reads (in place) or
accumulates with ``tl.atomic_*``, without ``restore_value=`` / ``reset_to_zero=``: the
autotuner runs every config on the caller's buffers, so the first call per key applies the
kernel many times. One config (nothing to tune) stays silent.
"""

from __future__ import annotations

import ast

from qmoe_doctor.lint.findings import Rule
from qmoe_doctor.lint.module import Module
from qmoe_doctor.lint.nodes import FuncDef, arg, factors, is_none, last, src, text
from qmoe_doctor.lint.project import Project


def check(project: Project, m: Module) -> None:
    for func in m.jit_defs.values():
        for dec in func.decorator_list:
            if not isinstance(dec, ast.Call):
                continue
            name = m.canon(dec.func) or ""
            if last(name) != "autotune" or not m.is_jit_decorator(dec):
                continue
            restored = [
                kw
                for kw in dec.keywords
                if kw.arg in ("restore_value", "reset_to_zero") and not is_none(kw.value)
            ]
            if restored or len(dec.args) >= 4:
                continue
            count = _count_configs(m, arg(dec, 0, "configs"), 0)
            if count is not None and count <= 1:
                continue
            what = _inplace_writes(m, func)
            if what is None:
                continue
            desc, ptr = what
            n = f"{count} configs" if count is not None else "a computed list of configs"
            project.add(
                m,
                dec,
                Rule.AUTOTUNE_INPLACE,
                f"`{func.name}` is autotuned over {n} and {desc}, with no restore_value= or "
                "reset_to_zero=: the autotuner runs every config on the caller's buffers, so the "
                "first call per key applies the kernel many times",
                f'@triton.autotune(configs=..., key=[...], restore_value=["{ptr}"])\n'
                f'# or reset_to_zero=["{ptr}"] for an accumulator the caller zeroes',
            )


def _count_configs(m: Module, configs: ast.expr | None, depth: int) -> int | None:
    """Length of a literal config list (through module constants and ``a if c else b``)."""
    if isinstance(configs, ast.Name) and depth < 3:
        configs = m.consts.get(configs.id)
    if isinstance(configs, ast.IfExp):
        counts = [_count_configs(m, c, depth + 1) for c in (configs.body, configs.orelse)]
        return None if None in counts else max(c for c in counts if c is not None)
    if isinstance(configs, (ast.List, ast.Tuple)) and not any(
        isinstance(e, ast.Starred) for e in configs.elts
    ):
        return len(configs.elts)
    return None


def _inplace_writes(m: Module, func: FuncDef) -> tuple[str, str] | None:
    """How ``func`` writes memory it depends on: ``(description, pointer)`` for a pointer it both
    loads and stores, or for a ``tl.atomic_*``; None for a pure out-of-place kernel."""
    params = [a.arg for a in (*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs)]
    constexpr = {
        a.arg
        for a in (*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs)
        if a.annotation is not None and "constexpr" in text(a.annotation)
    }
    # strides are multiplied and sizes compared; pointers are only offset
    not_pointers = {
        n.id
        for node in ast.walk(func)
        if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)) or isinstance(node, ast.Compare)
        for side in (
            (node.left, node.right) if isinstance(node, ast.BinOp) else (node.left, *node.comparators)
        )
        for n in factors(side)
    }
    pointer_params = {p for p in params if p not in constexpr and p not in not_pointers}
    env: dict[str, set[str]] = {}

    def roots(expr: ast.AST | None) -> set[str]:
        if expr is None:
            return set()
        if isinstance(expr, ast.Name):
            if expr.id in env:
                return set(env[expr.id])
            return {expr.id} if expr.id in pointer_params else set()
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, (ast.Add, ast.Sub)):
            return roots(expr.left) | roots(expr.right)
        if isinstance(expr, ast.Subscript):
            return roots(expr.value)
        if isinstance(expr, ast.IfExp):
            return roots(expr.body) | roots(expr.orelse)
        if isinstance(expr, ast.Call):
            name = last(m.canon(expr.func))
            if name in ("multiple_of", "max_contiguous", "advance", "make_block_ptr", "to"):
                if name == "to" and isinstance(expr.func, ast.Attribute):
                    return roots(expr.func.value)
                return roots(arg(expr, 0, "base"))
            if name == "where":
                return roots(arg(expr, 1, "x")) | roots(arg(expr, 2, "y"))
        return set()

    def prefer_pointers(found: set[str]) -> set[str]:
        named = {r for r in found if "ptr" in r.lower() or r.lower().endswith("_p")}
        return named or found

    loaded: set[str] = set()
    stored: list[tuple[str, ast.Call]] = []
    atomics: list[tuple[str, ast.Call]] = []
    for _ in range(2):  # flow-insensitive: a name holds every pointer ever assigned to it
        for node in ast.walk(func):
            if isinstance(node, ast.Assign):
                value_roots = roots(node.value)
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        env[t.id] = env.get(t.id, set()) | value_roots
            elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
                env[node.target.id] = env.get(node.target.id, roots(node.target)) | roots(node.value)
    for node in ast.walk(func):
        if not isinstance(node, ast.Call):
            continue
        name = m.canon(node.func) or ""
        if not name.startswith("triton.language."):
            continue
        op = last(name)
        ptr_roots = prefer_pointers(roots(arg(node, 0, "pointer")))
        if op == "load":
            loaded |= ptr_roots
        elif op == "store":
            stored.extend((r, node) for r in sorted(ptr_roots))
        elif op.startswith("atomic_"):
            atomics.append((next(iter(sorted(ptr_roots)), "out_ptr"), node))
    if atomics:
        ptr, node = atomics[0]
        return f"accumulates with `{src(node.func)}` into `{ptr}`", ptr
    for ptr, _node in stored:
        if ptr in loaded:
            return f"writes `{ptr}`, which it also reads (in place)", ptr
    return None
