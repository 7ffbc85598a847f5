"""Static lint for the multi-GPU faults of fused MoE Triton kernels.

Sources are read with :mod:`ast` only: never imported, never executed (a kernel module imports
torch and triton, and the parent side never does). Each rule names a cause of
:mod:`qmoe_doctor.core.causes`; a finding says where, what and how to fix it::

    lint_paths(["kernels/"]) --> LintReport(findings=(LintFinding, ...), errors=(LintError, ...))

Rules (each keeps its near-misses silent; false positives matter as much as misses):

* ``unguarded-launch``: a Triton launch ``kernel[grid](...)`` outside a device guard (a ``with``
  whose call ends in ``device``, ``device_of``, ``device_guard``, ``cuda_guard``, ``DeviceGuard``,
  or ``torch.cuda.stream`` of an explicit stream; ``torch.device(...)`` is not one) and not
  after ``torch.cuda.set_device``. A launch helper is followed up to its callers ("callers hold
  the guard"): the finding lands on each call without a guard, or on the launch itself when the
  helper has no caller in the linted files.
* ``int32-offset``: inside ``@triton.jit``, a global index (from ``tl.program_id``, a loop
  variable or ``tl.load``) times an outer-dimension stride (``stride_xm``, ``stride_we``,
  ``row_stride``) or a row length (``K``, ``N``, ``hidden``), with no int64 cast on the way.
  Tile-local ``tl.arange`` offsets and column strides (``stride_xk``, ``stride_wn``) stay silent.
* ``cached-device-property``: properties of the *current* device cached at module level, in a
  ``functools.cache`` / ``lru_cache`` function, or in a global.
* ``stream-without-device``: ``current_stream()`` without a device outside a guard, or a default
  (null) stream or an undeviced ``Stream()`` used for a launch.
* ``default-device-alloc``: ``device="cuda"`` (or ``.cuda()``) outside a guard in a kernel wrapper.
* ``autotune-inplace``: an autotuned in-place or accumulating kernel without ``restore_value`` /
  ``reset_to_zero``.

Files of one run are one project: kernels and launch helpers imported from another linted file
are recognised, and imported files found next to a linted one are read (not reported) for that.
Test functions and ``if __name__ == "__main__":`` blocks make their own tensors on the current
device, so the device rules stay silent there. A finding is silenced by a
``# qmoe-doctor: ignore`` (or ``ignore[rule,...]``) comment on its line.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import sys
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from qmoe_doctor.core.compat import StrEnum

__all__ = [
    "RULES",
    "LintError",
    "LintFinding",
    "LintReport",
    "Rule",
    "RuleInfo",
    "iter_python_files",
    "lint_paths",
    "lint_source",
    "parse_rules",
]


class Rule(StrEnum):
    UNGUARDED_LAUNCH = "unguarded-launch"
    INT32_OFFSET = "int32-offset"
    CACHED_DEVICE_PROPERTY = "cached-device-property"
    STREAM_WITHOUT_DEVICE = "stream-without-device"
    DEFAULT_DEVICE_ALLOC = "default-device-alloc"
    AUTOTUNE_INPLACE = "autotune-inplace"


@dataclass(frozen=True, slots=True, kw_only=True)
class RuleInfo:
    """What is fixed about a rule: the cause it points at and the generic fix."""

    rule: Rule
    cause: str  # a key of qmoe_doctor.core.causes.CAUSES
    summary: str
    fix: str


RULES: dict[Rule, RuleInfo] = {
    info.rule: info
    for info in (
        RuleInfo(
            rule=Rule.UNGUARDED_LAUNCH,
            cause="missing-device-guard",
            summary="Triton launch outside torch.cuda.device(...): runs on the current device",
            fix="with torch.cuda.device(x.device):\n    kernel[grid](x, ...)",
        ),
        RuleInfo(
            rule=Rule.INT32_OFFSET,
            cause="int32-offset-overflow",
            summary="global index x stride formed in int32 inside a @triton.jit kernel",
            fix="offset = index.to(tl.int64) * stride  # cast the index where the product is formed",
        ),
        RuleInfo(
            rule=Rule.CACHED_DEVICE_PROPERTY,
            cause="per-device-state-cached",
            summary="properties of the current device cached once for every device",
            fix="@functools.cache\ndef num_sms(device_index: int) -> int: ...  # keyed by device",
        ),
        RuleInfo(
            rule=Rule.STREAM_WITHOUT_DEVICE,
            cause="wrong-device-stream",
            summary="stream taken without the tensors' device",
            fix="with torch.cuda.device(x.device):\n    stream = torch.cuda.current_stream(x.device)",
        ),
        RuleInfo(
            rule=Rule.DEFAULT_DEVICE_ALLOC,
            cause="default-device-buffer",
            summary='buffer allocated with device="cuda" in a kernel wrapper',
            fix="buf = torch.empty(n, dtype=torch.int32, device=x.device)",
        ),
        RuleInfo(
            rule=Rule.AUTOTUNE_INPLACE,
            cause="autotune-inplace-rerun",
            summary="autotuned in-place/accumulating kernel without restore_value/reset_to_zero",
            fix='@triton.autotune(configs=..., key=[...], restore_value=["y_ptr"])',
        ),
    )
}


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class LintFinding:
    """One finding: where (1-based line and column), which rule and cause, what, and the fix."""

    path: str
    line: int
    col: int
    rule: Rule
    cause: str  # a key of qmoe_doctor.core.causes.CAUSES
    message: str
    fix: str  # a code snippet for this finding
    source: str = ""  # the source line, stripped

    @property
    def location(self) -> str:
        return f"{self.path}:{self.line}:{self.col}"

    def as_line(self) -> str:
        """``path:line:col: rule [cause] message`` (editors and grep read this)."""
        return f"{self.location}: {self.rule} [{self.cause}] {self.message}"


@dataclass(frozen=True, slots=True, kw_only=True)
class LintError:
    """A path that could not be linted: it does not exist, cannot be read, or does not parse."""

    path: str
    kind: Literal["missing", "unreadable", "syntax"]
    message: str
    line: int | None = None
    col: int | None = None
    source: str = ""  # the offending source line (syntax errors)

    def as_line(self) -> str:
        where = self.path
        if self.line is not None:
            where += f":{self.line}"
            if self.col is not None:
                where += f":{self.col}"
        return f"{where}: {self.message}"


@dataclass(frozen=True, slots=True, kw_only=True)
class LintReport:
    """The result of one lint run over a set of paths."""

    paths: tuple[str, ...]  # as given
    files: tuple[str, ...]  # the Python files that were parsed and linted
    rules: tuple[Rule, ...]  # the rules that ran
    findings: tuple[LintFinding, ...] = ()
    errors: tuple[LintError, ...] = ()

    @property
    def clean(self) -> bool:
        return not self.findings and not self.errors

    def by_file(self) -> dict[str, tuple[LintFinding, ...]]:
        grouped: dict[str, list[LintFinding]] = {}
        for f in self.findings:
            grouped.setdefault(f.path, []).append(f)
        return {path: tuple(items) for path, items in grouped.items()}

    def counts(self) -> dict[str, int]:
        """Findings per rule id, in rule order, rules without findings left out."""
        out: dict[str, int] = {}
        for rule in Rule:
            n = sum(1 for f in self.findings if f.rule is rule)
            if n:
                out[rule.value] = n
        return out


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------


def parse_rules(names: Iterable[str | Rule] | None) -> tuple[Rule, ...] | None:
    """Rule ids (strings, commas allowed inside) to Rules; ``None`` stays ``None``."""
    if names is None:
        return None
    out: list[Rule] = []
    for item in names:
        for raw in str(item).split(","):
            name = raw.strip()
            if not name:
                continue
            try:
                rule = Rule(name)
            except ValueError:
                known = ", ".join(r.value for r in Rule)
                raise ValueError(f"unknown lint rule {name!r}; known: {known}") from None
            if rule not in out:
                out.append(rule)
    return tuple(out)


def _active_rules(
    select: Iterable[str | Rule] | None, ignore: Iterable[str | Rule] | None
) -> tuple[Rule, ...]:
    chosen = parse_rules(select)
    skipped = parse_rules(ignore) or ()
    base = chosen if chosen else tuple(Rule)
    return tuple(r for r in base if r not in skipped)


_SKIP_DIRS = frozenset({"__pycache__", "node_modules", "site-packages"})


def iter_python_files(directory: Path) -> Iterator[Path]:
    """``*.py`` under ``directory``, sorted; skips hidden folders, caches and virtualenvs."""
    for root, dirs, files in os.walk(directory):
        root_path = Path(root)
        dirs[:] = sorted(
            d
            for d in dirs
            if not d.startswith(".") and d not in _SKIP_DIRS and not (root_path / d / "pyvenv.cfg").exists()
        )
        for name in sorted(files):
            if name.endswith(".py"):
                yield root_path / name


def lint_paths(
    paths: Iterable[str | os.PathLike[str]],
    select: Iterable[str | Rule] | None = None,
    ignore: Iterable[str | Rule] | None = None,
) -> LintReport:
    """Lint files and directories (walked for ``*.py``) as one project, so kernels imported from
    another linted file are recognised. Missing paths and unparsable files become ``errors``.
    Raises ``ValueError`` for an unknown rule id in ``select`` / ``ignore``."""
    rules = _active_rules(select, ignore)
    given = tuple(os.fspath(p) for p in paths)
    files: list[Path] = []
    errors: list[LintError] = []
    for raw in given:
        p = Path(raw)
        if p.is_dir():
            files.extend(iter_python_files(p))
        elif p.is_file():
            files.append(p)
        else:
            errors.append(LintError(path=raw, kind="missing", message="no such file or directory"))
    seen: set[str] = set()
    modules: list[_Module] = []
    for f in files:
        name = f.as_posix()
        if name in seen:
            continue
        seen.add(name)
        try:
            data = f.read_bytes()
        except OSError as exc:
            errors.append(LintError(path=name, kind="unreadable", message=f"cannot read: {exc.strerror}"))
            continue
        parsed = _parse(name, data)
        if isinstance(parsed, LintError):
            errors.append(parsed)
        else:
            modules.append(parsed)
    findings = _Project(modules, context=_context_modules(modules, seen)).run(rules)
    return LintReport(
        paths=given,
        files=tuple(m.path for m in modules),
        rules=rules,
        findings=findings,
        errors=tuple(errors),
    )


def lint_source(
    source: str,
    path: str = "<string>",
    *,
    select: Iterable[str | Rule] | None = None,
    ignore: Iterable[str | Rule] | None = None,
) -> tuple[LintFinding, ...]:
    """Lint one source text. Raises ``SyntaxError`` when it does not parse."""
    rules = _active_rules(select, ignore)
    parsed = _parse(path, source.encode())
    if isinstance(parsed, LintError):
        raise SyntaxError(parsed.message, (path, parsed.line, parsed.col, parsed.source))
    return _Project([parsed]).run(rules)


_MAX_CONTEXT_FILES = 64  # bounds the reading of imported files that were not asked for
_EXTERNAL_ROOTS = frozenset({"torch", "triton", "numpy", "typer", "rich", "pytest", "__future__"})


def _import_candidates(path: Path, nodes: Iterable[ast.AST]) -> Iterator[Path]:
    """Files that the imports of ``path`` may name, found next to it or in its parent folders:
    ``from .grouped_gemm import f`` or ``from pkg.kernels.grouped_gemm import f``."""
    here = path.parent
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            modules = [node.module or ""]
            if node.module is None or node.level:
                modules += [f"{node.module}.{a.name}" if node.module else a.name for a in node.names]
            level = node.level
        elif isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
            level = 0
        else:
            continue
        for module in modules:
            parts = [p for p in module.split(".") if p]
            if not parts or (not level and (parts[0] in _EXTERNAL_ROOTS or parts[0] in _STDLIB)):
                continue
            if level:
                base = here
                for _ in range(level - 1):
                    base = base.parent
                yield base.joinpath(*parts).with_suffix(".py")
                continue
            base = here
            for _ in range(4):  # the package root is a few folders up at most
                for k in range(len(parts), 0, -1):
                    yield base.joinpath(*parts[-k:]).with_suffix(".py")
                if base.parent == base:
                    break
                base = base.parent


def _context_modules(modules: Sequence[_Module], linted: set[str]) -> list[_Module]:
    """Parse (never import) the files the linted modules import from that were not linted
    themselves, so a launch helper or kernel defined there is recognised. Findings in them
    are not reported."""
    out: list[_Module] = []
    seen = set(linted)
    for m in modules:
        for cand in _import_candidates(Path(m.path), m.nodes):
            name = cand.as_posix()
            if name in seen or not cand.is_file():
                continue
            seen.add(name)
            try:
                parsed = _parse(name, cand.read_bytes())
            except OSError:
                continue
            if isinstance(parsed, _Module):
                out.append(parsed)
            if len(out) >= _MAX_CONTEXT_FILES:
                return out
    return out


def _parse(path: str, data: bytes) -> _Module | LintError:
    try:
        text = importlib.util.decode_source(data)
    except (SyntaxError, UnicodeDecodeError, LookupError) as exc:
        return LintError(path=path, kind="unreadable", message=f"cannot decode: {exc}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences and the like
            tree = ast.parse(text, filename=path)
    except SyntaxError as exc:
        line_text = (exc.text or "").strip()
        return LintError(
            path=path,
            kind="syntax",
            message=f"syntax error: {exc.msg}",
            line=exc.lineno,
            col=exc.offset,
            source=line_text,
        )
    except ValueError as exc:  # e.g. source with null bytes
        return LintError(path=path, kind="syntax", message=f"cannot parse: {exc}")
    return _Module(path, tree, text.splitlines())


# --------------------------------------------------------------------------------------------
# Module model: import aliases, parents, module-level constants, Triton kernels
# --------------------------------------------------------------------------------------------

_FUNC_TYPES = (ast.FunctionDef, ast.AsyncFunctionDef)
_MAX_CALL_DEPTH = 8  # callers followed up the call graph from a launch (deep chains are not)
_STDLIB: frozenset[str] = frozenset(getattr(sys, "stdlib_module_names", ()))
FuncDef = ast.FunctionDef | ast.AsyncFunctionDef

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
_CACHE_DECORATORS = frozenset({"functools.cache", "functools.lru_cache", "cache", "lru_cache"})
_GUARD_SUFFIXES = ("device", "device_of", "device_guard", "cuda_guard", "deviceguard", "device_index")
_STREAM_CONTEXTS = frozenset(
    {"torch.cuda.stream", "torch.cuda.StreamContext", "torch.cuda.streams.StreamContext"}
)
_CUDA_STRING = re.compile(r"^cuda(:\d+)?$")
_INT64_WORD = re.compile(r"\bu?int64\b")
_INT32_WORD = re.compile(r"\bu?int(32|16|8)\b")
_IGNORE_COMMENT = re.compile(r"#\s*qmoe-doctor:\s*ignore(?:\[([^\]]*)\])?")


def _dotted(expr: ast.AST) -> str | None:
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        base = _dotted(expr.value)
        return f"{base}.{expr.attr}" if base is not None else None
    return None


def _last(name: str | None) -> str:
    return (name or "").rsplit(".", 1)[-1]


def _kwarg(call: ast.Call, name: str) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def _arg(call: ast.Call, index: int, name: str) -> ast.expr | None:
    """The argument at ``index`` or passed as ``name=`` (None when absent)."""
    if len(call.args) > index and not any(isinstance(a, ast.Starred) for a in call.args[: index + 1]):
        return call.args[index]
    return _kwarg(call, name)


def _is_none(expr: ast.expr | None) -> bool:
    return isinstance(expr, ast.Constant) and expr.value is None


def _src(expr: ast.AST) -> str:
    text = ast.unparse(expr)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_main_guard(node: ast.AST) -> bool:
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    parts = [node.test.left, *node.test.comparators]
    names = {p.id for p in parts if isinstance(p, ast.Name)}
    consts = {p.value for p in parts if isinstance(p, ast.Constant)}
    return "__name__" in names and "__main__" in consts


def _walk_shallow(node: ast.AST) -> Iterator[ast.AST]:
    """Like ast.walk, but does not enter nested function or class bodies."""
    stack = list(ast.iter_child_nodes(node))
    while stack:
        item = stack.pop()
        yield item
        if not isinstance(item, (*_FUNC_TYPES, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(item))


class _Module:
    """One parsed file and what the rules need to know about it."""

    def __init__(self, path: str, tree: ast.Module, lines: list[str]) -> None:
        self.path = path
        self.tree = tree
        self.lines = lines
        self.stem = Path(path).stem
        if self.stem == "__init__":
            self.stem = Path(path).parent.name  # a package is imported by its folder's name
        self.nodes: list[ast.AST] = list(ast.walk(tree))
        self.calls: list[ast.Call] = [n for n in self.nodes if isinstance(n, ast.Call)]
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in self.nodes:
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self._shallow: dict[ast.AST, list[ast.AST]] = {}
        self._exempt: dict[ast.AST, bool] = {}
        self._set_device_lines: dict[ast.AST, list[int]] = {}
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
        for stmt in tree.body:
            if (
                isinstance(stmt, ast.Assign)
                and len(stmt.targets) == 1
                and isinstance(stmt.targets[0], ast.Name)
            ):
                self.consts[stmt.targets[0].id] = stmt.value
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value:
                self.consts[stmt.target.id] = stmt.value
        self.defined: set[str] = {
            n.name for n in tree.body if isinstance(n, (*_FUNC_TYPES, ast.ClassDef))
        } | set(self.consts)
        self.jit_defs: dict[str, FuncDef] = {}
        for node in self.nodes:
            if isinstance(node, _FUNC_TYPES) and any(self.is_jit_decorator(d) for d in node.decorator_list):
                self.jit_defs[node.name] = node
        self.kernels: set[str] = set(self.jit_defs)
        for stmt in tree.body:  # kernel = triton.jit(fn), kernel = triton.autotune(...)(fn), aliases
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

    # --- names ---

    def canon(self, expr: ast.AST) -> str | None:
        """Dotted name of ``expr`` with its first part resolved through the imports."""
        name = _dotted(expr)
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

    # --- tree navigation ---

    def ancestors(self, node: ast.AST) -> Iterator[ast.AST]:
        cur = self.parents.get(node)
        while cur is not None:
            yield cur
            cur = self.parents.get(cur)

    def func_of(self, node: ast.AST) -> FuncDef | None:
        for anc in self.ancestors(node):
            if isinstance(anc, _FUNC_TYPES):
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
            return any(_is_main_guard(anc) for anc in self.ancestors(node))
        if func not in self._exempt:
            self._exempt[func] = func.name.lstrip("_").startswith(("test", "bench")) or self.exempt(func)
        return self._exempt[func]

    def shallow(self, scope: ast.AST) -> list[ast.AST]:
        """The nodes of a function (or the module) outside its nested functions and classes."""
        if scope not in self._shallow:
            self._shallow[scope] = list(_walk_shallow(scope))
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

    # --- device expressions ---

    def undeviced(self, expr: ast.expr | None, *, depth: int = 0) -> str | None:
        """Describe a device expression that is not taken from a tensor (``"cuda"``, ``0``,
        ``torch.cuda.current_device()``, ``torch.device("cuda")``, a module constant of those);
        None for anything else (``x.device``, a parameter, ``"cpu"``)."""
        if expr is None:
            return None
        if isinstance(expr, ast.Constant):
            v = expr.value
            if isinstance(v, bool):
                return None
            if isinstance(v, int):
                return f"device {v} (hard-coded)"
            if isinstance(v, str) and _CUDA_STRING.match(v):
                return f"{v!r} (the current device)" if v == "cuda" else f"{v!r} (a hard-coded device)"
            return None
        if isinstance(expr, ast.Call):
            name = self.canon(expr.func) or ""
            if _last(name) in ("current_device", "get_active_torch_device"):
                return f"{_src(expr)} (the current device)"
            if name == "torch.device" and expr.args:
                inner = self.undeviced(expr.args[0], depth=depth + 1)
                if inner is not None:
                    index = len(expr.args) > 1 or "current device" not in inner
                    return f"{_src(expr)} ({'a hard-coded' if index else 'the current'} device)"
            return None
        if isinstance(expr, ast.Attribute) and expr.attr == "type":
            if isinstance(expr.value, ast.Attribute) and expr.value.attr == "device":
                return f"{_src(expr)} ('cuda' with no index)"
        if isinstance(expr, ast.Name) and depth < 2:
            func = self.func_of(expr)
            if func is not None and expr.id in _param_names(func):
                return None  # handed in by the caller
            value = self.local_value(expr)
            if value is not None and self.undeviced(value, depth=depth + 1) is not None:
                return f"{expr.id} = {_src(value)}"
        return None


def _param_names(func: FuncDef | ast.Lambda) -> list[str]:
    a = func.args
    names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
    names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
    return names


# --------------------------------------------------------------------------------------------
# The project: every module of one run, with cross-file kernel and caller lookup
# --------------------------------------------------------------------------------------------


class _Project:
    def __init__(self, modules: Sequence[_Module], context: Sequence[_Module] = ()) -> None:
        self.linted = {m.path for m in modules}
        self.modules = [*modules, *context]  # context: imported files, read for resolution only
        self.kernels_by_stem: dict[str, set[str]] = {}
        for m in self.modules:
            self.kernels_by_stem.setdefault(m.stem, set()).update(m.kernels)
        self.all_kernels: set[str] = (
            set().union(*(m.kernels for m in self.modules)) if self.modules else set()
        )
        self.calls_by_name: dict[str, list[tuple[_Module, ast.Call]]] = {}
        self.launches: dict[_Module, list[ast.Call]] = {}
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
        self._callers: dict[ast.AST, list[tuple[_Module, ast.Call]]] = {}
        self._guarded_memo: dict[ast.AST, bool] = {}
        self._sites_memo: dict[ast.AST, list[tuple[_Module, ast.AST]] | None] = {}
        self._busy: set[ast.AST] = set()
        self._launching: set[str] | None = None
        self.findings: list[LintFinding] = []

    # --- kernels and launches ---

    def is_kernel_ref(self, m: _Module, expr: ast.expr) -> bool:
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

    def kernel_name(self, m: _Module, call: ast.Call) -> str | None:
        """The launched kernel's name when ``call`` is ``kernel[grid](...)``."""
        if isinstance(call.func, ast.Subscript) and self.is_kernel_ref(m, call.func.value):
            return _dotted(call.func.value) or _src(call.func.value)
        return None

    # --- device guards ---

    def is_guard_cm(self, m: _Module, expr: ast.expr) -> bool:
        if not isinstance(expr, ast.Call):
            return False
        name = m.canon(expr.func) or ""
        if name == "torch.device":  # sets the default device of factories, not the CUDA device
            return False
        if _last(name).lower().lstrip("_").endswith(_GUARD_SUFFIXES):
            return True
        if name in _STREAM_CONTEXTS:  # entering a stream makes its device current
            stream = _arg(expr, 0, "stream")
            return stream is not None and self.stream_device(m, stream) == "explicit"
        return False

    def lexical_guard(self, m: _Module, node: ast.AST) -> bool:
        child = node
        for anc in m.ancestors(node):
            if isinstance(anc, (*_FUNC_TYPES, ast.ClassDef)):
                return False
            if isinstance(anc, (ast.With, ast.AsyncWith)) and any(child is s for s in anc.body):
                if any(self.is_guard_cm(m, item.context_expr) for item in anc.items):
                    return True
            child = anc
        return False

    def in_torch_device_cm(self, m: _Module, node: ast.AST) -> bool:
        for anc in m.ancestors(node):
            if isinstance(anc, _FUNC_TYPES):
                return False
            if isinstance(anc, (ast.With, ast.AsyncWith)) and any(
                isinstance(i.context_expr, ast.Call) and m.canon(i.context_expr.func) == "torch.device"
                for i in anc.items
            ):
                return True
        return False

    def sets_device_before(self, m: _Module, node: ast.AST) -> bool:
        scope: ast.AST = m.func_of(node) or m.tree
        if scope not in m._set_device_lines:
            m._set_device_lines[scope] = [
                n.lineno
                for n in m.shallow(scope)
                if isinstance(n, ast.Call)
                and m.canon(n.func) in ("torch.cuda.set_device", "torch.accelerator.set_device_index")
            ]
        line = getattr(node, "lineno", 0)
        return any(set_at < line for set_at in m._set_device_lines[scope])

    def guarded(self, m: _Module, node: ast.AST, depth: int = 0) -> bool:
        """Inside a device guard: lexically, after set_device in the same function, or in a
        function whose every caller in the linted files is itself guarded."""
        if self.lexical_guard(m, node) or self.sets_device_before(m, node):
            return True
        func = m.func_of(node)
        return func is not None and self.callers_guarded(m, func, depth)

    def callers(self, m: _Module, func: FuncDef) -> list[tuple[_Module, ast.Call]]:
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
            if self.may_call(m, func, is_method, cm, call) and not cm.exempt(call):
                out.append((cm, call))
        self._callers[func] = out
        return out

    def may_call(self, m: _Module, func: FuncDef, is_method: bool, cm: _Module, call: ast.Call) -> bool:
        if isinstance(call.func, ast.Attribute):
            owner = call.func.value
            if is_method:  # obj.method(...), but not module.function(...)
                return not (isinstance(owner, ast.Name) and owner.id in cm.aliases)
            return self.names_module(cm.canon(owner) or "", m, func.name)
        if is_method:
            return False
        if cm is m:
            return call.func.id not in cm.aliases if isinstance(call.func, ast.Name) else False
        full = cm.aliases.get(call.func.id) if isinstance(call.func, ast.Name) else None
        if full is None:
            return False  # a local name of another module
        return self.names_module(full.rpartition(".")[0], m, func.name)

    def names_module(self, module: str, m: _Module, name: str) -> bool:
        """Whether the dotted ``module`` may be ``m``: its last part is ``m``'s name, or no
        module of that name here defines ``name`` (a package re-export, an unread file)."""
        stem = module.rsplit(".", 1)[-1]
        if stem == m.stem:
            return True
        same = [o for o in self.modules if o.stem == stem]
        return not any(name in o.defined for o in same)

    def callers_guarded(self, m: _Module, func: FuncDef, depth: int = 0) -> bool:
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

    # --- streams ---

    def stream_device(
        self, m: _Module, expr: ast.expr, depth: int = 0
    ) -> Literal["none", "literal", "explicit"]:
        """Where a stream expression's device comes from: none (the current device), a literal
        device, or an explicit expression (a tensor's device, a stream handed in)."""
        if isinstance(expr, ast.Name) and depth < 3:
            value = m.local_value(expr)
            return self.stream_device(m, value, depth + 1) if value is not None else "explicit"
        if not isinstance(expr, ast.Call):
            return "explicit"
        name = m.canon(expr.func) or ""
        if name not in (
            "torch.cuda.current_stream",
            "torch.cuda.default_stream",
            "torch.cuda.Stream",
            "torch.cuda.streams.Stream",
        ):
            return "explicit"
        device = _arg(expr, 0, "device")
        if device is None or _is_none(device):
            return "none"
        desc = m.undeviced(device)
        if desc is None:
            return "explicit"
        return "none" if "current device" in desc else "literal"

    # --- running ---

    def add(self, m: _Module, node: ast.AST, rule: Rule, message: str, fix: str) -> None:
        line = getattr(node, "lineno", 1)
        col = getattr(node, "col_offset", 0) + 1
        text = m.lines[line - 1] if 0 < line <= len(m.lines) else ""
        hit = _IGNORE_COMMENT.search(text)
        if hit and (hit.group(1) is None or rule.value in {s.strip() for s in hit.group(1).split(",")}):
            return
        self.findings.append(
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

    def run(self, rules: Sequence[Rule]) -> tuple[LintFinding, ...]:
        checks = {
            Rule.UNGUARDED_LAUNCH: self.check_unguarded_launch,
            Rule.INT32_OFFSET: self.check_int32_offset,
            Rule.CACHED_DEVICE_PROPERTY: self.check_cached_device_property,
            Rule.STREAM_WITHOUT_DEVICE: self.check_stream_without_device,
            Rule.DEFAULT_DEVICE_ALLOC: self.check_default_device_alloc,
            Rule.AUTOTUNE_INPLACE: self.check_autotune_inplace,
        }
        for m in self.modules:
            for rule in rules:
                checks[rule](m)
        unique: dict[tuple[str, int, int, Rule], LintFinding] = {}
        for f in self.findings:  # the first finding at a place wins (the nearest launch)
            if f.path in self.linted:
                unique.setdefault((f.path, f.line, f.col, f.rule), f)
        return tuple(sorted(unique.values(), key=lambda f: (f.path, f.line, f.col, f.rule.value)))

    # ---------------------------------------------------------------------------------------
    # unguarded-launch
    # ---------------------------------------------------------------------------------------

    def unguarded_sites(self, m: _Module, node: ast.AST, depth: int = 0) -> list[tuple[_Module, ast.AST]]:
        """Where a guard is missing for ``node``: the node itself when its function has no caller
        in the linted files (an entry point), else each caller's call site without a guard,
        followed up the call graph."""
        if m.exempt(node) or self.lexical_guard(m, node) or self.sets_device_before(m, node):
            return []
        func = m.func_of(node)
        if func is None:
            return [(m, node)]
        sites = self.caller_sites(m, func, depth)
        return [(m, node)] if sites is None else sites

    def caller_sites(self, m: _Module, func: FuncDef, depth: int = 0) -> list[tuple[_Module, ast.AST]] | None:
        """Unguarded sites reached through the callers of ``func``; None when it has none."""
        if func in self._sites_memo:
            return self._sites_memo[func]
        if func in self._busy or depth > _MAX_CALL_DEPTH:
            return []  # a call cycle or a deep chain: not followed further
        self._busy.add(func)
        calls = self.callers(m, func)
        result: list[tuple[_Module, ast.AST]] | None = None
        if calls:
            unique: dict[int, tuple[_Module, ast.AST]] = {}
            for cm, call in calls:
                for site in self.unguarded_sites(cm, call, depth + 1):
                    unique.setdefault(id(site[1]), site)
            result = list(unique.values())
        self._busy.discard(func)
        self._sites_memo[func] = result
        return result

    def check_unguarded_launch(self, m: _Module) -> None:
        for launch in self.launches[m]:
            kernel = self.kernel_name(m, launch) or "kernel"
            for site_module, site in self.unguarded_sites(m, launch):
                if site is launch:
                    self.report_launch(m, launch, kernel)
                elif isinstance(site, ast.Call):
                    self.report_call_site(site_module, site, kernel, f"{m.path}:{launch.lineno}")

    def report_launch(self, m: _Module, launch: ast.Call, kernel: str) -> None:
        func = m.func_of(launch)
        msg = (
            f"Triton launch of `{kernel}` is not inside a device guard: it runs on the current "
            "CUDA device and that device's stream, not on the device of its tensors"
        )
        if self.in_torch_device_cm(m, launch):
            msg += " (`with torch.device(...)` only sets the default device of factories)"
        if func is not None:
            msg += f"; no caller of `{func.name}` in the linted files holds one"
        first = launch.args[0] if launch.args else None
        tensor = _src(first) if isinstance(first, (ast.Name, ast.Attribute)) else "x"
        fix = f"with torch.cuda.device({tensor}.device):\n    {kernel}[grid](...)"
        self.add(m, launch, Rule.UNGUARDED_LAUNCH, msg, fix)

    def report_call_site(self, m: _Module, call: ast.Call, kernel: str, launch_at: str) -> None:
        callee = _src(call.func)
        msg = (
            f"`{callee}(...)` is called outside a device guard and launches the Triton kernel "
            f"`{kernel}` ({launch_at}) without one: it runs on the current CUDA device and that "
            "device's stream, not on the device of its tensors"
        )
        if self.in_torch_device_cm(m, call):
            msg += " (`with torch.device(...)` only sets the default device of factories)"
        first = call.args[0] if call.args else None
        tensor = _src(first) if isinstance(first, (ast.Name, ast.Attribute)) else "x"
        fix = f"with torch.cuda.device({tensor}.device):\n    {callee}(...)"
        self.add(m, call, Rule.UNGUARDED_LAUNCH, msg, fix)

    # ---------------------------------------------------------------------------------------
    # stream-without-device
    # ---------------------------------------------------------------------------------------

    def check_stream_without_device(self, m: _Module) -> None:
        for node in m.calls:
            if m.exempt(node):
                continue
            name = m.canon(node.func) or ""
            if name == "torch.cuda.current_stream":
                where = self.stream_device(m, node)
                if where == "literal" or (where == "none" and not self.guarded(m, node)):
                    what = "a hard-coded device" if where == "literal" else "no device argument"
                    self.add(
                        m,
                        node,
                        Rule.STREAM_WITHOUT_DEVICE,
                        f"`{_src(node)}` with {what} outside a device guard returns the current "
                        "device's stream, not the stream of the tensors' device",
                        "with torch.cuda.device(x.device):\n    stream = torch.cuda.current_stream(x.device)",
                    )
            elif name in ("torch.cuda.default_stream", "torch.cuda.Stream", "torch.cuda.streams.Stream"):
                where = self.stream_device(m, node)
                default = name.endswith("default_stream")
                if not default and (where == "explicit" or (where == "none" and self.guarded(m, node))):
                    continue  # a side stream of the tensors' (or the guarded) device
                if not self.used_for_launch(m, node):
                    continue
                if default:
                    what = "the null stream, unordered against the caller's current stream"
                    if where != "explicit":
                        what += f" (and of {'the current' if where == 'none' else 'a hard-coded'} device)"
                    fix = (
                        "with torch.cuda.device(x.device):\n"
                        "    kernel[grid](...)  # on the caller's current stream of x.device"
                    )
                else:
                    what = f"a stream of {'the current' if where == 'none' else 'a hard-coded'} device"
                    fix = "side = torch.cuda.Stream(device=x.device)\nside.wait_stream(torch.cuda.current_stream(x.device))"
                self.add(
                    m,
                    node,
                    Rule.STREAM_WITHOUT_DEVICE,
                    f"`{_src(node)}` is used for a launch: it is {what}, so the kernel is not "
                    "ordered after the producer of its inputs",
                    fix,
                )

    def used_for_launch(self, m: _Module, stream_call: ast.Call) -> bool:
        """The stream made by ``stream_call`` is passed to a launch, or entered with
        ``torch.cuda.stream(...)`` around work (directly, through the name it is assigned to, or
        through a helper that returns the stream context)."""
        refs: list[ast.AST] = [stream_call]
        parent = m.parents.get(stream_call)
        if isinstance(parent, ast.Assign):
            names = {t.id for t in parent.targets if isinstance(t, ast.Name)}
            scope: ast.AST = m.func_of(stream_call) or m.tree
            refs += [n for n in m.shallow(scope) if isinstance(n, ast.Name) and n.id in names]
        for ref in refs:
            for anc in m.ancestors(ref):
                if isinstance(anc, ast.Call) and self.kernel_name(m, anc) is not None:
                    return True  # kernel[grid](..., stream=s)
                if isinstance(anc, ast.Call) and (m.canon(anc.func) or "") in _STREAM_CONTEXTS:
                    if self.context_runs_work(m, anc):
                        return True
                    break
                if isinstance(anc, ast.stmt):
                    break
        return False

    def context_runs_work(self, m: _Module, ctx: ast.Call) -> bool:
        parent = m.parents.get(ctx)
        if isinstance(parent, ast.withitem):
            with_node = m.parents.get(parent)
            return isinstance(with_node, (ast.With, ast.AsyncWith)) and self.body_runs_work(m, with_node)
        if isinstance(parent, ast.Return):  # def _default_stream(d): return torch.cuda.stream(...)
            func = m.func_of(ctx)
            for cm, call in self.callers(m, func) if func is not None else []:
                item = cm.parents.get(call)
                with_node = cm.parents.get(item) if isinstance(item, ast.withitem) else None
                if isinstance(with_node, (ast.With, ast.AsyncWith)) and self.body_runs_work(cm, with_node):
                    return True
        return False

    def body_runs_work(self, m: _Module, node: ast.With | ast.AsyncWith) -> bool:
        """The block launches a kernel, calls a linted function that does, or calls a function
        from outside (not torch, not a builtin) that may."""
        for stmt in node.body:
            for n in ast.walk(stmt):
                if not isinstance(n, ast.Call):
                    continue
                if self.kernel_name(m, n) is not None:
                    return True
                callee = n.func.id if isinstance(n.func, ast.Name) else None
                if callee is None:
                    continue
                if self.function_launches(callee):
                    return True
                full = m.aliases.get(callee)
                if full is not None and not full.startswith(("torch", "triton")):
                    return True
        return False

    def function_launches(self, name: str) -> bool:
        if self._launching is None:
            self._launching = {
                func.name for m, calls in self.launches.items() for c in calls if (func := m.func_of(c))
            }
        return name in self._launching

    # ---------------------------------------------------------------------------------------
    # cached-device-property
    # ---------------------------------------------------------------------------------------

    def check_cached_device_property(self, m: _Module) -> None:
        for node in m.calls:
            if _last(m.canon(node.func)) != "get_device_properties":
                continue
            device = _arg(node, 0, "device")
            if device is None or _is_none(device):
                which = "the current device"
            else:
                desc = m.undeviced(device)
                if desc is None:
                    continue  # keyed by a device that comes from the caller
                which = "the current device" if "current device" in desc else desc
            parent = m.parents.get(node)
            prop = parent.attr if isinstance(parent, ast.Attribute) and parent.value is node else None
            shown = _src(parent) if prop and isinstance(parent, ast.expr) else _src(node)
            what = f"`{shown}` reads {which}; the value"
            func = m.func_of(node)
            how: str | None = None
            if m.at_module_level(node):
                how = "is computed once at import and reused for every device"
            elif func is not None and self.lexical_guard(m, node):
                continue  # read under a guard: the function picks its device itself
            elif func is not None and any(
                (m.canon(d.func if isinstance(d, ast.Call) else d) or "") in _CACHE_DECORATORS
                for d in func.decorator_list
            ):
                how = f"is cached by `{func.name}`, which is not keyed by device"
            elif func is not None and self.stored_in_global(m, node, func):
                how = f"is stored in a module global by `{func.name}`"
            if how is None:
                continue
            self.add(
                m,
                node,
                Rule.CACHED_DEVICE_PROPERTY,
                f"{what} {how}: kernels launched for another GPU get this one's SM count and limits",
                "@functools.cache\ndef num_sms(device_index: int) -> int:\n"
                "    return torch.cuda.get_device_properties(device_index).multi_processor_count\n"
                "# at the call: num_sms(x.device.index)",
            )

    @staticmethod
    def stored_in_global(m: _Module, node: ast.AST, func: FuncDef) -> bool:
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

    # ---------------------------------------------------------------------------------------
    # default-device-alloc
    # ---------------------------------------------------------------------------------------

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

    def is_wrapper(self, m: _Module, func: FuncDef) -> bool:
        """A kernel wrapper: it launches a Triton kernel or takes tensor arguments."""
        if any(m.func_of(c) is func for c in self.launches[m]):
            return True
        args = [*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs]
        return any(a.annotation is not None and "Tensor" in ast.unparse(a.annotation) for a in args)

    @staticmethod
    def tensor_param(func: FuncDef) -> str:
        args = [*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs]
        for a in args:
            if a.annotation is not None and "Tensor" in ast.unparse(a.annotation):
                return a.arg
        plain = [a.arg for a in args if a.arg not in ("self", "cls", "ctx")]
        return plain[0] if plain else "x"

    def check_default_device_alloc(self, m: _Module) -> None:
        wrappers: dict[ast.AST, bool] = {}
        for node in m.calls:
            func = m.func_of(node)
            if func is None or m.exempt(node):
                continue
            desc = self.default_device_of(m, node)
            if desc is None:
                continue
            if func not in wrappers:
                wrappers[func] = self.is_wrapper(m, func)
            if not wrappers[func] or self.guarded(m, node):
                continue  # under a guard, "cuda" is the guarded device
            tensor = self.tensor_param(func)
            self.add(
                m,
                node,
                Rule.DEFAULT_DEVICE_ALLOC,
                f"`{_src(node)}` allocates on {desc} inside the kernel wrapper `{func.name}`: "
                "outside a device guard the buffer lands on the current device, not on its inputs' device",
                f"device={tensor}.device  # allocate where the inputs live",
            )

    def default_device_of(self, m: _Module, call: ast.Call) -> str | None:
        name = m.canon(call.func) or ""
        if name.startswith("torch.") and name.count(".") == 1 and _last(name) in self._FACTORIES:
            desc = m.undeviced(_kwarg(call, "device"))
            return f"device={desc}" if desc else None
        if isinstance(call.func, ast.Attribute):
            attr = call.func.attr
            if _dotted(call.func.value) in ("torch", "torch.cuda", "tl", "triton"):
                return None
            if attr in self._NEW_METHODS:
                desc = m.undeviced(_kwarg(call, "device"))
                return f"device={desc}" if desc else None
            if attr == "cuda":
                device = _arg(call, 0, "device")
                if device is None:
                    return "`.cuda()` (the current device)"
                desc = m.undeviced(device)
                return f".cuda({desc})" if desc else None
            if attr == "to":
                device = _arg(call, 0, "device")
                if isinstance(device, ast.Constant) and isinstance(device.value, int):
                    return None  # .to(0) is rare and ambiguous next to dtypes
                desc = m.undeviced(device)
                return f".to({desc})" if desc else None
        return None

    # ---------------------------------------------------------------------------------------
    # int32-offset
    # ---------------------------------------------------------------------------------------

    def check_int32_offset(self, m: _Module) -> None:
        for func in m.jit_defs.values():
            _Int32Flow(m, func, self).run()

    # ---------------------------------------------------------------------------------------
    # autotune-inplace
    # ---------------------------------------------------------------------------------------

    def check_autotune_inplace(self, m: _Module) -> None:
        for func in m.jit_defs.values():
            for dec in func.decorator_list:
                if not isinstance(dec, ast.Call):
                    continue
                name = m.canon(dec.func) or ""
                if _last(name) != "autotune" or not m.is_jit_decorator(dec):
                    continue
                restored = [
                    kw
                    for kw in dec.keywords
                    if kw.arg in ("restore_value", "reset_to_zero") and not _is_none(kw.value)
                ]
                if restored or len(dec.args) >= 4:
                    continue
                count = self.config_count(m, dec)
                if count is not None and count <= 1:
                    continue
                what = _inplace_writes(m, func)
                if what is None:
                    continue
                desc, ptr = what
                n = f"{count} configs" if count is not None else "a computed list of configs"
                self.add(
                    m,
                    dec,
                    Rule.AUTOTUNE_INPLACE,
                    f"`{func.name}` is autotuned over {n} and {desc}, with no restore_value= or "
                    "reset_to_zero=: the autotuner runs every config on the caller's buffers, so the "
                    "first call per key applies the kernel many times",
                    f'@triton.autotune(configs=..., key=[...], restore_value=["{ptr}"])\n'
                    f'# or reset_to_zero=["{ptr}"] for an accumulator the caller zeroes',
                )

    @staticmethod
    def config_count(m: _Module, dec: ast.Call) -> int | None:
        return _count_configs(m, _arg(dec, 0, "configs"), 0)


def _count_configs(m: _Module, configs: ast.expr | None, depth: int) -> int | None:
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


def _inplace_writes(m: _Module, func: FuncDef) -> tuple[str, str] | None:
    """How ``func`` writes memory it depends on: ``(description, pointer)`` for a pointer it both
    loads and stores, or for a ``tl.atomic_*``; None for a pure out-of-place kernel."""
    params = [a.arg for a in (*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs)]
    constexpr = {
        a.arg
        for a in (*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs)
        if a.annotation is not None and "constexpr" in ast.unparse(a.annotation)
    }
    # strides are multiplied and sizes compared; pointers are only offset
    not_pointers = {
        n.id
        for node in ast.walk(func)
        if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)) or isinstance(node, ast.Compare)
        for side in (
            (node.left, node.right) if isinstance(node, ast.BinOp) else (node.left, *node.comparators)
        )
        for n in _factors(side)
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
            name = _last(m.canon(expr.func))
            if name in ("multiple_of", "max_contiguous", "advance", "make_block_ptr", "to"):
                if name == "to" and isinstance(expr.func, ast.Attribute):
                    return roots(expr.func.value)
                return roots(_arg(expr, 0, "base"))
            if name == "where":
                return roots(_arg(expr, 1, "x")) | roots(_arg(expr, 2, "y"))
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
        op = _last(name)
        ptr_roots = prefer_pointers(roots(_arg(node, 0, "pointer")))
        if op == "load":
            loaded |= ptr_roots
        elif op == "store":
            stored.extend((r, node) for r in sorted(ptr_roots))
        elif op.startswith("atomic_"):
            atomics.append((next(iter(sorted(ptr_roots)), "out_ptr"), node))
    if atomics:
        ptr, node = atomics[0]
        return f"accumulates with `{_src(node.func)}` into `{ptr}`", ptr
    for ptr, _node in stored:
        if ptr in loaded:
            return f"writes `{ptr}`, which it also reads (in place)", ptr
    return None


# --------------------------------------------------------------------------------------------
# int32-offset: a small data flow over one @triton.jit function
# --------------------------------------------------------------------------------------------


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
    for n in _factors(expr):
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


def _factors(expr: ast.expr) -> list[ast.Name]:
    """The names multiplied together in ``expr`` (``stride_we``, ``N * K``, ``s[None, :]``)."""
    if isinstance(expr, ast.Name):
        return [expr]
    if isinstance(expr, ast.Subscript):
        return _factors(expr.value)
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Mult):
        return _factors(expr.left) + _factors(expr.right)
    return []


def _constexpr_like(expr: ast.expr) -> bool:
    return isinstance(expr, ast.Name) and expr.id.isupper() and len(expr.id) > 1


class _Int32Flow:
    """Tracks which names hold global indices, tile-local aranges or int64 values, statement by
    statement, and reports ``index * stride`` products formed in int32."""

    def __init__(self, m: _Module, func: FuncDef, project: _Project) -> None:
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
            line = m.lines[a.lineno - 1] if 0 < a.lineno <= len(m.lines) else ""
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
            origin = f"the loop variable `{_src(s.target)}`"
            self.assign(s.target, _Val(_Kind.INDEX, origin) if is_range else _NONE)
            self.loop(s.body, s.orelse)
        elif isinstance(s, ast.While):
            self.expr(s.test)
            self.loop(s.body, s.orelse)
        elif isinstance(s, (ast.With, ast.AsyncWith)):
            for item in s.items:
                self.expr(item.context_expr)
            self.block(s.body)
        elif isinstance(s, (*_FUNC_TYPES, ast.ClassDef)):
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
                return _WIDE if self.is_int64(_arg(e, 0, "dtype")) else base
        elif not isinstance(e.func, (ast.Name, ast.Attribute)):
            self.expr(e.func)
        if op == "program_id":
            return _Val(_Kind.INDEX, f"`{_src(e)}`")
        if op == "arange":
            return _LOCAL
        if op == "load":
            if self.points_to_int64(_arg(e, 0, "pointer")):
                return _WIDE
            return _Val(_Kind.INDEX, f"`{_src(e)}`")
        if op == "cast":
            return _WIDE if self.is_int64(_arg(e, 1, "dtype")) else (arg_vals[0] if arg_vals else _NONE)
        if op in ("full", "zeros"):
            return _WIDE if self.is_int64(_kwarg(e, "dtype") or (e.args[-1] if e.args else None)) else _NONE
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
            idx_src = _src(idx)
            cast = f"({idx_src})" if not isinstance(idx, (ast.Name, ast.Subscript, ast.Call)) else idx_src
            shown = _src(node) if isinstance(node, ast.expr) else f"{_src(left)} *= {_src(right)}"
            message = (
                f"`{shown}` is formed in int32: `{idx_src}` is a global index (from {iv.origin}) "
                f"and {why} makes the product pass 2**31 - 1 on large tensors"
            )
            fix = f"{cast}.to(tl.int64) * {_src(other)}  # cast the index where the product is formed"
            if node not in self.candidates:
                self.candidates[node] = (node, message, fix)
            cid = list(self.candidates).index(node)
            self.superseded |= (iv.via | ov.via) - {cid}
            return cid
        return None
