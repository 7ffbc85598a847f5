"""What is known of a kernel from its first launch on: name, source lines, parameter names, and
the lint of the code its first launch came through.

The lint is ``qmoe_doctor.lint`` over each file of that launch's call path (the kernel's own
file, the wrapper that wrote ``kernel[grid](...)``, every file between it and the user's call
site), each file once per process. Files are read with the bounded reader: never imported, never
executed. ``LIVE_RULES`` are left to the live checks. The int32-offset findings inside the
kernel's own lines are what ``diagnose.launch_rules.int32_by_size`` confirms by size at each launch.
"""

from __future__ import annotations

import ast
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FunctionType
from typing import Any

from qmoe_doctor.core.inputs import InputError, read_text
from qmoe_doctor.core.launches import KernelSeen, SourceLint
from qmoe_doctor.core.lint_findings import LintFinding, Rule
from qmoe_doctor.lint import lint_source
from qmoe_doctor.monitor.layout import Layout

#: Rules the monitor leaves out: what they guess statically, it sees at every launch (a tensor on
#: another device than the launch's is the unguarded launch at work). On one GPU, where no launch
#: can show it, `qmoe-doctor lint` names it.
LIVE_RULES = (Rule.UNGUARDED_LAUNCH,)
#: A source larger than this is not parsed for function extents (a generated file).
MAX_SOURCE_BYTES = 4 * 2**20


@dataclass(slots=True, kw_only=True)
class KernelInfo:
    """One kernel of this process (mutable: launches are counted here)."""

    key: object  # the JITFunction (or the interpreter's function), kept alive: its id is the key
    name: str
    file: str
    line: int
    end_line: int | None
    arg_names: tuple[str, ...]
    int32_lint: tuple[LintFinding, ...] = ()
    launches: int = 0
    #: its argument layouts seen so far: (keyword names, every value's type) -> Layout
    layouts: dict[tuple[Any, ...], Layout] = field(default_factory=dict)
    #: (keyword names, types, layout) of its last launch: the hot path compares, no hashing
    last_layout: tuple[Any, ...] = (None, None, None)
    #: its next launch to read whole (monitor.session: sampling)
    sample_at: int = 1
    #: its last launch read whole (a ring entry), kept past the ring for the record
    last_sampled: list[Any] | None = None

    def seen(self) -> KernelSeen:
        return KernelSeen(
            name=self.name,
            file=self.file,
            line=self.line,
            end_line=self.end_line,
            launches=self.launches,
            int32_lines=tuple(f.line for f in self.int32_lint),
        )


class SourceCache:
    """Function extents per file and lint results per call path, computed once per process."""

    def __init__(self) -> None:
        self._extents: dict[str, list[tuple[str, int, int]]] = {}  # name, first line, last line
        self._files: dict[str, dict[tuple[int, int, str], LintFinding]] = {}  # findings by file
        self._errors: dict[str, str] = {}
        self._lock = threading.Lock()

    def lints(self) -> tuple[SourceLint, ...]:
        """Every linted file with its findings (the first call path that linted it decides)."""
        with self._lock:
            paths = list(dict.fromkeys([*self._files, *self._errors]))
            return tuple(
                SourceLint(
                    path=p,
                    findings=tuple(self._files.get(p, {}).values()),
                    error=self._errors.get(p, ""),
                )
                for p in paths
            )

    def lint_path(self, files: Sequence[str]) -> tuple[LintFinding, ...]:
        """The findings of ``files``, each file linted once per process."""
        out: list[LintFinding] = []
        for path in dict.fromkeys(f for f in files if f and not f.startswith("<")):
            out.extend(self._lint_file(path))
        return tuple(out)

    def _lint_file(self, path: str) -> tuple[LintFinding, ...]:
        with self._lock:
            done = self._files.get(path)
            if done is not None or path in self._errors:
                return tuple((done or {}).values())
            try:
                text = read_text(path, limit=MAX_SOURCE_BYTES)
                findings = lint_source(text, path, ignore=LIVE_RULES)
            except InputError as exc:
                self._errors[path] = str(exc)
                return ()
            except (SyntaxError, RecursionError, ValueError) as exc:
                self._errors[path] = f"the lint could not analyse it: {type(exc).__name__}: {exc}"
                return ()
            self._files[path] = {(f.line, f.col, f.rule.value): f for f in findings}
            return findings

    def extent(self, path: str, name: str, line: int) -> int | None:
        """The last line of function ``name`` whose definition covers ``line``."""
        with self._lock:
            extents = self._extents.get(path)
            if extents is None:
                extents = self._extents[path] = _function_extents(path)
        for fn_name, first, last in extents:
            if fn_name == name and first <= line <= last:
                return last
        return None


def _function_extents(path: str) -> list[tuple[str, int, int]]:
    try:
        tree = ast.parse(read_text(path, limit=MAX_SOURCE_BYTES))
    except (InputError, SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    out: list[tuple[str, int, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            out.append((node.name, first, node.end_lineno or node.lineno))
    return out


def describe_kernel(
    key: object, fn: object, arg_names: tuple[str, ...], sources: SourceCache
) -> KernelInfo:
    """A kernel at its first launch. ``fn`` is its Python function (a JITFunction's ``fn``, or
    the interpreter's rewritten copy, which keeps the file name and the ``def`` line)."""
    code = fn.__code__ if isinstance(fn, FunctionType) else None
    name = str(getattr(fn, "__name__", type(fn).__name__))
    if code is None:
        return KernelInfo(key=key, name=name, file="", line=0, end_line=None, arg_names=arg_names)
    file, line = code.co_filename, code.co_firstlineno
    end = sources.extent(file, name, line) if not file.startswith("<") else None
    return KernelInfo(key=key, name=name, file=file, line=line, end_line=end, arg_names=arg_names)


def lint_kernel(info: KernelInfo, call_path: Sequence[str], sources: SourceCache) -> None:
    """Lint the kernel's call path (its own file first) and keep its int32 offset products."""
    findings = sources.lint_path([info.file, *call_path])
    if info.end_line is not None:
        info.int32_lint = tuple(
            f
            for f in findings
            if f.rule is Rule.INT32_OFFSET and f.path == info.file and info.line <= f.line <= info.end_line
        )


__all__ = ["LIVE_RULES", "KernelInfo", "SourceCache", "describe_kernel", "lint_kernel"]
