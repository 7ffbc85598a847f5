"""``int32-offset``: inside ``@triton.jit``, a global index (from ``tl.program_id``, a loop
variable or ``tl.load``) times an outer-dimension stride (``stride_xm``, ``stride_we``,
``row_stride``) or a row length (``K``, ``N``, ``hidden``), with no int64 cast on the way.
Tile-local ``tl.arange`` offsets and column strides (``stride_xk``, ``stride_wn``) stay silent.

A small forward data flow over one jit function, statement by statement: each name holds a
``_Val`` of kind NONE (constants, sizes), WIDE (int64), LOCAL (a tile-local arange) or INDEX
(global: program id, loop variable, loaded value). Branches join to the riskier kind; loops run
twice so values carried around them reach the start. A product is reported where it is formed,
and one that only feeds a larger product is superseded by it (``expert * N``, then
``(expert * N + n) * K``: the second is the offset that overflows).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from dataclasses import dataclass

from qmoe_doctor.core.compat import StrEnum
from qmoe_doctor.lint.findings import Rule
from qmoe_doctor.lint.module import Module
from qmoe_doctor.lint.nodes import FUNC_TYPES, FuncDef, arg, factors, kwarg, src
from qmoe_doctor.lint.project import Project

# A pointer argument documented as int64 (`bounds_ptr,  # (E + 1,) int64 row bounds`): its loads
# are int64; a comment naming a narrower type as well stays unsure.
_INT64_WORD = re.compile(r"\bu?int64\b")
_INT32_WORD = re.compile(r"\bu?int(32|16|8)\b")


def check(project: Project, m: Module) -> None:
    for func in m.jit_defs.values():
        _Int32Flow(m, func, project).run()


class _Kind(StrEnum):
    NONE = "none"  # constants, parameters, sizes: not an index
    WIDE = "wide"  # int64: products with it are formed in int64
    LOCAL = "local"  # tile-local tl.arange: bounded by a block size
    INDEX = "index"  # global: program id, loop variable, loaded value (an expert id, a row)


_JOIN_ORDER = {_Kind.NONE: 0, _Kind.WIDE: 1, _Kind.LOCAL: 2, _Kind.INDEX: 3}


@dataclass(frozen=True, slots=True)
class _Val:
    kind: _Kind = _Kind.NONE
    origin: str = ""  # for INDEX: where the index comes from
    via: frozenset[int] = frozenset()  # reportable products this value was computed from


_NONE = _Val()
_WIDE = _Val(_Kind.WIDE)
_LOCAL = _Val(_Kind.LOCAL)


def _with_via(v: _Val, via: frozenset[int]) -> _Val:
    return v if via <= v.via else _Val(v.kind, v.origin, v.via | via)


def _combine(a: _Val, b: _Val) -> _Val:
    """Value of an arithmetic result: int64 promotes, otherwise the most global operand wins."""
    if _Kind.WIDE in (a.kind, b.kind):
        return _WIDE
    return _with_via(a if _JOIN_ORDER[a.kind] >= _JOIN_ORDER[b.kind] else b, a.via | b.via)


def _join(a: _Val, b: _Val) -> _Val:
    """Value after two control-flow paths meet: the riskier one."""
    return _with_via(a if _JOIN_ORDER[a.kind] >= _JOIN_ORDER[b.kind] else b, a.via | b.via)


# Last token of a stride name for the dimensions whose offsets stay within one row or one matrix
# of the tensor (k, n, d, columns): index * these cannot pass 2**31 unless one expert's matrix does.
_INNER_DIMS = frozenset(
    {"k", "n", "d", "h", "i", "c", "col", "cols", "column", "columns", "inner", "last", "hidden", "1", "2"}
)
_SIZE_NAMES = frozenset(
    {
        "k",
        "n",
        "d",
        "h",
        "hidden",
        "hidden_size",
        "hidden_dim",
        "dim",
        "d_model",
        "model_dim",
        "n_cols",
        "ncols",
        "num_cols",
        "n_col",
        "row_size",
        "row_len",
        "row_length",
        "inter_size",
        "intermediate_size",
        "embed_dim",
        "head_dim",
        "ffn_dim",
        "d_ff",
        "n_embd",
        "feat_dim",
        "in_features",
        "out_features",
    }
)


def _stride_is_outer(name: str) -> bool | None:
    """None when ``name`` is not a stride; else whether it strides an outer dimension (rows,
    experts, batch, heads) rather than a column one (``stride_xk``, ``stride_wn``, ``col_stride``)."""
    low = name.lower()
    idx = low.find("stride")
    if idx < 0:
        return None
    after = low[idx + len("stride") :].strip("_")
    before = low[:idx].strip("_")
    tokens = [t for t in after.split("_") if t] if after else [t for t in before.split("_") if t]
    if not tokens:
        return True  # a bare `stride`: assume the row stride
    last = tokens[-1]
    if after and len(tokens) == 1 and last not in _INNER_DIMS:
        # compact stride_<tensor><dim>: stride_xm, stride_we, stride_bse (outer); stride_xk,
        # stride_wn, stride_bsn (columns)
        return not (2 <= len(last) <= 3 and last[-1] in "knd")
    # the last token names the dimension: stride_x_T, stride_pre_TK, stride_w_E, x_row_stride
    # (outer); stride_x_H, stride_w_N, col_stride (columns)
    return last not in _INNER_DIMS


def _big_multiplier(expr: ast.expr) -> str | None:
    """Why ``expr`` is a stride or size whose product with a global index can pass 2**31."""
    for n in factors(expr):
        outer = _stride_is_outer(n.id)
        if outer:
            return f"the stride `{n.id}`"
        low = n.id.lower()
        if outer is None and (
            n.id in ("K", "N", "D", "H")
            or (low in _SIZE_NAMES and len(n.id) > 1)
            or (low.endswith("_dim") and not low.startswith("block"))
        ):
            return f"the row length `{n.id}`"
    return None


def _constexpr_like(expr: ast.expr) -> bool:
    return isinstance(expr, ast.Name) and expr.id.isupper() and len(expr.id) > 1


class _Int32Flow:
    """Tracks which names hold global indices, tile-local aranges or int64 values, statement by
    statement, and reports ``index * stride`` products formed in int32."""

    def __init__(self, m: Module, func: FuncDef, project: Project) -> None:
        self.m = m
        self.func = func
        self.project = project
        self.env: dict[str, _Val] = {}
        args = [*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs]
        # products to report, by node; a product that only feeds a larger one is superseded by it
        # (expert * N, then (expert * N + n) * K: the second is the offset that overflows)
        self.candidates: dict[ast.AST, tuple[ast.AST, str, str]] = {}
        self.superseded: set[int] = set()
        # pointers documented as int64 (`bounds_ptr,  # (E + 1,) int64 row bounds`): loads are int64
        self.int64_ptrs: set[str] = set()
        for a in args:
            ann = self.m.canon(a.annotation) if a.annotation is not None else None
            if ann in ("triton.language.int64", "triton.language.uint64"):
                self.env[a.arg] = _WIDE  # stride_am: tl.int64 makes every product int64
            line = m.line(a)
            comment = line.partition("#")[2]
            if _INT64_WORD.search(comment) and not _INT32_WORD.search(comment):
                self.int64_ptrs.add(a.arg)

    def run(self) -> None:
        self.block(self.func.body)
        for cid, (node, message, fix) in enumerate(self.candidates.values()):
            if cid not in self.superseded:
                self.project.add(self.m, node, Rule.INT32_OFFSET, message, fix)

    # --- statements ---

    def block(self, body: Sequence[ast.stmt]) -> None:
        for stmt in body:
            self.stmt(stmt)

    def branches(self, *bodies: Sequence[ast.stmt]) -> None:
        start = dict(self.env)
        results = []
        for body in bodies:
            self.env = dict(start)
            self.block(body)
            results.append(self.env)
        merged: dict[str, _Val] = {}
        for env in results:
            for k, v in env.items():
                merged[k] = _join(merged[k], v) if k in merged else v
        self.env = merged

    def loop(self, body: Sequence[ast.stmt], orelse: Sequence[ast.stmt]) -> None:
        for _ in range(2):  # twice: values carried around the loop reach its start
            before = dict(self.env)
            self.block(body)
            for k, v in before.items():
                self.env[k] = _join(self.env.get(k, v), v)
        self.block(orelse)

    def assign(self, target: ast.expr, value: _Val, value_expr: ast.expr | None = None) -> None:
        if isinstance(target, ast.Name):
            self.env[target.id] = value
            if value_expr is not None and self.points_to_int64(value_expr):
                self.int64_ptrs.add(target.id)
        elif isinstance(target, (ast.Tuple, ast.List)):
            if isinstance(value_expr, (ast.Tuple, ast.List)) and len(value_expr.elts) == len(target.elts):
                for t, v in zip(target.elts, value_expr.elts, strict=True):
                    self.assign(t, self.expr(v))
            else:
                for t in target.elts:
                    self.assign(t, value)

    def stmt(self, s: ast.stmt) -> None:
        if isinstance(s, ast.Assign):
            if isinstance(s.value, (ast.Tuple, ast.List)) and all(
                isinstance(t, (ast.Tuple, ast.List)) for t in s.targets
            ):
                for t in s.targets:
                    self.assign(t, _NONE, s.value)
                return
            v = self.expr(s.value)
            for t in s.targets:
                self.assign(t, v, s.value)
        elif isinstance(s, ast.AnnAssign):
            if s.value is not None:
                self.assign(s.target, self.expr(s.value), s.value)
        elif isinstance(s, ast.AugAssign):
            cur = self.expr(s.target)
            val = self.expr(s.value)
            out = _combine(cur, val)
            if isinstance(s.op, ast.Mult):
                cid = self.product(s, s.target, s.value, cur, val)
                if cid is not None:
                    out = _with_via(out, frozenset({cid}))
            if isinstance(s.target, ast.Name):
                self.env[s.target.id] = out
        elif isinstance(s, ast.If):
            self.expr(s.test)
            self.branches(s.body, s.orelse)
        elif isinstance(s, (ast.For, ast.AsyncFor)):
            self.expr(s.iter)
            is_range = isinstance(s.iter, ast.Call) and (self.m.canon(s.iter.func) or "") in (
                "range",
                "triton.language.range",
                "triton.language.static_range",
            )
            origin = f"the loop variable `{src(s.target)}`"
            self.assign(s.target, _Val(_Kind.INDEX, origin) if is_range else _NONE)
            self.loop(s.body, s.orelse)
        elif isinstance(s, ast.While):
            self.expr(s.test)
            self.loop(s.body, s.orelse)
        elif isinstance(s, (ast.With, ast.AsyncWith)):
            for item in s.items:
                self.expr(item.context_expr)
            self.block(s.body)
        elif isinstance(s, (*FUNC_TYPES, ast.ClassDef)):
            return
        else:
            for child in ast.iter_child_nodes(s):
                if isinstance(child, ast.expr):
                    self.expr(child)
                elif isinstance(child, ast.stmt):
                    self.stmt(child)

    # --- expressions ---

    def points_to_int64(self, expr: ast.expr | None) -> bool:
        return expr is not None and any(
            isinstance(n, ast.Name) and n.id in self.int64_ptrs for n in ast.walk(expr)
        )

    def is_int64(self, expr: ast.expr | None) -> bool:
        if expr is None:
            return False
        return (self.m.canon(expr) or "") in ("triton.language.int64", "triton.language.uint64")

    def expr(self, e: ast.expr) -> _Val:
        if isinstance(e, ast.Name):
            return self.env.get(e.id, _NONE)
        if isinstance(e, ast.Constant):
            return _NONE
        if isinstance(e, (ast.Subscript, ast.Starred)):
            if isinstance(e, ast.Subscript):
                self.expr(e.slice)
            return self.expr(e.value)
        if isinstance(e, ast.UnaryOp):
            return self.expr(e.operand)
        if isinstance(e, ast.BinOp):
            left = self.expr(e.left)
            right = self.expr(e.right)
            out = _combine(left, right)
            if isinstance(e.op, ast.Mult):
                cid = self.product(e, e.left, e.right, left, right)
                if cid is not None:
                    out = _with_via(out, frozenset({cid}))
            return out
        if isinstance(e, ast.IfExp):
            self.expr(e.test)
            return _join(self.expr(e.body), self.expr(e.orelse))
        if isinstance(e, ast.Call):
            return self.call(e)
        if isinstance(e, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            return _NONE
        for child in ast.iter_child_nodes(e):  # compares, bool ops, tuples: check inside, no index
            if isinstance(child, ast.expr):
                self.expr(child)
        return _NONE

    def call(self, e: ast.Call) -> _Val:
        arg_vals = [self.expr(a) for a in e.args]
        kw_vals = {kw.arg: self.expr(kw.value) for kw in e.keywords}
        name = self.m.canon(e.func) or ""
        op = name[len("triton.language.") :] if name.startswith("triton.language.") else None
        base = _NONE  # the object of a method call: offs.to(...), tl.load(p).to(...)
        if isinstance(e.func, ast.Attribute) and op is None:
            base = self.expr(e.func.value)
            if e.func.attr == "to":
                return _WIDE if self.is_int64(arg(e, 0, "dtype")) else base
        elif not isinstance(e.func, (ast.Name, ast.Attribute)):
            self.expr(e.func)
        if op == "program_id":
            return _Val(_Kind.INDEX, f"`{src(e)}`")
        if op == "arange":
            return _LOCAL
        if op == "load":
            if self.points_to_int64(arg(e, 0, "pointer")):
                return _WIDE
            return _Val(_Kind.INDEX, f"`{src(e)}`")
        if op == "cast":
            return _WIDE if self.is_int64(arg(e, 1, "dtype")) else (arg_vals[0] if arg_vals else _NONE)
        if op in ("full", "zeros"):
            return _WIDE if self.is_int64(kwarg(e, "dtype") or (e.args[-1] if e.args else None)) else _NONE
        if op in ("num_programs", "cdiv", "zeros_like", "dot", "sum", "max", "min") or name in (
            "len",
            "range",
        ):
            return _NONE
        out = base
        for v in [*arg_vals, *kw_vals.values()]:
            out = _combine(out, v)
        return out

    def product(self, node: ast.AST, left: ast.expr, right: ast.expr, lv: _Val, rv: _Val) -> int | None:
        """Record ``left * right`` when it is a global index times a stride or row length in
        int32; returns its candidate id."""
        for idx, iv, other, ov in ((left, lv, right, rv), (right, rv, left, lv)):
            if iv.kind is not _Kind.INDEX or ov.kind is _Kind.WIDE:
                continue
            if _constexpr_like(idx) and _constexpr_like(other):
                continue
            why = _big_multiplier(other)
            if why is None:
                continue
            idx_src = src(idx)
            cast = f"({idx_src})" if not isinstance(idx, (ast.Name, ast.Subscript, ast.Call)) else idx_src
            shown = src(node) if isinstance(node, ast.expr) else f"{src(left)} *= {src(right)}"
            message = (
                f"`{shown}` is formed in int32: `{idx_src}` is a global index (from {iv.origin}) "
                f"and {why} makes the product pass 2**31 - 1 on large tensors"
            )
            fix = f"{cast}.to(tl.int64) * {src(other)}  # cast the index where the product is formed"
            if node not in self.candidates:
                self.candidates[node] = (node, message, fix)
            cid = list(self.candidates).index(node)
            self.superseded |= (iv.via | ov.via) - {cid}
            return cid
        return None
