"""Side-by-side throughput of our MoE kernels and the alternatives, in one run.

    python -m benchmarks.bench_kernels                       # qwen3-30b-a3b gate_up, M=16384, bf16
    python -m benchmarks.bench_kernels --preset qwen3-235b-a22b --m 8192 --json-out bench.json
    python -m benchmarks.bench_kernels --tokens 512,2048,8192 --plot bench.png
    python -m benchmarks.bench_kernels --tiny                # CPU, Triton interpreter: a smoke run
    python -m benchmarks.bench_kernels --kernel mylib.moe:grouped_gemm   # also your kernel

The flag interface of the measurement: the measuring code is ``qmoe_doctor.probes.bench``
(installed with the package), the same code ``qmoe-doctor bench`` runs in a child process; here
it runs in this process on the current CUDA device, and the CLI's renderer draws the table. Rows, for forward (y = x @ w[e].T), dx (dy @ w[e]) and dw (dy_e.T @ x_e):
``qmoe`` (ours), ``torch._grouped_mm``, the ``per-expert loop``, and ``dense (same FLOPs)``, one
cuBLAS GEMM of the same FLOPs (the ceiling); and for the whole Qwen3-MoE block (forward, and
forward + backward): ``MoEBlock`` on our kernels, with ``torch._grouped_mm`` as its forward
kernel, and the per-expert-loop twin. ``--kernel REF`` (any ``qmoe-doctor --kernel`` form) adds
that kernel's forward, dx and block rows beside ours (``qmoe_doctor.probes.bench_user``).

TFLOP/s count 2*M*N*K FLOP per GEMM (6*M*H*I for the block forward, 3x that with backward) over
the median time of ``triton.testing.do_bench``. Every row also gives its relative error against
a float32 reference (float64 on the CPU). ``--tiny`` runs on the CPU under TRITON_INTERPRET=1 to
show that the script works: it times nothing and claims nothing about speed. The JSON
(``--json-out``) is the ``bench`` report of ``qmoe-doctor bench --json``.
"""

from __future__ import annotations

import argparse
import os
import sys

from qmoe_doctor.core import bench as B
from qmoe_doctor.core.kernel_ref import KernelRef, KernelRefError
from qmoe_doctor.core.shapes import get_preset
from qmoe_doctor.probes.bench import DTYPES, run, write_report  # imports torch, not triton
from qmoe_doctor.probes.loader import KernelResolutionError


def parse_script_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="bench_kernels",
        description="Side-by-side throughput of our MoE kernels and the alternatives, in one run "
        "(the same measurement as `qmoe-doctor bench`, in this process).",
    )
    p.add_argument("--preset", default="qwen3-30b-a3b", help="MoE shape preset (qmoe_doctor.core.shapes)")
    p.add_argument("--m", type=int, default=None, help="rows M = tokens * top_k (default 16384); one shape")
    p.add_argument("--tokens", default=None, help="token counts, comma-separated (instead of --m)")
    p.add_argument("--e", type=int, default=None, help="experts E (default: the preset's)")
    p.add_argument("--n", type=int, default=None, help="N of the GEMM (default: 2 * intermediate)")
    p.add_argument("--k", type=int, default=None, help="K of the GEMM (default: hidden)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument(
        "--routing", choices=B.ROUTINGS, default="random",
        help="rows per expert of the GEMM rows: random top-k (default) or balanced (every expert M/E)",
    )  # fmt: skip
    p.add_argument("--tiny", action="store_true", help="CPU + Triton interpreter, tiny shape, no timing")
    p.add_argument("--no-block", action="store_true", help="skip the MoE block rows")
    p.add_argument("--placement", action="store_true", help="also per placement (needs 2 visible GPUs)")
    p.add_argument("--kernel", default="", help="also this kernel beside ours (any qmoe-doctor --kernel form)")
    p.add_argument("--json-out", default=None, help="write the results as JSON (kind 'bench') to this path")
    p.add_argument("--plot", default=None, help="write a PNG plot to this path (needs matplotlib)")
    return p.parse_args(argv)


def script_main(argv: list[str] | None = None) -> int:
    from qmoe_doctor.cli.output import stderr_console, stdout_console
    from qmoe_doctor.cli.render.bench import render_report

    args = parse_script_args(argv)
    try:
        kernel = str(KernelRef.parse(args.kernel).validate()) if args.kernel else ""
    except KernelRefError as exc:
        print(f"bench_kernels: {exc}", file=sys.stderr)
        return 2
    if args.tiny:
        # before triton is imported: the interpreter is chosen when kernels are decorated
        os.environ["TRITON_INTERPRET"] = "1"
    preset = get_preset("tiny" if args.tiny else args.preset)
    top_k = min(preset.top_k, args.e or preset.num_experts)
    if args.tokens:
        tokens = B.parse_tokens(args.tokens)
    else:
        m = args.m or (64 if args.tiny else 16384)
        tokens = (max(1, m // top_k),)
    request = B.BenchRequest(
        preset=preset.name,
        tokens=tokens,
        dtype=args.dtype,
        tiny=args.tiny,
        block=not args.no_block,
        placement=args.placement,
        num_experts=args.e,
        n=args.n,
        k=args.k,
        routing=args.routing,
        kernel=kernel,
    )
    try:
        report = run(
            request,
            command=" ".join(["benchmarks/bench_kernels.py", *(argv if argv is not None else sys.argv[1:])]),
        )
    except KernelResolutionError as exc:  # --kernel: the user's code failed to import, or another signature
        print(f"bench_kernels: the kernel could not be used: {exc}", file=sys.stderr)
        return 2
    render_report(stdout_console(), report)
    err = stderr_console()
    if args.json_out:
        write_report(report, args.json_out)
        err.print(f"wrote {args.json_out}")
    if args.plot:
        from qmoe_doctor.reports.plot import MISSING_MATPLOTLIB, plot_available, write_plot

        if not report.timed:
            err.print("no plot: a --tiny run times nothing", style="yellow")
        elif plot_available():
            write_plot(report, args.plot)
            err.print(f"wrote {args.plot}")
        else:
            err.print(MISSING_MATPLOTLIB, style="yellow")
    return 0


if __name__ == "__main__":
    raise SystemExit(script_main())
