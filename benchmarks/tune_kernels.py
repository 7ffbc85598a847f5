"""Measure candidate launch configs of our forward, dx and dw kernels on this GPU, side by side
with ``torch._grouped_mm``, over the presets' GEMM shapes and several token counts; write the
best per (op, shape) as this device's config table (``kernels/configs-<device key>.json``, the
key from what the device reports: ``qmoe_doctor.core.launch_configs.DeviceFacts``).

    python benchmarks/tune_kernels.py --install                   # tune this card once, for this user
    python benchmarks/tune_kernels.py --out tune/                 # every preset shape, 4 token counts
    python benchmarks/tune_kernels.py --set card --deadline-s 200 --package --out tune/   # tools/gpu/perf_card.sh
    python benchmarks/tune_kernels.py --shapes 30b-gate_up:2048 --ops forward --out tune/
    python benchmarks/tune_kernels.py --tiny                      # CPU, interpreter: a smoke run

Writes ``OUT/tune.json`` (every measurement: config, ms, TFLOP/s, relative difference from
``torch._grouped_mm``'s result) and ``OUT/configs.json`` (the table: the fastest correct config
per point), and a copy of the table named for the device, ``OUT/configs-<key>.json``.
``--install`` also puts it in this user's cache folder, where the kernels find it for this
device from then on (``kernels/tuning.py``; nothing ever tunes at run time); ``--package``
beside ``kernels/tuning.py`` (in a checkout: the file to commit).

At every point the config the device uses today (its current table's pick: the incumbent) is
measured with the candidates, so a new table is never slower than the old one at a point it
measured. Compilation is spread over ``--jobs`` processes first (it fills the Triton cache;
nothing is timed then); timing runs in this process alone, one kernel at a time, with
``triton.testing.do_bench`` (median, L2 flushed between calls). The fastest ``--finalists`` of
that first pass and the incumbent are then timed again ``--rounds`` times, interleaved in a
rotated order, and the median of those rounds picks the point's config: the fastest of many
single timings is biased fast (configs within a few percent of each other otherwise trade places
from run to run on one card). A config that fails to compile
or launch, or whose result differs from torch's by more than ``--max-rel-diff``, is recorded
with its reason and never chosen. Past ``--deadline-s`` only the incumbents are measured, so
the table stays complete.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# rows: (label, E, N, K) of each preset GEMM: gate_up (N = 2I, K = H) and down (N = H, K = I)
PRESET_GEMMS = {
    "30b-gate_up": (128, 1536, 2048),
    "30b-down": (128, 2048, 768),
    "235b-gate_up": (128, 3072, 4096),
    "235b-down": (128, 4096, 1536),
    "480b-gate_up": (160, 5120, 6144),
    "480b-down": (160, 6144, 2560),
}
TOP_K = 8
FINALISTS = 3  # --finalists
ROUNDS = 3  # --rounds
DEFAULT_POINTS = (
    [f"30b-gate_up:{t}" for t in (128, 512, 2048, 8192)]
    + [f"30b-down:{t}" for t in (128, 512, 2048, 8192)]
    + [f"{g}:{t}" for g in ("235b-gate_up", "235b-down", "480b-gate_up", "480b-down") for t in (512, 2048)]
)

FWD_CONFIGS = [
    "128x256x64-w8-s3",  # the built-in rule before this table (pointer kernel)
    "128x256x64-w8-s3-tma",
    "64x128x64-w4-s4-p2",
    "64x128x64-w4-s4-p2-tma",
    "64x256x64-w4-s4-tma",
    "64x128x128-w4-s3-tma",
    # one flattened loop per program (the pipeline runs on across tiles)
    "128x256x64-w8-s3-flat",
    "128x256x64-w8-s4-flat",
    "128x256x64-w8-s3-tma-flat",
    "128x256x64-w8-s4-tma-flat",
    "128x128x64-w8-s4-flat",
    "128x128x64-w8-s4-tma-flat",
    "128x128x64-w4-s4-tma-flat",
    "128x128x128-w8-s3-tma-flat",
    "64x256x64-w4-s4-flat",
    "64x256x64-w4-s4-tma-flat",
    "64x256x64-w8-s4-tma-flat",
    "64x128x64-w4-s4-p2-flat",
    "64x128x64-w4-s4-p2-tma-flat",
    "64x128x64-w4-s5-tma-flat",
]
DW_CONFIGS = [
    "64x128x128-w8-s3",  # the built-in rule before this table (pointer kernel)
    "32x128x128-w4-s4-p2-tma",
    "64x128x128-w8-s3-p2-tma",
    # larger output tiles (fewer re-reads of x and dy per expert), one or two programs per SM
    "32x128x128-w4-s4-tma",
    "32x128x128-w4-s3-p3-tma",
    "64x128x128-w8-s3-tma",
    "64x128x128-w4-s3-p2-tma",
    "32x128x256-w8-s4-tma",
    "32x256x128-w8-s4-tma",
    "64x128x256-w8-s3-tma",
    "64x256x128-w8-s3-tma",
    "128x128x128-w8-s3-tma",
    # one flattened loop per program
    "64x128x128-w8-s3-flat",
    "64x128x128-w8-s4-flat",
    "64x128x128-w4-s3-p2-flat",
    "32x128x128-w4-s4-flat",
    "32x128x128-w4-s5-flat",
    "32x128x128-w4-s4-p2-flat",
    "16x128x128-w4-s6-flat",
    "16x128x128-w4-s6-p2-flat",
    "64x128x256-w8-s3-flat",
    "32x128x256-w8-s4-flat",
    "64x256x128-w8-s3-flat",
    "32x256x128-w8-s4-flat",
    "128x128x128-w8-s2-flat",
    "64x128x64-w4-s4-p2-flat",
    "64x128x64-w4-s4-p3-flat",
    # the output gradient resident in registers across the K tiles (-rCHUNKS: experts of up to
    # CHUNKS row chunks; more rows stream dy chunk by chunk)
    "64x128x128-w8-s3-tma-r3",
    "64x128x128-w8-s4-tma-r2",
    "64x128x64-w4-s3-p2-tma-r2",
    "64x128x64-w8-s3-p2-tma-r2",
    "32x128x64-w8-s3-p2-tma-r4",
    "32x128x128-w8-s4-tma-r2",
    "32x128x128-w8-s4-tma-r1",
    "16x128x128-w8-s4-tma-r1",
    "64x128x64-w4-s2-p2-tma-r3",
    # x resident, dy streamed (-rxCHUNKS): for a dw with few K tiles and many N tiles
    "64x128x128-w8-s3-tma-rx3",
    "64x128x128-w8-s4-tma-rx2",
    "64x128x64-w4-s3-p2-tma-rx2",
    "64x128x64-w4-s2-p2-tma-rx3",
    # 32-row chunks, up to 6: the shifted last chunk re-reads at most 31 rows (64-row chunks: 63)
    "32x128x128-w8-s3-tma-r6",
    "32x128x128-w8-s3-tma-r5",
    "32x128x128-w8-s3-tma-rx6",
    "32x128x64-w4-s2-p2-tma-r6",
    # dy resident with the epilogue overlapped with the next tile's MMA (Gluon, Hopper:
    # -ovCHUNKS, stages <= chunks)
    "32x128x128-w8-s2-tma-ov5",
    "32x128x128-w8-s3-tma-ov5",
    "32x128x128-w8-s2-tma-ov6",
    "64x128x128-w8-s2-tma-ov3",
    "32x128x64-w8-s4-tma-ov5",
    "32x128x128-w8-s2-tma-ov2",
    "16x128x128-w8-s2-tma-ov2",
    "16x128x128-w8-s2-tma-ov4",
]
# Where an H100 lost to the public design's best fixed tile with the H200's table (30b and 235b
# gate_up at 2048 tokens, 2026-11-25): 128x256x64 tiles in every form the H100's 227 KiB of
# shared memory holds (4 stages: 192 KiB), two programs per SM of 128x128 tiles, and 256-row
# tiles for the 8192-token points (experts of ~512 rows).
# An expert's row tiles first (-mf: neighbouring programs share a weight tile), the large tiles:
# where the public design's order beat ours at the same tile (235b gate_up, 2048 tokens, H100
# and H200). In both sets.
ROWS_FIRST_CONFIGS = [
    "128x256x64-w8-s4-mf",
    "128x256x64-w8-s3-tma-mf",
    "128x256x64-w8-s3-tma-flat-mf",
    "128x256x64-w8-s4-tma-flat-mf",
    "128x128x128-w8-s3-tma-flat-mf",
]
# An expert's tail rows in its last full row tile (-tN: one pass of that weight tile through L2,
# not two): about half the experts of a 2048-token batch end with at most 32 rows past a tile.
# The 128-wide ones led an H100's 2048-token forward where the weight is widest (235B gate_up
# and down, 480B gate_up; 2026-12-06), 1-2% ahead of the flattened kernels' best.
TAIL_CONFIGS = [
    "128x256x64-w8-s3-tma-t32",
    "128x256x64-w8-s4-tma-t32",
    "128x128x128-w8-s3-tma-t16",
    "128x128x128-w8-s3-tma-t32",
    "128x128x64-w4-s3-p2-tma-t32",
    # the flattened loop with the tail: the 128x256x64 tile, the fastest of six shapes that hold
    # the tail's ring at every 2048-token point of an H100 (2026-12-06), ahead at dx 30B down
    "128x256x64-w8-s3-tma-flat-t32",
    "128x256x64-w8-s3-tma-flat-mf-t32",
]
FWD_CONFIGS += [
    *TAIL_CONFIGS,
    "128x256x64-w8-s4",
    "128x256x64-w8-s4-tma",
    "128x128x64-w4-s3-p2-tma-flat",
    "256x128x64-w8-s3-tma-flat",
    *ROWS_FIRST_CONFIGS,
]
# dw at 8192 tokens is compute-bound (experts of ~512 rows): larger dw tiles, deeper steps.
DW_CONFIGS += ["128x128x128-w8-s3-tma", "64x256x64-w8-s4-tma", "128x128x64-w8-s4-tma"]
# The warp-specialized kernel (Gluon, Hopper, -ws): a loader warp ahead across tiles, one
# warpgroup multiplying; two programs per SM of 96 KiB, or one with a deeper ring. An H100
# (2026-12-06) measured the first at 8192 tokens and the 32-row s8 at 2048 fastest.
WS_CONFIGS = [
    "32x128x128-w4-s4-p2-tma-ws",
    "32x128x128-w4-s8-tma-ws",
    "32x128x128-w4-s6-tma-ws",
    "64x128x128-w4-s4-tma-ws",
    # the ring as deep as shared memory allows (224 KiB with two staging tiles): the loader further
    # ahead of the multiplier at the few-row points, where dw's loads slow its write stream
    "64x128x128-w4-s5-tma-ws",
    "32x128x128-w4-s10-tma-ws",
]
DW_CONFIGS += WS_CONFIGS
CONFIGS = {"forward": FWD_CONFIGS, "dx": FWD_CONFIGS, "dw": DW_CONFIGS}
#: The per-card set (``--set card``, tools/gpu/perf_card.sh): about 3 minutes on an H100 with the
#: incumbents, compile included. Forward/dx: the public design's tile in each of our kernels,
#: the H100 additions, the 128x128 and 64-row tiles of the few-row points, the large tiles in
#: the row-tiles-first order; dw: every config a
#: packaged table picked at some point, the compute-bound candidates, the overlapped kernel's
#: paired and one-tile items, the warp-specialized kernel.
CARD_FWD_CONFIGS = [
    "128x256x64-w8-s3",
    "128x256x64-w8-s4",
    "128x256x64-w8-s3-tma",
    "128x256x64-w8-s4-tma",
    "128x256x64-w8-s3-flat",
    "128x256x64-w8-s3-tma-flat",
    "128x256x64-w8-s4-tma-flat",
    "128x128x64-w8-s4-tma-flat",
    "128x128x64-w4-s4-tma-flat",
    "128x128x64-w4-s3-p2-tma-flat",
    "128x128x128-w8-s3-tma-flat",
    "256x128x64-w8-s3-tma-flat",
    "64x256x64-w4-s4-tma-flat",
    "64x256x64-w8-s4-tma-flat",
    "64x128x64-w4-s4-p2-tma-flat",
    "64x128x64-w4-s5-tma-flat",
    # more weight bytes in flight at the few-row points, where the forward and dx stream W
    "64x128x64-w4-s6-tma-flat",
    "64x128x128-w4-s4-tma-flat",
    "64x256x64-w4-s5-tma-flat",
    *ROWS_FIRST_CONFIGS,
    *TAIL_CONFIGS,
]
CARD_DW_CONFIGS = [
    *WS_CONFIGS,
    "32x128x128-w4-s5-p2-tma",
    # one stage more (two programs of 96 KiB per SM): the H100's best at the 8192-token points
    "32x128x128-w4-s6-p2-tma",
    "32x128x128-w4-s4-p2-tma",
    "64x128x128-w8-s3-tma",
    "64x256x128-w8-s3-tma",
    "128x128x128-w8-s3-tma",
    "64x256x64-w8-s4-tma",
    "128x128x64-w8-s4-tma",
    "64x128x128-w8-s3-tma-r3",
    "32x128x128-w8-s3-tma-r6",
    "32x256x128-w8-s2-tma-ov5",
    "32x256x128-w8-s3-tma-ov4",
    "16x256x128-w8-s2-tma-ov8",
    "64x256x128-w8-s2-tma-ov2",
    "32x128x128-w8-s2-tma-ov5",
    "16x128x128-w8-s2-tma-ov4",
    "64x128x128-w8-s2-tma-ov3",
]
CONFIG_SETS = {
    "full": CONFIGS,
    "card": {"forward": CARD_FWD_CONFIGS, "dx": CARD_FWD_CONFIGS, "dw": CARD_DW_CONFIGS},
}
TINY_CONFIGS = {
    "forward": ["32x32x32-w4-s1", "32x32x32-w4-s1-tma", "32x32x32-w4-s1-flat", "32x32x32-w4-s1-tma-flat", "32x32x32-w4-s1-tma-t16"],
    "dx": ["32x32x32-w4-s1", "32x32x32-w4-s1-tma", "32x32x32-w4-s1-flat", "32x32x32-w4-s1-tma-flat", "32x32x32-w4-s1-tma-t16"],
    "dw": [
        "32x32x32-w4-s1",
        "16x32x32-w4-s1-tma",
        "16x32x32-w4-s1-flat",
        "16x32x32-w4-s1-tma-r2",
        "16x32x32-w4-s1-tma-ov2",
        "16x64x32-w4-s1-tma-ws",
    ],
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_points(text: str, tiny: bool) -> list[tuple[str, int, int, int, int]]:
    """``"30b-gate_up:2048,30b-down:512"`` -> [(label, E, N, K, tokens)]."""
    if tiny:
        return [("tiny", 4, 32, 64, 24)]
    points = []
    for item in text.split(","):
        label, _, tokens = item.strip().partition(":")
        if label not in PRESET_GEMMS or not tokens.isdigit():
            raise SystemExit(f"--shapes: {item!r} is not GEMM:TOKENS with GEMM one of {sorted(PRESET_GEMMS)}")
        e, n, k = PRESET_GEMMS[label]
        points.append((label, e, n, k, int(tokens)))
    return points


class Point:
    """Operands of one (GEMM, tokens) point, and torch._grouped_mm's results as references."""

    def __init__(
        self, label: str, e: int, n: int, k: int, tokens: int, device: Any, dtype: Any, top_k: int
    ) -> None:
        import torch

        from qmoe_doctor.kernels.routing import sort_by_expert

        self.label, self.e, self.n, self.k, self.tokens = label, e, n, k, tokens
        gen = torch.Generator(device=device).manual_seed(tokens * 7 + n)
        ids = torch.rand(tokens, e, generator=gen, device=device).topk(top_k, dim=-1).indices
        self.m_sizes = sort_by_expert(ids, e).m_sizes
        self.m = tokens * top_k
        self.offs = torch.cumsum(self.m_sizes, 0).to(torch.int32)
        self.x = (torch.randn(self.m, k, generator=gen, device=device)).to(dtype)
        self.dy = torch.randn(self.m, n, generator=gen, device=device).to(dtype)
        # scaled in place: the float32 draw and its cast are the only stacks alive at once (the
        # 480B gate_up stack, 160 x 5120 x 6144, is 18.75 GiB in float32)
        self.w = torch.randn(e, n, k, generator=gen, device=device).div_(k**0.5).to(dtype)
        self.flops = 2.0 * self.m * n * k

    def theirs(self, op: str) -> Callable[[], Any]:
        import torch

        if not hasattr(torch, "_grouped_mm") or self.x.device.type != "cuda":
            from qmoe_doctor.kernels.backward import moe_grouped_gemm_dw_torch, moe_grouped_gemm_dx_torch
            from qmoe_doctor.kernels.grouped_gemm import moe_grouped_gemm_torch

            fallback = {
                "forward": lambda: moe_grouped_gemm_torch(self.x, self.w, self.m_sizes),
                "dx": lambda: moe_grouped_gemm_dx_torch(self.dy, self.w, self.m_sizes),
                "dw": lambda: moe_grouped_gemm_dw_torch(self.dy, self.x, self.m_sizes),
            }
            return fallback[op]
        gm = torch._grouped_mm
        return {
            "forward": lambda: gm(self.x, self.w.transpose(1, 2), offs=self.offs),
            "dx": lambda: gm(self.dy, self.w, offs=self.offs),
            "dw": lambda: gm(self.dy.T, self.x, offs=self.offs),
        }[op]

    def ours(self, op: str, config: Any) -> Callable[[], Any]:
        from qmoe_doctor.kernels.backward import moe_grouped_gemm_dw, moe_grouped_gemm_dx
        from qmoe_doctor.kernels.grouped_gemm import moe_grouped_gemm

        return {
            "forward": lambda: moe_grouped_gemm(self.x, self.w, self.m_sizes, config=config),
            "dx": lambda: moe_grouped_gemm_dx(self.dy, self.w, self.m_sizes, config=config),
            "dw": lambda: moe_grouped_gemm_dw(self.dy, self.x, self.m_sizes, config=config),
        }[op]

    def path(self, op: str, config: Any) -> str:
        """The kernel ``ours(op, config)`` runs: its launch plan's own choice."""
        from qmoe_doctor.kernels.backward import dw_kernel_path
        from qmoe_doctor.kernels.grouped_gemm import kernel_path

        if op == "forward":
            return kernel_path(self.x, self.w, self.m_sizes, config=config)
        if op == "dx":
            return kernel_path(self.dy, self.w, self.m_sizes, transposed=True, config=config)
        return dw_kernel_path(self.dy, self.x, self.m_sizes, config=config)


#: rel_diff's float32 temporaries hold at most this many elements each (one leading-dim slice
#: where a slice is larger). Incident: the whole-tensor form upcast both operands of the 480B
#: gate_up dw, (160, 5120, 6144), and formed their difference: three 18.75 GiB float32 copies
#: beside the bf16 stacks, out of memory on an 80 GB H100 (2026-11-25).
REL_DIFF_CHUNK = 1 << 26


def rel_diff(a: Any, b: Any, *, chunk: int = REL_DIFF_CHUNK) -> float:
    """``‖a − b‖ / ‖b‖`` in float32, a slice of the leading dimension at a time (the sums of
    squares in float64): never a whole float32 copy of either operand or of their difference."""
    import torch

    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"rel_diff: shapes {tuple(a.shape)} and {tuple(b.shape)} differ")
    if a.dim() == 0:
        a, b = a.reshape(1), b.reshape(1)
    if a.numel() == 0:
        return 0.0
    rows = max(1, chunk // (a.numel() // a.shape[0]))
    diff_sq = torch.zeros((), dtype=torch.float64, device=b.device)
    ref_sq = torch.zeros((), dtype=torch.float64, device=b.device)
    for start in range(0, a.shape[0], rows):
        b_part = b[start : start + rows].float()
        ref_sq += torch.linalg.vector_norm(b_part).double() ** 2
        diff_sq += torch.linalg.vector_norm(a[start : start + rows].float() - b_part).double() ** 2
        del b_part
    return float(diff_sq.sqrt() / ref_sq.sqrt().clamp_min(1e-30))


def incumbent(op: str, label: str, e: int, n: int, k: int, tokens: int, top_k: int, device: Any, dtype: Any) -> str:
    """The config this device uses today at this point (its current table, ``kernels/tuning.py``);
    "" on the CPU (the interpreter's config is not a candidate)."""
    if device.type != "cuda":
        return ""
    from qmoe_doctor.kernels.backward import pick_dw_config
    from qmoe_doctor.kernels.grouped_gemm import pick_config

    m = tokens * top_k
    if op == "dw":
        return pick_dw_config(n, k, device, dtype, avg_rows=m / e).name
    if op == "dx":  # the forward kernel on w.T: N and K trade places
        return pick_config(m, k, n, e, device, dtype, op="dx").name
    return pick_config(m, n, k, e, device, dtype, op="forward").name


def candidates(args: argparse.Namespace, op: str, point: tuple[str, int, int, int, int], device: Any, dtype: Any) -> list[str]:
    """This point's candidates for ``op``: the set's (or ``--configs``), then the incumbent, with
    ``--configs`` too: a pinned list without it would write its own best even where today's pick
    is faster, and the table must never be slower where it measured."""
    names = configs_for(args, op)
    if args.tiny:
        return names
    label, e, n, k, tokens = point
    today = incumbent(op, label, e, n, k, tokens, args.top_k, device, dtype)
    return names + ([today] if today and today not in names else [])


def warm(args: argparse.Namespace, job: int, jobs: int) -> int:
    """Compile this job's share of (op, config) pairs at the first point (nothing timed); the
    incumbents of every point are compiled too (the integer arguments of the preset points all
    specialise alike, so one compile per config serves them)."""
    import torch

    from qmoe_doctor.kernels.tuning import config_from_name

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if not args.tiny else torch.float16
    points = parse_points(args.shapes, args.tiny)
    label, e, n, k, tokens = points[0]
    pt = Point(label, e, n, k, tokens, device, dtype, args.top_k)
    pairs: list[tuple[str, str]] = []
    for op in args.ops:
        for point in points:
            pairs += [(op, c) for c in candidates(args, op, point, device, dtype) if (op, c) not in pairs]
    for i, (op, name) in enumerate(pairs):
        if i % jobs != job:
            continue
        t0 = time.perf_counter()
        try:
            pt.ours(op, config_from_name(name))()
            if device.type == "cuda":
                torch.cuda.synchronize()
            log(f"  warm {op:<8} {name:<28} {time.perf_counter() - t0:5.1f} s")
        except Exception as exc:  # reported again, with its reason, by the timing pass
            log(f"  warm {op:<8} {name:<28} failed: {type(exc).__name__}: {str(exc)[:120]}")
    return 0


def configs_for(args: argparse.Namespace, op: str) -> list[str]:
    if args.configs:
        return [c.strip() for c in args.configs.split(",") if c.strip()]
    return (TINY_CONFIGS if args.tiny else CONFIG_SETS[args.set])[op]


def device_facts(device: Any) -> Any:
    """The device's facts as the config tables are keyed (the CPU smoke run: a "cpu" device no
    GPU matches)."""
    from qmoe_doctor.core.launch_configs import DeviceFacts

    if device.type != "cuda":
        return DeviceFacts(name="cpu (Triton interpreter)", capability=(0, 0), sms=os.cpu_count() or 1)
    from qmoe_doctor.kernels.tuning import device_facts as facts_of

    return facts_of(device.index or 0)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import triton

    from qmoe_doctor.kernels.tuning import config_from_name, describe_device_table

    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.float16 if args.tiny else torch.bfloat16
    timed = device.type == "cuda"
    facts = device_facts(device)
    table_before = describe_device_table(0) if timed else ""
    t0 = getattr(args, "started", None) or time.perf_counter()
    late: list[str] = []
    rows: list[dict[str, Any]] = []
    for point in parse_points(args.shapes, args.tiny):
        label, e, n, k, tokens = point
        pt = Point(label, e, n, k, tokens, device, dtype, args.top_k)
        log(f"{label} T={tokens} M={pt.m} E={e} N={n} K={k}")
        for op in args.ops:
            ref_fn = pt.theirs(op)
            ref = ref_fn()
            base = {"point": label, "tokens": tokens, "m": pt.m, "e": e, "n": n, "k": k, "op": op}
            ms = bench_ms(ref_fn, args) if timed else None
            rows.append(
                {
                    **base,
                    "impl": "torch._grouped_mm",
                    "config": "",
                    "path": "",
                    "ms": ms,
                    "tflops": pt.flops / ms / 1e9 if ms else None,
                    "rel_diff": 0.0,
                    "note": "",
                }
            )
            names = candidates(args, op, point, device, dtype)
            today = incumbent(op, label, e, n, k, tokens, args.top_k, device, dtype)
            if args.deadline_s and time.perf_counter() - t0 > args.deadline_s and today:
                names = [today]  # past the deadline: the table stays complete, with today's pick
                late.append(f"{op} {label}:{tokens}")
            fns: dict[str, Callable[[], Any]] = {}
            for name in names:
                cfg = config_from_name(name)
                row = {
                    **base,
                    "impl": "qmoe",
                    "config": name,
                    "incumbent": name == today,
                    "path": "",
                    "ms": None,
                    "tflops": None,
                    "rel_diff": None,
                    "note": "",
                }
                try:
                    row["path"] = pt.path(op, cfg)
                    fn = pt.ours(op, cfg)
                    row["rel_diff"] = rel_diff(fn(), ref)
                    if row["rel_diff"] > args.max_rel_diff:
                        row["note"] = f"result differs from torch._grouped_mm by {row['rel_diff']:.3g}"
                    elif timed:
                        row["ms"] = bench_ms(fn, args)
                        row["tflops"] = pt.flops / row["ms"] / 1e9
                        fns[name] = fn
                except Exception as exc:
                    row["note"] = f"{type(exc).__name__}: {str(exc)[:160]}".replace("\n", " ")
                rows.append(row)
                shown = f"{row['tflops']:7.1f} TFLOP/s" if row["tflops"] else row["note"][:60] or "ok"
                log(f"  {op:<8} {name:<28} {row['path']:<8} {shown}{'  (incumbent)' if row['incumbent'] else ''}")
            final_rounds([r for r in rows if r["impl"] == "qmoe" and _same(r, base)], fns, args)
            del ref
        del pt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if late:
        log(f"past --deadline-s {args.deadline_s}: only the incumbent at {', '.join(late)}")
    return {
        "format": 1,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": facts.name,
        "capability": list(facts.capability),
        "sms": facts.sms,
        "key": facts.key,
        "table_before": table_before,
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
        },
        "command": " ".join(["benchmarks/tune_kernels.py", *sys.argv[1:]]),
        "timed": timed,
        "incumbents_only": late,
        "rows": rows,
    }


def bench_ms(fn: Callable[[], Any], args: argparse.Namespace) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median"))


def interleaved_rounds(
    contenders: dict[str, Callable[[], Any]], rounds: int, time_one: Callable[[Callable[[], Any]], float | None]
) -> dict[str, list[float]]:
    """``rounds`` timings of each contender by ``time_one``, interleaved: round r starts at the
    r-th contender (a rotated order), so that a drift of the clocks weighs on all alike. A timing
    that fails, or gives none, raises (the callers keep their first pass)."""
    names = list(contenders)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            ms = time_one(contenders[name])
            if ms is None:
                raise RuntimeError(f"{name}: no timing")
            samples[name].append(ms)
    return samples


def _same(row: dict[str, Any], base: dict[str, Any]) -> bool:
    return all(row[k] == base[k] for k in ("point", "tokens", "op"))


def finalists(rows: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """The rows of one (point, tokens, op) timed again in the rounds: the ``count`` fastest of
    the first pass, and the incumbent wherever it ranked (the new table is then never slower
    than the old at a point measured)."""
    timed = sorted((r for r in rows if r["ms"] is not None), key=lambda r: r["ms"])
    picked = timed[:count]
    picked += [r for r in timed[count:] if r.get("incumbent")]
    return picked


def final_rounds(rows: list[dict[str, Any]], fns: dict[str, Callable[[], Any]], args: argparse.Namespace) -> None:
    """Time the finalists ``args.rounds`` more times each, interleaved in a rotated order; each
    finalist's row gets ``rounds`` (the timings) and ``final_ms`` (their median), which decide
    the point (``best_table``). Nothing to do with fewer than two finalists or no rounds. A
    timing that fails here leaves the first pass to decide, and the rows say why."""
    import statistics

    picked = finalists(rows, args.finalists)
    if args.rounds <= 0 or len(picked) < 2:
        return
    names = [r["config"] for r in picked]
    try:
        samples = interleaved_rounds({name: fns[name] for name in names}, args.rounds, lambda fn: bench_ms(fn, args))
    except Exception as exc:  # the first pass stands
        for r in picked:
            r["rounds_note"] = f"rounds not taken, the first pass decides: {type(exc).__name__}: {str(exc)[:120]}"
        return
    for r in picked:
        r["rounds"] = samples[r["config"]]
        r["final_ms"] = statistics.median(samples[r["config"]])
    shown = ", ".join(f"{name} {statistics.median(samples[name]) * 1e3:.1f} us" for name in names)
    log(f"  rounds ({args.rounds}, medians): {shown}")


def decisive_ms(rows: list[dict[str, Any]]) -> list[tuple[float, dict[str, Any]]]:
    """(ms, row) of the rows that decide a point: the finalists by their rounds' median where the
    point had rounds, else every timed row by its first pass (sweeps recorded before the rounds)."""
    final = [(float(r["final_ms"]), r) for r in rows if r.get("final_ms") is not None]
    return final or [(float(r["ms"]), r) for r in rows if r["ms"] is not None]


def best_table(result: dict[str, Any]) -> dict[str, Any]:
    """The fastest correct config per (point, tokens, op), with torch's figure beside it: among
    the finalists by the median of their rounds, where the point had rounds."""
    entries = []
    keys = sorted({(r["point"], r["tokens"], r["op"]) for r in result["rows"]}, key=str)
    for point, tokens, op in keys:
        rows = [r for r in result["rows"] if (r["point"], r["tokens"], r["op"]) == (point, tokens, op)]
        ours = [r for r in rows if r["impl"] == "qmoe" and r["ms"] is not None]
        theirs = next((r for r in rows if r["impl"] != "qmoe"), None)
        if not ours:
            continue
        ms, best = min(decisive_ms(ours), key=lambda pair: pair[0])
        first = rows[1] if len(rows) > 1 else None
        today = next((r for r in ours if r.get("incumbent")), None)
        flops = best["tflops"] * best["ms"]  # TFLOP/s x ms: the point's FLOPs / 1e9
        extra = {}
        if today:
            today_ms = today.get("final_ms") or today["ms"]
            extra = {"incumbent": today["config"], "incumbent_tflops": round(flops / today_ms, 1)}
        entries.append(
            {
                "op": op,
                "point": point,
                "tokens": tokens,
                "avg_rows": best["m"] / best["e"],
                "n": best["n"] if op != "dx" else best["k"],
                "k": best["k"] if op != "dx" else best["n"],
                "config": best["config"],
                "path": best["path"],
                "ms": round(ms, 5),
                "tflops": round(flops / ms, 1),
                "grouped_mm_tflops": round(theirs["tflops"], 1) if theirs and theirs["tflops"] else None,
                "previous_rule_tflops": round(first["tflops"], 1) if first and first["tflops"] else None,
                **extra,  # the config the device used before this table, measured beside the rest
            }
        )
    return {
        "format": 1,
        "about": "launch configs measured by benchmarks/tune_kernels.py on one device; kernels/tuning.py reads this",
        "tuned_on": {
            k: result[k] for k in ("date", "device", "capability", "sms", "versions", "command") if k in result
        },
        "entries": entries,
    }


def merge_tables(
    table: dict[str, Any], old: dict[str, Any], measured: set[tuple[str, str, int]], source: str
) -> dict[str, Any]:
    """``table`` (this run's entries) plus ``old``'s entries for every (op, point, tokens) this
    run did not measure (other ops, other shapes or token counts), with a note of where those
    came from and when they were measured."""
    kept = [
        e for e in old.get("entries", []) if (e.get("op"), e.get("point"), e.get("tokens")) not in measured
    ]
    return {
        **table,
        "entries": kept + table["entries"],
        "kept_from": {
            "table": source,
            "ops": sorted({e["op"] for e in kept}),
            "entries": len(kept),
            "tuned_on": old.get("tuned_on"),
        },
    }


def render(table: dict[str, Any]) -> str:
    lines = [
        f"{'op':<8} {'point':<14} {'tokens':>6}  {'best config':<26} {'path':<7} "
        f"{'TFLOP/s':>8} {'grouped_mm':>10} {'ratio':>6} {'before':>7}"
    ]
    for e in table["entries"]:
        ratio = e["tflops"] / e["grouped_mm_tflops"] if e["grouped_mm_tflops"] else float("nan")
        lines.append(
            f"{e['op']:<8} {e['point']:<14} {e['tokens']:>6}  {e['config']:<26} {e['path']:<7} "
            f"{e['tflops']:>8.1f} {e['grouped_mm_tflops'] or float('nan'):>10.1f} {ratio:>6.2f} "
            f"{e['previous_rule_tflops'] or float('nan'):>7.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--shapes",
        default=",".join(DEFAULT_POINTS),
        help="GEMM:TOKENS,... (GEMM: " + ", ".join(PRESET_GEMMS) + ")",
    )
    ap.add_argument("--ops", default="forward,dx,dw", help="any of forward,dx,dw")
    ap.add_argument(
        "--configs",
        default="",
        help="pin the candidate list (BMxBNxBK-wW-sS[-pP][-tma],...); each point's incumbent is measured with it",
    )
    ap.add_argument(
        "--set", choices=sorted(CONFIG_SETS), default="full",
        help="candidate set: full (every candidate) or card (the per-card set of tools/gpu/perf_card.sh)",
    )  # fmt: skip
    ap.add_argument(
        "--deadline-s", type=float, default=0.0,
        help="seconds from the start (compile included) after which only the incumbents are measured (0: none)",
    )  # fmt: skip
    ap.add_argument(
        "--install", action="store_true",
        help="also put the table in this user's cache folder, where the kernels find it for this device",
    )  # fmt: skip
    ap.add_argument(
        "--package", action="store_true",
        help="also write the table beside kernels/tuning.py (in a checkout: the file to commit)",
    )  # fmt: skip
    ap.add_argument("--top-k", type=int, default=TOP_K)
    ap.add_argument(
        "--jobs", type=int, default=min(8, os.cpu_count() or 1), help="compile processes (0: none)"
    )
    ap.add_argument("--warmup", type=int, default=5, help="do_bench warmup, ms")
    ap.add_argument("--rep", type=int, default=25, help="do_bench repetitions, ms")
    ap.add_argument(
        "--finalists", type=int, default=FINALISTS,
        help="the fastest configs of the first pass timed again in the rounds (the incumbent always is)",
    )  # fmt: skip
    ap.add_argument(
        "--rounds", type=int, default=ROUNDS,
        help="interleaved re-timings of the finalists; their medians pick the config (0: the first pass picks)",
    )  # fmt: skip
    ap.add_argument("--max-rel-diff", type=float, default=2e-2)
    ap.add_argument("--out", type=Path, default=Path("tune"))
    ap.add_argument(
        "--merge",
        type=Path,
        default=None,
        help="a config table whose entries for the (op, shape, tokens) NOT measured here are kept in OUT/configs.json",
    )
    ap.add_argument(
        "--tiny", action="store_true", help="CPU, TRITON_INTERPRET=1: checks that the script works"
    )
    ap.add_argument("--warm-job", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in args.ops if o not in CONFIGS]
    if bad:
        ap.error(f"--ops: unknown {bad}; choose from forward, dx, dw")
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"
        args.jobs = 0
        args.top_k = min(args.top_k, 2)
    if args.warm_job:
        job, jobs = (int(v) for v in args.warm_job.split("/"))
        return warm(args, job, jobs)
    t0 = args.started = time.perf_counter()
    if args.jobs > 0:
        log(f"compiling in {args.jobs} processes")
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    *(argv if argv is not None else sys.argv[1:]),
                    "--warm-job",
                    f"{j}/{args.jobs}",
                ]
            )
            for j in range(args.jobs)
        ]
        for p in procs:
            p.wait()
        log(f"compiled in {time.perf_counter() - t0:.0f} s")
    result = measure(args)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tune.json").write_text(json.dumps(result, indent=1))
    table = best_table(result)
    if args.merge is not None:
        measured = {(r["op"], r["point"], r["tokens"]) for r in result["rows"]}
        table = merge_tables(table, json.loads(args.merge.read_text()), measured, str(args.merge))
    text = json.dumps(table, indent=1) + "\n"
    (args.out / "configs.json").write_text(text)
    written = [write_table(args.out / table_name(result), text)]
    if args.install:
        written.append(write_table(user_table(result), text))
    if args.package:
        from qmoe_doctor.kernels.tuning import PACKAGE_DIR

        written.append(write_table(PACKAGE_DIR / table_name(result), text))
    if result["timed"]:
        print(render(table))
    else:
        failed = [r for r in result["rows"] if r["impl"] == "qmoe" and r["note"]]
        print(f"smoke run: {len(result['rows'])} rows, nothing timed; failures: {len(failed)}")
        for r in failed:
            print(f"  {r['op']} {r['config']}: {r['note']}")
        if failed:
            return 1
    log(f"wrote {args.out / 'tune.json'}, {args.out / 'configs.json'} ({result['wall_s']} s)")
    for path in written:
        log(f"table for {result['device']} ({result['key']}): {path}")
    return 0


def _facts(result: dict[str, Any]) -> Any:
    from qmoe_doctor.core.launch_configs import DeviceFacts

    cc = result.get("capability") or [0, 0]
    return DeviceFacts(name=result["device"], capability=(int(cc[0]), int(cc[1])), sms=int(result["sms"]))


def table_name(result: dict[str, Any]) -> str:
    """``configs-<device key>.json``: the name the kernels look for (packaged or installed)."""
    from qmoe_doctor.core.launch_configs import table_file_name

    return str(table_file_name(_facts(result)))


def user_table(result: dict[str, Any]) -> Path:
    from qmoe_doctor.core.launch_configs import user_table_path

    return Path(user_table_path(_facts(result)))


def write_table(path: Path, text: str) -> Path:
    """Write atomically: a kernel reading the table meanwhile sees the old one or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
