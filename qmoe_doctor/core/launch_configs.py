"""Launch configs: the one fallback table of the built-in kernels (pure data), and which
measured table a device gets.

The fallback table serves where no measured table covers the device. The planner reads it
without importing torch (the scan's launch-config sweep); ``kernels/grouped_gemm.py`` and
``kernels/backward.py`` pick from it (``GemmConfig.from_tile``) after the device's measured table
(``kernels/tuning.py``), and prune the pick against the device's shared memory. A small pinned
table per shape class instead of an autotune at run time: the public kernel's 1000-config
autotune took 49 s for one shape on an H200 (shared/FINDINGS.md).

Measured tables are per device, keyed by what the device reports (``DeviceFacts``: name,
compute capability, SM count); ``choose_table`` decides which one applies (the device's own, this
user's tuning of it, the nearest of its capability, none) and says why; ``user_cache_dir`` is
where a user's own tuning is kept. Stdlib only: the parent can say which table a device would
get without torch.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

from qmoe_doctor.core import knobs


class TileConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int

    @property
    def name(self) -> str:
        return f"{self.block_m}x{self.block_n}x{self.block_k}-w{self.num_warps}-s{self.num_stages}"

    def smem_bytes(self, itemsize: int) -> int:
        """Shared memory the software pipeline asks for: one x tile and one w tile per stage."""
        return (self.block_m + self.block_n) * self.block_k * itemsize * self.num_stages


#: forward and dx (the forward kernel on w.T): shape class -> config (``gemm_fallback`` says
#: when each applies). The scan's launch-config sweep runs every entry: "interpreter" on the
#: CPU tier, the others on a GPU.
GEMM_CONFIGS: dict[str, TileConfig] = {
    "few-rows": TileConfig(64, 128, 64, 4, 4),  # <= 64 rows per expert on average
    "wide-n": TileConfig(128, 256, 64, 8, 3),  # N >= 256
    "default": TileConfig(128, 128, 64, 8, 3),
    "interpreter": TileConfig(32, 32, 32, 4, 1),  # CPU tier: small and quick (dw too)
}

#: dw (block_n x block_k of dw, block_m rows of the reduction per step): shape class -> config
#: (``dw_fallback`` says when each applies).
DW_CONFIGS: dict[str, TileConfig] = {
    "wide": TileConfig(64, 128, 128, 8, 3),  # N >= 128 and K >= 128
    "narrow": TileConfig(64, 64, 64, 4, 3),
}


def gemm_fallback(avg_rows: int, n: int) -> TileConfig:
    """The forward / dx config on a GPU the measured table does not cover: ``avg_rows`` is
    M // E (rows per expert, at least 1), ``n`` the output's columns."""
    if avg_rows <= 64:
        return GEMM_CONFIGS["few-rows"]
    if n >= 256:
        return GEMM_CONFIGS["wide-n"]
    return GEMM_CONFIGS["default"]


def dw_fallback(n: int, k: int) -> TileConfig:
    """The dw config on a GPU the measured table does not cover (dw is (E, N, K))."""
    return DW_CONFIGS["wide" if n >= 128 and k >= 128 else "narrow"]


def parse_config(text: str) -> TileConfig:
    """``"128x256x64-w8-s3"`` (the form ``TileConfig.name`` prints) -> TileConfig."""
    try:
        tiles, warps, stages = text.strip().split("-")
        bm, bn, bk = (int(v) for v in tiles.lower().split("x"))
        if not (warps.startswith("w") and stages.startswith("s")):
            raise ValueError
        cfg = TileConfig(bm, bn, bk, int(warps[1:]), int(stages[1:]))
    except ValueError:
        raise ValueError(
            f"launch config {text!r}: expected BMxBNxBK-wWARPS-sSTAGES, e.g. 128x256x64-w8-s3"
        ) from None
    if min(cfg) <= 0:
        raise ValueError(f"launch config {text!r}: every value must be positive")
    return cfg


# --------------------------------------------------------------------------------------------
# Measured tables per device: which one a device gets (pure: the kernels pass the device's facts).
# --------------------------------------------------------------------------------------------

# The variables (a table file instead of the device's, this user's cache folder, the lean launch
# path) are declared and read in core/knobs.py; these two names stay for the tests that use them.
TABLE_ENV = knobs.QMOE_CONFIG_TABLE
CACHE_ENV = knobs.QMOE_CACHE_DIR
#: The packaged tables are ``configs-<device key>.json`` beside ``kernels/tuning.py``; this
#: user's are the same names under ``<cache>/configs/``.
TABLE_PREFIX = "configs-"
APP_NAME = "qmoe-doctor"

TableSource = Literal["env", "user", "packaged", "nearest", "none"]


class ConfigTableError(ValueError):
    """A config table that cannot be read or does not say what it is: names the file."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceFacts:
    """What a GPU reports of itself, as a config table is keyed.

    Name and compute capability and multiprocessor count, all three: the capability decides
    which kernels exist and how much shared memory a block gets (H100 and H200 alike: 9.0,
    227 KiB); the multiprocessor count sizes the persistent grids (132 on H100 SXM and H200,
    114 on H100 PCIe, fewer on a MIG slice); the name tells apart memory systems the first two
    do not (H100 80GB HBM3 at 3.35 TB/s and H200 at 4.8 TB/s share both), and the memory system
    moves the best tile at the memory-bound points (a table tuned on an H200 lost to a fixed
    tile on an H100, 2026-11-25)."""

    name: str  # "NVIDIA H100 80GB HBM3", as torch.cuda.get_device_name reports it
    capability: tuple[int, int]
    sms: int

    @property
    def key(self) -> str:
        """``nvidia-h100-80gb-hbm3-sm90-132sm``: the file-name form of the three facts."""
        major, minor = self.capability
        return f"{device_slug(self.name)}-sm{major}{minor}-{self.sms}sm"


def device_slug(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def table_file_name(facts: DeviceFacts) -> str:
    return f"{TABLE_PREFIX}{facts.key}.json"


@dataclass(frozen=True, slots=True, kw_only=True)
class TableHeader:
    """The ``tuned_on`` part of a table file: the device its configs were measured on."""

    path: Path
    device: str
    capability: tuple[int, int]
    sms: int | None  # None in tables written before the field (the H200 table of 2026-11-22)

    def matches(self, facts: DeviceFacts) -> bool:
        """Measured on this kind of device: same name, capability and (where recorded) SMs."""
        return (
            _same_name(self.device, facts.name)
            and self.capability == facts.capability
            and (self.sms is None or self.sms == facts.sms)
        )


def _same_name(a: str, b: str) -> bool:
    return " ".join(a.lower().split()) == " ".join(b.lower().split())


def parse_table_header(text: str, path: Path) -> TableHeader:
    """The header of a table file's text. Raises ConfigTableError naming ``path``."""
    try:
        doc = json.loads(text)
        tuned = doc["tuned_on"]
        major, minor = (int(v) for v in tuned["capability"])
        sms = tuned.get("sms")
        if not isinstance(doc["entries"], list):
            raise TypeError("'entries' is not a list")
        return TableHeader(
            path=path, device=str(tuned["device"]), capability=(major, minor), sms=None if sms is None else int(sms)
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigTableError(
            f"config table {path}: {type(exc).__name__}: {exc} (expected the JSON that "
            "benchmarks/tune_kernels.py writes: 'tuned_on' with device, capability, sms; 'entries')"
        ) from None


def read_table_header(path: Path) -> TableHeader:
    """The header of a table file. Raises ConfigTableError (unreadable or malformed)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigTableError(f"config table {path}: cannot read it ({exc.strerror or exc})") from None
    return parse_table_header(text, path)


def user_cache_dir(environ: Mapping[str, str] | None = None, platform: str | None = None) -> Path:
    """This user's cache folder for qmoe-doctor, as ``platformdirs.user_cache_dir("qmoe-doctor",
    appauthor=False)`` gives it (written out here: core stays stdlib-only, and a GPU machine
    installs us without dependencies): ``$QMOE_DOCTOR_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/qmoe-doctor`` or ``~/.cache/qmoe-doctor`` (Linux),
    ``~/Library/Caches/qmoe-doctor`` (macOS), ``%LOCALAPPDATA%\\qmoe-doctor\\Cache`` (Windows)."""
    env = os.environ if environ is None else environ
    platform = sys.platform if platform is None else platform
    chosen = knobs.cache_dir(env)
    if chosen is not None:
        return Path(chosen).expanduser()
    home = Path(env.get("HOME") or env.get("USERPROFILE") or Path.home())
    if platform == "darwin":
        return home / "Library" / "Caches" / APP_NAME
    if platform.startswith("win"):
        base = env.get("LOCALAPPDATA", "").strip()
        return (Path(base) if base else home / "AppData" / "Local") / APP_NAME / "Cache"
    xdg = env.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg) if xdg and Path(xdg).is_absolute() else home / ".cache") / APP_NAME


def user_table_path(facts: DeviceFacts, environ: Mapping[str, str] | None = None) -> Path:
    """Where ``benchmarks/tune_kernels.py --install`` puts this device's table for this user."""
    return user_cache_dir(environ) / "configs" / table_file_name(facts)


@dataclass(frozen=True, slots=True, kw_only=True)
class TableChoice:
    """The config table a device gets, and why (what the bench header and reports print)."""

    path: Path | None  # None: no measured table applies; the fallback table above serves
    source: TableSource
    tuned_on: str = ""  # the device the table was measured on
    reason: str = ""

    def describe(self) -> str:
        if self.path is None:
            return f"built-in fallback configs ({self.reason})"
        return f"{self.path.name} ({self.source}, tuned on {self.tuned_on}; {self.reason})"


def choose_table(
    facts: DeviceFacts,
    *,
    packaged: Sequence[TableHeader],
    user_table: TableHeader | None = None,
    override: TableHeader | None = None,
) -> TableChoice:
    """The table for ``facts``, first that applies:

    1. ``override`` (``$QMOE_CONFIG_TABLE``), where measured on this compute capability;
    2. ``user_table``: this user's own tuning of this device (``tune_kernels.py --install``);
    3. a packaged table measured on this kind of device (``TableHeader.matches``);
    4. the nearest packaged table: same compute capability, the same SM count first (so the
       persistent grids were sized alike), then the most recently listed;
    5. none: the fallback table of this module (no measured table for this capability).

    Never a tuning at run time: a device without its own table says so, and
    ``benchmarks/tune_kernels.py --install`` makes one."""
    if override is not None:
        if override.capability != facts.capability:
            return TableChoice(
                path=None,
                source="none",
                reason=(
                    f"{knobs.QMOE_CONFIG_TABLE}={override.path} was measured on compute capability "
                    f"{_cc(override.capability)}, this device is {_cc(facts.capability)}"
                ),
            )
        return TableChoice(
            path=override.path, source="env", tuned_on=override.device, reason=knobs.QMOE_CONFIG_TABLE
        )
    if user_table is not None:
        return TableChoice(
            path=user_table.path, source="user", tuned_on=user_table.device, reason="tuned on this machine"
        )
    exact = [h for h in packaged if h.matches(facts)]
    if exact:
        return TableChoice(path=exact[-1].path, source="packaged", tuned_on=exact[-1].device, reason="this device")
    same_cc = [h for h in packaged if h.capability == facts.capability]
    if same_cc:
        near = sorted(same_cc, key=lambda h: h.sms == facts.sms)[-1]
        return TableChoice(
            path=near.path,
            source="nearest",
            tuned_on=near.device,
            reason=(
                f"no table for {facts.name} ({facts.key}); nearest of compute capability "
                f"{_cc(facts.capability)}: tune this device with benchmarks/tune_kernels.py --install"
            ),
        )
    return TableChoice(
        path=None, source="none", reason=f"no measured table for compute capability {_cc(facts.capability)}"
    )


def _cc(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"
