"""One lint run: paths in, a report out.

    paths --source.find_sources/read_source--> [Source] (+ errors, skips)
          --source.context_sources--> [Source] of imported files (resolution only)
          --Module, Project--> the project model --rules.run_rules--> [LintFinding]
          --> LintReport(files, findings, errors, skipped)

    (file, function) --reach.reach--> the files the function reaches --> the same project
          --> the findings in the code it reaches --> LintReport(files, findings, notes)

Nothing here raises for a bad input: every file that cannot be linted becomes a one-line
``LintError`` or ``LintSkip`` in the report (an unknown rule id is the one ``ValueError``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

from qmoe_doctor.lint.findings import LintError, LintFinding, LintReport, Rule, active_rules
from qmoe_doctor.lint.module import MAX_KERNEL_NESTING, Module
from qmoe_doctor.lint.project import Project
from qmoe_doctor.lint.reach import MAX_REACH_DEPTH, MAX_REACH_FILES, reach
from qmoe_doctor.lint.rules import run_rules
from qmoe_doctor.lint.source import Source, context_sources, find_sources, parse_source, read_source


def lint_paths(
    paths: Iterable[str | os.PathLike[str]],
    select: Iterable[str | Rule] | None = None,
    ignore: Iterable[str | Rule] | None = None,
) -> LintReport:
    """Lint files and directories (walked for ``*.py``) as one project, so kernels imported from
    another linted file are recognised. A named path that cannot be linted (missing, not a
    regular file, unreadable, too large, does not parse, too deep) is an ``error``; an entry of
    a walked folder that is not a source (FIFO, device, socket, broken link) is ``skipped``.
    Raises ``ValueError`` for an unknown rule id in ``select`` / ``ignore``."""
    rules = active_rules(select, ignore)
    given = tuple(os.fspath(p) for p in paths)
    found, errors, skipped = find_sources(given)
    seen: set[str] = set()
    modules: list[Module] = []
    for path, named in found:
        name = path.as_posix()
        if name in seen:
            continue
        seen.add(name)
        got = read_source(path, named=named)
        if isinstance(got, Source):
            modules.append(Module(got))
        elif isinstance(got, LintError):
            errors.append(got)
        else:
            skipped.append(got)
    context = [Module(s) for s in context_sources(((m.path, m.nodes) for m in modules), seen)]
    findings, too_deep = _analyse(modules, context, rules)
    failed = {e.path for e in too_deep}  # parsed, but not analysed
    return LintReport(
        paths=given,
        files=tuple(m.path for m in modules if m.path not in failed),
        rules=rules,
        findings=findings,
        errors=(*errors, *too_deep),
        skipped=tuple(skipped),
    )


def lint_reached(
    entry: str | os.PathLike[str],
    function: str,
    *,
    search: Sequence[str] | None = None,
    select: Iterable[str | Rule] | None = None,
    ignore: Iterable[str | Rule] | None = None,
    max_depth: int = MAX_REACH_DEPTH,
    max_files: int = MAX_REACH_FILES,
) -> LintReport:
    """Lint what ``function`` of the file ``entry`` reaches (:mod:`qmoe_doctor.lint.reach`):
    the files of the functions, classes and constants it names, followed through the imports,
    linted as one project. A finding counts when it is in a reached function or class, or in
    code that runs at import; the others are counted in ``notes`` (``qmoe-doctor lint FILE``
    shows them). ``files`` lists every file linted, the entry first. The entry file unreadable
    is an ``error`` (as a named path); a reached file that cannot be linted is a note."""
    rules = active_rules(select, ignore)
    got = reach(entry, function, search=search, max_depth=max_depth, max_files=max_files)
    shown = f"{os.fspath(entry)}:{function}"
    if got.error is not None or not got.files:
        unread = (got.error,) if got.error is not None else ()
        return LintReport(paths=(os.fspath(entry),), files=(), rules=rules, errors=unread, reached_from=shown)
    modules = [r.module for r in got.files]
    context = [Module(s) for s in context_sources(((m.path, m.nodes) for m in modules), {m.path for m in modules})]
    findings, too_deep = _analyse(modules, context, rules)
    notes = list(got.notes)
    entry_path = modules[0].path
    errors = [e for e in too_deep if e.path == entry_path]
    notes += [f"not linted: {e.as_line()}" for e in too_deep if e.path != entry_path]
    failed = {e.path for e in too_deep}
    kept: list[LintFinding] = []
    left: dict[str, list[str]] = {}
    for f in findings:
        spans = next(r.left_out() for r in got.files if r.module.path == f.path)
        outside = next((name for first, end, name in spans if first <= f.line <= end), None)
        if outside is None:
            kept.append(f)
        else:
            left.setdefault(f.path, []).append(outside)
    for path, names in left.items():
        funcs = ", ".join(f"`{n}`" for n in dict.fromkeys(names))
        notes.append(
            f"{len(names)} finding(s) of {path} left out: in {funcs}, which {function} does not reach "
            f"(`qmoe-doctor lint {path}` shows them)"
        )
    return LintReport(
        paths=(os.fspath(entry),),
        files=tuple(m.path for m in modules if m.path not in failed),
        rules=rules,
        findings=tuple(kept),
        errors=tuple(errors),
        reached_from=shown,
        notes=tuple(notes),
    )


def lint_source(
    source: str,
    path: str = "<string>",
    *,
    select: Iterable[str | Rule] | None = None,
    ignore: Iterable[str | Rule] | None = None,
) -> tuple[LintFinding, ...]:
    """Lint one source text. Raises ``SyntaxError`` when it does not parse (or is nested too
    deeply to parse or analyse)."""
    rules = active_rules(select, ignore)
    parsed = parse_source(path, source.encode())
    if isinstance(parsed, LintError):
        raise SyntaxError(parsed.message, (path, parsed.line, parsed.col, parsed.source))
    findings, too_deep = _analyse([Module(parsed)], [], rules)
    for e in too_deep:
        raise SyntaxError(e.message, (path, e.line, e.col, e.source))
    return findings


def _analyse(
    modules: Sequence[Module], context: Sequence[Module], rules: Sequence[Rule]
) -> tuple[tuple[LintFinding, ...], list[LintError]]:
    """Run the rules over the project; the findings, and the linted files set aside as too
    deep (context files that are, are dropped in silence: they were not asked for)."""
    errors: list[LintError] = []
    linted: list[Module] = []
    for m in modules:
        problem = _kernel_too_deep(m)
        if problem is None:
            linted.append(m)
        else:
            errors.append(problem)
    extra = [m for m in context if _kernel_too_deep(m) is None]
    # A backstop for the stack: MAX_KERNEL_NESTING and nodes.SHOWN_LEVELS keep every recursive
    # pass shallow from an ordinary call stack. Should one still exhaust it (the lint called
    # from deep inside another program), the deepest file is set aside and the rest re-run
    # on a fresh project, so the others' findings are those they would have without it.
    while True:
        try:
            return run_rules(Project(linted, extra), rules), errors
        except RecursionError:
            if not linted and not extra:
                raise
            worst = max([*linted, *extra], key=lambda m: m.nesting)
            if worst in linted:
                linted.remove(worst)
                errors.append(
                    LintError(
                        path=worst.path,
                        kind="syntax",
                        message=f"nested {worst.nesting} levels deep: too deep for the lint to analyse",
                    )
                )
            else:
                extra.remove(worst)


def _kernel_too_deep(m: Module) -> LintError | None:
    """An error when a jit function of ``m`` is deeper than the kernel rules walk."""
    kernel = m.deepest_kernel()
    if kernel is None or kernel[1] <= MAX_KERNEL_NESTING:
        return None
    name, levels, line = kernel
    return LintError(
        path=m.path,
        kind="syntax",
        message=f"the Triton kernel `{name}` is nested {levels} levels deep; "
        f"the lint analyses kernels up to {MAX_KERNEL_NESTING}",
        line=line,
    )


__all__ = ["lint_paths", "lint_reached", "lint_source"]
