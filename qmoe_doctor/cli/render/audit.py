"""Rendering of int32 offset audits (``qmoe-doctor audit``): one table per shape, the wraps."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from qmoe_doctor.cli.output import print_table
from qmoe_doctor.core.audit import DOCS_PAGE, FIX, AuditReport, AuditRow, OperandKind

#: Below this terminal width the role column is left out (the JSON always has it; a pipe or a CI
#: log gets it, the table printed at its natural width).
_ROLE_MIN_WIDTH = 130


def _unit(row: AuditRow) -> str:
    return "expert" if row.kind is OperandKind.EXPERT_STACK else "row"


def render_audit(console: Console, report: AuditReport) -> None:
    s = report.shape
    title = Text.assemble(
        (report.shape_name, "bold"),
        f": {s.num_experts} experts, top-{s.top_k}, hidden {s.hidden}, intermediate {s.intermediate}; "
        f"{report.tokens:,} tokens = {report.sorted_rows:,} sorted rows",
    )
    with_role = not console.is_terminal or console.width >= _ROLE_MIN_WIDTH  # piped: the natural width
    table = Table(title=title, title_justify="left")
    table.add_column("operand", no_wrap=True)
    table.add_column("shape", no_wrap=True)
    table.add_column("max offset", justify="right", no_wrap=True)
    table.add_column("<= 2**31-1", justify="center", no_wrap=True)
    table.add_column("first wrap")  # first index whose base offset passes the limit
    if with_role:
        table.add_column("role", style="dim")
    for row in report.rows:
        cells = [
            Text(row.operand),
            Text(" x ".join(str(d) for d in row.shape)),
            Text(f"{row.max_offset:,}"),
            Text("WRAPS" if row.wraps else "ok"),
            Text(row.first_wrap or ""),
        ]
        if with_role:
            cells.append(Text(row.role))
        table.add_row(*cells, style="red" if row.wraps else None)
    print_table(console, table)
    console.print(
        Text(
            f"Activations wrap from {report.min_wrap_tokens:,} tokens "
            f"({', '.join(report.min_wrap_operands)})."
        )
    )
    straddles = [
        f"{r.operand} {_unit(r)} {r.straddle_index}"
        for r in report.wrapping
        if r.straddle_index is not None
        and r.first_wrap_index is not None
        and r.straddle_index < r.first_wrap_index
    ]
    if straddles:
        console.print(
            Text(
                f"Element 2**31 lies in {', '.join(straddles)}: the base offset fits there but the last "
                "elements do not, so a kernel that forms the whole offset in int32 is wrong from there."
            )
        )
    if report.wraps:
        names = ", ".join(r.operand for r in report.wrapping)
        console.print(Text.assemble(("Wraps in int32: ", "bold red"), f"{names}. {FIX} See {DOCS_PAGE}."))
    if report.gathered:
        _render_gathered(console, report, with_role)
    console.print()


def _render_gathered(console: Console, report: AuditReport, with_role: bool) -> None:
    """The routed protocol's gathered ids: slot ids (t * top_k + j) and their tokens times a row
    stride, for kernels that take the router's ids."""
    table = Table(
        title="gathered ids (kernels that take the router's ids: adapter:routed)", title_justify="left"
    )
    table.add_column("product", no_wrap=True)
    table.add_column("shape", no_wrap=True)
    table.add_column("max offset", justify="right", no_wrap=True)
    table.add_column("<= 2**31-1", justify="center", no_wrap=True)
    table.add_column("first wrap")
    table.add_column("wraps from", justify="right", no_wrap=True)
    if with_role:
        table.add_column("role", style="dim")
    for row in report.gathered:
        cells = [
            Text(row.operand),
            Text(" x ".join(str(d) for d in row.shape)),
            Text(f"{row.max_offset:,}"),
            Text("WRAPS" if row.wraps else "ok"),
            Text(row.first_wrap or ""),
            Text(f"{row.wrap_tokens:,} tokens" if row.wrap_tokens is not None else ""),
        ]
        if with_role:
            cells.append(Text(row.role))
        table.add_row(*cells, style="red" if row.wraps else None)
    print_table(console, table)
    if report.gathered_min_wrap_tokens is not None:
        console.print(
            Text(
                f"Gathered ids wrap from {report.gathered_min_wrap_tokens:,} tokens "
                f"({', '.join(report.gathered_min_wrap_operands)}): a slot id loaded from sorted_token_ids "
                "or gather_indx (int32) times the row stride; cast the id to int64 where it meets the stride."
            )
        )
