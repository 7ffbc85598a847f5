"""Rendering of scan reports for the terminal (rich). Data lives in the records; this draws."""

from __future__ import annotations

from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from qmoe_doctor.cli.output import print_table
from qmoe_doctor.cli.render.lint import lint_lines
from qmoe_doctor.core.causes import get_cause
from qmoe_doctor.core.conditions import PAIR_ORDER, ROUTED_ORDER, SINGLE_ORDER, SWEEP_CONDITIONS
from qmoe_doctor.core.records import Condition, Diagnosis, Phase, Status
from qmoe_doctor.core.reports import ScanReport
from qmoe_doctor.workflows.scan import Cell, all_spawn_failures, build_matrix, not_checked_reason, nothing_ran

#: Colour of a cell label; error kinds not listed are red.
STYLE = {
    "pass": "green",
    "rejected": "green",  # the kernel refused an input its contract excludes: correct
    "unchecked": "yellow",  # passed, but the check could not see what the cell claims
    "slow": "yellow",
    "wrong": "bold red",
    "skipped": "dim",
}

CONDITION_TEXT = {
    Condition.REPEAT_CALL: "first vs second call",
    Condition.SINGLE: "single device",
    Condition.SIDE_STREAM: "producer on a side stream",
    Condition.OVER_ROUTED: "m_sizes sums past M",
    Condition.NEGATIVE_SIZES: "-1 sentinel in m_sizes",
    Condition.INT32_BOUNDARY: "expert offset past 2**31",
    Condition.OFFSETS: "offsets",
    Condition.LAUNCH_CONFIG: "launch config",
    Condition.GUARDED: "guarded (b current)",
    Condition.UNTOUCHED: "a current, a untouched",
    Condition.NO_PEER: "a current, no peer a->b",
    Condition.PEER: "a current, peer a->b on",
    Condition.PRODUCER_RACE: "+ x producer pending on b",
    Condition.SIZES_RACE: "+ m_sizes pending on b",
    Condition.ROUTED: "routed: valid top-k ids",
    Condition.IDS_OUT_OF_RANGE: "routed: ids past E, below -1",
    Condition.DROPPED_SLOTS: "routed: -1 ids, no map",
    Condition.EXPERT_MAP: "routed: expert_map, -1 remote",
    Condition.MAP_PAST_LOCAL: "routed: map past local count",
    Condition.PADDED_COUNT: "routed: padded count past buffer",
    Condition.GATHER_PAST_T: "routed: gather index past T",
    Condition.GATHERED_INT32: "routed: gathered rows past 2**31",
}


def _cell_text(cell: Cell | None) -> Text:
    if cell is None:
        return Text("-", style="dim")
    label = cell.label
    text = Text(label, style=STYLE.get(label, "bold red"))
    o = cell.outcome
    if label == "slow" and cell.slowdown:
        text.append(f" {cell.slowdown:.1f}x", style="yellow")
    elif label == "wrong" and o.rel_error is not None and o.rel_error == o.rel_error:
        text.append(f" {o.rel_error:.2g}", style="red")
    elif label == "pass" and o.kernel_ms:
        text.append(f" {o.kernel_ms:.2f}ms", style="dim")
    return text


def matrix_tables(report: ScanReport) -> list[Table]:
    matrix = build_matrix(report.outcomes)
    groups = matrix.groups()
    placements = matrix.placements()
    single_groups = [g for g in groups if not placements[g].is_pair]
    pair_groups = [g for g in groups if placements[g].is_pair]
    tables = []
    if single_groups:
        t = Table(title="Single-device cells", title_justify="left", show_lines=False)
        t.add_column("condition")
        for g in single_groups:
            t.add_column(g)
        for cond in (*SINGLE_ORDER, *ROUTED_ORDER):
            if any(matrix.get(g, cond) for g in single_groups):
                t.add_row(CONDITION_TEXT[cond], *[_cell_text(matrix.get(g, cond)) for g in single_groups])
        for cond in SWEEP_CONDITIONS:
            names = list(
                dict.fromkeys(
                    v
                    for g in single_groups
                    for v in (c.outcome.spec.placement.variant for c in matrix.variants(g, cond))
                )
            )
            for name in names:
                t.add_row(
                    f"{CONDITION_TEXT[cond]}: {name}",
                    *[_cell_text(matrix.get(g, cond, str(name))) for g in single_groups],
                )
        tables.append(t)
    if pair_groups:
        t = Table(title="Placement cells: operands on b, a current (a -> b)", title_justify="left")
        t.add_column("condition")
        for g in pair_groups:
            t.add_column(placements[g].label)
        for cond in PAIR_ORDER:
            if any(matrix.get(g, cond) for g in pair_groups):
                t.add_row(CONDITION_TEXT[cond], *[_cell_text(matrix.get(g, cond)) for g in pair_groups])
        tables.append(t)
    return tables


def diagnosis_panel(d: Diagnosis) -> Panel:
    cause = get_cause(d.cause)
    body: list[RenderableType] = [
        Text.assemble((d.summary, "bold"), "\n"),
        Text.assemble(
            ("where: ", "dim"), ", ".join(d.where) or "-", ("   confidence: ", "dim"), str(d.confidence)
        ),
        Text("evidence:", style="dim"),
    ]
    for e in d.evidence:
        body.append(
            Text.assemble(
                "  ", (e.probe_id, "cyan"), " ", (e.label, STYLE.get(e.label, "red")), ": ", e.detail
            )
        )
    body += [
        Text.assemble(("mechanism: ", "dim"), cause.mechanism),
        Text("fix:", style="dim"),
        Syntax(cause.fix, "python", theme="ansi_dark", background_color="default"),
        Text.assemble(("docs: ", "dim"), cause.docs),
    ]
    if d.repro:
        body.append(Text.assemble(("repro: ", "dim"), (d.repro, "bold")))
    title = Text.assemble((d.cause, "bold red"), f" - {cause.title}")
    return Panel(Group(*body), title=title, title_align="left")


def hardening_lines(d: Diagnosis) -> list[Text]:
    """A hardening finding (not a fault, exit 0): a note, with where, the cells, repro and docs."""
    lines = [
        Text.assemble(
            ("note: hardening ", "yellow"),
            ("(reported, exit 0): ", "dim"),
            (d.cause, "bold yellow"),
            f": {d.summary}",
            (f"  [{d.confidence}]", "dim"),
        )
    ]
    failing = list(dict.fromkeys(e.probe_id for e in d.evidence if e.label != "pass"))
    lines.append(
        Text(
            f"  where: {', '.join(d.where) or '-'}; cells: {', '.join(failing)}",
            style="dim",
        )
    )
    if d.repro:
        lines.append(Text.assemble(("  repro: ", "dim"), (d.repro, "bold")))
    lines.append(Text(f"  docs: {get_cause(d.cause).docs}", style="dim"))
    return lines


def _restates_hardening(note: str, report: ScanReport) -> bool:
    """An explanation that says what a hardening note already shows."""
    return any(h.summary in note for h in report.hardening)


def render_report(console: Console, report: ScanReport) -> None:
    head = Text.assemble(
        ("kernel ", "dim"),
        (report.kernel, "bold"),
        ("   tier ", "dim"),
        report.tier,
        ("   probes ", "dim"),
        str(len(report.outcomes)),
        ("   wall ", "dim"),
        f"{report.wall_s:.1f} s",
    )
    console.print(head)
    for s in report.sessions:
        if s.gpu_of_ordinal:
            mapping = ", ".join(f"GPU {g} -> cuda:{o}" for o, g in sorted(s.gpu_of_ordinal.items()))
            console.print(Text(f"  {s.label}: probes saw {mapping}", style="dim"))
    for table in matrix_tables(report):
        print_table(console, table)
    for audit in report.audit:
        wraps = [r for r in audit.rows if r.wraps]
        if wraps:
            parts = ", ".join(f"{r.operand} ({r.first_wrap})" for r in wraps)
            console.print(
                Text.assemble(
                    ("int32 audit: ", "yellow"),
                    f"{audit.shape_name} at {audit.tokens} tokens: offsets pass 2**31 in {parts}; "
                    "the kernel must form those products in int64 (qmoe-doctor audit)",
                )
            )
        else:
            console.print(
                Text(
                    f"int32 audit: {audit.shape_name} at {audit.tokens} tokens: every offset fits",
                    style="dim",
                )
            )
    for d in report.diagnoses:
        console.print(diagnosis_panel(d))
    for d in report.hardening:
        for line in hardening_lines(d):
            console.print(line)
    for note in report.explanations:
        if not _restates_hardening(note, report):
            console.print(Text.assemble(("note: ", "yellow"), note))
    if report.unexplained:
        console.print(
            Text("Failing cells no rule accounts for (a fault, cause not named):", style="bold red")
        )
        for e in report.unexplained:
            console.print(Text.assemble("  ", (e.probe_id, "cyan"), " ", (e.label, "red"), ": ", e.detail))
    for note in report.skipped:
        console.print(Text.assemble(("skipped: ", "dim"), note))
    if report.lint is not None:  # notes: the verdict below is the cells' (check fails on findings)
        for line in lint_lines(report.lint, "", head="lint (notes, not part of the scan's verdict)"):
            console.print(line, soft_wrap=True)
    console.print(verdict_line(report))
    if report.log_dir:  # "" when a healthy run's logs were removed
        console.print(Text(f"logs: {report.log_dir}", style="dim"))


def could_not_run(report: ScanReport) -> str | None:
    """Why the scan asserted nothing (exit 4), or None when probes of the kernel ran."""
    if not report.outcomes:
        return "no probe was planned for these options"
    if all_spawn_failures(report):
        return f"no probe child could start: {_first_line(report.outcomes[0].error_message)}"
    if not nothing_ran(report):
        return None
    env = next((o for o in report.outcomes if o.spec.condition is Condition.INTERPRETER_CHECK), None)
    if env is not None and env.status is Status.ERROR and env.phase is Phase.SPAWN:
        return f"no probe child could start: {_first_line(env.error_message)}"
    if env is not None and env.failed:
        return f"the Triton interpreter cannot run here: {_first_line(env.error_message)}"
    cuda = not_checked_reason(report)
    if cuda is not None:
        return cuda
    notes = sorted({n for o in report.outcomes if o.status is Status.SKIPPED for n in o.notes})
    return "every probe was skipped" + (f": {notes[0]}" if notes else "")


def verdict_line(report: ScanReport) -> Text:
    """The last word: healthy only when probes of the kernel ran and every one passed, and it
    says what it covers: a CPU tier or one GPU is never read as a clean bill for what it could
    not run."""
    broken = could_not_run(report)
    if broken is not None:
        return Text(f"could not run: {broken}; nothing about the kernel was checked", style="bold yellow")
    if report.healthy:
        cov = report.coverage
        hardening = [f"{len(report.hardening)} hardening finding(s), not faults"] if report.hardening else []
        if cov is None:  # a report from before coverage: it cannot say what it covers
            return Text(
                "; ".join(("healthy: no fault in the cells that ran", *hardening)), style="bold green"
            )
        if cov.complete and not hardening:
            return Text(
                f"healthy: every cell passed; no cause diagnosed ({cov.sentence()})", style="bold green"
            )
        ran = f"no fault in the {cov.cells_ran} cell{'s' if cov.cells_ran != 1 else ''} that ran"
        return Text("; ".join((f"healthy in what ran: {ran}", *cov.caveats, *hardening)), style="bold yellow")
    if not report.diagnoses and not report.unexplained:
        return Text(
            "incomplete: every cell that ran passed; sessions not run: " + ", ".join(report.not_run),
            style="bold yellow",
        )
    n = len(report.diagnoses)
    return Text(
        f"{n} cause{'s' if n != 1 else ''} diagnosed"
        + (f", {len(report.unexplained)} unexplained failing cell(s)" if report.unexplained else ""),
        style="bold red",
    )


def _first_line(text: str | None) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[0][:300] if lines else "no message"
