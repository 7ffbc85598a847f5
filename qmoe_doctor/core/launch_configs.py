"""Launch configs of the built-in kernels where no measured table covers the device: the one
fallback table (pure data). The planner reads it without importing torch (the scan's
launch-config sweep); ``kernels/grouped_gemm.py`` and ``kernels/backward.py`` pick from it
(``GemmConfig.from_tile``), after the measured table of ``kernels/tuning.py`` on the devices it
was measured for, and prune the pick against the device's shared memory.

A small pinned table per shape class instead of an autotune at run time: the public kernel's
1000-config autotune took 49 s for one shape on an H200 (shared/FINDINGS.md).
"""

from __future__ import annotations

from typing import NamedTuple


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
