"""`qmoe-doctor audit`: which fused-MoE operand offsets pass 2**31 - 1 for a model shape.

Pure arithmetic (``qmoe_doctor.core.audit``); no GPU. Exit 0 whatever it finds: it reports facts
about shapes, not a fault of a kernel. Exit 2 for an unknown preset or a bad config file.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table
from rich.text import Text

from qmoe_doctor.cli.output import emit_json, stderr_console, stdout_console
from qmoe_doctor.core.audit import (
    DEFAULT_TOKENS,
    DOCS_PAGE,
    FIX,
    AuditReport,
    AuditRow,
    ConfigError,
    OperandKind,
    audit_shape,
    load_hf_config,
)
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.shapes import PRESETS, MoEShape, get_preset


def _usage_error(message: str) -> typer.Exit:
    console = stderr_console()
    console.print(Text.assemble(("error: ", "bold red"), message))
    return typer.Exit(int(ExitCode.USAGE))


#: Below this terminal width the role column is left out (the JSON always has it).
_ROLE_MIN_WIDTH = 130


def _unit(row: AuditRow) -> str:
    return "expert" if row.kind is OperandKind.EXPERT_STACK else "row"


def _render(report: AuditReport) -> None:
    console = stdout_console()
    s = report.shape
    title = Text.assemble(
        (report.shape_name, "bold"),
        f": {s.num_experts} experts, top-{s.top_k}, hidden {s.hidden}, intermediate {s.intermediate}; "
        f"{report.tokens:,} tokens = {report.sorted_rows:,} sorted rows",
    )
    with_role = console.width >= _ROLE_MIN_WIDTH
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
    console.print(table)
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
    console.print()


def audit_command(
    preset: list[str] | None = typer.Option(
        None, "--preset", "-p", metavar="NAME", help=f"Preset to audit (repeatable): {', '.join(PRESETS)}."
    ),
    config: list[Path] | None = typer.Option(
        None,
        "--config",
        "-c",
        metavar="FILE",
        help="Hugging Face model config.json to audit (repeatable); text_config nesting is read.",
    ),
    tokens: int = typer.Option(
        DEFAULT_TOKENS, "--tokens", "-t", min=1, help="Tokens per call; sorted rows = tokens x top_k."
    ),
    json_out: bool = typer.Option(False, "--json", help="Write the versioned JSON document to stdout."),
) -> None:
    """Show which operand offsets of the fused MoE pass 2**31 - 1 elements (int32 overflow).

    Defaults to every preset. Pure arithmetic: no GPU needed.
    """
    shapes: list[tuple[MoEShape, str]] = []
    for name in preset or []:
        try:
            shapes.append((get_preset(name), "preset"))
        except KeyError as exc:
            raise _usage_error(f"{exc.args[0]}.") from None
    for path in config or []:
        try:
            shapes.append((load_hf_config(path), str(path)))
        except ConfigError as exc:
            raise _usage_error(
                f"{exc} Pass the model's Hugging Face config.json (keys num_experts, "
                "num_experts_per_tok, hidden_size, moe_intermediate_size)."
            ) from None
    if not shapes:
        shapes = [(s, "preset") for s in PRESETS.values()]

    reports = [audit_shape(shape, tokens, source=source) for shape, source in shapes]
    if json_out:
        emit_json("audit", {"tokens": tokens, "fix": FIX, "docs": DOCS_PAGE, "reports": reports})
    else:
        for report in reports:
            _render(report)
    raise typer.Exit(int(ExitCode.HEALTHY))
