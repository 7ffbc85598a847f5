"""Our kernels side by side with their peers at every preset point, on this GPU, and the verdict
against the performance targets (docs/performance.md says which and why).

    python3 -m benchmarks.side_by_side --out sbs/        # on a GPU (tools/gpu/perf_card.sh runs it)
    python3 -m benchmarks.side_by_side --tiny            # CPU, interpreter: the control flow only

Measured in one process, bf16, random top-8 routing (``benchmarks/tune_kernels.py``'s operands),
median of ``triton.testing.do_bench`` (L2 flushed between calls):

* every preset point (``tune_kernels.DEFAULT_POINTS``: the presets' gate_up and down GEMMs at
  128-8192 tokens) x forward, dx, dw: ours (the device's config table, which the header names),
  ``torch._grouped_mm``, the public design at its best fixed tile (``benchmarks/public_peer.py``,
  the tile searched over a small set) and one dense cuBLAS GEMM of the same FLOPs;
* the memory roofline: the device's copy bandwidth (``dst.copy_(src)`` of 1 GiB, bytes read +
  written per second) times each GEMM's arithmetic intensity (2*M*N*K FLOP over the bytes it must
  move: the weight stack once, both activations once), capped by the fastest dense GEMM measured;
  a point is memory-bound where that cap is not reached;
* the Qwen3-30B MoE block's eager forward at 2048 tokens on our kernels and on
  ``torch._grouped_mm`` (one set of parameters);
* host time per call of forward, dx and dw at 128 tokens (``tools/profile/host_overhead.py``
  has the stage-by-stage view): ours on the lean launch path, ours through Triton's
  ``JITFunction.run`` (``QMOE_DOCTOR_LEAN_LAUNCH=0``), ``torch._grouped_mm``.

Prints the table per point, then the targets as a short pass/fail table, last. Writes
``OUT/side_by_side.json`` (every number) and ``OUT/side_by_side.md`` (the tables, for
docs/performance.md). ``--tiny`` runs every row once on the CPU and compares it; nothing is
timed and no verdict is given.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root, for `benchmarks.`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.tune_kernels import DEFAULT_POINTS, PRESET_GEMMS, TOP_K, Point, log, parse_points, rel_diff

OPS = ("forward", "dx", "dw")
#: The targets (issue "ours ahead on every Hopper card"), declared once.
ROOFLINE_SHARE = 0.90  # at the memory-bound points, of the copy-bandwidth roofline
HOST_US_TARGET = 25.0  # host time per forward / dx / dw call
BLOCK_TOKENS = 2048  # the eager MoE block forward compared at this many tokens
HOST_TOKENS = 128
HOST_CALLS = 200
COPY_BYTES = 1 << 30

Row = dict[str, Any]


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


class Timer:
    def __init__(self, timed: bool, warmup: int, rep: int) -> None:
        self.timed, self.warmup, self.rep = timed, warmup, rep

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
    if not timer.timed:
        return None
    import torch

    src = torch.empty(COPY_BYTES // 2, dtype=torch.bfloat16, device=device).normal_()
    ms = timer.ms(_copier(src, torch.empty_like(src)))
    return 2 * COPY_BYTES / (ms * 1e-3) if ms else None


def _copier(src: Any, dst: Any) -> Callable[[], Any]:
    return lambda: dst.copy_(src)


def _matmul(a: Any, b: Any) -> Callable[[], Any]:
    return lambda: a @ b


def gemm_bytes(op: str, m: int, e: int, n: int, k: int, item: int) -> int:
    """Bytes a GEMM must move at least: the (E, N, K) stack once (read, or written by dw) and its
    two activations once."""
    return item * (e * n * k + m * k + m * n)


# --------------------------------------------------------------------------------------------
# The GEMM points
# --------------------------------------------------------------------------------------------


def peer_fns(pt: Point, op: str, tiles: Any) -> list[tuple[str, Callable[[], Any]]]:
    from benchmarks.public_peer import peer_dw, peer_forward, tile_name

    if op == "forward":
        return [(tile_name(t), lambda t=t: peer_forward(pt.x, pt.w, pt.m_sizes, t)) for t in tiles]
    if op == "dx":
        return [(tile_name(t), lambda t=t: peer_forward(pt.dy, pt.w.transpose(1, 2), pt.m_sizes, t)) for t in tiles]
    return [(tile_name(t), lambda t=t: peer_dw(pt.dy, pt.x, pt.m_sizes, t)) for t in tiles]


def measure_point(pt: Point, timer: Timer, *, fwd_tiles: Any, dw_tiles: Any, max_rel: float) -> list[Row]:
    import torch

    from qmoe_doctor.kernels.backward import pick_dw_config
    from qmoe_doctor.kernels.grouped_gemm import pick_config

    gen = torch.Generator(device=pt.x.device).manual_seed(3)
    dense_a = torch.randn(pt.m, pt.k, generator=gen, device=pt.x.device).to(pt.x.dtype)
    dense_b = torch.randn(pt.k, pt.n, generator=gen, device=pt.x.device).to(pt.x.dtype)
    dense_ms = timer.ms(_matmul(dense_a, dense_b))
    item = pt.x.element_size()
    rows: list[Row] = []
    for op in OPS:
        ref = pt.theirs(op)()
        if op == "dw":
            config = pick_dw_config(pt.n, pt.k, pt.x.device, pt.x.dtype, avg_rows=pt.m / pt.e).name
        else:
            n, k = (pt.n, pt.k) if op == "forward" else (pt.k, pt.n)
            config = pick_config(pt.m, n, k, pt.e, pt.x.device, pt.x.dtype, op=op).name
        ours_fn = pt.ours(op, None)
        ours_err = rel_diff(ours_fn(), ref)
        ours_ms = timer.ms(ours_fn)
        theirs_ms = timer.ms(pt.theirs(op))
        peers = []
        for name, fn in peer_fns(pt, op, dw_tiles if op == "dw" else fwd_tiles):
            try:
                err = rel_diff(fn(), ref)
                peers.append({"tile": name, "ms": timer.ms(fn) if err <= max_rel else None, "rel_err": err})
            except Exception as exc:  # a tile that does not fit this device: recorded, not chosen
                peers.append({"tile": name, "ms": None, "rel_err": None, "note": f"{type(exc).__name__}: {exc}"[:160]})
        timed_peers = [p for p in peers if p["ms"]]
        best = min(timed_peers, key=lambda p: p["ms"]) if timed_peers else None
        row: Row = {
            "point": pt.label, "tokens": pt.tokens, "m": pt.m, "e": pt.e, "n": pt.n, "k": pt.k, "op": op,
            "config": config, "ours_ms": ours_ms, "ours_rel_err": ours_err,
            "ours": tflops(pt.flops, ours_ms), "grouped_mm": tflops(pt.flops, theirs_ms),
            "peer": tflops(pt.flops, best["ms"]) if best else None, "peer_tile": best["tile"] if best else "",
            "peer_tiles": peers, "dense": tflops(pt.flops, dense_ms), "flops": pt.flops,
            "bytes": gemm_bytes(op, pt.m, pt.e, pt.n, pt.k, item),
            "ok": ours_err <= max_rel,
        }  # fmt: skip
        rows.append(row)
        log(
            f"  {pt.label}:{pt.tokens:<5} {op:<8} ours {_f(row['ours'])} ({config})  grouped_mm {_f(row['grouped_mm'])}"
            f"  peer {_f(row['peer'])} ({row['peer_tile']})  dense {_f(row['dense'])}  err {ours_err:.1e}"
        )
        del ref
    return rows


def add_roofline(rows: list[Row], bandwidth: float | None) -> float | None:
    """Each row's roofline (TFLOP/s) and whether it is memory-bound; returns the compute cap
    (the fastest dense GEMM measured)."""
    dense = [r["dense"] for r in rows if r["dense"]]
    cap = max(dense) if dense else None
    for r in rows:
        if bandwidth is None or cap is None:
            r.update(roofline=None, memory_bound=None, share=None)
            continue
        memory = r["flops"] / (r["bytes"] / bandwidth) / 1e12
        r["roofline"] = min(memory, cap)
        r["memory_bound"] = memory < cap
        r["share"] = r["ours"] / r["roofline"] if r["ours"] else None
    return cap


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
    with torch.no_grad():
        a, b = ours(hidden)[0], theirs(hidden)[0]
        err = rel_diff(a, b)
        ours_ms = timer.ms(lambda: ours(hidden))
        theirs_ms = timer.ms(lambda: theirs(hidden))
    log(f"  block forward {tokens} tokens: ours {_f(tflops(flops, ours_ms))}  grouped_mm {_f(tflops(flops, theirs_ms))}")
    return {
        "preset": s.name, "tokens": tokens, "ours_ms": ours_ms, "grouped_mm_ms": theirs_ms,
        "ours": tflops(flops, ours_ms), "grouped_mm": tflops(flops, theirs_ms), "rel_diff": err,
    }  # fmt: skip


def host_us(fn: Callable[[], Any], calls: int, sync: Callable[[], None], *, runs: int = 5) -> float:
    """Host microseconds per call: ``calls`` back to back, the GPU queue drained before (not
    inside); the median of ``runs`` such runs, after ``runs`` warm-up calls."""
    for _ in range(runs):
        fn()
    samples = []
    for _ in range(runs):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    sync()
    return statistics.median(samples)


def measure_host(pt: Point, calls: int, *, runs: int = 5) -> list[Row]:
    """Host time per call of forward, dx, dw: ours lean, ours through JITFunction.run, torch."""
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

    rows = []
    for op in OPS:
        before = launch.counts.lean
        lean = host_us(pt.ours(op, None), calls, sync, runs=runs)
        took_lean = launch.counts.lean > before
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
        theirs = host_us(pt.theirs(op), calls, sync, runs=runs)
        rows.append({"op": op, "tokens": pt.tokens, "ours": lean, "ours_standard": standard, "grouped_mm": theirs, "lean_used": took_lean})
        log(f"  host {op:<8} ours {lean:6.1f} us (lean: {took_lean})  through JITFunction.run {standard:6.1f}  torch {theirs:6.1f}")
    return rows


# --------------------------------------------------------------------------------------------
# Verdicts and tables
# --------------------------------------------------------------------------------------------


def _f(v: float | None, fmt: str = "7.1f") -> str:
    return format(v, fmt) if v is not None else "-".rjust(len(format(0.0, fmt)))


def verdicts(rows: list[Row], block: Row | None, host: list[Row]) -> list[tuple[str, str, str]]:
    """(target, PASS / FAIL / n/a, detail) per target."""
    out: list[tuple[str, str, str]] = []
    timed = [r for r in rows if r["ours"]]
    if not timed:
        return [("every target", "n/a", "nothing timed (--tiny)")]
    wrong = [f"{r['op']} {r['point']}:{r['tokens']}" for r in rows if not r["ok"]]
    out.append(("ours correct at every point", "PASS" if not wrong else "FAIL", ", ".join(wrong) or f"{len(rows)} rows"))
    lost = []
    for r in timed:
        peer = max(v for v in (r["grouped_mm"], r["peer"], 0.0) if v is not None)
        if r["ours"] < peer:
            lost.append(f"{r['op']} {r['point']}:{r['tokens']} {r['ours'] / peer:.2f}x")
    out.append(
        ("ours >= max(grouped_mm, public best tile), every point", "PASS" if not lost else "FAIL",
         f"{len(timed) - len(lost)}/{len(timed)}" + (f"; behind: {', '.join(lost)}" if lost else "")),
    )  # fmt: skip
    bound = [r for r in timed if r.get("memory_bound")]
    short = [f"{r['op']} {r['point']}:{r['tokens']} {r['share']:.0%}" for r in bound if r["share"] < ROOFLINE_SHARE]
    out.append(
        (f"memory-bound points >= {ROOFLINE_SHARE:.0%} of the copy roofline",
         "PASS" if bound and not short else ("n/a" if not bound else "FAIL"),
         f"{len(bound) - len(short)}/{len(bound)}" + (f"; short: {', '.join(short)}" if short else "")),
    )  # fmt: skip
    if block and block["ours"]:
        ok = block["ours"] >= block["grouped_mm"]
        out.append(
            (f"eager block forward at {block['tokens']} tokens >= with grouped_mm", "PASS" if ok else "FAIL",
             f"{block['ours']:.1f} vs {block['grouped_mm']:.1f} TFLOP/s"),
        )  # fmt: skip
    if host:
        over = [f"{h['op']} {h['ours']:.1f}" for h in host if h["ours"] > HOST_US_TARGET]
        out.append(
            (f"host time per call <= {HOST_US_TARGET:.0f} us", "PASS" if not over else "FAIL",
             ", ".join(f"{h['op']} {h['ours']:.1f} (torch {h['grouped_mm']:.1f})" for h in host)),
        )  # fmt: skip
    return out


def render(report: dict[str, Any]) -> str:
    rows, lines = report["rows"], []
    lines.append(f"{report['device']} | {report['versions']} | config table: {report['config_table']}")
    bw = report["copy_bandwidth"]
    lines.append(
        f"copy bandwidth {bw / 1e12:.2f} TB/s; compute cap (fastest dense) {report['compute_cap']:.0f} TFLOP/s"
        if bw and report["compute_cap"]
        else "not timed (--tiny)"
    )
    lines.append("")
    lines.append(
        f"{'point':<13} {'tok':>5} {'op':<7} {'ours':>7} {'gmm':>7} {'peer':>7} {'dense':>6} {'x best':>6} "
        f"{'roof':>7} {'%roof':>5}  config / peer tile"
    )
    for r in rows:
        best = max((v for v in (r["grouped_mm"], r["peer"]) if v), default=None)
        ratio = f"{r['ours'] / best:6.2f}" if r["ours"] and best else "     -"
        share = f"{r['share']:5.0%}" if r.get("share") else "    -"
        mark = "*" if r.get("memory_bound") else " "
        lines.append(
            f"{r['point']:<13} {r['tokens']:>5} {r['op']:<7} {_f(r['ours'])} {_f(r['grouped_mm'])} {_f(r['peer'])} "
            f"{_f(r['dense'], '6.0f')} {ratio} {_f(r.get('roofline'))}{mark}{share}  {r['config']} / {r['peer_tile'] or '-'}"
        )
    lines.append("(TFLOP/s; x best: ours over the faster of grouped_mm and the peer; * memory-bound point)")
    b = report.get("block")
    if b:
        lines.append(
            f"block forward {b['preset']} {b['tokens']} tokens, eager: ours {_f(b['ours'])}  "
            f"with grouped_mm {_f(b['grouped_mm'])} TFLOP/s (rel diff {b['rel_diff']:.1e})"
        )
    for h in report.get("host", []):
        lines.append(
            f"host {h['op']:<8} ours {h['ours']:6.1f} us/call (lean launch used: {h['lean_used']})  "
            f"through JITFunction.run {h['ours_standard']:6.1f}  torch._grouped_mm {h['grouped_mm']:6.1f}"
        )
    launches = report.get("launches") or {}
    lines.append(f"launches: {launches.get('lean', 0)} lean, {launches.get('standard', 0)} through JITFunction.run")
    for refused in launches.get("refused", []):
        lines.append(f"lean launch refused (that plan went back to JITFunction.run): {refused}")
    lines.append("")
    lines.append("==== targets")
    for target, verdict, detail in report["verdicts"]:
        lines.append(f"{verdict:<5} {target}: {detail}")
    return "\n".join(lines)


def markdown(report: dict[str, Any]) -> str:
    """The per-device tables of docs/performance.md."""
    out = [
        f"{report['device']}, {report['versions']}; {report['date']}; config table {report['config_table']}.",
        f"Command: `{report['command']}`.",
        "",
        "| point (M, E, N, K) | op | ours | `torch._grouped_mm` | public design, best fixed tile | dense cuBLAS | roofline |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report["rows"]:
        best = max((v for v in (r["grouped_mm"], r["peer"]) if v), default=0)
        ours = _f(r["ours"], ".1f").strip()
        ours = f"**{ours}**" if r["ours"] and r["ours"] >= best else ours
        roof = f"{_f(r.get('roofline'), '.0f').strip()}{' (memory-bound)' if r.get('memory_bound') else ''}"
        out.append(
            f"| {r['point']} {r['tokens']} tok ({r['m']}, {r['e']}, {r['n']}, {r['k']}) | {r['op']} | {ours} | "
            f"{_f(r['grouped_mm'], '.1f').strip()} | {_f(r['peer'], '.1f').strip()} ({r['peer_tile']}) | "
            f"{_f(r['dense'], '.0f').strip()} | {roof} |"
        )
    out += ["", "| target | verdict | detail |", "| --- | --- | --- |"]
    out += [f"| {t} | {v} | {d} |" for t, v, d in report["verdicts"]]
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def warm(args: argparse.Namespace, job: int, jobs: int) -> int:
    """Compile the peer's tiles (and our table's picks) at the first point, this job's share."""
    import torch

    from benchmarks.public_peer import PEER_DW_TILES, PEER_TILES

    label, e, n, k, tokens = parse_points(args.points, False)[0]
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import triton

    from benchmarks.public_peer import PEER_DW_TILES, PEER_TILES, TINY_TILE
    from qmoe_doctor.kernels import tuning

    tiny = args.tiny
    device = torch.device("cpu" if tiny else "cuda", 0 if not tiny else None)
    dtype = torch.float32 if tiny else torch.bfloat16  # bf16 tl.dot is garbage in the interpreter
    timer = Timer(not tiny, args.warmup, args.rep)
    points = parse_points(args.points, tiny)
    fwd_tiles, dw_tiles = ((TINY_TILE,), (TINY_TILE,)) if tiny else (PEER_TILES, PEER_DW_TILES)
    facts = tuning.device_facts(0) if not tiny else None
    report: dict[str, Any] = {
        "format": 1,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": facts.name if facts else "cpu (Triton interpreter)",
        "device_key": facts.key if facts else "",
        "config_table": tuning.describe_device_table(0) if facts else "interpreter config",
        "versions": f"torch {torch.__version__}, triton {triton.__version__}, cuda {torch.version.cuda}, "
        f"python {platform.python_version()}",
        "command": " ".join(["python3 -m benchmarks.side_by_side", *sys.argv[1:]]),
        "timed": timer.timed,
        "targets": {"roofline_share": ROOFLINE_SHARE, "host_us": HOST_US_TARGET, "block_tokens": args.block_tokens},
    }
    log(f"{report['device']}: config table {report['config_table']}")
    report["copy_bandwidth"] = copy_bandwidth(timer, device)
    rows: list[Row] = []
    for label, e, n, k, tokens in points:
        pt = Point(label, e, n, k, tokens, device, dtype, TOP_K if not tiny else 2)
        rows += measure_point(pt, timer, fwd_tiles=fwd_tiles, dw_tiles=dw_tiles, max_rel=args.max_rel_diff)
        del pt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report["compute_cap"] = add_roofline(rows, report["copy_bandwidth"])
    report["rows"] = rows
    block = None
    if args.block_tokens:
        block = measure_block(timer, device, dtype, 16 if tiny else args.block_tokens, "tiny" if tiny else args.block_preset)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report["block"] = block
    host: list[Row] = []
    if args.host_calls and not tiny:
        label, e, n, k = "30b-gate_up", *PRESET_GEMMS["30b-gate_up"]
        host = measure_host(Point(label, e, n, k, HOST_TOKENS, device, dtype, TOP_K), args.host_calls)
    elif args.host_calls:  # the CPU smoke run: the code path, two calls, no figure
        label, e, n, k, tokens = points[0]
        measure_host(Point(label, e, n, k, tokens, device, dtype, 2), 1, runs=1)
    report["host"] = host
    from qmoe_doctor.kernels.launch import counts

    report["launches"] = {"lean": counts.lean, "standard": counts.standard, "refused": counts.refused[:8]}
    report["verdicts"] = verdicts(rows, block, host)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default=",".join(DEFAULT_POINTS), help="GEMM:TOKENS,... (tune_kernels.py's)")
    ap.add_argument("--out", type=Path, default=Path("side-by-side"))
    ap.add_argument("--block-tokens", type=int, default=BLOCK_TOKENS, help="0: no block row")
    ap.add_argument("--block-preset", default="qwen3-30b-a3b")
    ap.add_argument("--host-calls", type=int, default=HOST_CALLS, help="0: no host timing")
    ap.add_argument("--warmup", type=int, default=5, help="do_bench warmup, ms")
    ap.add_argument("--rep", type=int, default=25, help="do_bench repetitions, ms")
    ap.add_argument("--max-rel-diff", type=float, default=2e-2)
    ap.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1), help="compile processes (0: none)")
    ap.add_argument("--tiny", action="store_true", help="CPU, TRITON_INTERPRET=1: the control flow, nothing timed")
    ap.add_argument("--warm-job", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tiny:
        os.environ["TRITON_INTERPRET"] = "1"
        args.jobs = 0
    if args.warm_job:
        job, jobs = (int(v) for v in args.warm_job.split("/"))
        return warm(args, job, jobs)
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
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "side_by_side.json").write_text(json.dumps(report, indent=1))
    (args.out / "side_by_side.md").write_text(markdown(report))
    print(render(report))
    log(f"wrote {args.out / 'side_by_side.json'}, {args.out / 'side_by_side.md'} ({report['wall_s']} s)")
    return 0 if all(r["ok"] for r in report["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
