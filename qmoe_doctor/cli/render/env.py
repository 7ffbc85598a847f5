"""Rendering of the GPU inventory (``qmoe-doctor env``): versions, the GPU table, link and P2P
grids, CUDA ordinals, warnings. Draws exactly the GPUs and pairs the inventory holds."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from qmoe_doctor.cli.output import print_table
from qmoe_doctor.machine.inventory import GpuInfo, GpuPair, Inventory, LinkKind, P2PStatus

_GIB = 1024**3


def render_inventory(console: Console, inv: Inventory) -> None:
    """The inventory as a terminal report: versions, GPU table, link and P2P grids, ordinals,
    warnings. Draws exactly the GPUs and pairs ``inv`` holds."""
    console.print(_versions_line(inv))
    if not inv.gpus:
        reason = inv.nvml_error or "NVML lists no GPU"
        console.print(
            f"No NVIDIA GPU found: {reason}.\n"
            "GPU probes cannot run here; the CPU tier (Triton interpreter) still can."
        )
        _render_warnings(console, inv.warnings)
        return
    print_table(console, _gpu_table(inv.gpus))
    if len(inv.gpus) > 1:
        console.print(Text("Links (as nvidia-smi topo -m)", style="italic"))
        print_table(console, _pair_grid(inv, _link_cell))
        console.print(Text("P2P support, read/write/NVLink (row GPU accessing column GPU)", style="italic"))
        print_table(console, _pair_grid(inv, _p2p_cell))
        console.print(
            Text(
                "NV# = # NVLinks (direct or via NVSwitch); PIX/PXB = PCIe switch(es); PHB = host "
                "bridge; NODE = within a NUMA node; SYS = across NUMA nodes. P2P: OK; NS not "
                "supported; TNS topology; CNS chipset; GNS GPU; DRK disabled by regkey; U unknown.",
                style="dim",
            )
        )
    _render_ordinals(console, inv)
    _render_warnings(console, inv.warnings)


def _versions_line(inv: Inventory) -> Text:
    def field(label: str, value: str | None) -> str:
        return f"{label} {value if value is not None else '-'}"

    no_driver = inv.driver_version is None and inv.cuda_driver_version is None
    parts = [
        "NVIDIA driver: none found" if no_driver else field("driver", inv.driver_version),
        *([] if no_driver else [field("CUDA (driver)", inv.cuda_driver_version)]),
        field("torch", inv.torch_version),
        field("triton", inv.triton_version),
        field("Python", inv.python_version or None),
        field("nvidia-ml-py", inv.nvml_py_version),
    ]
    return Text("  ".join(parts), style="bold")


def _gpu_table(gpus: Sequence[GpuInfo]) -> Table:
    table = Table(title="GPUs (numbered as nvidia-smi and --gpus number them)", title_justify="left")
    table.add_column("GPU", justify="right")
    table.add_column("Name", overflow="fold")
    table.add_column("PCI bus id", no_wrap=True, min_width=max(len(g.pci_bus_id) for g in gpus))
    table.add_column("CC", justify="right")
    table.add_column("Mem free/total", justify="right")
    table.add_column("MIG")
    table.add_column("ECC")
    table.add_column("Uncorr. ECC vol/agg", justify="right")
    table.add_column("Retired", justify="right")
    for g in gpus:
        table.add_row(
            str(g.index),
            g.name,
            g.pci_bus_id,
            g.cc_text,
            _memory(g),
            _on_off(g.mig_current, g.mig_pending, bad_when_on=True),
            _on_off(g.ecc_current, g.ecc_pending, bad_when_on=False),
            _ecc_counts(g),
            _retired(g),
        )
    return table


def _memory(g: GpuInfo) -> str:
    if g.memory_total is None:
        return "-"
    free = "-" if g.memory_free is None else f"{g.memory_free / _GIB:.0f}"
    return f"{free}/{g.memory_total / _GIB:.0f} GiB"


def _on_off(current: bool | None, pending: bool | None, *, bad_when_on: bool) -> Text:
    if current is None:
        return Text("n/a", style="dim")
    text = Text("on" if current else "off", style="yellow" if current == bad_when_on else "")
    if pending is not None and pending != current:
        text.append(f" (-> {'on' if pending else 'off'} after reset)", style="yellow")
    return text


def _ecc_counts(g: GpuInfo) -> Text:
    if g.ecc_volatile_uncorrected is None and g.ecc_aggregate_uncorrected is None:
        return Text("n/a", style="dim")
    vol = "-" if g.ecc_volatile_uncorrected is None else str(g.ecc_volatile_uncorrected)
    agg = "-" if g.ecc_aggregate_uncorrected is None else str(g.ecc_aggregate_uncorrected)
    return Text(f"{vol}/{agg}", style="red" if g.ecc_volatile_uncorrected else "")


def _retired(g: GpuInfo) -> Text:
    parts: list[str] = []
    if g.retired_pages_sbe is not None or g.retired_pages_dbe is not None:
        parts.append(f"pages {(g.retired_pages_sbe or 0) + (g.retired_pages_dbe or 0)}")
    if g.remapped_rows_uncorrectable is not None:
        parts.append(f"rows {g.remapped_rows_uncorrectable}")
    if not parts:
        return Text("n/a", style="dim")
    bad = bool(g.remap_failure or g.remap_pending or g.retired_pages_pending)
    return Text(", ".join(parts) + (" (pending)" if bad else ""), style="yellow" if bad else "")


def _pair_grid(inv: Inventory, cell: Callable[[GpuPair | None], Text]) -> Table:
    grid = Table()
    grid.add_column("")
    for g in inv.gpus:
        grid.add_column(f"GPU{g.index}", justify="center")
    for a in inv.gpus:
        row: list[Text | str] = [Text(f"GPU{a.index}", style="bold")]
        for b in inv.gpus:
            row.append(Text("X", style="dim") if a.index == b.index else cell(inv.pair(a.index, b.index)))
        grid.add_row(*row)
    return grid


def _link_cell(pair: GpuPair | None) -> Text:
    if pair is None:
        return Text("?", style="dim")
    style = "green" if pair.link is LinkKind.NVLINK else ("yellow" if pair.link is LinkKind.SYS else "")
    return Text(pair.label, style=style)


def _p2p_cell(pair: GpuPair | None) -> Text:
    if pair is None:
        return Text("?", style="dim")
    text = Text()
    for i, status in enumerate((pair.p2p_read, pair.p2p_write, pair.p2p_nvlink)):
        if i:
            text.append("/")
        if status is None:
            text.append("?", style="dim")
        else:
            text.append(status.short, style="green" if status is P2PStatus.OK else "yellow")
    return text


def _render_ordinals(console: Console, inv: Inventory) -> None:
    visible = "<unset>" if inv.cuda_visible_devices is None else repr(inv.cuda_visible_devices)
    order = inv.cuda_device_order if inv.cuda_device_order else f"<unset> = {inv.device_order.value}"
    lines: list[Text] = [
        Text(
            f"CUDA ordinals in this environment (CUDA_VISIBLE_DEVICES={visible}, CUDA_DEVICE_ORDER={order}):"
        )
    ]
    if not inv.cuda_ordinals:
        lines.append(Text("  none: CUDA would see no GPU", style="yellow"))
    for o in inv.cuda_ordinals:
        target = f"GPU {o.nvml_index} (NVML)  " + (f"MIG instance {o.uuid}" if o.mig else o.uuid)
        style = "yellow" if o.ordinal != o.nvml_index else ""
        lines.append(Text(f"  cuda:{o.ordinal} -> {target}", style=style))
    console.print(Group(*lines))


def _render_warnings(console: Console, warnings: Sequence[str]) -> None:
    for warning in warnings:
        console.print(Text(f"warning: {warning}", style="yellow"))
