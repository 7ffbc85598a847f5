"""Our kernels side by side with their peers at every preset point, on this GPU, and the verdict
against the performance targets (docs/performance.md says which and why).

    python3 -m benchmarks.side_by_side --out sbs/        # on a GPU (tools/gpu/perf_card.sh runs it)
    python3 -m benchmarks.side_by_side --tiny            # CPU, interpreter: the control flow only
    python3 -m benchmarks.side_by_side --render-partial sbs/side_by_side.partial.json --out sbs/
                                                         # the targets of a run that stopped early

Measured in one process, bf16, random top-8 routing (``benchmarks/tune_kernels.py``'s operands),
median of ``triton.testing.do_bench`` (L2 flushed between calls):

* every preset point (``tune_kernels.DEFAULT_POINTS``: the presets' gate_up and down GEMMs at
  128-8192 tokens) x forward, dx, dw: ours (the device's config table, which the header names),
  ``torch._grouped_mm``, the public design at its best fixed tile (``benchmarks/public_peer.py``,
  the tile searched over a small set) and one dense cuBLAS GEMM of the same FLOPs; once the
  peer's best tile is chosen, ours, ``torch._grouped_mm`` and that tile are timed again
  ``--rounds`` times (5), interleaved (the timing that chose the best of several tiles is
  biased fast, and clocks drift between the passes): the medians are the row's figures, and
  the point is decided by the median over the rounds of each round's ratio, the faster of
  torch's and the peer's time over ours (timed back to back in that round, so that a drift or
  a slow window weighs on both sides of the ratio; ``ahead_ratio``);
* the memory roofline: the device's copy bandwidth (``dst.copy_(src)`` of 1 GiB, bytes read +
  written per second) times each GEMM's arithmetic intensity (2*M*N*K FLOP over the bytes it must
  move: the weight stack once, both activations once), capped by the fastest dense GEMM measured;
  a point is memory-bound where that cap is not reached. Beside it, not a target: the same
  roofline with the bytes a GEMM writes (dw: the whole stack) also bounded by the device's write
  rate (``dst.zero_()`` of 1 GiB), which on an H200 is ~79% of the copy rate: where the writes
  dominate, no kernel can reach 90% of the copy roofline, and this one says how near it is;
* the Qwen3-30B MoE block's eager forward at 2048 tokens on our kernels and on
  ``torch._grouped_mm`` (one set of parameters), the two timed in the same interleaved rounds
  and judged by the median of the rounds' paired ratios (``block_ratio``): host-bound at 2048
  tokens, the block moves with the host's speed;
* host time per call of forward, dx and dw at 128 tokens (``tools/profile/host_overhead.py``
  has the stage-by-stage view): ours on the lean launch path, ours through Triton's
  ``JITFunction.run`` (``QMOE_DOCTOR_LEAN_LAUNCH=0``), ``torch._grouped_mm``.

Prints the table per point, then the targets, last: every target on every run, PASS or FAIL on
what was measured, UNMEASURED where some of its points were not (failed, not reached), never
PASS then. Writes ``OUT/side_by_side.json`` (every number) and ``OUT/side_by_side.md`` (the
tables, for docs/performance.md). ``--tiny`` runs every row once on the CPU and compares it;
nothing is timed and every performance target is n/a.

One 80 GB card holds every preset point: ``peak_bytes`` counts what a point holds at once (at
most about 33 GiB: the 480B gate_up stack, drawn in float32, or compared in dw), the operands
are built once per point and shared by every implementation, errors are summed a slice at a
time (``tune_kernels.rel_diff``), each output is freed before the next is made, and the
allocator's cache is emptied between ops and points. A point or an implementation that fails
(out of memory, a compile or launch error) is recorded in its row, marked in the tables and in
the targets, and the run goes on. Before the compile processes start and after every point the
report so far is written to ``OUT/side_by_side.partial.json``; a run killed before its end
leaves it, and ``--render-partial FILE`` prints the tables and targets from it (every point not
reached marked failed): ``tools/gpu/perf_card.sh`` does, so its summary always ends with the
targets.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

if __package__ in (None, ""):  # run as a script: the repository root, for `benchmarks.`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.tune_kernels import (
    DEFAULT_POINTS,
    PRESET_GEMMS,
    REL_DIFF_CHUNK,
    TOP_K,
    Point,
    interleaved_rounds,
    log,
    parse_points,
    rel_diff,
)

OPS = ("forward", "dx", "dw")
#: The targets (issue "ours ahead on every Hopper card"), declared once.
ROOFLINE_SHARE = 0.90  # at the memory-bound points, of the copy-bandwidth roofline
HOST_US_TARGET = 25.0  # host time per forward / dx / dw call
BLOCK_TOKENS = 2048  # the eager MoE block forward compared at this many tokens
ROUNDS = 5  # interleaved re-timings per op and point (--rounds)
HOST_TOKENS = 128
HOST_CALLS = 200
COPY_BYTES = 1 << 30
GIB = 1 << 30
#: What a point may hold at most by ``peak_bytes`` (an 80 GB card has 79.2 GiB; the rest is
#: left to the CUDA context and the allocator's rounding).
PEAK_LIMIT = 70 * GIB
#: Device memory outside the tensors ``peak_bytes`` counts: the CUDA context and the loaded
#: cuBLAS / Triton modules (non-PyTorch memory, under 1 GiB on an H100), cuBLAS's and
#: torch._grouped_mm's workspaces, do_bench's 256 MiB L2-flush buffer, allocation rounding.
PEAK_HEADROOM = 3 * GIB
#: Where the run's report so far is written after every point (``--render-partial`` reads it).
PARTIAL_NAME = "side_by_side.partial.json"

Row = dict[str, Any]


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


class Timer:
    """``do_bench`` medians; ``rounds``: how many interleaved re-timings decide a point (below)."""

    def __init__(self, timed: bool, warmup: int, rep: int, rounds: int = 0) -> None:
        self.timed, self.warmup, self.rep, self.rounds = timed, warmup, rep, rounds

    def ms(self, fn: Callable[[], Any]) -> float | None:
        if not self.timed:
            return None
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=self.warmup, rep=self.rep, return_mode="median"))


def tflops(flops: float, ms: float | None) -> float | None:
    return flops / ms / 1e9 if ms else None


def copy_bandwidth(timer: Timer, device: Any) -> float | None:
    """Bytes read + written per second by ``dst.copy_(src)`` of COPY_BYTES (the device's
    sustained copy rate: the roofline's bandwidth)."""
    return _stream_rate(timer, device, lambda src: functools.partial(src.new_empty(src.shape).copy_, src), 2)


def write_bandwidth(timer: Timer, device: Any) -> float | None:
    """Bytes written per second by ``dst.zero_()`` of COPY_BYTES (nothing read)."""
    return _stream_rate(timer, device, lambda dst: dst.zero_, 1)


def read_bandwidth(timer: Timer, device: Any) -> float | None:
    """Bytes read per second by ``src.sum()`` of COPY_BYTES (nothing written but a scalar)."""
    import torch

    return _stream_rate(timer, device, lambda src: functools.partial(src.sum, dtype=torch.float32), 1)


def _stream_rate(timer: Timer, device: Any, op: Callable[[Any], Callable[[], Any]], passes: int) -> float | None:
    """``passes`` x COPY_BYTES per second of ``op(tensor)()`` over a bf16 tensor of COPY_BYTES."""
    if not timer.timed:
        return None
    import torch

    tensor = torch.empty(COPY_BYTES // 2, dtype=torch.bfloat16, device=device).normal_()
    ms = timer.ms(op(tensor))
    return passes * COPY_BYTES / (ms * 1e-3) if ms else None


def _matmul(a: Any, b: Any) -> Callable[[], Any]:
    return lambda: a @ b


def gemm_bytes(op: str, m: int, e: int, n: int, k: int, item: int) -> int:
    """Bytes a GEMM must move at least: the (E, N, K) stack once (read, or written by dw) and its
    two activations once."""
    return item * (e * n * k + m * k + m * n)


def written_bytes(op: str, m: int, e: int, n: int, k: int, item: int) -> int:
    """The bytes of ``gemm_bytes`` that are written: the output (forward y (M, N), dx (M, K),
    dw the (E, N, K) stack)."""
    return item * {"forward": m * n, "dx": m * k, "dw": e * n * k}[op]


# --------------------------------------------------------------------------------------------
# Memory: what one point holds at once
# --------------------------------------------------------------------------------------------


def peak_bytes(e: int, n: int, k: int, tokens: int, *, top_k: int = TOP_K, item: int = 2) -> int:
    """The most device memory one point of ``measure_point`` holds at once, in bytes, with
    PEAK_HEADROOM added. Phases (elements: S = E*N*K, X = M*K, Y = M*N, M = tokens * top_k):

    * setup, ``tune_kernels.Point.__init__``: x and dy drawn in float32 and cast; then the weight
      stack drawn in float32 (4S bytes), scaled in place and cast while the draw lives: 6S bytes
      beside x and dy (the 480B gate_up stack, 160 x 5120 x 6144: 28.1 GiB). The allocator's
      cache is emptied after it, so its blocks do not fragment what follows.
    * resident for the rest of the point: the bf16 stack, x, dy, the routing.
    * the dense GEMM: x is its A; its B (K, N) is drawn in float32 and cast; the (M, N) product.
    * each op compares, then times: torch._grouped_mm's result (the reference) and one other
      implementation's result at a time (ours, then each peer tile, each freed before the next),
      plus ``rel_diff``'s three float32 slices (operand, reference, difference) of at most
      REL_DIFF_CHUNK elements or one leading row. The reference is freed before the timing,
      which holds one result at a time. dw's result is a whole stack: the 480B gate_up dw
      compares at 2S bytes beside the resident 1S, as large as the setup.

    What it gives, headroom included (GiB at 512 / 2048 / 8192 tokens; bf16, top-8):
    480b-gate_up 32.0 / 32.2 / 33.3, 480b-down 17.9 / 18.1 / 18.9, 235b-gate_up 12.8 / 13.0 /
    13.6, 235b-down 8.3 / 8.4 / 8.9, 30b-gate_up 6.0 / 6.1 / 6.4, 30b-down 4.9 / 5.0 / 5.2.
    The comparison before slices held the stack, the reference and three float32 stacks at once:
    84 GiB at the 480B gate_up dw, the OOM of 2026-11-25 on an H100 80GB.
    tests/unit/test_kernels_side_by_side.py holds every preset point under PEAK_LIMIT.
    """
    m = tokens * top_k
    stack, x, dy = e * n * k, m * k, m * n
    routing = 2 * 4 * tokens * e + 16 * e  # the float32 draw and its top-k; m_sizes, offs
    setup = routing + item * (x + dy) + max(4 * (x + dy), 4 * stack + item * stack)
    resident = routing + item * (stack + x + dy)
    dense = resident + (4 + item) * k * n + item * m * n
    measure = dense
    for out, row in ((dy, n), (x, k), (stack, n * k)):  # forward (M, N), dx (M, K), dw (E, N, K)
        chunk = min(out, max(REL_DIFF_CHUNK, row))
        measure = max(measure, resident + 2 * item * out + 3 * 4 * chunk)
    return max(setup, measure) + PEAK_HEADROOM


def free_memory(device: Any) -> int | None:
    """Empty the allocator's cache (what earlier points and ops freed) and say how many bytes the
    device has free; None on the CPU, or where the device cannot answer (a sticky fault)."""
    if device.type != "cuda":
        return None
    import torch

    try:
        torch.cuda.empty_cache()
        return int(torch.cuda.mem_get_info(device)[0])
    except Exception:  # after a launch fault every call fails: each point records its own error
        return None


def describe(exc: BaseException) -> str:
    """The error on one line (a CUDA out-of-memory message runs to several), an out-of-memory
    error as ``OOM: ...`` (torch.OutOfMemoryError, named without importing torch)."""
    name = "OOM" if type(exc).__name__ == "OutOfMemoryError" else type(exc).__name__
    return " ".join(f"{name}: {exc}".split())


def failure(stage: str, exc: BaseException) -> str:
    """What a row's ``failed`` says: the stage that failed and its error, on one line."""
    return f"{stage}: {describe(exc)}"[:300]


# --------------------------------------------------------------------------------------------
# The GEMM points
# --------------------------------------------------------------------------------------------


def peer_fns(pt: Point, op: str, tiles: Any) -> list[tuple[str, Callable[[], Any]]]:
    from benchmarks.public_peer import peer_dw, peer_forward, tile_name

    if op == "forward":
        return [(tile_name(t), functools.partial(peer_forward, pt.x, pt.w, pt.m_sizes, t)) for t in tiles]
    if op == "dx":  # the forward kernel on the transposed view: no copy of the stack
        w_t = pt.w.transpose(1, 2)
        return [(tile_name(t), functools.partial(peer_forward, pt.dy, w_t, pt.m_sizes, t)) for t in tiles]
    return [(tile_name(t), functools.partial(peer_dw, pt.dy, pt.x, pt.m_sizes, t)) for t in tiles]


def base_row(label: str, e: int, n: int, k: int, tokens: int, top_k: int, op: str, item: int) -> Row:
    """A row with nothing measured yet (what a point that fails before its op keeps)."""
    m = tokens * top_k
    return {
        "point": label, "tokens": tokens, "m": m, "e": e, "n": n, "k": k, "op": op,
        "config": "", "ours_ms": None, "ours_rel_err": None, "ours": None, "grouped_mm": None,
        "peer": None, "peer_tile": "", "peer_tiles": [], "dense": None, "flops": 2.0 * m * n * k,
        "bytes": gemm_bytes(op, m, e, n, k, item), "written": written_bytes(op, m, e, n, k, item),
        "ok": False, "failed": "",
    }  # fmt: skip


def failed_rows(spec: tuple[str, int, int, int, int], top_k: int, item: int, why: str) -> list[Row]:
    label, e, n, k, tokens = spec
    return [{**base_row(label, e, n, k, tokens, top_k, op, item), "failed": why} for op in OPS]


def measure_point(
    pt: Point, timer: Timer, *, fwd_tiles: Any, dw_tiles: Any, max_rel: float, top_k: int
) -> list[Row]:
    """Forward, dx and dw at one point; an op's failure is recorded in its row, not raised."""
    import torch

    dense_ms = None
    try:  # one dense GEMM of the same FLOPs: x (M, K) @ (K, N)
        gen = torch.Generator(device=pt.x.device).manual_seed(3)
        dense_b = torch.randn(pt.k, pt.n, generator=gen, device=pt.x.device).to(pt.x.dtype)
        dense_ms = timer.ms(_matmul(pt.x, dense_b))
        del dense_b
    except Exception as exc:  # the dense figure is a yardstick: the row goes on without it
        log(f"  {pt.label}:{pt.tokens} dense GEMM: {failure('dense', exc)}")
    rows = []
    for op in OPS:
        tiles = dw_tiles if op == "dw" else fwd_tiles
        row = measure_op(pt, op, timer, tiles=tiles, max_rel=max_rel, top_k=top_k)
        row["dense"] = tflops(pt.flops, dense_ms)
        rows.append(row)
        ok = f"err {row['ours_rel_err']:.1e}" if row["ours_rel_err"] is not None else ""
        log(
            f"  {pt.label}:{pt.tokens:<5} {op:<8} ours {_f(row['ours'])} ({row['config']})  grouped_mm {_f(row['grouped_mm'])}"
            f"  peer {_f(row['peer'])} ({row['peer_tile']})  dense {_f(row['dense'])}  {ok}"
            + (f"  FAILED {row['failed']}" if row["failed"] else "")
            + (f"  ({row['rounds_note']})" if row.get("rounds_note") else "")
        )
        if row["failed"]:
            gc.collect()  # what the failure's traceback held
        free_memory(pt.x.device)
    return rows


def measure_op(pt: Point, op: str, timer: Timer, *, tiles: Any, max_rel: float, top_k: int) -> Row:
    """One op at one point: compare ours and each peer tile with torch._grouped_mm's result, one
    result alive beside the reference at a time, then free the reference and time each.
    A failure of the reference, of ours or of torch's timing goes in ``failed``; a peer tile
    that fails (one that does not fit this device) is recorded in its entry and never chosen."""
    from qmoe_doctor.kernels.backward import pick_dw_config
    from qmoe_doctor.kernels.grouped_gemm import pick_config

    row = base_row(pt.label, pt.e, pt.n, pt.k, pt.tokens, top_k, op, pt.x.element_size())
    failed: list[str] = []
    try:
        ref = pt.theirs(op)()
    except Exception as exc:  # no reference: nothing to compare with
        row["failed"] = failure("torch._grouped_mm (the reference)", exc)
        return row
    ours_fn = pt.ours(op, None)
    try:
        if op == "dw":
            row["config"] = pick_dw_config(pt.n, pt.k, pt.x.device, pt.x.dtype, avg_rows=pt.m / pt.e).name
        else:
            n, k = (pt.n, pt.k) if op == "forward" else (pt.k, pt.n)
            row["config"] = pick_config(pt.m, n, k, pt.e, pt.x.device, pt.x.dtype, op=op).name
        row["ours_rel_err"] = rel_diff(ours_fn(), ref)
    except Exception as exc:
        failed.append(failure("ours", exc))
    peers: list[dict[str, Any]] = []
    fns = peer_fns(pt, op, tiles)
    for name, fn in fns:
        try:
            peers.append({"tile": name, "ms": None, "rel_err": rel_diff(fn(), ref)})
        except Exception as exc:  # a tile that does not fit this device: recorded, not chosen
            peers.append({"tile": name, "ms": None, "rel_err": None, "note": describe(exc)[:160]})
            free_memory(pt.x.device)
    del ref
    free_memory(pt.x.device)
    if row["ours_rel_err"] is not None:
        try:
            row["ours_ms"] = timer.ms(ours_fn)
        except Exception as exc:
            failed.append(failure("ours (timing)", exc))
    gmm_ms = None
    try:
        gmm_ms = timer.ms(pt.theirs(op))
    except Exception as exc:
        failed.append(failure("torch._grouped_mm (timing)", exc))
    for (_, fn), peer in zip(fns, peers, strict=True):
        if peer["rel_err"] is not None and peer["rel_err"] <= max_rel:
            try:
                peer["ms"] = timer.ms(fn)
            except Exception as exc:
                peer["note"] = f"timing: {describe(exc)}"[:160]
    timed_peers = [p for p in peers if p["ms"]]
    best = min(timed_peers, key=lambda p: float(p["ms"])) if timed_peers else None
    best_ms = best["ms"] if best else None
    if timer.rounds and row["ours_ms"] and gmm_ms and best:
        best_fn = dict(fns)[best["tile"]]
        try:
            decided = decide(timer, {"ours": ours_fn, "grouped_mm": pt.theirs(op), "peer": best_fn})
        except Exception as exc:  # the first pass stands, and the row says why
            row["rounds_note"] = f"rounds not taken, the first pass decides: {describe(exc)}"[:200]
        else:
            row["rounds"] = decided
            row["ours_ms"], gmm_ms, best_ms = (statistics.median(decided[name]) for name in ("ours", "grouped_mm", "peer"))
            row["paired"] = paired_ratio(decided)
    row.update(
        ours=tflops(pt.flops, row["ours_ms"]), grouped_mm=tflops(pt.flops, gmm_ms),
        peer=tflops(pt.flops, best_ms), peer_tile=best["tile"] if best else "",
        peer_tiles=peers, ok=row["ours_rel_err"] is not None and row["ours_rel_err"] <= max_rel,
        failed="; ".join(failed),
    )  # fmt: skip
    return row


def paired_ratio(decided: dict[str, list[float]]) -> float:
    """The median over the rounds of each round's min(torch's, the peer's) time over ours: above
    1 where ours is the fastest. Each round times the three back to back, so a slow window of the
    device (clocks, a neighbour) lands on both sides of that round's ratio; the ratio of the
    separate medians can pair one contender's fast round with another's slow one (one H200,
    2026-11-28: identical kernels 0.94-1.00x apart within a round, the medians 0.96x)."""
    rounds = zip(decided["ours"], decided["grouped_mm"], decided["peer"], strict=True)
    return statistics.median(min(gmm, peer) / ours for ours, gmm, peer in rounds)


def ahead_ratio(r: Row) -> float | None:
    """Ours over the faster of torch's and the peer's: the rounds' paired ratio where the point
    had rounds, else the ratio of the first pass's figures; None where one is missing."""
    if r.get("paired"):
        return float(r["paired"])
    best = max((v for v in (r["grouped_mm"], r["peer"]) if v), default=None)
    return r["ours"] / best if r["ours"] and best else None


def decide(timer: Timer, contenders: dict[str, Callable[[], Any]]) -> dict[str, list[float]]:
    """``timer.rounds`` fresh timings of each contender, interleaved (each round in a rotated
    order), so that a drift of the clocks during the point weighs on all of them alike, and
    the peer's best tile is not judged by the timing that chose it (the fastest of several
    noisy timings is biased fast). A timing that fails raises (the caller keeps the first pass)."""
    return interleaved_rounds(contenders, timer.rounds, timer.ms)


def measure_points(
    points: list[tuple[str, int, int, int, int]],
    timer: Timer,
    device: Any,
    dtype: Any,
    top_k: int,
    *,
    fwd_tiles: Any,
    dw_tiles: Any,
    max_rel: float,
    on_point: Callable[[list[Row]], None] = lambda rows: None,
) -> list[Row]:
    """Every point in turn; a point that cannot start (too little free memory for its
    ``peak_bytes``, its operands failing to build) keeps failed rows and the run goes on.
    ``on_point`` gets the rows so far after every point."""
    import torch

    item = torch.empty((), dtype=dtype).element_size()
    rows: list[Row] = []
    for spec in points:
        label, e, n, k, tokens = spec
        need = peak_bytes(e, n, k, tokens, top_k=top_k, item=item)
        free = free_memory(device)
        if free is not None and need > free:
            why = f"not run: needs about {need / GIB:.1f} GiB (peak_bytes), {free / GIB:.1f} GiB free"
            rows += failed_rows(spec, top_k, item, why)
            log(f"  {label}:{tokens} {why}")
        else:
            try:
                pt = Point(label, e, n, k, tokens, device, dtype, top_k)
            except Exception as exc:
                rows += failed_rows(spec, top_k, item, failure("operands", exc))
                log(f"  {label}:{tokens} {rows[-1]['failed']}")
                gc.collect()
            else:
                free_memory(device)  # the float32 draws of the stack, cached: not kept for the ops
                rows += measure_point(
                    pt, timer, fwd_tiles=fwd_tiles, dw_tiles=dw_tiles, max_rel=max_rel, top_k=top_k
                )
                del pt
        free_memory(device)
        on_point(rows)
    return rows


def add_roofline(
    rows: list[Row], bandwidth: float | None, write_rate: float | None = None, read_rate: float | None = None
) -> float | None:
    """Each row's roofline (TFLOP/s) and whether it is memory-bound; returns the compute cap
    (the fastest dense GEMM measured). With ``write_rate`` also ``write_roofline`` and
    ``write_share``: the same with the time at least the written bytes at the write rate; with
    ``read_rate`` too, ``direction_roofline`` and ``direction_share``: the time also at least
    the bytes read at the read rate (each direction at the rate a stream of it alone reaches)."""
    dense = [r["dense"] for r in rows if r["dense"]]
    cap = max(dense) if dense else None
    for r in rows:
        r.update(direction_roofline=None, direction_share=None)
        if bandwidth is None or cap is None:
            r.update(roofline=None, memory_bound=None, share=None, write_roofline=None, write_share=None)
            continue
        seconds = r["bytes"] / bandwidth
        memory = r["flops"] / seconds / 1e12
        r["roofline"] = min(memory, cap)
        r["memory_bound"] = memory < cap
        r["share"] = r["ours"] / r["roofline"] if r["ours"] else None
        written = r.get("written")
        if write_rate and written is not None:
            r["write_roofline"] = min(r["flops"] / max(seconds, written / write_rate) / 1e12, cap)
            r["write_share"] = r["ours"] / r["write_roofline"] if r["ours"] else None
            if read_rate:
                slowest = max(seconds, written / write_rate, (r["bytes"] - written) / read_rate)
                r["direction_roofline"] = min(r["flops"] / slowest / 1e12, cap)
                r["direction_share"] = r["ours"] / r["direction_roofline"] if r["ours"] else None
        else:
            r.update(write_roofline=None, write_share=None)
    return cap


def write_bound_line(rows: list[Row], write_rate: float | None) -> str:
    """One line, not a target: how many memory-bound points reach ROOFLINE_SHARE of the roofline
    whose writes are bounded by the write rate, and which do not."""
    name = "roofline with writes at the write rate"
    return _bound_line(rows, "write_share", name, f"{_f(_tb(write_rate), '.2f')} TB/s, dst.zero_()", bool(write_rate))


def direction_bound_line(rows: list[Row], read_rate: float | None, write_rate: float | None) -> str:
    """The same for the roofline with reads at the read rate and writes at the write rate."""
    name = "roofline with reads at the read rate and writes at the write rate"
    detail = f"{_f(_tb(read_rate), '.2f')} TB/s, src.sum(); {_f(_tb(write_rate), '.2f')} TB/s"
    return _bound_line(rows, "direction_share", name, detail, bool(read_rate and write_rate))


def _bound_line(rows: list[Row], key: str, name: str, detail: str, measured: bool) -> str:
    every = [r for r in rows if r.get("memory_bound")]
    bound = [r for r in every if r.get(key)]
    if not measured or not bound:
        return f"{name}: not measured"
    short = [f"{_where(r)} {r[key]:.0%}" for r in bound if r[key] < ROOFLINE_SHARE]
    head = f"{name} ({detail}): {len(bound) - len(short)}/{len(every)} memory-bound points at >= {ROOFLINE_SHARE:.0%}"
    unmeasured = len(every) - len(bound)
    return head + (f"; short: {', '.join(short)}" if short else "") + (
        f"; {unmeasured} not measured" if unmeasured else ""
    )


# --------------------------------------------------------------------------------------------
# The MoE block and the host path
# --------------------------------------------------------------------------------------------


def measure_block(timer: Timer, device: Any, dtype: Any, tokens: int, preset: str) -> Row:
    """The eager block forward, ours against the same block calling ``torch._grouped_mm``."""
    import torch

    from qmoe_doctor.kernels.moe_block import MoEBlock

    def grouped_mm_kernel(x: Any, w: Any, m_sizes: Any) -> Any:
        return torch._grouped_mm(x, w.transpose(1, 2), offs=torch.cumsum(m_sizes, 0).to(torch.int32))

    torch.manual_seed(0)
    ours = MoEBlock(preset, device=device, dtype=dtype)
    if device.type == "cuda" and hasattr(torch, "_grouped_mm"):
        theirs = MoEBlock(preset, kernel=grouped_mm_kernel, device="meta", dtype=dtype)
    else:  # the CPU smoke run: the block on the twin kernel
        from qmoe_doctor.kernels.grouped_gemm import moe_grouped_gemm_torch

        theirs = MoEBlock(preset, kernel=moe_grouped_gemm_torch, device="meta", dtype=dtype)
    theirs.gate.weight, theirs.gate_up_proj, theirs.down_proj = ours.gate.weight, ours.gate_up_proj, ours.down_proj
    s = ours.shape
    hidden = torch.randn(tokens, s.hidden, device=device).to(dtype)
    flops = 6.0 * tokens * s.top_k * s.hidden * s.intermediate
    extra: Row = {}
    with torch.no_grad():
        a, b = ours(hidden)[0], theirs(hidden)[0]
        err = rel_diff(a, b)
        blocks = {"ours": lambda: ours(hidden), "grouped_mm": lambda: theirs(hidden)}
        if timer.timed and timer.rounds:
            # interleaved, as the points' rounds: at 2048 tokens the eager block is host-bound, so
            # a slow window of the host (one H200 host, 2026-11-29: both blocks 2.5x below the
            # runs before) must weigh on both sides of a round's ratio
            rounds = interleaved_rounds(blocks, timer.rounds, timer.ms)
            ours_ms, theirs_ms = (statistics.median(rounds[name]) for name in ("ours", "grouped_mm"))
            extra = {"rounds": rounds, "paired": block_ratio(rounds)}
        else:
            ours_ms, theirs_ms = timer.ms(blocks["ours"]), timer.ms(blocks["grouped_mm"])
    log(
        f"  block forward {tokens} tokens: ours {_f(tflops(flops, ours_ms))}  grouped_mm {_f(tflops(flops, theirs_ms))}"
        + (f"  (paired {extra['paired']:.3f})" if extra else "")
    )
    return {
        "preset": s.name, "tokens": tokens, "ours_ms": ours_ms, "grouped_mm_ms": theirs_ms,
        "ours": tflops(flops, ours_ms), "grouped_mm": tflops(flops, theirs_ms), "rel_diff": err, **extra,
    }  # fmt: skip


def block_ratio(rounds: dict[str, list[float]]) -> float:
    """The median over the rounds of each round's grouped_mm block time over ours: 1 or more
    where ours is at least as fast (the points' ``paired_ratio``, one contender against ours)."""
    return statistics.median(g / o for o, g in zip(rounds["ours"], rounds["grouped_mm"], strict=True))


def host_us(fn: Callable[[], Any], calls: int, sync: Callable[[], None], *, runs: int = 5) -> float:
    """Host microseconds per call: ``calls`` back to back, the GPU queue drained before (not
    inside); the median of ``runs`` such runs, after ``runs`` warm-up calls."""
    for _ in range(runs):
        fn()
    samples = [host_run(fn, calls, sync) for _ in range(runs)]
    sync()
    return statistics.median(samples)


def host_run(fn: Callable[[], Any], calls: int, sync: Callable[[], None]) -> float:
    """One run: microseconds per call of ``calls`` calls back to back, the GPU queue drained
    before them."""
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def measure_host(pt: Point, calls: int, *, runs: int = 5) -> list[Row]:
    """Host time per call of forward, dx, dw: ours lean and torch's, their runs interleaved
    (round r starts at the r-th of the six, as the GPU rounds do), each figure the median of
    its ``runs``; then ours through JITFunction.run, op by op (not a target). Interleaved, a
    slow window of the host (a neighbour, the allocator) weighs on every op alike: one op's
    runs back to back had the same call path at 17.3 us for the forward and 25.0 for dx in
    one process (one H200 host, 2026-11-29)."""
    import torch

    from qmoe_doctor.core.knobs import QMOE_LEAN_LAUNCH as LEAN_LAUNCH_ENV
    from qmoe_doctor.kernels import backward, grouped_gemm, launch

    def sync() -> None:
        if pt.x.device.type == "cuda":
            torch.cuda.synchronize()

    def fresh_plans() -> None:
        grouped_gemm.clear_plans()
        backward._DW_PLANS.clear()
        backward._BOUNDS_PLANS.clear()

    contenders: dict[str, Callable[[], Any]] = {}
    took_lean = {}
    for op in OPS:
        contenders[f"{op} ours"], contenders[f"{op} torch"] = pt.ours(op, None), pt.theirs(op)
        for _ in range(runs):  # warm-up (plans, compiled kernels, torch's caches)
            contenders[f"{op} ours"]()
            contenders[f"{op} torch"]()
        before = launch.counts.lean
        contenders[f"{op} ours"]()
        took_lean[op] = launch.counts.lean > before
    samples = interleaved_rounds(contenders, runs, lambda fn: host_run(fn, calls, sync))
    sync()
    rows = []
    for op in OPS:
        lean, theirs = (statistics.median(samples[f"{op} {who}"]) for who in ("ours", "torch"))
        saved = os.environ.get(LEAN_LAUNCH_ENV)
        os.environ[LEAN_LAUNCH_ENV] = "0"
        fresh_plans()
        try:
            standard = host_us(pt.ours(op, None), calls, sync, runs=runs)
        finally:
            if saved is None:
                os.environ.pop(LEAN_LAUNCH_ENV, None)
            else:
                os.environ[LEAN_LAUNCH_ENV] = saved
            fresh_plans()
        rows.append({"op": op, "tokens": pt.tokens, "ours": lean, "ours_standard": standard, "grouped_mm": theirs, "lean_used": took_lean[op]})
        log(f"  host {op:<8} ours {lean:6.1f} us (lean: {took_lean[op]})  through JITFunction.run {standard:6.1f}  torch {theirs:6.1f}")
    return rows


# --------------------------------------------------------------------------------------------
# Verdicts and tables
# --------------------------------------------------------------------------------------------


def _f(v: float | None, fmt: str = "7.1f") -> str:
    return format(v, fmt) if v is not None else "-".rjust(len(format(0.0, fmt)))


def _tb(rate: float | None) -> float | None:
    return rate / 1e12 if rate else None


def _where(r: Row) -> str:
    return f"{r['op']} {r['point']}:{r['tokens']}"


#: A target's verdict. PASS / FAIL: judged on what was measured; UNMEASURED: nothing measured
#: misses it but some of its points (or all) were not measured (failed, not reached, not asked
#: for), so it is not met either; n/a: nothing to judge (--tiny times nothing; a card where no
#: preset point is memory-bound).
Verdict = Literal["PASS", "FAIL", "UNMEASURED", "n/a"]
MEASURED = "every point measured"
CORRECT = "ours correct at every point"
AHEAD = "ours >= max(grouped_mm, public best tile), every point"
ROOFLINE = f"memory-bound points >= {ROOFLINE_SHARE:.0%} of the copy roofline"
HOST = f"host time per call <= {HOST_US_TARGET:.0f} us"


def block_target(tokens: int) -> str:
    return f"eager block forward at {tokens} tokens >= with grouped_mm"


def _few(items: Sequence[str], most: int = 6) -> str:
    more = f"; and {len(items) - most} more (the table says which)" if len(items) > most else ""
    return "; ".join(items[:most]) + more


def _judge(total: int, missed: Sequence[str], unmeasured: Sequence[str], behind: str) -> tuple[Verdict, str]:
    """A target over ``total`` rows: FAIL where a measurement misses it, else UNMEASURED where a
    row was not measured, else PASS."""
    detail = f"{total - len(missed) - len(unmeasured)}/{total}"
    detail += f"; {behind}: {_few(missed)}" if missed else ""
    detail += f"; not measured: {_few(unmeasured)}" if unmeasured else ""
    return ("FAIL" if missed else "UNMEASURED" if unmeasured or not total else "PASS"), detail


def _why_not(failures: Sequence[str], stage: str, default: str) -> str:
    return next((f"not measured ({f})" for f in failures if f.startswith(stage)), default)


def verdicts(
    rows: list[Row],
    block: Row | None,
    host: list[Row],
    failures: Sequence[str] = (),
    *,
    timed: bool = True,
    block_tokens: int = BLOCK_TOKENS,
) -> list[tuple[str, Verdict, str]]:
    """(target, verdict, detail) for every target, always all of them, in one order: a target
    whose points were not all measured says which and is never PASS. ``failures``: what failed
    outside the points (the copy bandwidth, the block, the host timing, a run stopped early);
    ``timed``: False for --tiny (correctness only, every performance target n/a)."""
    out: list[tuple[str, Verdict, str]] = []
    broken = [f"{_where(r)} ({r['failed'][:90]})" for r in rows if r.get("failed")] + list(failures)
    if broken:
        out.append((MEASURED, "FAIL", f"{len(broken)} failed: {_few(broken)}"))
    else:
        out.append((MEASURED, "PASS" if rows else "UNMEASURED", f"{len(rows)} rows"))
    compared = [r for r in rows if r.get("ours_rel_err") is not None]
    wrong = [_where(r) for r in compared if not r["ok"]]
    out.append((CORRECT, *_judge(len(rows), wrong, [_where(r) for r in rows if r.get("ours_rel_err") is None], "wrong")))
    block_name = block_target(block["tokens"] if block else block_tokens)
    if not timed:
        return out + [(t, "n/a", "not timed (--tiny)") for t in (AHEAD, ROOFLINE, block_name, HOST)]

    lost, unmeasured = [], []
    for r in rows:
        ratio = ahead_ratio(r)
        if ratio is not None and ratio < 1:
            lost.append(f"{_where(r)} {ratio:.3f}x")
        elif r.get("failed") or not (r["ours"] and r["grouped_mm"] and r["peer"]):
            unmeasured.append(_where(r))
    out.append((AHEAD, *_judge(len(rows), lost, unmeasured, "behind")))

    if not any(r.get("roofline") for r in rows):
        why = _why_not(failures, "copy bandwidth", "not measured (no dense GEMM timed: no compute cap)")
        out.append((ROOFLINE, "UNMEASURED", f"no roofline: {why}"))
    else:
        bound = [r for r in rows if r.get("memory_bound")]
        short = [f"{_where(r)} {r['share']:.0%}" for r in bound if r.get("share") and r["share"] < ROOFLINE_SHARE]
        unmeasured = [_where(r) for r in bound if r.get("failed") or not r.get("share")]
        if bound:
            out.append((ROOFLINE, *_judge(len(bound), short, unmeasured, "short")))
        else:
            out.append((ROOFLINE, "n/a", "no preset point is memory-bound on this card"))

    if block and block.get("ours") and block.get("grouped_mm"):
        # the rounds' paired ratio where the block had rounds (reports before them: the figures)
        paired = block.get("paired")
        ok = paired >= 1 if paired else block["ours"] >= block["grouped_mm"]
        detail = f"{block['ours']:.1f} vs {block['grouped_mm']:.1f} TFLOP/s" + (f", paired {paired:.3f}x" if paired else "")
        out.append((block_name, "PASS" if ok else "FAIL", detail))
    else:
        default = "not measured (--block-tokens 0)" if not block and not block_tokens else "not measured"
        out.append((block_name, "UNMEASURED", _why_not(failures, "block forward", default)))

    if host:
        over = [h for h in host if h["ours"] > HOST_US_TARGET]
        detail = ", ".join(f"{h['op']} {h['ours']:.1f} (torch {h['grouped_mm']:.1f})" for h in host)
        out.append((HOST, "PASS" if not over else "FAIL", detail))
    else:
        out.append((HOST, "UNMEASURED", _why_not(failures, "host time", "not measured (--host-calls 0)")))
    return out


def render(report: dict[str, Any]) -> str:
    rows, lines = report["rows"], []
    lines.append(f"{report['device']} | {report['versions']} | config table: {report['config_table']}")
    bw = report["copy_bandwidth"]
    lines.append(
        f"copy bandwidth {bw / 1e12:.2f} TB/s; write bandwidth {_f(_tb(report.get('write_bandwidth')), '.2f')} TB/s; "
        f"read bandwidth {_f(_tb(report.get('read_bandwidth')), '.2f')} TB/s; "
        f"compute cap (fastest dense) {report['compute_cap']:.0f} TFLOP/s"
        if bw and report["compute_cap"]
        else "not timed (--tiny)"
        if not report["timed"]
        else "no roofline: the copy bandwidth or the dense GEMMs failed"
    )
    lines.append("")
    lines.append(
        f"{'point':<13} {'tok':>5} {'op':<7} {'ours':>7} {'gmm':>7} {'peer':>7} {'dense':>6} {'x best':>6} "
        f"{'roof':>7} {'%roof':>5} {'%wroof':>6} {'%droof':>6}  config / peer tile"
    )
    for r in rows:
        ahead = ahead_ratio(r)
        ratio = f"{ahead:6.3f}" if ahead is not None else "     -"
        share = f"{r['share']:5.0%}" if r.get("share") else "    -"
        wshare = f"{r['write_share']:6.0%}" if r.get("write_share") else "     -"
        dshare = f"{r['direction_share']:6.0%}" if r.get("direction_share") else "     -"
        mark = "*" if r.get("memory_bound") else " "
        lines.append(
            f"{r['point']:<13} {r['tokens']:>5} {r['op']:<7} {_f(r['ours'])} {_f(r['grouped_mm'])} {_f(r['peer'])} "
            f"{_f(r['dense'], '6.0f')} {ratio} {_f(r.get('roofline'))}{mark}{share} {wshare} {dshare}  "
            f"{r['config'] or '-'} / {r['peer_tile'] or '-'}"
            + (f"  FAILED {r['failed'][:160]}" if r.get("failed") else "")
        )
    lines.append(
        "(TFLOP/s, medians of the rounds; x best: ours over the faster of grouped_mm and the peer, the median of "
        "the rounds' paired ratios; * memory-bound point; "
        "%wroof: of the roofline with writes at the write rate; %droof: reads at the read rate too)"
    )
    b = report.get("block")
    if b:
        lines.append(
            f"block forward {b['preset']} {b['tokens']} tokens, eager: ours {_f(b['ours'])}  "
            f"with grouped_mm {_f(b['grouped_mm'])} TFLOP/s"
            + (f", paired {b['paired']:.3f}x over {len(b['rounds']['ours'])} rounds" if b.get("paired") else "")
            + f" (rel diff {b['rel_diff']:.1e})"
        )
    for h in report.get("host", []):
        lines.append(
            f"host {h['op']:<8} ours {h['ours']:6.1f} us/call (lean launch used: {h['lean_used']})  "
            f"through JITFunction.run {h['ours_standard']:6.1f}  torch._grouped_mm {h['grouped_mm']:6.1f}"
        )
    for failed in report.get("failures", []):
        lines.append(f"FAILED {failed}")
    launches = report.get("launches") or {}
    lines.append(
        f"launches: {launches.get('lean', 0)} lean ({launches.get('direct', 0)} of them straight to Triton's C "
        f"launcher), {launches.get('standard', 0)} through JITFunction.run"
    )
    for refused in launches.get("refused", []):
        lines.append(f"lean launch refused (that plan went back to JITFunction.run): {refused}")
    if report.get("timed", True):
        lines.append(write_bound_line(rows, report.get("write_bandwidth")))
        lines.append(direction_bound_line(rows, report.get("read_bandwidth"), report.get("write_bandwidth")))
    lines.append("")
    lines.append("==== targets")
    for target, verdict, detail in report["verdicts"]:
        lines.append(f"{verdict:<10} {target}: {detail}")
    return "\n".join(lines)


def markdown(report: dict[str, Any]) -> str:
    """The per-device tables of docs/performance.md."""
    out = [
        f"{report['device']}, {report['versions']}; {report['date']}; config table {report['config_table']}.",
        f"Command: `{report['command']}`.",
        "",
        "| point (M, E, N, K) | op | ours | `torch._grouped_mm` | public design, best fixed tile | ours / faster | dense cuBLAS | roofline |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["rows"]:
        ahead = ahead_ratio(r)
        ours = _f(r["ours"], ".1f").strip()
        ours = f"**{ours}**" if ahead is not None and ahead >= 1 else ours
        if r.get("failed"):
            ours += f" (failed: {r['failed'][:120]})".replace("|", "/")
        roof = f"{_f(r.get('roofline'), '.0f').strip()}{' (memory-bound)' if r.get('memory_bound') else ''}"
        out.append(
            f"| {r['point']} {r['tokens']} tok ({r['m']}, {r['e']}, {r['n']}, {r['k']}) | {r['op']} | {ours} | "
            f"{_f(r['grouped_mm'], '.1f').strip()} | {_f(r['peer'], '.1f').strip()} ({r['peer_tile']}) | "
            f"{_f(ahead, '.3f').strip()} | {_f(r['dense'], '.0f').strip()} | {roof} |"
        )
    out += [
        "",
        "TFLOP/s: medians of the rounds. Ours / faster: ours over the faster of `torch._grouped_mm` and the "
        "peer's tile, the median over the rounds of each round's ratio (the three timed back to back); bold: ours "
        "where that is 1 or more.",
    ]
    out += ["", "| target | verdict | detail |", "| --- | --- | --- |"]
    out += [f"| {t} | {v} | {d.replace('|', '/')} |" for t, v, d in report["verdicts"]]
    if report.get("timed", True):
        out += ["", f"Not a target: {write_bound_line(report['rows'], report.get('write_bandwidth'))}."]
        direction = direction_bound_line(report["rows"], report.get("read_bandwidth"), report.get("write_bandwidth"))
        out += ["", f"Not a target either: {direction}."]
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def warm(args: argparse.Namespace, job: int, jobs: int) -> int:
    """Compile the peer's tiles (and our table's picks) at the smallest point, this job's share
    (the preset points' integer arguments all specialise alike; every job holds its operands
    on the one GPU at once, so never the 480B stacks)."""
    import torch

    from benchmarks.public_peer import PEER_DW_TILES, PEER_TILES

    label, e, n, k, tokens = min(parse_points(args.points, False), key=lambda p: (p[1] * p[2] * p[3], p[4]))
    pt = Point(label, e, n, k, tokens, torch.device("cuda"), torch.bfloat16, TOP_K)
    work: list[Callable[[], Any]] = []
    for op in OPS:
        work += [fn for _, fn in peer_fns(pt, op, PEER_DW_TILES if op == "dw" else PEER_TILES)]
        work.append(pt.ours(op, None))
    for i, fn in enumerate(work):
        if i % jobs == job:
            try:
                fn()
            except Exception as exc:  # measured (and reported) again by the timing pass
                log(f"  warm: {type(exc).__name__}: {str(exc)[:120]}")
    torch.cuda.synchronize()
    return 0


def write_json(path: Path, report: dict[str, Any]) -> None:
    """Whole or not at all: a run killed while writing leaves the previous file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(path)


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """The report before anything is measured: what the run means to measure, so that
    ``--render-partial`` marks what a stopped run did not reach. Written before the compile
    processes start (no torch import: a run killed while compiling still names every point)."""
    tiny = args.tiny
    return {
        "format": 1,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": "not reached (the run stopped while compiling)",
        "device_key": "",
        "config_table": "not reached",
        "versions": "-",
        "command": " ".join(["python3 -m benchmarks.side_by_side", *sys.argv[1:]]),
        "timed": not tiny,
        "targets": {"roofline_share": ROOFLINE_SHARE, "host_us": HOST_US_TARGET, "block_tokens": args.block_tokens},
        "points": [list(p) for p in parse_points(args.points, tiny)],
        "top_k": 2 if tiny else TOP_K,
        "item": 4 if tiny else 2,  # float32 in the interpreter (bf16 tl.dot is garbage there), else bf16
        "planned": {"block": bool(args.block_tokens), "host": bool(args.host_calls and not tiny)},
        "failures": [],
        "rows": [],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import triton

    from benchmarks.public_peer import PEER_DW_TILES, PEER_TILES, TINY_TILE
    from qmoe_doctor.kernels import tuning

    tiny = args.tiny
    device = torch.device("cpu") if tiny else torch.device("cuda", 0)
    dtype = torch.float32 if tiny else torch.bfloat16  # bf16 tl.dot is garbage in the interpreter
    top_k = 2 if tiny else TOP_K
    timer = Timer(not tiny, args.warmup, args.rep, args.rounds)
    points = parse_points(args.points, tiny)
    fwd_tiles, dw_tiles = ((TINY_TILE,), (TINY_TILE,)) if tiny else (PEER_TILES, PEER_DW_TILES)
    facts = tuning.device_facts(0) if not tiny else None
    failures: list[str] = []  # what failed outside the points
    report = plan(args)
    report.update(
        device=facts.name if facts else "cpu (Triton interpreter)",
        device_key=facts.key if facts else "",
        config_table=tuning.describe_device_table(0) if facts else "interpreter config",
        versions=f"torch {torch.__version__}, triton {triton.__version__}, cuda {torch.version.cuda}, "
        f"python {platform.python_version()}",
        failures=failures,
    )
    partial = args.out / PARTIAL_NAME
    log(f"{report['device']}: config table {report['config_table']}")
    try:
        report["copy_bandwidth"] = copy_bandwidth(timer, device)
    except Exception as exc:
        report["copy_bandwidth"] = None
        failures.append(failure("copy bandwidth", exc))
    try:
        report["write_bandwidth"] = write_bandwidth(timer, device)
    except Exception as exc:  # informational: the targets do not use it
        report["write_bandwidth"] = None
        log(f"  write bandwidth: {failure('write bandwidth', exc)}")
    try:
        report["read_bandwidth"] = read_bandwidth(timer, device)
    except Exception as exc:  # informational, as the write rate
        report["read_bandwidth"] = None
        log(f"  read bandwidth: {failure('read bandwidth', exc)}")
    free_memory(device)
    write_json(partial, report)  # a run that dies in its first point still names every point

    def saved(rows: list[Row]) -> None:
        report["rows"] = rows
        write_json(partial, report)

    rows = measure_points(
        points, timer, device, dtype, top_k,
        fwd_tiles=fwd_tiles, dw_tiles=dw_tiles, max_rel=args.max_rel_diff, on_point=saved,
    )  # fmt: skip
    report["compute_cap"] = add_roofline(
        rows, report["copy_bandwidth"], report["write_bandwidth"], report["read_bandwidth"]
    )
    report["rows"] = rows
    block = None
    if args.block_tokens:
        try:
            tokens, preset = (16, "tiny") if tiny else (args.block_tokens, args.block_preset)
            block = measure_block(timer, device, dtype, tokens, preset)
        except Exception as exc:
            failures.append(failure("block forward", exc))
            log(f"  block forward: {failures[-1]}")
        free_memory(device)
    report["block"] = block
    write_json(partial, report)
    host: list[Row] = []
    try:
        if args.host_calls and not tiny:
            label, e, n, k = "30b-gate_up", *PRESET_GEMMS["30b-gate_up"]
            host = measure_host(Point(label, e, n, k, HOST_TOKENS, device, dtype, TOP_K), args.host_calls)
        elif args.host_calls:  # the CPU smoke run: the code path, two calls, no figure
            label, e, n, k, tokens = points[0]
            measure_host(Point(label, e, n, k, tokens, device, dtype, 2), 1, runs=1)
    except Exception as exc:
        failures.append(failure("host time", exc))
        log(f"  host time: {failures[-1]}")
    report["host"] = host
    from qmoe_doctor.kernels.launch import counts

    report["launches"] = {
        "lean": counts.lean, "direct": counts.direct, "standard": counts.standard, "refused": counts.refused[:8],
    }  # fmt: skip
    report["verdicts"] = verdicts(rows, block, host, failures, timed=timer.timed, block_tokens=args.block_tokens)
    return report


def finish_partial(path: Path) -> dict[str, Any]:
    """The report a stopped run left (``OUT/side_by_side.partial.json``), completed: every planned
    point it did not reach keeps failed rows, the block and host time it did not reach are
    failures, and the roofline and targets are worked out from what it measured."""
    report: dict[str, Any] = json.loads(path.read_text())
    rows: list[Row] = report.get("rows", [])
    failures: list[str] = list(report.get("failures", []))
    done = {(r["point"], r["tokens"]) for r in rows}
    for label, e, n, k, tokens in report["points"]:
        if (label, tokens) not in done:
            why = "not reached: the run stopped before this point (its log says why)"
            rows += failed_rows((label, e, n, k, tokens), report["top_k"], report["item"], why)
    planned = report.get("planned", {})
    if planned.get("block") and not report.get("block"):
        failures.append("block forward: not reached (the run stopped first)")
    if planned.get("host") and not report.get("host"):
        failures.append("host time: not reached (the run stopped first)")
    report.update(rows=rows, failures=failures, block=report.get("block"), host=report.get("host", []))
    report.setdefault("copy_bandwidth", None)
    report.setdefault("write_bandwidth", None)
    report.setdefault("read_bandwidth", None)
    report["compute_cap"] = add_roofline(
        rows, report["copy_bandwidth"], report["write_bandwidth"], report["read_bandwidth"]
    )
    report["verdicts"] = verdicts(
        rows, report["block"], report["host"], failures, timed=report.get("timed", True),
        block_tokens=report.get("targets", {}).get("block_tokens", BLOCK_TOKENS),
    )  # fmt: skip
    report["stopped_early"] = True
    return report


def passed(report: dict[str, Any]) -> bool:
    return not report.get("failures") and all(r["ok"] and not r.get("failed") for r in report["rows"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default=",".join(DEFAULT_POINTS), help="GEMM:TOKENS,... (tune_kernels.py's)")
    ap.add_argument("--out", type=Path, default=Path("side-by-side"))
    ap.add_argument("--block-tokens", type=int, default=BLOCK_TOKENS, help="0: no block row")
    ap.add_argument("--block-preset", default="qwen3-30b-a3b")
    ap.add_argument("--host-calls", type=int, default=HOST_CALLS, help="0: no host timing")
    ap.add_argument("--warmup", type=int, default=5, help="do_bench warmup, ms")
    ap.add_argument("--rep", type=int, default=25, help="do_bench repetitions, ms")
    ap.add_argument(
        "--rounds", type=int, default=ROUNDS,
        help="after the first pass, ours, torch._grouped_mm and the peer's best tile are timed again this many "
        "times, interleaved; their medians decide the point (0: the first pass decides)",
    )  # fmt: skip
    ap.add_argument("--max-rel-diff", type=float, default=2e-2)
    ap.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1), help="compile processes (0: none)")
    ap.add_argument("--tiny", action="store_true", help="CPU, TRITON_INTERPRET=1: the control flow, nothing timed")
    ap.add_argument(
        "--render-partial", type=Path, metavar="FILE",
        help=f"no run: the tables and targets from a stopped run's {PARTIAL_NAME}, written to --out",
    )  # fmt: skip
    ap.add_argument("--warm-job", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.render_partial:
        report = finish_partial(args.render_partial)
        write_json(args.out / "side_by_side.json", report)
        (args.out / "side_by_side.md").write_text(markdown(report))
        print(render(report))
        return 1
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"
        args.jobs = 0
    # Blocks of every size come and go point by point (a 9.4 GiB dw result, then 100 MiB ones):
    # growable segments keep the cache from fragmenting into blocks too small for the next stack.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if args.warm_job:
        job, jobs = (int(v) for v in args.warm_job.split("/"))
        return warm(args, job, jobs)
    write_json(args.out / PARTIAL_NAME, plan(args))  # replaced by run()'s, point by point
    t0 = time.perf_counter()
    if args.jobs > 0:
        log(f"compiling the peer's tiles in {args.jobs} processes")
        cmd = [sys.executable, "-m", "benchmarks.side_by_side", *(argv if argv is not None else sys.argv[1:])]
        root = Path(__file__).resolve().parents[1]
        procs = [subprocess.Popen([*cmd, "--warm-job", f"{j}/{args.jobs}"], cwd=root) for j in range(args.jobs)]
        for p in procs:
            p.wait()
        log(f"compiled in {time.perf_counter() - t0:.0f} s")
    report = run(args)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    write_json(args.out / "side_by_side.json", report)
    (args.out / "side_by_side.md").write_text(markdown(report))
    (args.out / PARTIAL_NAME).unlink(missing_ok=True)
    print(render(report))
    log(f"wrote {args.out / 'side_by_side.json'}, {args.out / 'side_by_side.md'} ({report['wall_s']} s)")
    return 0 if passed(report) else 1


if __name__ == "__main__":
    raise SystemExit(main())
