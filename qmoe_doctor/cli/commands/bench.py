"""`qmoe-doctor bench`: kernel throughput side by side, in TFLOP/s and against a dense GEMM.

The library (``qmoe_doctor.workflows.bench``, records in ``qmoe_doctor.core.bench``) does the work in a child process; this module
validates, calls, renders and writes the files under --out.
"""

from __future__ import annotations

import dataclasses
import shlex
import tempfile
from pathlib import Path
from typing import Annotated, Literal, cast

import typer

from qmoe_doctor.cli import options as opt
from qmoe_doctor.cli.devices import Need, check_gpus_option, select_devices
from qmoe_doctor.cli.errors import CliError
from qmoe_doctor.cli.output import (
    OutputPathError,
    check_outputs,
    emit_document,
    note,
    save_document,
    stderr_console,
    stdout_console,
)
from qmoe_doctor.cli.render.bench import render_report
from qmoe_doctor.core.bench import (
    BENCH_FILES,
    DEFAULT_TIMEOUT_S,
    DEFAULT_TOKENS,
    ROUTINGS,
    TINY_MAX_TOKENS,
    BenchReport,
    BenchRequest,
    default_tokens,
    parse_tokens,
    report_document,
)
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.machine.inventory import GpuInfo
from qmoe_doctor.reports.plot import MISSING_MATPLOTLIB, plot_available, write_plot
from qmoe_doctor.workflows.bench import BenchError, run_bench

_TOKENS_HELP = "; ".join(f"{p}: {','.join(map(str, t))}" for p, t in DEFAULT_TOKENS.items() if p != "tiny")
_TOKENS_HELP += f"; --tiny: {','.join(map(str, DEFAULT_TOKENS['tiny']))}"
DEFAULT_OUT = Path("qmoe-bench")
ROUTING_HELP = (
    "Rows per expert of the GEMM rows: 'random' (each token's top-k of uniform random scores, an "
    "untrained router: many experts end in a partial row tile) or 'balanced' (every expert M/E rows: "
    "the kernels without routing imbalance). The block rows use the block's own router."
)
#: --kernel here adds a kernel beside ours instead of choosing the one under test, so the shared
#: alias's help (opt.KernelOpt: "Kernel, called as ...") is prefixed with what bench does with it;
#: the forms, the parser (opt.kernel_ref) and the refusals are the shared ones.
KERNEL_HELP = (
    "Also measure this kernel beside ours, in the same table and plot: its forward, its dx (the "
    "forward on the transposed weights; no dw: the signature has none) and the MoE block with it as "
    "the forward kernel. " + opt.KERNEL_HELP
)


def bench_command(
    ctx: typer.Context,
    preset: opt.PresetOpt = opt.DEFAULT_PRESET,
    gpus: opt.GpusOpt = None,
    tokens: Annotated[
        str | None,
        typer.Option(
            "--tokens",
            help=f"Token counts, comma-separated; rows M = tokens x top_k. Default per preset: {_TOKENS_HELP}.",
        ),
    ] = None,
    placement: Annotated[
        bool,
        typer.Option(
            "--placement",
            help="Also time the forward per placement on 2 GPUs: guarded (ours) against remote execution over "
            "peer access (specimen:unguarded), the reference for scan's 'slow' label.",
        ),
    ] = False,
    block: Annotated[
        bool, typer.Option("--block/--no-block", help="Also the whole MoE block, forward and backward.")
    ] = True,
    dtype: Annotated[
        str, typer.Option("--dtype", help="bf16, fp16 or fp32 (ignored by --tiny: float32).")
    ] = "bf16",
    routing: Annotated[str, typer.Option("--routing", help=ROUTING_HELP)] = "random",
    kernel: Annotated[str | None, typer.Option("--kernel", "-k", help=KERNEL_HELP)] = None,
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            help="Folder for bench.json, bench.png and bench.log (default ./qmoe-bench, or a temp folder when the working directory is read-only).",
        ),
    ] = DEFAULT_OUT,
    json_out: opt.JsonOpt = False,
    save: opt.SaveOpt = None,
    plot: Annotated[
        bool, typer.Option("--plot/--no-plot", help="Draw bench.png (needs matplotlib: the 'plot' extra).")
    ] = True,
    tiny: Annotated[
        bool,
        typer.Option(
            "--tiny",
            help="Run on the CPU under the Triton interpreter at the tiny preset, to check that the benchmark "
            "works: nothing is timed and no speed is claimed.",
        ),
    ] = False,
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout",
            callback=opt.timeout_seconds,
            help=f"Seconds the measuring child may take, from 1 to {opt.MAX_TIMEOUT_S:g} (a week).",
        ),
    ] = DEFAULT_TIMEOUT_S,
) -> None:
    """Measure our forward, dx and dw grouped GEMMs and the whole MoE block side by side with
    torch._grouped_mm, the per-expert loop, one dense GEMM of the same FLOPs and, with --kernel,
    your kernel, over a range of token counts, in a child process; print a table, write JSON and
    a PNG plot under --out. --gpus: the first measures; --placement uses the first two.

    Exit codes: 0 measured (bench asserts no speed), 2 usage error (unknown preset, bad --gpus,
    --tokens, --dtype, --routing or --kernel, a --kernel the child cannot import, --tiny with
    --gpus or --placement, an --out or --save that cannot be written), 3 too few GPUs (none
    without --tiny, fewer than 2 for --placement), 4 the benchmark child failed (crash, timeout,
    no report), 130 interrupted.
    """
    opt.preset(preset)
    check_gpus_option(gpus)
    ref = str(opt.kernel_ref(kernel)) if kernel is not None else ""  # KernelRefError: exit 2, no child
    if dtype not in ("bf16", "fp16", "fp32"):
        raise CliError(f"--dtype {dtype!r}: choose bf16, fp16 or fp32")
    if routing not in ROUTINGS:
        raise CliError(f"--routing {routing!r}: choose {' or '.join(ROUTINGS)}")
    try:
        counts = parse_tokens(tokens) if tokens is not None else default_tokens(preset, tiny=tiny)
    except ValueError as exc:
        raise CliError(f"--tokens: {exc}") from None
    if tiny and (gpus is not None or placement):
        raise CliError(
            f"--tiny runs on the CPU under the Triton interpreter; {'--gpus' if gpus is not None else '--placement'} needs GPUs"
        )
    if tiny and max(counts) > TINY_MAX_TOKENS:
        raise CliError(f"--tokens: --tiny runs in the interpreter: at most {TINY_MAX_TOKENS} tokens")
    check_outputs(files={"--save": save})
    out = _out_folder(out, given=opt.given(ctx, "out"))
    need = Need(
        count=2 if placement else 1,
        code=ExitCode.TOO_FEW_GPUS,
        why="--placement needs 2 GPUs" if placement else "bench measures GPU throughput",
        hint="Run `qmoe-doctor bench --tiny` for a CPU check that it works.",
    )
    used: tuple[GpuInfo, ...] = () if tiny else select_devices(gpus, need=need).gpus[: need.count]
    request = BenchRequest(
        preset="tiny" if tiny else preset,
        tokens=counts,
        dtype=cast(Literal["bf16", "fp16", "fp32"], dtype),
        tiny=tiny,
        block=block,
        placement=placement,
        routing=cast(Literal["random", "balanced"], routing),
        kernel=ref,
    )
    where = ", ".join(g.describe() for g in used) if used else "the CPU (Triton interpreter, nothing timed)"
    err = stderr_console()
    beside = f", with --kernel {ref}" if ref else ""
    note(f"bench {request.preset}, tokens {','.join(map(str, counts))} on {where}{beside}", style="dim")
    try:
        report = run_bench(
            request, gpus=used, workdir=out, timeout_s=timeout, on_line=lambda ln: err.print(ln, style="dim")
        )
    except BenchError as exc:  # its output streamed above; the log keeps it
        raise CliError(
            f"{exc.message}; its output is in {out / BENCH_FILES['log']}", code=ExitCode.CHECK_BROKEN
        ) from None
    report = dataclasses.replace(report, command=_command(request, used, dtype))
    files: dict[str, str | None] = {
        "json": str(out / BENCH_FILES["json"]),
        "plot": _plot(report, out / BENCH_FILES["plot"]) if plot else None,
        "log": str(out / BENCH_FILES["log"]),
    }
    doc = report_document(report, files)
    files["json"] = str(save_document(out / BENCH_FILES["json"], doc, fallback_dir=out))
    if save is not None:
        save_document(save, doc, fallback_dir=out)
    if json_out:
        emit_document(doc)
    else:
        render_report(stdout_console(), report)
    note(f"wrote {', '.join(p for p in files.values() if p)}", style="dim")
    raise typer.Exit(ExitCode.HEALTHY)


def _out_folder(out: Path, *, given: bool) -> Path:
    """--out, checked before the child starts. The default in a read-only working directory
    becomes a temp folder (said on stderr); a given --out that cannot be written is exit 2."""
    try:
        check_outputs(dirs={"--out": out})
        return out
    except OutputPathError:
        if given:
            raise
    spare = Path(tempfile.mkdtemp(prefix="qmoe-bench-"))
    note(f"cannot write ./{DEFAULT_OUT} here; writing the bench files to {spare}")
    return spare


def _command(request: BenchRequest, used: tuple[GpuInfo, ...], dtype: str) -> str:
    """The command line that reruns this measurement."""
    command = [
        "qmoe-doctor",
        "bench",
        "--preset",
        request.preset,
        "--tokens",
        ",".join(map(str, request.tokens)),
    ]
    gpus = ",".join(str(g.index) for g in used)
    command += ["--tiny"] if request.tiny else ["--gpus", gpus, "--dtype", dtype]
    command += (["--placement"] if request.placement else []) + ([] if request.block else ["--no-block"])
    command += ["--routing", request.routing] if request.routing != "random" else []
    command += ["--kernel", request.kernel] if request.kernel else []
    return shlex.join(command)


def _plot(report: BenchReport, path: Path) -> str | None:
    if not report.timed:
        note("no plot: a --tiny run times nothing", style="dim")
        return None
    if not plot_available():
        note(MISSING_MATPLOTLIB)
        return None
    return str(write_plot(report, path))
