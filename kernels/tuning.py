"""Launch configs measured once per device class and kept in a file, instead of an autotune
at run time (the public kernel's 1000-config autotune took 49 s for one shape on an H200).

``configs_sm90.json`` beside this module holds, for Hopper (compute capability 9.0: H100 and
H200, 132 SMs and 227 KiB of shared memory per block on both), the best config that
``benchmarks/tune_kernels.py`` measured for each (op, rows per expert, N, K) it swept, with what
it measured. ``lookup`` returns the entry nearest the call's shape (distance in log2 of rows per
expert, N and K); the caller still prunes the config against the device's shared memory.

``QMOE_CONFIG_TABLE=PATH`` replaces the packaged table (the tuner writes one; a benchmark run
can then measure exactly that table before it is committed). A table that does not parse is
an error that names the file, never a silent fallback.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qmoe_doctor.kernels.grouped_gemm import GemmConfig

__all__ = ["OPS", "TABLE_ENV", "TableEntry", "config_from_name", "load_table", "lookup", "table_path"]

TABLE_ENV = "QMOE_CONFIG_TABLE"
OPS = ("forward", "dx", "dw")
_PACKAGED = Path(__file__).with_name("configs_sm90.json")


@dataclass(frozen=True, slots=True)
class TableEntry:
    op: str
    avg_rows: float  # rows per expert (M / E)
    n: int
    k: int
    config: GemmConfig


def config_from_name(text: str) -> GemmConfig:
    """``"128x128x64-w8-s3-p2-tma-flat"`` -> GemmConfig (``-pN``, ``-tma``, ``-flat``, ``-rN`` / ``-rxN`` / ``-ovN`` optional)."""
    parts = text.strip().lower().split("-")
    try:
        bm, bn, bk = (int(v) for v in parts[0].split("x"))
        warps = stages = None
        programs, tma, flat, resident, resident_x, overlap = 1, False, False, 0, False, 0
        for part in parts[1:]:
            if part == "tma":
                tma = True
            elif part == "flat":
                flat = True
            elif part[:1] == "w":
                warps = int(part[1:])
            elif part[:1] == "s":
                stages = int(part[1:])
            elif part[:1] == "p":
                programs = int(part[1:])
            elif part[:2] == "ov":
                overlap = int(part[2:])
            elif part[:2] == "rx":
                resident, resident_x = int(part[2:]), True
            elif part[:1] == "r":
                resident = int(part[1:])
            else:
                raise ValueError(part)
        if warps is None or stages is None:
            raise ValueError("warps and stages are required")
    except ValueError:
        raise ValueError(
            f"launch config {text!r}: expected BMxBNxBK-wWARPS-sSTAGES[-pPROGRAMS_PER_SM][-tma][-flat][-rCHUNKS|-rxCHUNKS|-ovCHUNKS], "
            "e.g. 128x128x64-w8-s3-p2-tma"
        ) from None
    cfg = GemmConfig(
        bm,
        bn,
        bk,
        warps,
        stages,
        programs_per_sm=programs,
        tma=tma,
        flat=flat,
        resident=resident,
        resident_x=resident_x,
        overlap=overlap,
    )
    if min(bm, bn, bk, warps, stages, programs) <= 0:
        raise ValueError(f"launch config {text!r}: every value must be positive")
    if not 0 <= resident <= 6:
        raise ValueError(f"launch config {text!r}: -rCHUNKS / -rxCHUNKS take 1 to 6 resident row chunks")
    if not 0 <= overlap <= 12 or (overlap and resident):
        raise ValueError(f"launch config {text!r}: -ovCHUNKS takes 1 to 12 row chunks, without -r/-rx")
    return cfg


def table_path() -> Path:
    override = os.environ.get(TABLE_ENV, "")
    return Path(override) if override else _PACKAGED


@functools.cache
def load_table(path: Path) -> tuple[TableEntry, ...]:
    """The entries of a table file; () when the packaged table is absent."""
    if not path.exists():
        if path == _PACKAGED:
            return ()
        raise FileNotFoundError(f"{TABLE_ENV}={path}: no such config table")
    try:
        data: Any = json.loads(path.read_text())
        entries = tuple(
            TableEntry(
                op=str(item["op"]),
                avg_rows=float(item["avg_rows"]),
                n=int(item["n"]),
                k=int(item["k"]),
                config=config_from_name(str(item["config"])),
            )
            for item in data["entries"]
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"config table {path}: {exc}") from exc
    for entry in entries:
        if entry.op not in OPS:
            raise ValueError(f"config table {path}: unknown op {entry.op!r} (expected one of {OPS})")
    return entries


def _distance(entry: TableEntry, avg_rows: float, n: int, k: int) -> float:
    def gap(a: float, b: float) -> float:
        return abs(math.log2(max(a, 1.0) / max(b, 1.0)))

    # rows per expert decides tile height and waste; weigh it above the matrix sizes
    return 2.0 * gap(avg_rows, entry.avg_rows) + gap(n, entry.n) + gap(k, entry.k)


def lookup(op: str, avg_rows: float, n: int, k: int, capability: tuple[int, int]) -> GemmConfig | None:
    """The table's config for the nearest measured shape, or None (no table for this device)."""
    if capability[0] != 9:
        return None  # measured on Hopper only: other devices keep the built-in defaults
    entries = [e for e in load_table(table_path()) if e.op == op]
    if not entries:
        return None
    best = min(entries, key=lambda e: _distance(e, avg_rows, n, k))
    return best.config
