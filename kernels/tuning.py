"""Launch configs measured once per device and kept in a file, instead of an autotune at run
time (the public kernel's 1000-config autotune took 49 s for one shape on an H200).

A table holds, for one device, the best config ``benchmarks/tune_kernels.py`` measured for each
(op, rows per expert, N, K) it swept, with what it measured. Which table a device gets is
decided once per device from what the device reports (name, compute capability, SM count:
``qmoe_doctor.core.launch_configs.DeviceFacts`` says why those three), by
``core.launch_configs.choose_table``, first that applies:

1. ``$QMOE_CONFIG_TABLE=PATH`` (a tuning run measures its table before it is committed);
2. this user's own table for this device, ``<user cache>/configs/configs-<key>.json``
   (``tune_kernels.py --install`` writes it; nothing here ever tunes at run time);
3. the packaged table of this kind of device, ``configs-<key>.json`` beside this module;
4. the packaged table of the nearest device of the same compute capability (said so in
   ``describe``: the bench header and the reports print it);
5. no table: the fallback table of ``core.launch_configs``.

``lookup`` returns the entry nearest the call's shape (distance in log2 of rows per expert, N
and K); the caller still prunes the config against the device's shared memory. A table that
does not parse is an error that names the file, never a silent fallback.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qmoe_doctor.core import knobs
from qmoe_doctor.core.launch_configs import (
    TABLE_PREFIX,
    ConfigTableError,
    DeviceFacts,
    TableChoice,
    TableHeader,
    choose_table,
    read_table_header,
    user_table_path,
)
from qmoe_doctor.kernels.grouped_gemm import GemmConfig

__all__ = [
    "OPS",
    "TableEntry",
    "choice_for",
    "config_from_name",
    "describe_device_table",
    "device_facts",
    "load_table",
    "lookup",
    "packaged_tables",
]

OPS = ("forward", "dx", "dw")
PACKAGE_DIR = Path(__file__).parent


@dataclass(frozen=True, slots=True)
class TableEntry:
    op: str
    avg_rows: float  # rows per expert (M / E)
    n: int
    k: int
    config: GemmConfig


def config_from_name(text: str) -> GemmConfig:
    """``"128x128x64-w8-s3-p2-tma-flat"`` -> GemmConfig (``-pN``, ``-tma``, ``-flat``, ``-mf``, ``-tN``, ``-rN`` /
    ``-rxN`` / ``-ovN``, ``-ws`` optional)."""
    parts = text.strip().lower().split("-")
    try:
        bm, bn, bk = (int(v) for v in parts[0].split("x"))
        warps = stages = None
        programs, tma, flat, resident, resident_x, overlap, rows_first = 1, False, False, 0, False, 0, False
        tail, ws = 0, False
        for part in parts[1:]:
            if part == "ws":
                ws = True
            elif part == "tma":
                tma = True
            elif part[:1] == "t" and part[1:].isdigit():
                tail = int(part[1:])
            elif part == "flat":
                flat = True
            elif part == "mf":
                rows_first = True
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
            f"launch config {text!r}: expected BMxBNxBK-wWARPS-sSTAGES[-pPROGRAMS_PER_SM][-tma][-flat][-mf][-tTAIL][-rCHUNKS|-rxCHUNKS|-ovCHUNKS][-ws], "
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
        rows_first=rows_first,
        tail=tail,
        ws=ws,
    )
    if min(bm, bn, bk, warps, stages, programs) <= 0:
        raise ValueError(f"launch config {text!r}: every value must be positive")
    if not 0 <= resident <= 6:
        raise ValueError(f"launch config {text!r}: -rCHUNKS / -rxCHUNKS take 1 to 6 resident row chunks")
    if not 0 <= overlap <= 12 or (overlap and resident):
        raise ValueError(f"launch config {text!r}: -ovCHUNKS takes 1 to 12 row chunks, without -r/-rx")
    if rows_first and (resident or overlap):
        raise ValueError(f"launch config {text!r}: -mf orders the forward's tiles; a dw config (-r/-rx/-ov) cannot take it")
    if tail and (not tma or resident or overlap):
        raise ValueError(
            f"launch config {text!r}: -tTAIL is a form of the forward's TMA kernels: it takes -tma (and -flat or "
            "not), not -r/-rx or -ov"
        )
    if ws and (not tma or flat or resident or overlap or rows_first or tail or warps != 4 or programs > 2):
        raise ValueError(
            f"launch config {text!r}: -ws is the warp-specialized dw kernel: it takes -tma, 4 warps (one "
            "warpgroup), one or two programs per SM, and no -flat, -mf, -tN, -r/-rx or -ov"
        )
    if tail and (tail < 16 or tail >= bm or tail & (tail - 1)):
        raise ValueError(f"launch config {text!r}: -tTAIL takes a power of two from 16 to below the tile's rows ({bm})")
    return cfg


# --------------------------------------------------------------------------------------------
# Which table: per device, from its facts.
# --------------------------------------------------------------------------------------------


@functools.cache
def device_facts(device_index: int) -> DeviceFacts:
    """What CUDA device ``device_index`` reports (cached per index, never "the first device")."""
    import torch

    props = torch.cuda.get_device_properties(device_index)
    return DeviceFacts(
        name=str(props.name), capability=(int(props.major), int(props.minor)), sms=int(props.multi_processor_count)
    )


@functools.cache
def packaged_tables(folder: Path = PACKAGE_DIR) -> tuple[TableHeader, ...]:
    """The headers of the tables shipped beside this module, in file-name order."""
    return tuple(read_table_header(p) for p in sorted(folder.glob(f"{TABLE_PREFIX}*.json")))


@functools.cache
def _header(path: Path, mtime_ns: int) -> TableHeader:
    del mtime_ns  # part of the cache key: a table rewritten by a tuning run is read again
    return read_table_header(path)


def _header_of(path: Path) -> TableHeader:
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        raise ConfigTableError(f"{knobs.QMOE_CONFIG_TABLE}={path}: no such config table") from None
    return _header(path, mtime)


def choice_for(facts: DeviceFacts) -> TableChoice:
    """The table this device gets now (``core.launch_configs.choose_table``): reads the
    environment and this user's cache folder, so a table installed since is seen; the kernels
    call it once per shape (their launch plans are cached)."""
    override = knobs.config_table()
    user = user_table_path(facts)
    return choose_table(
        facts,
        packaged=packaged_tables(),
        user_table=_header_of(user) if user.is_file() else None,
        override=_header_of(Path(override)) if override else None,
    )


def describe_device_table(device_index: int) -> str:
    """One line for reports: which config table device ``device_index`` uses and why."""
    return choice_for(device_facts(device_index)).describe()


@functools.cache
def _entries(path: Path, mtime_ns: int) -> tuple[TableEntry, ...]:
    del mtime_ns
    try:
        data: Any = json.loads(path.read_text(encoding="utf-8"))
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
        raise ConfigTableError(f"config table {path}: {exc}") from exc
    for entry in entries:
        if entry.op not in OPS:
            raise ConfigTableError(f"config table {path}: unknown op {entry.op!r} (expected one of {OPS})")
    return entries


def load_table(path: Path) -> tuple[TableEntry, ...]:
    """The entries of a table file. Raises ConfigTableError (a ValueError) naming the file."""
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        raise ConfigTableError(f"config table {path}: no such file") from None
    return _entries(path, mtime)


def _distance(entry: TableEntry, avg_rows: float, n: int, k: int) -> float:
    def gap(a: float, b: float) -> float:
        return abs(math.log2(max(a, 1.0) / max(b, 1.0)))

    # rows per expert decides tile height and waste; weigh it above the matrix sizes
    return 2.0 * gap(avg_rows, entry.avg_rows) + gap(n, entry.n) + gap(k, entry.k)


def lookup(op: str, avg_rows: float, n: int, k: int, facts: DeviceFacts) -> GemmConfig | None:
    """The config of the device's table for the nearest measured shape, or None (no table
    applies to this device, or it has no entry for ``op``: the fallback table serves)."""
    choice = choice_for(facts)
    if choice.path is None:
        return None
    entries = [e for e in load_table(choice.path) if e.op == op]
    if not entries:
        return None
    best = min(entries, key=lambda e: _distance(e, avg_rows, n, k))
    return best.config
