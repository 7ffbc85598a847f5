"""Host cost of `qmoe-doctor run`'s launch monitor on the MoE block's training step, one GPU.

    python -m benchmarks.monitor_overhead                  # qwen3-30b-a3b, bf16, 2048 and 128 tokens
    python -m benchmarks.monitor_overhead --tokens 2048,512,128 --steps 200 --rounds 5
    python -m benchmarks.monitor_overhead --tiny           # CPU, Triton interpreter: a smoke run

The step is ``MoEBlock`` (``qmoe_doctor.kernels.moe_block``, our kernels) forward + backward on
``tokens`` tokens. Each measurement is a child process of its own, started plainly or exactly as
``qmoe-doctor run`` starts the command (the monitor's bootstrap on PYTHONPATH, its variables
set: ``workflows.run.monitor_env``); plain and monitored children alternate for ``--rounds``
rounds so drift hits both alike. A child warms up (compiles), then times ``--steps`` steps one
by one (``torch.cuda.synchronize`` around each) and reports the median. At 2048 tokens the step
is GPU-bound; at 128 it is host-bound, where the monitor's cost (a few microseconds per launch)
shows most. A monitored child also reports its launches per step and how long one flush of its
record takes (the monitor writes it every ``knobs.RUN_FLUSH_INTERVAL_S`` seconds while it runs).

Our kernels launch through a lean path (``kernels/launch.py``: later calls go straight to the
compiled launcher). Under the monitor it stays on and hands each launch to the monitor's observer
(``core.launch_observer``), so the monitor sees every launch without Triton's full launch path.
The table has two baselines: ``plain`` (lean path on, the default) and ``no lean``
(``QMOE_DOCTOR_LEAN_LAUNCH=0``: every launch through ``JITFunction.run``). ``vs plain`` is what a
user of our kernels pays under ``qmoe-doctor run`` (the target: 3% or less at 2048 tokens);
``vs no lean`` compares with Triton's own launch path unmonitored. ``lean/step`` is how many of
the monitored child's launches per step took the lean path (0 under the interpreter; on a GPU,
as many as launches/step once the plans have compiled: fewer means it stepped aside).

``host ms`` is the median time until ``step()`` returns, before the synchronize: the host's
share (when it is close to the step time, the step is host-bound and every microsecond the
monitor adds per launch shows). ``--profile N`` also runs ``--steps`` more steps of the first
round's plain and monitored children under cProfile and prints each one's N functions of most
own time per step, side by side: where a monitored step's extra host time goes.

``--tiny`` runs the tiny preset on the CPU under TRITON_INTERPRET=1 to show that the script
works: it claims nothing about speed. Results for docs/run.md: the table this prints, with the
device and versions it prints above it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from qmoe_doctor.core.knobs import QMOE_LEAN_LAUNCH as LEAN_LAUNCH_ENV
from qmoe_doctor.workflows.run import RunOptions, monitor_env

CHILD_FLAG = "--child"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="monitor_overhead", description="Host cost of the launch monitor.")
    p.add_argument("--preset", default="qwen3-30b-a3b", help="MoE shape preset")
    p.add_argument("--tokens", default="2048,128", help="comma-separated token counts")
    p.add_argument("--steps", type=int, default=100, help="timed steps per child")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (compilation)")
    p.add_argument("--rounds", type=int, default=3, help="plain/monitored child pairs per token count")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny preset, interpreter, 1 step, no warm-up")
    p.add_argument(
        "--profile", type=int, default=0, metavar="N",
        help="also profile the first round's plain and monitored children: their N functions of most own time",
    )  # fmt: skip
    p.add_argument(CHILD_FLAG, action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child-tokens", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny:
        args.preset, args.tokens, args.steps, args.warmup, args.rounds = "tiny", "8", 1, 0, 1
    return args


# --- the child: one block, timed -----------------------------------------------------------


def child(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from qmoe_doctor.kernels.launch import counts as lean_counts
    from qmoe_doctor.kernels.moe_block import MoEBlock

    cpu = args.tiny
    device = torch.device("cpu" if cpu else "cuda")
    dtype = torch.float32 if cpu else torch.bfloat16
    torch.manual_seed(0)
    block = MoEBlock(args.preset, device=device, dtype=dtype)
    x = torch.randn(args.child_tokens, block.shape.hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(x)

    def sync() -> None:
        if not cpu:
            torch.cuda.synchronize()

    def step() -> None:
        out, _ = block(x)
        out.backward(grad)
        block.zero_grad(set_to_none=True)
        x.grad = None

    for _ in range(args.warmup):
        step()
    sync()
    monitor = _monitor()
    launches_before = monitor.seq if monitor is not None else 0
    lean_before = lean_counts.lean
    times, host = [], []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        sync()
        times.append(time.perf_counter() - t0)
        host.append(t1 - t0)
    result: dict[str, Any] = {
        "median_ms": statistics.median(times) * 1e3,
        "host_ms": statistics.median(host) * 1e3,
        "lean_per_step": (lean_counts.lean - lean_before) / args.steps,
        "monitored": monitor is not None,
    }
    if monitor is not None:
        result["launches_per_step"] = (monitor.seq - launches_before) / args.steps
        flushes = []
        for _ in range(5):
            t0 = time.perf_counter()
            monitor.flush()
            flushes.append(time.perf_counter() - t0)
        result["flush_ms"] = statistics.median(flushes) * 1e3
    if args.profile:  # after the counts above: the profiled steps are not among them
        result["profile"] = _profile(step, sync, args.steps, args.profile)
    if not cpu:
        import triton

        result["device"] = torch.cuda.get_device_name()
        result["versions"] = f"torch {torch.__version__}, triton {triton.__version__}"
    return result


def _profile(step: Any, sync: Any, steps: int, top: int) -> list[list[Any]]:
    """cProfile over ``steps`` steps: the ``top`` functions of most own time, as [where, calls
    per step, own us per step, cumulative us per step]."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        step()
    sync()
    prof.disable()
    stats: dict[tuple[str, int, str], tuple[Any, ...]] = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [
        [f"{Path(file).name}:{line}({name})", calls / steps, own / steps * 1e6, cumulative / steps * 1e6]
        for (file, line, name), (_, calls, own, cumulative, _) in rows
    ]


def _monitor() -> Any:
    """This process's launch monitor, when `qmoe-doctor run`'s bootstrap attached one."""
    attach = sys.modules.get("qmoe_doctor.monitor.attach")
    return attach.current() if attach is not None else None


# --- the parent: children in turns, one table ----------------------------------------------


def run_child(
    args: argparse.Namespace, tokens: int, *, monitored: bool, folder: Path, lean: bool = True, profile: bool = False
) -> dict[str, Any]:
    argv = [
        sys.executable, "-m", "benchmarks.monitor_overhead", CHILD_FLAG, "--child-tokens", str(tokens),
        "--preset", args.preset, "--steps", str(args.steps), "--warmup", str(args.warmup),
    ]
    if args.tiny:
        argv.append("--tiny")
    if args.profile and profile:
        argv += ["--profile", str(args.profile)]
    env = dict(os.environ)
    if args.tiny:
        env["TRITON_INTERPRET"] = "1"
    if not lean:
        env[LEAN_LAUNCH_ENV] = "0"
    if monitored:
        env = monitor_env(folder, RunOptions(), env)
    out = subprocess.run(argv, capture_output=True, text=True, env=env, check=False, cwd=Path(__file__).resolve().parents[1])
    if out.returncode != 0:
        raise SystemExit(f"the {'monitored' if monitored else 'plain'} child failed:\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    if monitored and not result["monitored"]:
        raise SystemExit("the monitored child ran without the monitor: the bootstrap did not attach")
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    rows = []
    profiles: list[tuple[int, list[list[Any]], list[list[Any]]]] = []
    facts: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="qmoe-doctor-overhead-") as tmp:
        for tokens in (int(t) for t in args.tokens.split(",")):
            plain, no_lean, watched, per_step, lean, flush = [], [], [], [], [], []
            host_plain, host_watched, lean_plain = [], [], []
            for r in range(args.rounds):
                folder = Path(tmp) / f"{tokens}-{r}"
                a = run_child(args, tokens, monitored=False, folder=folder, profile=r == 0)
                b = run_child(args, tokens, monitored=False, folder=folder, lean=False)
                c = run_child(args, tokens, monitored=True, folder=folder, profile=r == 0)
                if r == 0 and args.profile:
                    profiles.append((tokens, a.get("profile", []), c.get("profile", [])))
                plain.append(a["median_ms"])
                no_lean.append(b["median_ms"])
                watched.append(c["median_ms"])
                host_plain.append(a["host_ms"])
                host_watched.append(c["host_ms"])
                lean_plain.append(a["lean_per_step"])
                per_step.append(c["launches_per_step"])
                lean.append(c["lean_per_step"])
                flush.append(c["flush_ms"])
                facts = {**a, **facts}
            p, n, w = statistics.median(plain), statistics.median(no_lean), statistics.median(watched)
            rows.append(
                (
                    tokens, p, n, w, 100.0 * (w - p) / p, 100.0 * (w - n) / n, statistics.median(per_step),
                    statistics.median(lean), statistics.median(flush), statistics.median(host_plain),
                    statistics.median(host_watched), statistics.median(lean_plain),
                )
            )  # fmt: skip
    where = "CPU, Triton interpreter (a smoke run: no claim about speed)" if args.tiny else facts.get("device", "?")
    print(f"launch monitor overhead: MoE block training step (forward + backward), {args.preset}, "
          f"{'float32' if args.tiny else 'bfloat16'}, {where}; {facts.get('versions', '')}")
    print(f"median of {args.steps} steps per child, median of {args.rounds} rounds of children")
    for tokens, plain_rows, watched_rows in profiles:
        print(f"profile, {tokens} tokens, per step (calls, own us, cumulative us): plain child | monitored child")
        for i in range(max(len(plain_rows), len(watched_rows))):
            cells = [
                f"{r[0][:48]:48} {r[1]:9.1f} {r[2]:9.1f} {r[3]:9.1f}" if r is not None else " " * 78
                for r in (plain_rows[i] if i < len(plain_rows) else None, watched_rows[i] if i < len(watched_rows) else None)
            ]
            print(f"  {cells[0]} | {cells[1]}")
    print(
        f"{'tokens':>7}  {'plain ms':>9}  {'no lean ms':>10}  {'monitored ms':>12}  {'vs plain':>8}  "
        f"{'vs no lean':>10}  {'host plain':>10}  {'host monitored':>14}  {'plain lean':>10}  "
        f"{'launches/step':>13}  {'lean/step':>9}  {'flush ms':>8}"
    )
    for tokens, p, n, w, pct, own, per_step, lean_step, flush, host_p, host_w, lean_p in rows:
        print(
            f"{tokens:>7}  {p:>9.3f}  {n:>10.3f}  {w:>12.3f}  {pct:>+7.1f}%  {own:>+9.1f}%  "
            f"{host_p:>10.3f}  {host_w:>14.3f}  {lean_p:>10.1f}  {per_step:>13.1f}  {lean_step:>9.1f}  {flush:>8.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
