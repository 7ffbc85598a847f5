"""Launch-config table of the built-in grouped GEMM (pure data: the planner reads it without
importing torch; kernels/grouped_gemm.py picks from it).

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


#: shape class -> config (see grouped_gemm.pick_config for when each applies)
GEMM_CONFIGS: dict[str, TileConfig] = {
    "few-rows": TileConfig(64, 128, 64, 4, 4),  # <= 64 rows per expert on average
    "wide-n": TileConfig(128, 256, 64, 8, 3),  # N >= 256
    "default": TileConfig(128, 128, 64, 8, 3),
    "interpreter": TileConfig(32, 32, 32, 4, 1),  # CPU tier: small and quick
}


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
