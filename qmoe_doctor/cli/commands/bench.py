"""`qmoe-doctor bench`: kernel throughput side by side, in TFLOP/s and against a dense GEMM.

The library (``qmoe_doctor.workflows.bench``) does the work in a child process; this module validates,
calls, renders and writes the files under --out.
"""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path

import typer

from qmoe_doctor.cli.output import emit_json, stderr_console, stdout_console
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.core.shapes import PRESETS
from qmoe_doctor.machine.inventory import GpuInfo, GpuSelectionError, collect_inventory, select_gpus
from qmoe_doctor.workflows.bench import (
    BENCH_FILES,
    DEFAULT_TIMEOUT_S,
    DEFAULT_TOKENS,
    ROUTINGS,
    TINY_MAX_TOKENS,
    BenchError,
    BenchReport,
    BenchRequest,
    default_tokens,
    parse_tokens,
    render_report,
    report_document,
    run_bench,
    write_json,
)

_TOKENS_HELP = "; ".join(f"{p}: {','.join(map(str, t))}" for p, t in DEFAULT_TOKENS.items() if p != "tiny")
_TOKENS_HELP += f"; --tiny: {','.join(map(str, DEFAULT_TOKENS['tiny']))}"


def bench_command(
    preset: str = typer.Option("qwen3-30b-a3b", "--preset", help=f"Shape preset: {', '.join(PRESETS)}."),
    gpus: str | None = typer.Option(
        None,
        "--gpus",
        help="NVML / nvidia-smi GPU indices (default: all). The first measures; --placement uses the first two.",
    ),
    tokens: str | None = typer.Option(
        None,
        "--tokens",
        help=f"Token counts, comma-separated; rows M = tokens x top_k. Default per preset: {_TOKENS_HELP}.",
    ),
    placement: bool = typer.Option(
        False,
        "--placement",
        help="Also time the forward per placement on 2 GPUs: guarded (ours) against remote execution "
        "over peer access (specimen:unguarded), the reference for scan's 'slow' label.",
    ),
    block: bool = typer.Option(
        True, "--block/--no-block", help="Also the whole MoE block, forward and backward."
    ),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16, fp16 or fp32 (ignored by --tiny: float32)."),
    routing: str = typer.Option(
        "random",
        "--routing",
        help="Rows per expert of the GEMM rows: 'random' (each token's top-k of uniform random scores, an "
        "untrained router: many experts end in a partial row tile) or 'balanced' (every expert M/E rows: "
        "the kernels without routing imbalance). The block rows use the block's own router.",
    ),
    out: Path = typer.Option(
        Path("qmoe-bench"), "--out", help="Directory for bench.json, bench.png and bench.log."
    ),
    json_out: bool = typer.Option(
        False, "--json", help="Write the versioned JSON report (kind 'bench') to stdout."
    ),
    plot: bool = typer.Option(
        True, "--plot/--no-plot", help="Draw bench.png (needs matplotlib: the 'plot' extra)."
    ),
    tiny: bool = typer.Option(
        False,
        "--tiny",
        help="Run on the CPU under the Triton interpreter at the tiny preset, to check that the benchmark "
        "works: nothing is timed and no speed is claimed.",
    ),
    timeout: float = typer.Option(
        DEFAULT_TIMEOUT_S, "--timeout", min=1.0, help="Seconds the measuring child may take."
    ),
) -> None:
    """Measure our forward, dx and dw grouped GEMMs and the whole MoE block side by side with
    torch._grouped_mm, the per-expert loop and one dense GEMM of the same FLOPs, over a range of
    token counts, in a child process; print a table, write JSON and a PNG plot under --out.

    Exit codes: 0 measured (bench asserts no speed), 2 usage error (unknown preset, bad --gpus,
    --tokens, --dtype or --routing, --tiny with --gpus or --placement), 3 too few GPUs (none without --tiny,
    fewer than 2 for --placement), 4 the benchmark child failed (crash, timeout, no report).
    """
    err = stderr_console()
    if preset not in PRESETS:
        raise typer.BadParameter(
            f"unknown preset {preset!r}; known: {', '.join(PRESETS)}", param_hint="--preset"
        )
    if dtype not in ("bf16", "fp16", "fp32"):
        raise typer.BadParameter(f"{dtype!r}: choose bf16, fp16 or fp32", param_hint="--dtype")
    if routing not in ROUTINGS:
        raise typer.BadParameter(f"{routing!r}: choose {' or '.join(ROUTINGS)}", param_hint="--routing")
    try:
        counts = parse_tokens(tokens) if tokens else default_tokens(preset, tiny=tiny)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--tokens") from None
    used: tuple[GpuInfo, ...] = ()
    if tiny:
        if gpus or placement:
            what = "--gpus" if gpus else "--placement"
            err.print(
                f"[red]error:[/] --tiny runs on the CPU under the Triton interpreter; {what} needs GPUs"
            )
            raise typer.Exit(ExitCode.USAGE)
        if max(counts) > TINY_MAX_TOKENS:
            raise typer.BadParameter(
                f"--tiny runs in the interpreter: at most {TINY_MAX_TOKENS} tokens", param_hint="--tokens"
            )
    else:
        used = _select(gpus, need=2 if placement else 1)
    request = BenchRequest(
        preset="tiny" if tiny else preset,
        tokens=counts,
        dtype=dtype,  # type: ignore[arg-type]
        tiny=tiny,
        block=block,
        placement=placement,
        routing=routing,  # type: ignore[arg-type]
    )
    where = ", ".join(g.describe() for g in used) if used else "the CPU (Triton interpreter, nothing timed)"
    err.print(f"bench {request.preset}, tokens {','.join(map(str, counts))} on {where}", style="dim")
    try:
        report = run_bench(
            request,
            gpus=used,
            workdir=out,
            timeout_s=timeout,
            on_line=lambda line: err.print(line, style="dim", markup=False, highlight=False),
        )
    except BenchError as exc:
        err.print(f"[red]error:[/] {exc.message}; its output is in {out / BENCH_FILES['log']}")
        if exc.tail:
            err.print(exc.tail, markup=False, highlight=False)
        raise typer.Exit(ExitCode.CHECK_BROKEN) from None
    command = ["qmoe-doctor", "bench", "--preset", request.preset, "--tokens", ",".join(map(str, counts))]
    command += ["--tiny"] if tiny else ["--gpus", ",".join(str(g.index) for g in used), "--dtype", dtype]
    command += (["--placement"] if placement else []) + ([] if block else ["--no-block"])
    command += ["--routing", routing] if routing != "random" else []
    report = dataclasses.replace(report, command=shlex.join(command))
    files: dict[str, str | None] = {
        "json": str(out / BENCH_FILES["json"]),
        "plot": _plot(report, out / BENCH_FILES["plot"]) if plot else None,
        "log": str(out / BENCH_FILES["log"]),
    }
    write_json(report, out / BENCH_FILES["json"], files)
    if json_out:
        emit_json("bench", report_document(report, files))
    else:
        render_report(stdout_console(), report)
    err.print(f"wrote {', '.join(p for p in files.values() if p)}", style="dim")
    raise typer.Exit(ExitCode.HEALTHY)


def _select(spec: str | None, *, need: int) -> tuple[GpuInfo, ...]:
    err = stderr_console()
    inv = collect_inventory()
    if not inv.gpus and not spec:
        err.print(
            f"[red]error:[/] no GPU found ({inv.nvml_error or 'NVML lists none'}): bench measures GPU "
            "throughput. Run [bold]qmoe-doctor bench --tiny[/] for a CPU check that it works."
        )
        raise typer.Exit(ExitCode.TOO_FEW_GPUS)
    try:
        chosen = select_gpus(inv, spec)
    except GpuSelectionError as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(ExitCode.USAGE) from None
    if len(chosen) < need:
        err.print(
            f"[red]error:[/] --placement needs 2 GPUs; {len(chosen)} selected "
            f"({', '.join(g.describe() for g in chosen)})"
        )
        raise typer.Exit(ExitCode.TOO_FEW_GPUS)
    return chosen[:need]


def _plot(report: BenchReport, path: Path) -> str | None:
    from qmoe_doctor.reports.plot import MISSING_MATPLOTLIB, plot_available, write_plot

    err = stderr_console()
    if not report.timed:
        err.print("no plot: a --tiny run times nothing", style="dim")
        return None
    if not plot_available():
        err.print(MISSING_MATPLOTLIB, style="yellow")
        return None
    return str(write_plot(report, path))
