"""`qmoe-doctor env`: the GPUs, how they connect, and which CUDA ordinal is which.

The library (``qmoe_doctor.machine.inventory``) does the work; this module validates, calls,
renders (``qmoe_doctor.cli.render.env``).
"""

from __future__ import annotations

from rich.text import Text

from qmoe_doctor.cli import options as opt
from qmoe_doctor.cli.devices import select_devices
from qmoe_doctor.cli.output import check_outputs, emit_document, save_document, stdout_console
from qmoe_doctor.cli.render.env import render_inventory
from qmoe_doctor.machine.inventory import describe_probe_mapping, subset_inventory
from qmoe_doctor.reports.json import json_document


def env_command(gpus: opt.GpusOpt = None, json_out: opt.JsonOpt = False, save: opt.SaveOpt = None) -> None:
    """Show the GPUs, their NVLink/PCIe links, P2P support, versions and the CUDA ordinal mapping.

    Reads NVML only; creates no CUDA context. With no GPU or no NVIDIA driver it says so and
    exits 0.
    """
    check_outputs(files={"--save": save})
    devices = select_devices(gpus, cpu_fallback="the report says why", announce=False)
    inv = devices.inventory
    assert inv is not None  # not --cpu: NVML was asked
    selected = devices.gpus
    shown = inv if gpus is None else subset_inventory(inv, selected)
    doc = json_document("inventory", shown)
    if save is not None:
        save_document(save, doc)
    if json_out:
        emit_document(doc)
        return
    console = stdout_console()
    render_inventory(console, shown)
    if gpus is not None and selected:
        console.print()
        console.print(Text("Probes address the selected GPUs by UUID:", style="bold"))
        for line in describe_probe_mapping(selected):
            console.print(f"  {line}")
