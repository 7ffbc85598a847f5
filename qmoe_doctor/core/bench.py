"""`qmoe-doctor bench`: what to measure and what came of it, as records, and the arithmetic on
them (stdlib only: the measuring child, ``probes/bench.py``, imports this; the parent's
``workflows.bench`` runs that child; ``cli.render.bench`` and ``reports.plot`` draw the report).

One run measures, side by side, our forward, dx and dw grouped GEMMs and the whole ``MoEBlock``
against ``torch._grouped_mm``, the per-expert loop (the stock Transformers block) and one dense
GEMM of the same FLOPs, over a range of token counts; with ``kernel`` (``--kernel REF``) also the
user's kernel in the same table (``probes/bench_user.py`` names its rows and says what it
measures); with ``placement`` on 2 GPUs it also
times the same forward per placement, so that scan's "slow" label (``knobs.SLOW_FACTOR``) has a
reference:

* ``local``: operands on GPU b, b current, our kernel;
* ``guarded``: operands on b, a current, our kernel (its device guard launches on b);
* ``remote``: operands on b, a current after one copy a -> b (peer access a -> b on), the
  ``specimen:unguarded`` kernel: it runs on a and reads b's memory over the link.

::

    BenchRequest --(JSON argument)--> python -m qmoe_doctor.probes.bench --> BenchReport (JSON file)

``report_from_jsonable`` also reads the single-shape JSON of the earlier
``benchmarks/bench_kernels.py`` (kind ``qmoe-bench-kernels``, the 2x H200 validation of 2026-11-22).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from qmoe_doctor.core import knobs
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.records import SCHEMA_VERSION, from_jsonable, json_document

KIND = "bench"
#: The JSON kind of the single-shape reports the earlier script wrote (the 2x H200 validation of 2026-11-22).
LEGACY_KIND = "qmoe-bench-kernels"

Op = Literal["forward", "dx", "dw", "block-forward", "block-forward-backward"]
OPS: tuple[Op, ...] = ("forward", "dx", "dw", "block-forward", "block-forward-backward")
#: How the terminal table names each op (short: the table is wide).
OP_LABEL: Mapping[str, str] = {
    "forward": "forward",
    "dx": "dx",
    "dw": "dw",
    "block-forward": "block fwd",
    "block-forward-backward": "block fwd+bwd",
}
GEMM_OPS: tuple[Op, ...] = ("forward", "dx", "dw")
BLOCK_OPS: tuple[Op, ...] = ("block-forward", "block-forward-backward")
#: Where the per-placement forward runs (``PlacementRow``): see the module doc.
BenchPlacement = Literal["local", "guarded", "remote"]
PLACEMENTS: tuple[BenchPlacement, ...] = ("local", "guarded", "remote")

# Implementation names, shared by the child (which writes them) and the renderers.
QMOE = "qmoe"
GROUPED_MM = "torch._grouped_mm"
LOOP = "per-expert loop"
DENSE = "dense (same FLOPs)"
BLOCK_QMOE = "qmoe MoEBlock"
BLOCK_GROUPED_MM = "MoEBlock + torch._grouped_mm"
BLOCK_LOOP = "per-expert loop twin"
#: The block forward replayed from a CUDA graph (GPU runs only): the same GPU work without the
#: host's launch path, which a step of a few small kernels is bound by below ~8192 tokens.
BLOCK_QMOE_GRAPH = "qmoe MoEBlock, CUDA graph"
BLOCK_GROUPED_MM_GRAPH = "MoEBlock + torch._grouped_mm, CUDA graph"
GEMM_IMPLS = (QMOE, GROUPED_MM, LOOP, DENSE)
BLOCK_IMPLS = (BLOCK_QMOE, BLOCK_GROUPED_MM, BLOCK_LOOP, DENSE)
GRAPH_IMPLS = (BLOCK_QMOE_GRAPH, BLOCK_GROUPED_MM_GRAPH)
#: Ours, in either table: the row the targets of issue 8 speak of.
OURS = frozenset({QMOE, BLOCK_QMOE})

FLOP_CONVENTION = (
    "2*M*N*K per GEMM (M = tokens * top_k rows); block forward 6*M*H*I, forward+backward 3x; "
    "dense (same FLOPs) is one (M, K) x (K, N) GEMM, for the block (M, H) x (H, 3I) and (M, H) x (H, 9I)"
)
TIMING_GEMM = "median of triton.testing.do_bench (CUDA events on the current stream)"
TIMING_PLACEMENT = (
    "ms: host wall time per call over back-to-back calls, every device synchronized before and after; "
    "ms_scan: scan's own measure, the median of calls each followed by a synchronize of every device"
)

#: Token counts per preset (rows M = tokens * top_k): from a decode-sized batch to a long
#: prefill; 2048 tokens of qwen3-30b-a3b is issue 8's M=16384 target shape.
GENERIC_TOKENS = (128, 512, 2048, 8192)  # a preset not listed below
DEFAULT_TOKENS: Mapping[str, tuple[int, ...]] = {
    "tiny": (16, 32),
    "qwen3-30b-a3b": (128, 512, 2048, 8192),
    "qwen3-235b-a22b": (128, 512, 2048, 8192),
    # 10 GB of bf16 weights per stack: the float32 references and the block's gradients need the rest
    "qwen3-coder-480b-a35b": (128, 512, 2048),
}
#: The interpreter runs every program of a kernel in Python: keep --tiny small (seconds).
TINY_MAX_TOKENS = 256
#: How long the whole measuring child may take. Escape hatch: --timeout (large presets with the
#: per-expert-loop block at many tokens take minutes; a cold Triton cache adds compile time).
DEFAULT_TIMEOUT_S = 1800.0
#: How the child ends when the --kernel REF does not resolve there (the parent checked its form;
#: the user's code failed to import or has another signature): this status, and one stderr line
#: that starts with the prefix and gives the reason. The parent makes it the kernel's usage
#: error (exit 2), not a broken benchmark (exit 4).
KERNEL_UNUSABLE_EXIT = int(ExitCode.USAGE)
KERNEL_UNUSABLE_PREFIX = "qmoe-doctor bench: the kernel could not be used: "
#: What `qmoe-doctor bench` writes under --out.
BENCH_FILES: Mapping[str, str] = {"json": "bench.json", "plot": "bench.png", "log": "bench.log"}


# --------------------------------------------------------------------------------------------
# Records (cross the process boundary as JSON)
# --------------------------------------------------------------------------------------------


Routing = Literal["random", "balanced"]
#: How the GEMM rows spread over the experts. "random": each token's top-k of uniform random
#: scores (an untrained router: ~M/E rows per expert, give or take sqrt(M/E), so many experts end
#: in a partial row tile); "balanced": every expert M/E rows (the rest one each to the first),
#: which separates the kernels' efficiency from routing imbalance. The block rows always route
#: through the block's own router.
ROUTINGS: tuple[str, ...] = ("random", "balanced")


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchRequest:
    """What the parent asks the child to measure."""

    schema_version: int = SCHEMA_VERSION
    preset: str
    tokens: tuple[int, ...]  # token counts; rows M = tokens * top_k
    dtype: Literal["bf16", "fp16", "fp32"] = "bf16"
    tiny: bool = False  # CPU + Triton interpreter: every row runs once, nothing is timed
    block: bool = True  # also the whole MoEBlock (forward, forward + backward)
    placement: bool = False  # also the per-placement forward on cuda:0 (a) and cuda:1 (b)
    num_experts: int | None = None  # overrides of the preset's GEMM shape (the script's --e/--n/--k)
    n: int | None = None
    k: int | None = None
    routing: Routing = "random"  # GEMM rows: the rows per expert (see ROUTINGS)
    kernel: str = ""  # --kernel REF: the user's kernel, canonical KernelRef text ("" = none)
    result_path: str = ""  # where the child writes the BenchReport JSON


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchShape:
    e: int  # experts
    n: int  # N of the gate_up GEMM (2 * intermediate)
    k: int  # K of the gate_up GEMM (hidden)
    top_k: int
    hidden: int  # of the block (H = k)
    intermediate: int  # of the block (I = n // 2)


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchRow:
    op: Op
    impl: str
    tokens: int
    m: int  # rows = tokens * top_k
    ms: float | None  # median; None when not timed (--tiny) or failed
    tflops: float | None
    frac_dense: float | None = None  # tflops / the dense (same FLOPs) row's, same op and tokens
    rel_err: float | None = None  # ||out - ref|| / ||ref|| against float32 (CPU: float64)
    config: str = ""  # our kernel's launch config, BMxBNxBK-wW-sS, when the kernel says
    note: str = ""  # why a row has no numbers (an exception, an alternative missing here)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacementRow:
    """Our forward (or the unguarded specimen) with operands on b, timed per placement."""

    placement: BenchPlacement
    kernel: str  # "builtin" or "specimen:unguarded"
    tokens: int
    m: int
    current: int  # CUDA ordinal current at the call (in the child: 0 = a, 1 = b)
    device: int  # CUDA ordinal the operands live on
    peer_enabled: bool
    ms: float | None
    ms_scan: float | None  # the measure scan's cells use
    tflops: float | None
    slowdown: float | None = None  # ms / the guarded row's ms, same tokens
    slowdown_scan: float | None = None  # ms_scan / the guarded row's ms_scan (what scan compares)
    rel_err: float | None = None  # against the local call
    note: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchReport:
    schema_version: int = SCHEMA_VERSION
    timed: bool
    interpreter: bool
    device: str  # the device the GEMM and block rows ran on, in words
    devices: tuple[str, ...] = ()  # names of the CUDA devices the child saw (cuda:0, cuda:1, ...)
    gpus: tuple[int, ...] = ()  # their NVML indices (filled in by the parent)
    torch: str
    triton: str
    python: str = ""
    preset: str
    dtype: str  # torch dtype name: "bfloat16", ...
    shape: BenchShape
    tokens: tuple[int, ...]
    routing: str = "random"  # of the GEMM rows (ROUTINGS)
    config_table: str = ""  # which launch-config table our kernels used (kernels/tuning.py describe_device_table)
    kernel: str = ""  # the --kernel REF measured beside ours ("" = none)
    flop_convention: str = FLOP_CONVENTION
    timing: str = TIMING_GEMM
    timing_placement: str = TIMING_PLACEMENT
    slow_factor: float = knobs.SLOW_FACTOR  # scan labels a correct cell this much slower "slow"
    created_unix: float = 0.0
    wall_s: float = 0.0  # the child's time, compile and set-up included
    rows: tuple[BenchRow, ...] = ()
    placement: tuple[PlacementRow, ...] = ()
    notes: tuple[str, ...] = ()
    command: str = ""  # how the run was started

    def row(self, op: str, impl: str, tokens: int) -> BenchRow | None:
        for r in self.rows:
            if r.op == op and r.impl == impl and r.tokens == tokens:
                return r
        return None

    def ops(self) -> list[Op]:
        present = {r.op for r in self.rows}
        return [op for op in OPS if op in present]

    def impls(self, op: str) -> list[str]:
        seen: list[str] = []
        for r in self.rows:
            if r.op == op and r.impl not in seen:
                seen.append(r.impl)
        return seen


# --------------------------------------------------------------------------------------------
# Choices and arithmetic (pure)
# --------------------------------------------------------------------------------------------


#: The largest token count bench takes: 2**20 tokens of the largest preset is already ~50 GiB of
#: activations; a 20-digit count is a typo, refused before any child starts.
MAX_TOKENS = 2**20


def parse_tokens(text: str) -> tuple[int, ...]:
    """``"128,512,2048"`` -> (128, 512, 2048), sorted, no repeats (a trailing comma is allowed).
    Raises ValueError for an empty list or item (``''``, ``'1,,2'``), anything but ASCII digits,
    0, or more than MAX_TOKENS."""
    parts = [part.strip() for part in text.split(",")]
    if len(parts) > 1 and not parts[-1]:
        parts.pop()  # a trailing comma, as in "64,"
    if not any(parts):
        raise ValueError(f"{text[:80]!r} names no token count; give e.g. 128,512,2048")
    values: list[int] = []
    for part in parts:
        if not part:
            raise ValueError(f"{text[:80]!r} has an empty item; give e.g. 128,512,2048")
        if not (part.isascii() and part.isdigit()) or len(part) > 7 or not 0 < int(part) <= MAX_TOKENS:
            raise ValueError(f"{part[:80]!r} is not a positive whole number of tokens (at most {MAX_TOKENS})")
        values.append(int(part))
    return tuple(sorted(set(values)))


def default_tokens(preset: str, *, tiny: bool = False) -> tuple[int, ...]:
    return DEFAULT_TOKENS["tiny"] if tiny else DEFAULT_TOKENS.get(preset, GENERIC_TOKENS)


def tflops(flops: float, ms: float | None) -> float | None:
    return flops / (ms * 1e-3) / 1e12 if ms else None


def with_fractions(rows: Sequence[BenchRow]) -> tuple[BenchRow, ...]:
    """Each row with ``frac_dense`` filled in from the dense row of the same op and tokens."""
    dense = {(r.op, r.tokens): r.tflops for r in rows if r.impl == DENSE and r.tflops}
    out = []
    for r in rows:
        ref = dense.get((r.op, r.tokens))
        frac = r.tflops / ref if (ref and r.tflops is not None) else None
        out.append(dataclasses.replace(r, frac_dense=frac))
    return tuple(out)


def with_slowdowns(rows: Sequence[PlacementRow]) -> tuple[PlacementRow, ...]:
    """Each placement row with its slowdown against the guarded row of the same tokens."""
    guarded = {r.tokens: r for r in rows if r.placement == "guarded"}
    out = []
    for r in rows:
        g = guarded.get(r.tokens)
        slow = r.ms / g.ms if (g is not None and g.ms and r.ms is not None) else None
        slow_scan = r.ms_scan / g.ms_scan if (g is not None and g.ms_scan and r.ms_scan is not None) else None
        out.append(dataclasses.replace(r, slowdown=slow, slowdown_scan=slow_scan))
    return tuple(out)


# --------------------------------------------------------------------------------------------
# Reading reports (this version and the run-3 script's)
# --------------------------------------------------------------------------------------------


def report_from_jsonable(doc: Mapping[str, Any]) -> BenchReport:
    """A BenchReport from a ``bench`` JSON document, or from the earlier script's single-shape
    ``qmoe-bench-kernels`` report (its rows get that shape's tokens and M)."""
    if doc.get("kind") == LEGACY_KIND:
        return _from_legacy(doc)
    return from_jsonable(BenchReport, dict(doc))


def _from_legacy(doc: Mapping[str, Any]) -> BenchReport:
    s = doc["shape"]
    tokens, m = int(s["tokens"]), int(s["m"])
    rows = [
        BenchRow(
            op=r["op"],
            impl=r["impl"],
            tokens=tokens,
            m=m,
            ms=r.get("ms"),
            tflops=r.get("tflops"),
            rel_err=r.get("rel_err"),
            note=r.get("note", ""),
        )
        for r in doc["rows"]
    ]
    return BenchReport(
        timed=bool(doc["timed"]),
        interpreter=bool(doc.get("interpreter", False)),
        device=str(doc["device"]),
        torch=str(doc["torch"]),
        triton=str(doc["triton"]),
        preset=str(doc["preset"]),
        dtype=str(doc["dtype"]),
        shape=BenchShape(
            e=int(s["e"]),
            n=int(s["n"]),
            k=int(s["k"]),
            top_k=int(s["top_k"]),
            hidden=int(s["k"]),
            intermediate=max(1, int(s["n"]) // 2),
        ),
        tokens=(tokens,),
        flop_convention=str(doc.get("flop_convention", FLOP_CONVENTION)),
        created_unix=float(doc.get("created_unix", 0.0)),
        rows=with_fractions(rows),
        notes=(f"read from a {LEGACY_KIND} report (benchmarks/bench_kernels.py, one shape)",),
    )


def report_document(report: BenchReport, files: Mapping[str, str | None] | None = None) -> dict[str, Any]:
    """The versioned JSON document (``kind`` "bench"), with the files written beside it."""
    doc = json_document(KIND, report)
    if files is not None:
        doc["files"] = dict(files)
    return doc


__all__ = [
    "BENCH_FILES",
    "BLOCK_GROUPED_MM",
    "BLOCK_GROUPED_MM_GRAPH",
    "BLOCK_IMPLS",
    "BLOCK_LOOP",
    "BLOCK_OPS",
    "BLOCK_QMOE",
    "BLOCK_QMOE_GRAPH",
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_TOKENS",
    "DENSE",
    "GEMM_IMPLS",
    "GEMM_OPS",
    "GRAPH_IMPLS",
    "GROUPED_MM",
    "KERNEL_UNUSABLE_EXIT",
    "KERNEL_UNUSABLE_PREFIX",
    "KIND",
    "LEGACY_KIND",
    "LOOP",
    "OPS",
    "OP_LABEL",
    "OURS",
    "PLACEMENTS",
    "QMOE",
    "ROUTINGS",
    "TINY_MAX_TOKENS",
    "BenchPlacement",
    "BenchReport",
    "BenchRequest",
    "BenchRow",
    "BenchShape",
    "Op",
    "PlacementRow",
    "Routing",
    "default_tokens",
    "parse_tokens",
    "report_document",
    "report_from_jsonable",
    "tflops",
    "with_fractions",
    "with_slowdowns",
]
