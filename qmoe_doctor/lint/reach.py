"""What a kernel reference reaches, statically: the files ``check`` and ``scan`` lint.

    (source file, function) --walk--> the functions, classes and constants its code names,
    followed through the imports into other files (parsed, never imported) --> Reach

From the function, every name its code loads (decorators, defaults and nested functions
included, annotations left out) is resolved: a function, class or constant at the top of the
same file, or an imported name, found through the import system's finders without importing
anything (:func:`qmoe_doctor.core.kernel_ref.module_source`, the importing file's folder first,
as the probe child puts it first on ``sys.path``), or by its path relative to the importing file.
A resolved function or class is walked in turn, breadth first: the modules whose ``@triton.jit``
functions the reference launches are reached, and so are the modules between. A launch form
needs nothing of its own here: ``fn = kernel_ws if ws else kernel`` loads both names,
``KERNELS[name]`` loads the dict whose values name the kernels, ``getattr(module, name)``
loads the module (every function of it is then reached).

What is not followed is said, each with its reason (``Reach.notes``): a module that cannot be
found without importing it or is not Python source (an extension module), a name a module does
not define at its top (a star import, a module ``__getattr__``), a name more than
``MAX_REACH_DEPTH`` references from the reference, and files past ``MAX_REACH_FILES``. Never
followed, and not worth a note: torch, triton, numpy and the standard library.

The result says, per file, which top-level functions and classes were reached; the lint keeps
the findings in those and in code that runs at import (module level), and counts the others
(``run.lint_reached``).
"""

from __future__ import annotations

import ast
import os
import sys
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from qmoe_doctor.core.kernel_ref import module_source
from qmoe_doctor.lint.findings import LintError
from qmoe_doctor.lint.module import Module
from qmoe_doctor.lint.nodes import FUNC_TYPES
from qmoe_doctor.lint.source import Source, read_source

#: Names followed from the reference, one reference after another (``wrapper -> helper ->
#: kernel`` is 2). Public wrappers reach their kernel in 1 to 3; the built-in kernel in 3.
MAX_REACH_DEPTH = 8
#: Files read. A wrapper of a large library names many of its modules (logging, config,
#: platform checks); the ones nearest the reference come first, and the rest is said.
MAX_REACH_FILES = 32
_MAX_NOTES = 12  # notes of one kind listed before "and N more"
_NEVER_FOLLOWED = frozenset({"torch", "triton", "numpy", "__future__"}) | frozenset(
    getattr(sys, "stdlib_module_names", ())
)

TopDef = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


@dataclass(slots=True)
class Reached:
    """One reached file: its module, and what of it was reached."""

    module: Module
    names: set[str] = field(default_factory=set)  # top-level functions and classes reached
    whole: bool = False  # every function of it (the module object itself was referenced)

    def left_out(self) -> list[tuple[int, int, str]]:
        """``(first line, last line, name)`` of the top-level functions and classes not reached."""
        if self.whole:
            return []
        return [
            (node.lineno, node.end_lineno or node.lineno, node.name)
            for node in self.module.tree.body
            if isinstance(node, (*FUNC_TYPES, ast.ClassDef)) and node.name not in self.names
        ]


@dataclass(frozen=True, slots=True, kw_only=True)
class Reach:
    """The files a reference reaches, the entry file first; what was not followed, and why."""

    entry: str  # the reference's source file
    function: str
    files: tuple[Reached, ...]
    notes: tuple[str, ...] = ()
    error: LintError | None = None  # the entry file itself could not be read or parsed


def reach(
    entry: str | os.PathLike[str],
    function: str,
    *,
    search: Sequence[str] | None = None,
    max_depth: int = MAX_REACH_DEPTH,
    max_files: int = MAX_REACH_FILES,
) -> Reach:
    """Walk from ``function`` of the file ``entry`` (see the module docstring). ``search``: the
    folders an absolute import is looked up in before the finders (default: the entry's folder,
    which the probe child puts first on ``sys.path`` for a ``file.py:function`` reference; ()
    for a module reference, imported as Python imports it)."""
    path = Path(entry)
    where = [str(path.resolve().parent)] if search is None else list(search)
    walker = _Walker(path, search=where, max_depth=max_depth, max_files=max_files)
    return walker.run(function)


class _Walker:
    def __init__(self, entry: Path, *, search: Sequence[str], max_depth: int, max_files: int) -> None:
        self.entry = entry
        self.max_depth = max_depth
        self.max_files = max_files
        self.search = list(search)
        self.files: dict[str, Reached] = {}  # by resolved path, in the order reached
        self.unreadable: set[str] = set()
        self.queue: deque[tuple[Reached, ast.AST, int]] = deque()
        self.walked: set[int] = set()  # ids of the nodes walked (defs, constants)
        self.notes: dict[str, list[str]] = {}  # kind -> lines

    # --- the walk ---

    def run(self, function: str) -> Reach:
        got = read_source(self.entry, named=True)
        if not isinstance(got, Source):
            error = got if isinstance(got, LintError) else None
            return Reach(entry=self.entry.as_posix(), function=function, files=(), error=error)
        first = self._add(self.entry, got)
        if not self._name(first, function, 0, where=None):
            first.whole = True
            self._note("entry", f"`{function}` is not defined at the top of {first.module.path}: all of it is linted")
        while self.queue:
            reached, node, depth = self.queue.popleft()
            self._walk(reached, node, depth)
        return Reach(
            entry=first.module.path,
            function=function,
            files=tuple(self.files.values()),
            notes=self._notes(),
        )

    def _walk(self, reached: Reached, node: ast.AST, depth: int) -> None:
        """Resolve every name ``node`` loads, one reference deeper than ``node``."""
        for ref in _loads(node):
            if isinstance(ref, ast.Call):  # getattr(obj, "name"): obj.name; getattr(module, name): the module
                target, name = _dotted(ref.args[0]), ref.args[1]
                if target and isinstance(name, ast.Constant) and isinstance(name.value, str):
                    self._dotted(reached, f"{target}.{name.value}", depth + 1, ref)
                continue
            text = _dotted(ref)
            if text:
                self._dotted(reached, text, depth + 1, ref)

    def _dotted(self, reached: Reached, text: str, depth: int, ref: ast.AST) -> None:
        head, _, rest = text.partition(".")
        if not head:
            return
        m = reached.module
        if head in m.defined:
            self._name(reached, head, depth, where=ref)
        elif head in m.aliases:
            full = m.aliases[head] + ("." + rest if rest else "")
            if depth > self.max_depth:
                self._too_deep(reached, full.lstrip("."), ref)
            else:
                self._import(reached, full, depth, where=ref)

    def _name(self, reached: Reached, name: str, depth: int, *, where: ast.AST | None) -> bool:
        """Reach ``name`` at the top of ``reached``'s module: a function or class (walked), a
        constant (its value walked) or a name imported there (followed). False when it is none.
        Past ``max_depth`` a function or class still counts as reached, but what it names is
        not followed."""
        m = reached.module
        node: ast.AST | None = _top_def(m, name)
        if node is not None:
            reached.names.add(name)
        elif name in m.consts:
            node = m.consts[name]
        elif name in m.aliases:
            if depth > self.max_depth:
                self._too_deep(reached, name, where)
            else:
                self._import(reached, m.aliases[name], depth, where=where)
            return True
        else:
            return False
        if depth > self.max_depth or node is None:
            self._too_deep(reached, name, where)
        else:
            self._queue(reached, node, depth)
        return True

    def _queue(self, reached: Reached, node: ast.AST, depth: int) -> None:
        if id(node) not in self.walked:
            self.walked.add(id(node))
            self.queue.append((reached, node, depth))

    def _import(self, reached: Reached, full: str, depth: int, *, where: ast.AST | None) -> None:
        """Follow ``full`` (``pkg.mod.name``, ``.mod.name``, ``..pkg``), imported in ``reached``."""
        level = len(full) - len(full.lstrip("."))
        parts = [p for p in full[level:].split(".") if p]
        if not level and (not parts or parts[0] in _NEVER_FOLLOWED):
            return
        for cut in range(len(parts), -1 if level else 0, -1):
            path = self._find(reached, level, parts[:cut])
            if path is None:
                continue
            target = self._open(path, full, reached, where)
            if target is None:
                return
            attrs = parts[cut:]
            if not attrs:  # the module object itself (getattr(module, name), module passed on)
                if not target.whole:
                    target.whole = True
                    self._queue(target, target.module.tree, depth)
                return
            if not self._name(target, attrs[0], depth, where=where) and not target.whole:
                self._note(
                    "undefined",
                    f"`{full}` ({_at(reached, where)}): {target.module.path} does not define "
                    f"`{attrs[0]}` at its top (a star import or a module __getattr__)",
                )
            return
        self._note("missing", f"`{full}` ({_at(reached, where)}): not found as Python source without importing it")

    def _find(self, reached: Reached, level: int, parts: Sequence[str]) -> Path | None:
        """The source file of a module, without importing it: relative to the importing file,
        or through the finders (the entry's folder first), or in a folder above the importer."""
        here = Path(reached.module.path).parent
        if level:
            base = here
            for _ in range(level - 1):
                base = base.parent
            return _source_in(base, parts)
        dotted = ".".join(parts)
        found = module_source(dotted, search=self.search)
        if found is not None:
            return found
        base = here
        for _ in range(4):  # a package root not installed, a few folders up
            hit = _source_in(base, parts)
            if hit is not None:
                return hit
            if base.parent == base:
                break
            base = base.parent
        return None

    def _open(self, path: Path, full: str, reached: Reached, where: ast.AST | None) -> Reached | None:
        key = path.resolve().as_posix()
        if key in self.files:
            return self.files[key]
        if key in self.unreadable:
            return None
        if len(self.files) >= self.max_files:
            self._note("files", f"`{full}` ({_at(reached, where)}): {path.as_posix()}")
            self.unreadable.add(key)
            return None
        got = read_source(_shown(path), named=False)
        if not isinstance(got, Source):
            self.unreadable.add(key)
            why = got.message if isinstance(got, LintError) else got.reason
            self._note("unreadable", f"{path.as_posix()} (`{full}`): {why}")
            return None
        return self._add(path, got)

    def _add(self, path: Path, source: Source) -> Reached:
        reached = Reached(module=Module(source))
        self.files[path.resolve().as_posix()] = reached
        return reached

    # --- notes ---

    def _too_deep(self, reached: Reached, name: str, where: ast.AST | None) -> None:
        self._note("depth", f"`{name}` ({_at(reached, where)})")

    def _note(self, kind: str, text: str) -> None:
        lines = self.notes.setdefault(kind, [])
        if text not in lines:
            lines.append(text)

    def _notes(self) -> tuple[str, ...]:
        heads = {
            "entry": "",
            "missing": "not followed: ",
            "undefined": "not followed: ",
            "unreadable": "not followed, cannot be linted: ",
            "depth": f"not followed past {self.max_depth} references from the kernel: ",
            "files": f"not followed, past the {self.max_files} files the lint reads for a kernel: ",
        }
        out: list[str] = []
        for kind, head in heads.items():
            lines = self.notes.get(kind, [])
            if kind == "depth" and lines:  # one line: deep names are many and mostly plumbing
                out.append(f"{head}{len(lines)} name(s), e.g. {lines[0]}")
                continue
            out += [head + line for line in lines[:_MAX_NOTES]]
            if len(lines) > _MAX_NOTES:
                out.append(f"{head}and {len(lines) - _MAX_NOTES} more")
        return tuple(out)


# ---------------------------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------------------------


def _shown(path: Path) -> Path:
    """A reached file as the report names it: relative to the working folder when under it."""
    full = Path(os.path.abspath(path))
    try:
        return full.relative_to(Path.cwd())
    except (ValueError, OSError):  # elsewhere, or the working folder is gone
        return full


def _top_def(m: Module, name: str) -> TopDef | None:
    found: TopDef | None = None
    for node in m.tree.body:  # the last definition wins, as at import
        if isinstance(node, (*FUNC_TYPES, ast.ClassDef)) and node.name == name:
            found = node
    return found


def _source_in(base: Path, parts: Sequence[str]) -> Path | None:
    """``base/a/b.py`` or ``base/a/b/__init__.py`` (``base/__init__.py`` for no parts)."""
    folder = base.joinpath(*parts)
    for cand in ((folder.with_suffix(".py"),) if parts else ()) + (folder / "__init__.py",):
        if os.path.isfile(cand):  # stat only; reading refuses what is not a regular file
            return cand
    return None


def _dotted(expr: ast.AST) -> str | None:
    parts: list[str] = []
    while isinstance(expr, ast.Attribute):
        parts.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name):
        return None
    parts.append(expr.id)
    return ".".join(reversed(parts))


def _at(reached: Reached, where: ast.AST | None) -> str:
    line = getattr(where, "lineno", None)
    return f"{reached.module.path}:{line}" if line else reached.module.path


def _loads(node: ast.AST) -> Iterator[ast.AST]:
    """The names and attribute chains ``node`` loads (the outermost chain only), and its
    ``getattr(obj, name)`` calls; annotations are not walked (a type names no launch).
    Iterative: deep sources do not exhaust the stack."""
    stack: list[ast.AST] = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, (ast.Name, ast.Attribute)):
            if isinstance(getattr(item, "ctx", None), ast.Load) and _dotted(item) is not None:
                yield item
                continue
            if isinstance(item, ast.Attribute):
                stack.append(item.value)
            continue
        if (
            isinstance(item, ast.Call)
            and isinstance(item.func, ast.Name)
            and item.func.id == "getattr"
            and len(item.args) >= 2
        ):
            yield item
        stack.extend(_children(item))


def _children(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, (*FUNC_TYPES, ast.Lambda)):
        a = node.args
        out: list[ast.AST] = [*a.defaults, *(d for d in a.kw_defaults if d is not None)]
        if isinstance(node, FUNC_TYPES):
            out += node.decorator_list
        body = node.body
        out += body if isinstance(body, list) else [body]
        return out
    if isinstance(node, ast.AnnAssign):
        return [node.target, *([node.value] if node.value is not None else [])]
    if isinstance(node, ast.arg):
        return []
    return list(ast.iter_child_nodes(node))


__all__ = ["MAX_REACH_DEPTH", "MAX_REACH_FILES", "Reach", "Reached", "reach"]
