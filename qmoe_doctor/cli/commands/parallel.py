"""`qmoe-doctor parallel`: the MoE block under data, pipeline, tensor and expert parallelism, each
rank checked against one GPU, and timed.

A skin over :mod:`qmoe_doctor.workflows.parallel` (through :mod:`qmoe_doctor.cli.parallel_runs`,
which ``scan --parallel`` shares): validate, pick the GPUs, call, render, exit with a documented
code. Every knob of the runs is here (docs/parallel.md).
"""

from __future__ import annotations

from typing import Annotated

import typer

from qmoe_doctor.cli import options as opt
from qmoe_doctor.cli.errors import CliError
from qmoe_doctor.cli.output import check_outputs
from qmoe_doctor.cli.parallel_runs import run_and_report
from qmoe_doctor.core.options import DEFAULT_RUN_TIMEOUT_S, ParallelOptions
from qmoe_doctor.core.shapes import PRESETS

MODES_HELP = "Comma-separated modes: dp (DDP), pp (layers over GPUs, one process), tp (tensor), ep (expert)."


def parallel_command(
    modes: Annotated[str, typer.Option("--modes", "-m", help=MODES_HELP)] = "dp,pp,tp,ep",
    kernel: opt.KernelOpt = "builtin",
    gpus: opt.GpusOpt = None,
    preset: Annotated[
        str | None,
        typer.Option(
            "--preset", help=f"Shape preset: {', '.join(PRESETS)} (default: qwen3-30b-a3b; tiny on the CPU)."
        ),
    ] = None,
    tokens: Annotated[
        int | None,
        typer.Option("--tokens", min=1, help="Global tokens per step (default: 16384; 16 on the CPU)."),
    ] = None,
    steps: Annotated[
        int | None, typer.Option("--steps", min=0, help="Timed steps (default: 5; 0 on the CPU).")
    ] = None,
    warmup: Annotated[
        int | None,
        typer.Option("--warmup", min=0, help="Untimed steps before timing (default: 1; 0 on the CPU)."),
    ] = None,
    layers: Annotated[
        int | None, typer.Option("--layers", min=1, help="pp: blocks in the stack (default: 2 per GPU).")
    ] = None,
    seed: Annotated[
        int, typer.Option("--seed", help="Seed of the weights and inputs (the same in every rank).")
    ] = 0,
    backend: Annotated[
        str | None, typer.Option("--backend", help="nccl or gloo (default: nccl; gloo on the CPU).")
    ] = None,
    baseline: Annotated[
        bool | None,
        typer.Option(
            "--baseline/--no-baseline",
            help="Time the block on one GPU first, for speedup and efficiency (default: on GPUs).",
        ),
    ] = None,
    nproc_per_node: Annotated[
        int | None,
        typer.Option(
            "--nproc-per-node", min=1, help="Ranks on this node (default: one per GPU; 2 on the CPU)."
        ),
    ] = None,
    nnodes: Annotated[
        int, typer.Option("--nnodes", min=1, help="Nodes; run the same command on each (docs/parallel.md).")
    ] = 1,
    rdzv_endpoint: Annotated[
        str | None,
        typer.Option(
            "--rdzv-endpoint",
            help="HOST:PORT of the c10d rendezvous, the same on every node (default: localhost, a free port).",
        ),
    ] = None,
    rdzv_id: Annotated[
        str, typer.Option("--rdzv-id", help="Rendezvous id, the same on every node (the mode is appended).")
    ] = "qmoe-doctor",
    cpu: opt.CpuOpt = False,
    json_out: opt.JsonOpt = False,
    save: opt.SaveOpt = None,
    log_dir: opt.LogDirOpt = None,
    timeout: opt.TimeoutOpt = DEFAULT_RUN_TIMEOUT_S,
) -> None:
    """Run the MoE block (forward and backward) under data, pipeline, tensor and expert
    parallelism, each rank compared with a single-device run of the same weights and inputs,
    timed against one GPU; failures are diagnosed per rank.

    Exit codes: 0 healthy, 1 fault diagnosed, 2 usage error, 4 the runs could not start, 130
    interrupted (143 by SIGTERM).
    """
    if backend is not None and backend not in ("nccl", "gloo"):
        raise CliError(f"--backend {backend!r}: use nccl or gloo")
    if preset is not None:
        opt.preset(preset)
    check_outputs(files={"--save": save}, dirs={"--log-dir": log_dir})
    options = ParallelOptions(
        preset=preset,
        tokens=tokens,
        steps=steps,
        warmup=warmup,
        layers=layers,
        seed=seed,
        backend=backend,
        baseline=baseline,
        nproc_per_node=nproc_per_node,
        nnodes=nnodes,
        rdzv_endpoint=rdzv_endpoint,
        rdzv_id=rdzv_id,
        timeout_s=timeout,
    )
    run_and_report(
        modes=modes,
        kernel=kernel,
        gpus=gpus,
        cpu=cpu,
        options=options,
        json_out=json_out,
        save=save,
        log_dir=log_dir,
    )
