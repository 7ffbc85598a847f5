"""`qmoe-doctor bench`, parent side: what to measure, the child that measures it, the report.

One run measures, side by side, our forward, dx and dw grouped GEMMs and the whole ``MoEBlock``
against ``torch._grouped_mm``, the per-expert loop (the stock Transformers block) and one dense
GEMM of the same FLOPs, over a range of token counts; with ``placement`` on 2 GPUs it also
times the same forward per placement, so that scan's "slow" label (``knobs.SLOW_FACTOR``) has a
reference:

* ``local``: operands on GPU b, b current, our kernel;
* ``guarded``: operands on b, a current, our kernel (its device guard launches on b);
* ``remote``: operands on b, a current after one copy a -> b (peer access a -> b on), the
  ``specimen:unguarded`` kernel: it runs on a and reads b's memory over the link.

Data flows one way::

    BenchRequest --(JSON argument)--> python -m qmoe_doctor.probes.bench --> BenchReport (JSON file)
    BenchReport --render_report--> terminal (rich) | JSON document (kind "bench") | PNG (bench_plot)

The measuring happens in a child process (a fresh interpreter, pinned to the chosen GPUs by
UUID); this module never imports torch. ``load_report`` also reads the single-shape JSON of the
earlier ``benchmarks/bench_kernels.py`` (kind ``qmoe-bench-kernels``, validation run 3).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import select
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rich.console import Console
from rich.table import Table
from rich.text import Text

from qmoe_doctor.core import knobs
from qmoe_doctor.core.records import SCHEMA_VERSION, from_jsonable, to_json
from qmoe_doctor.isolate.worker_pool import child_env, child_python
from qmoe_doctor.machine.inventory import GpuInfo, child_cuda_env

KIND = "bench"
#: The JSON kind of the single-shape reports the earlier script wrote (validation run 3).
LEGACY_KIND = "qmoe-bench-kernels"
CHILD_MODULE = "qmoe_doctor.probes.bench"

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
Placement = Literal["local", "guarded", "remote"]
PLACEMENTS: tuple[Placement, ...] = ("local", "guarded", "remote")

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
TAIL_LINES = 40
#: How long a timed-out child gets to dump its stacks (faulthandler on SIGUSR1) before SIGKILL.
STACK_DUMP_WAIT_S = 0.5
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

    placement: Placement
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


class BenchError(Exception):
    """The measuring child failed: it crashed, timed out or wrote no report."""

    def __init__(self, message: str, *, tail: str = "", returncode: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.tail = tail
        self.returncode = returncode


# --------------------------------------------------------------------------------------------
# Choices and arithmetic (pure)
# --------------------------------------------------------------------------------------------


def parse_tokens(text: str) -> tuple[int, ...]:
    """``"128,512,2048"`` -> (128, 512, 2048), sorted, no repeats. Raises ValueError."""
    values: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit() or int(part) <= 0:
            raise ValueError(f"{part!r} is not a positive whole number of tokens")
        values.append(int(part))
    if not values:
        raise ValueError(f"{text!r} names no token count; give e.g. 128,512,2048")
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


def load_report(path: str | os.PathLike[str]) -> BenchReport:
    with open(path, encoding="utf-8") as fh:
        return report_from_jsonable(json.load(fh))


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


# --------------------------------------------------------------------------------------------
# The child
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ChildRun:
    returncode: int | None  # None: killed at the timeout
    tail: str  # the last lines it wrote (stdout and stderr together)
    wall_s: float
    lines: list[str] = field(default_factory=list)


def child_command(request: BenchRequest, python: str | None = None) -> list[str]:
    return [child_python(python), "-m", CHILD_MODULE, to_json(request)]


def child_environment(gpus: Sequence[GpuInfo], *, tiny: bool) -> dict[str, str]:
    """The child's environment: pinned to ``gpus`` by UUID (none: every GPU hidden), the
    interpreter on for --tiny, NVLink multicast off (isolate.FORCED_ENV)."""
    extra = child_cuda_env(gpus)
    if tiny:
        extra[knobs.TRITON_INTERPRET] = "1"
    else:
        extra[knobs.TRITON_INTERPRET] = "0"  # an inherited 1 would time the interpreter
    return child_env(extra)


def stream_child(
    argv: Sequence[str],
    env: Mapping[str, str],
    *,
    timeout_s: float,
    on_line: Callable[[str], None] | None = None,
    log_path: Path | None = None,
) -> ChildRun:
    """Run argv in a session of its own, passing each line it writes (stdout and stderr
    together) to ``on_line`` and to ``log_path``; at the timeout its process group is killed."""
    t0 = time.monotonic()
    log = open(log_path, "w", encoding="utf-8") if log_path is not None else None
    lines: list[str] = []
    try:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,  # a group of its own: a timeout kills it whole
        )
    except OSError as exc:
        if log is not None:
            log.close()
        raise BenchError(f"cannot start {argv[0]}: {exc}") from exc
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buffer = b""

    def take(raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").rstrip("\r")
        lines.append(line)
        if log is not None:
            log.write(line + "\n")
            log.flush()
        if on_line is not None:
            on_line(line)

    def pump(until: float) -> bool:
        """Pass on what the child writes until EOF (True) or the deadline (False)."""
        nonlocal buffer
        while True:
            remaining = until - time.monotonic()
            if remaining <= 0:
                return False
            readable, _, _ = select.select([fd], [], [], min(remaining, 0.5))
            if not readable:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return True
            buffer += chunk
            *complete, buffer = buffer.split(b"\n")
            for raw in complete:
                take(raw)

    try:
        deadline = t0 + timeout_s
        timed_out = not pump(deadline)
        if not timed_out:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True  # it closed its output but did not exit
        if timed_out:
            with contextlib.suppress(OSError):
                os.kill(proc.pid, signal.SIGUSR1)  # the child's faulthandler: its stacks to the log
            pump(time.monotonic() + STACK_DUMP_WAIT_S)
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)  # the child leads its own group
        if buffer:
            take(buffer)
        returncode = proc.wait()
    finally:
        if proc.returncode is None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        proc.stdout.close()
        if log is not None:
            log.close()
    return ChildRun(
        returncode=None if timed_out else returncode,
        tail="\n".join(lines[-TAIL_LINES:]),
        wall_s=time.monotonic() - t0,
        lines=lines,
    )


def run_bench(
    request: BenchRequest,
    *,
    gpus: Sequence[GpuInfo] = (),
    workdir: Path,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    python: str | None = None,
    on_line: Callable[[str], None] | None = None,
) -> BenchReport:
    """Measure ``request`` in a child pinned to ``gpus`` (the first is cuda:0 there; with
    placement the second is cuda:1). The child's output goes to ``workdir/bench.log``.
    Raises BenchError when the child fails or writes no report."""
    workdir.mkdir(parents=True, exist_ok=True)
    result = workdir / ".bench-child.json"
    with contextlib.suppress(FileNotFoundError):
        result.unlink()
    request = dataclasses.replace(request, result_path=str(result.resolve()))
    run = stream_child(
        child_command(request, python),
        child_environment(gpus, tiny=request.tiny),
        timeout_s=timeout_s,
        on_line=on_line,
        log_path=workdir / BENCH_FILES["log"],
    )
    if run.returncode is None:
        raise BenchError(f"the benchmark child did not finish in {timeout_s:.0f} s (killed)", tail=run.tail)
    if run.returncode != 0:
        raise BenchError(
            f"the benchmark child exited with status {run.returncode}",
            tail=run.tail,
            returncode=run.returncode,
        )
    try:
        doc = json.loads(result.read_text(encoding="utf-8"))
        report = report_from_jsonable(doc)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise BenchError(f"the benchmark child wrote no readable report: {exc}", tail=run.tail) from exc
    finally:
        with contextlib.suppress(FileNotFoundError):
            result.unlink()
    return dataclasses.replace(report, gpus=tuple(g.index for g in gpus))


def report_document(report: BenchReport, files: Mapping[str, str | None] | None = None) -> dict[str, Any]:
    """The versioned JSON document (``kind`` "bench"), with the files written beside it."""
    from qmoe_doctor.reports.json import json_document

    doc = json_document(KIND, report)
    if files is not None:
        doc["files"] = dict(files)
    return doc


def write_json(report: BenchReport, path: Path, files: Mapping[str, str | None] | None = None) -> None:
    path.write_text(
        json.dumps(report_document(report, files), indent=2, allow_nan=True) + "\n", encoding="utf-8"
    )


# --------------------------------------------------------------------------------------------
# Rendering (rich)
# --------------------------------------------------------------------------------------------


def _fmt_tflops(r: BenchRow | None, timed: bool) -> Text:
    if r is None:
        return Text("-", style="dim")
    if r.note and r.ms is None:
        return Text("failed", style="red")
    if not timed or r.tflops is None:
        return Text("ran", style="green")
    text = Text(f"{r.tflops:.1f}", style="bold" if r.impl in OURS else "")
    if r.frac_dense is not None and r.impl != DENSE:
        text.append(f" {r.frac_dense:.0%}", style="dim")
    return text


def _max_err(rows: Sequence[BenchRow]) -> str:
    errs = [r.rel_err for r in rows if r.rel_err is not None and not math.isnan(r.rel_err)]
    return f"{max(errs):.1e}" if errs else "-"


def header_lines(report: BenchReport) -> list[str]:
    s = report.shape
    gpus = f" (GPU {', '.join(str(i) for i in report.gpus)})" if report.gpus else ""
    lines = [
        f"{report.device}{gpus} | torch {report.torch} | triton {report.triton} | {report.dtype} | "
        f"preset {report.preset}: E={s.e} N={s.n} K={s.k} top_k={s.top_k} (block H={s.hidden} I={s.intermediate})"
    ]
    if report.routing != "random":
        lines.append(
            f"GEMM rows routed {report.routing}: every expert M/E rows (the block rows use the block's router)"
        )
    if report.timed:
        lines.append(
            f"TFLOP/s ({report.timing}); the dim % is the fraction of one dense GEMM of the same FLOPs"
        )
    else:
        lines.append(
            "CPU smoke run (Triton interpreter): nothing timed, no speed claims ('ran': it ran, and was compared where there is a reference)"
        )
    return lines


def gemm_table(report: BenchReport) -> Table:
    has_block = any(op in BLOCK_OPS for op in report.ops())
    table = Table(title="Grouped GEMMs" + (" and the MoE block" if has_block else ""), title_justify="left")
    table.add_column("op", no_wrap=True)
    table.add_column("implementation", no_wrap=True)
    for t in report.tokens:
        m = next((r.m for r in report.rows if r.tokens == t), t * report.shape.top_k)
        table.add_column(f"{t} tok\nM={m}", justify="right")
    table.add_column("max rel err", justify="right")
    for op in report.ops():
        for i, impl in enumerate(report.impls(op)):
            cells = [_fmt_tflops(report.row(op, impl, t), report.timed) for t in report.tokens]
            rows = [r for r in report.rows if r.op == op and r.impl == impl]
            table.add_row(
                OP_LABEL[op] if i == 0 else "",
                impl,
                *cells,
                _max_err(rows),
                end_section=i == len(report.impls(op)) - 1,
            )
    return table


def placement_table(report: BenchReport) -> Table:
    a, b = "a = cuda:0", "b = cuda:1"
    if len(report.gpus) >= 2:
        a, b = f"{a} (GPU {report.gpus[0]})", f"{b} (GPU {report.gpus[1]})"
    table = Table(title=f"Forward per placement: {a}, {b}; operands on b", title_justify="left")
    for name, justify in (
        ("tokens", "right"),
        ("placement", "left"),
        ("kernel", "left"),
        ("current", "right"),
        ("peer a->b", "left"),
        ("ms", "right"),
        ("TFLOP/s", "right"),
        ("x guarded", "right"),
        ("x guarded (scan)", "right"),
        ("rel err", "right"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for r in report.placement:
        slow = Text("-", style="dim")
        if r.slowdown_scan is not None:
            flagged = r.slowdown_scan >= report.slow_factor
            slow = Text(f"{r.slowdown_scan:.1f}x", style="yellow" if flagged else "green")
        table.add_row(
            str(r.tokens),
            r.placement,
            r.kernel,
            f"cuda:{r.current}",
            "on" if r.peer_enabled else "off",
            f"{r.ms:.3f}"
            if r.ms is not None
            else Text("failed" if r.note else "-", style="red" if r.note else "dim"),
            f"{r.tflops:.1f}" if r.tflops is not None else "-",
            f"{r.slowdown:.1f}x" if r.slowdown is not None else "-",
            slow,
            f"{r.rel_err:.1e}" if r.rel_err is not None else "-",
        )
    return table


def render_report(console: Console, report: BenchReport) -> None:
    for line in header_lines(report):
        console.print(line, style="dim" if line.startswith(("TFLOP", "CPU")) else "bold", soft_wrap=True)
    console.print(gemm_table(report))
    if report.placement:
        console.print(placement_table(report))
        console.print(
            f"scan labels a correct cell 'slow' at {report.slow_factor:.1f}x its guarded baseline "
            "(the 'x guarded (scan)' column is the same measure).",
            style="dim",
        )
    for r in report.rows:
        if r.note:
            console.print(f"note: {r.op} {r.impl} at {r.tokens} tokens: {r.note}", style="yellow")
    for p in report.placement:
        if p.note:
            console.print(
                f"note: placement {p.placement} ({p.kernel}) at {p.tokens} tokens: {p.note}", style="yellow"
            )
    for note in report.notes:
        console.print(f"note: {note}", style="dim")


__all__ = [
    "BENCH_FILES",
    "BenchError",
    "BenchReport",
    "BenchRequest",
    "BenchRow",
    "BenchShape",
    "BLOCK_GROUPED_MM_GRAPH",
    "BLOCK_QMOE_GRAPH",
    "DEFAULT_TIMEOUT_S",
    "DEFAULT_TOKENS",
    "GRAPH_IMPLS",
    "KIND",
    "PlacementRow",
    "ROUTINGS",
    "Routing",
    "default_tokens",
    "load_report",
    "parse_tokens",
    "render_report",
    "report_from_jsonable",
    "run_bench",
    "with_fractions",
    "with_slowdowns",
]
