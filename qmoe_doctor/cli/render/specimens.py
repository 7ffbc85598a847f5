"""Rendering of the specimen catalogue (``qmoe-doctor specimens``)."""

from __future__ import annotations

from collections.abc import Sequence

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from qmoe_doctor.cli.output import print_table
from qmoe_doctor.core.kernel_ref import BuiltinAdapter
from qmoe_doctor.core.specimens import SpecimenInfo


def render_specimens(
    console: Console, specimens: Sequence[SpecimenInfo], adapters: Sequence[BuiltinAdapter] = ()
) -> None:
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("--kernel", no_wrap=True, style="bold")
    table.add_column("cause", no_wrap=True)
    table.add_column("what it does wrong / when it misbehaves")
    for spec in specimens:
        what = Text(spec.summary)
        what.append(f"\nwhen: {spec.trigger}", style="dim")
        if spec.lint_rule:
            what.append(f"\nfound by: qmoe-doctor lint (rule {spec.lint_rule})", style="dim")
        if spec.protocol != "m_sizes":
            what.append(f"\ncalled as: {spec.protocol} (adapter:{spec.protocol})", style="dim")
        cause = Text(spec.cause) if spec.cause is not None else Text("none (correct)", style="green")
        table.add_row(spec.kernel_option, cause, what)
    print_table(console, table)
    console.print(
        "Each is qmoe_doctor.kernels.specimens.<name>:moe_grouped_gemm (a routed one: :fused_moe or "
        ":ragged_moe); docs: docs/causes/<cause>.md; a correct one must get no diagnosis"
    )
    if not adapters:
        return
    console.print()
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("built-in adapter (--kernel)", no_wrap=True, style="bold")
    table.add_column("for a kernel / what it passes")
    for adapter in adapters:
        what = Text(adapter.takes)
        what.append(f"\n{adapter.summary}", style="dim")
        table.add_row(adapter_option(adapter), what)
    print_table(console, table)
    console.print(
        "TARGET: your kernel, module:function or path/to/file.py:function (docs/ci.md, adapters); "
        "adapter:routed alone runs our routed kernel"
    )


def adapter_option(adapter: BuiltinAdapter) -> str:
    """What ``--kernel`` takes for a built-in adapter: ``adapter:NAME:TARGET``, with the target
    optional where the adapter has a kernel of its own (``adapter:routed[:TARGET]``)."""
    if adapter.default_target is not None:
        return f"adapter:{adapter.name}[:TARGET]"
    return f"adapter:{adapter.name}:TARGET"
