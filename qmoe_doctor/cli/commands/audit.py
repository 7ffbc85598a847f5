"""`qmoe-doctor audit`: which fused-MoE operand offsets pass 2**31 - 1 for a model shape.

Pure arithmetic (``qmoe_doctor.core.audit``); no GPU. Exit 0 whatever it finds: it reports facts
about shapes, not a fault of a kernel. Exit 2 for an unknown preset or a bad config file (read
bounded: a huge, special or pathological file is one line, not a traceback).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from qmoe_doctor.cli import options as opt
from qmoe_doctor.cli.errors import CliError
from qmoe_doctor.cli.output import check_outputs, deliver
from qmoe_doctor.cli.render.audit import render_audit
from qmoe_doctor.core.audit import DEFAULT_TOKENS, DOCS_PAGE, FIX, ConfigError, audit_shape, load_hf_config
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.shapes import PRESETS, MoEShape, get_preset
from qmoe_doctor.reports.json import json_document

CONFIG_KEYS = (
    "Pass the model's Hugging Face config.json (keys num_experts, num_experts_per_tok, hidden_size, "
    "moe_intermediate_size)."
)


def audit_command(
    preset: Annotated[
        list[str] | None,
        typer.Option(
            "--preset", "-p", metavar="NAME", help=f"Preset to audit (repeatable): {', '.join(PRESETS)}."
        ),
    ] = None,
    config: Annotated[
        list[Path] | None,
        typer.Option(
            "--config",
            "-c",
            metavar="FILE",
            help="Hugging Face model config.json to audit (repeatable); text_config nesting is read.",
        ),
    ] = None,
    tokens: Annotated[
        int, typer.Option("--tokens", "-t", min=1, help="Tokens per call; sorted rows = tokens x top_k.")
    ] = DEFAULT_TOKENS,
    top_k: Annotated[
        int | None,
        typer.Option(
            "--top-k",
            min=1,
            help="Experts per token, overriding the preset's or config's num_experts_per_tok (the sorted "
            "rows and the gathered slot ids reach tokens x top_k).",
        ),
    ] = None,
    json_out: opt.JsonOpt = False,
    save: opt.SaveOpt = None,
) -> None:
    """Show which operand offsets of the fused MoE pass 2**31 - 1 elements (int32 overflow).

    Defaults to every preset. Pure arithmetic: no GPU needed.
    """
    check_outputs(files={"--save": save})
    shapes: list[tuple[MoEShape, str]] = []
    for name in preset or []:
        shapes.append((get_preset(opt.preset(name)), "preset"))
    for path in config or []:
        try:
            shapes.append((load_hf_config(path), str(path)))
        except ConfigError as exc:
            raise CliError(f"--config {exc}", hint=CONFIG_KEYS) from None
    if not shapes:
        shapes = [(s, "preset") for s in PRESETS.values()]
    for shape, _source in shapes:
        if top_k is not None and top_k > shape.num_experts:
            raise CliError(f"--top-k {top_k}: {shape.name} has {shape.num_experts} experts; top_k cannot exceed them")
    reports = [audit_shape(shape, tokens, source=source, top_k=top_k) for shape, source in shapes]
    def render(console: Console) -> None:
        for report in reports:
            render_audit(console, report)

    doc = json_document("audit", {"tokens": tokens, "fix": FIX, "docs": DOCS_PAGE, "reports": reports})
    deliver(doc, render, json_out=json_out, save=save)
    raise typer.Exit(int(ExitCode.HEALTHY))
