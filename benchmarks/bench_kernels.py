"""Side-by-side throughput of our MoE kernels and the alternatives, in one run.

    python -m benchmarks.bench_kernels                       # qwen3-30b-a3b gate_up, M=16384, bf16
    python -m benchmarks.bench_kernels --preset qwen3-235b-a22b --m 8192 --json-out bench.json
    python -m benchmarks.bench_kernels --tiny                # CPU, Triton interpreter: a smoke run

Rows, for forward (y = x @ w[e].T), dx (dy @ w[e]) and dw (dy_e.T @ x_e):

* ``qmoe``: ours (``moe_grouped_gemm``, ``moe_grouped_gemm_dx``, ``moe_grouped_gemm_dw``);
* ``torch._grouped_mm``: PyTorch's grouped GEMM, ``offs`` = cumulative int32 row ends;
* ``per-expert loop``: the stock Transformers loop of one GEMM per expert;
* ``dense``: one cuBLAS GEMM of the same FLOPs (the ceiling);

and for the whole Qwen3-MoE block (forward, and forward + backward): ``MoEBlock`` on our kernels,
``MoEBlock`` with ``torch._grouped_mm`` as its forward kernel, and the per-expert-loop twin.

TFLOP/s count 2*M*N*K FLOP per GEMM (6*M*H*I for the block forward, 3x that with backward) over
the median time of ``triton.testing.do_bench``. Every row also gives its relative error against
a float32 reference (float64 on the CPU). ``--tiny`` runs on the CPU under TRITON_INTERPRET=1 to
show that the script works: it times nothing and claims nothing about speed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch  # does not import triton: TRITON_INTERPRET can still be set after this

SCHEMA_VERSION = 1
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    op: str  # forward | dx | dw | block-forward | block-forward-backward
    impl: str
    ms: float | None  # median; None when not timed (--tiny) or failed
    tflops: float | None
    rel_err: float | None  # ||out - ref|| / ||ref|| against the float32 (CPU: float64) reference
    note: str = ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-30b-a3b", help="MoE shape preset (qmoe_doctor.presets)")
    p.add_argument("--m", type=int, default=None, help="rows M = tokens * top_k (default 16384)")
    p.add_argument("--e", type=int, default=None, help="experts E (default: the preset's)")
    p.add_argument("--n", type=int, default=None, help="N of the GEMM (default: 2 * intermediate)")
    p.add_argument("--k", type=int, default=None, help="K of the GEMM (default: hidden)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--tiny", action="store_true", help="CPU + Triton interpreter, tiny shape, no timing")
    p.add_argument("--no-block", action="store_true", help="skip the MoE block rows")
    p.add_argument("--json-out", default=None, help="write the results as JSON to this path")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tiny:
        # before triton is imported: the interpreter is chosen when kernels are decorated
        os.environ["TRITON_INTERPRET"] = "1"
    report = run(args)
    print(render(report))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
        print(f"wrote {args.json_out}", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    import triton
    import triton.testing

    from qmoe_doctor.kernels.backward import (
        moe_grouped_gemm_dw,
        moe_grouped_gemm_dw_torch,
        moe_grouped_gemm_dx,
        moe_grouped_gemm_dx_torch,
    )
    from qmoe_doctor.kernels.grouped_gemm import moe_grouped_gemm, moe_grouped_gemm_torch
    from qmoe_doctor.kernels.routing import sort_by_expert
    from qmoe_doctor.presets import MoEShape, get_preset

    preset = get_preset("tiny" if args.tiny else args.preset)
    if args.tiny:
        device = torch.device("cpu")
        dtype = torch.float32  # bf16 tl.dot is garbage in the interpreter
        ref_dtype = torch.float64
        m = args.m or 64
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --tiny for a CPU smoke run")
        device = torch.device("cuda", torch.cuda.current_device())
        dtype = getattr(torch, DTYPES[args.dtype])
        ref_dtype = torch.float32
        m = args.m or 16384
    e = args.e or preset.num_experts
    n = args.n or 2 * preset.intermediate
    k = args.k or preset.hidden
    timed = device.type == "cuda"

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    def bench(fn: Callable[[], object], grad_to_none: list[torch.Tensor] | None = None) -> float | None:
        if not timed:
            return None  # smoke run: every fn has already run once (for its error); no timing
        return float(triton.testing.do_bench(fn, grad_to_none=grad_to_none, return_mode="median"))

    def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
        ref = ref.to(ref_dtype)
        return float((out.to(ref_dtype) - ref).norm() / ref.norm().clamp_min(1e-30))

    rows: list[Row] = []

    def add(
        op: str, impl: str, fn: Callable[[], torch.Tensor], ref: torch.Tensor | None, flops: float
    ) -> None:
        log(f"  {op:<24} {impl}")
        try:
            out = fn()
            err = rel_err(out, ref) if ref is not None else None
            ms = bench(fn)
        except Exception as exc:  # an alternative missing on this build is a row, not a crash
            rows.append(
                Row(
                    op=op,
                    impl=impl,
                    ms=None,
                    tflops=None,
                    rel_err=None,
                    note=f"{type(exc).__name__}: {exc}"[:160],
                )
            )
            return
        tflops = flops / (ms * 1e-3) / 1e12 if ms else None
        rows.append(Row(op=op, impl=impl, ms=ms, tflops=tflops, rel_err=err))

    # ---- operands: router-like imbalance (uniform random top-k), rows sorted by expert ----
    gen = torch.Generator().manual_seed(0)
    top_k = min(preset.top_k, e)
    tokens = max(1, m // top_k)
    m = tokens * top_k
    ids = torch.rand(tokens, e, generator=gen).topk(top_k, dim=-1).indices
    m_sizes = sort_by_expert(ids, e).m_sizes.to(device)
    offs = torch.cumsum(m_sizes, 0).to(torch.int32)  # torch._grouped_mm: cumulative row ends
    x = torch.randn(m, k, generator=gen).to(device, dtype)
    dy = torch.randn(m, n, generator=gen).to(device, dtype)
    w = (torch.randn(e, n, k, generator=gen) / k**0.5).to(device, dtype)
    ends = [0, *offs.tolist()]
    dense_a = torch.randn(m, k, generator=gen).to(device, dtype)
    dense_b = torch.randn(k, n, generator=gen).to(device, dtype)
    gemm_flops = 2.0 * m * n * k
    log(f"shape M={m} E={e} N={n} K={k} {dtype} on {device} (top_k={top_k}, {tokens} tokens)")

    def loop_forward() -> torch.Tensor:
        y = torch.empty(m, n, device=device, dtype=dtype)
        for expert in range(e):
            y[ends[expert] : ends[expert + 1]] = x[ends[expert] : ends[expert + 1]] @ w[expert].T
        return y

    def loop_dx() -> torch.Tensor:
        dx = torch.empty(m, k, device=device, dtype=dtype)
        for expert in range(e):
            dx[ends[expert] : ends[expert + 1]] = dy[ends[expert] : ends[expert + 1]] @ w[expert]
        return dx

    def loop_dw() -> torch.Tensor:
        dw = torch.empty(e, n, k, device=device, dtype=dtype)
        for expert in range(e):
            dw[expert] = dy[ends[expert] : ends[expert + 1]].T @ x[ends[expert] : ends[expert + 1]]
        return dw

    x_ref, dy_ref, w_ref = x.to(ref_dtype), dy.to(ref_dtype), w.to(ref_dtype)
    ref_y = moe_grouped_gemm_torch(x_ref, w_ref, m_sizes)
    add("forward", "qmoe", lambda: moe_grouped_gemm(x, w, m_sizes), ref_y, gemm_flops)
    add(
        "forward",
        "torch._grouped_mm",
        lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs),
        ref_y,
        gemm_flops,
    )
    add("forward", "per-expert loop", loop_forward, ref_y, gemm_flops)
    add("forward", "dense (same FLOPs)", lambda: dense_a @ dense_b, None, gemm_flops)
    del ref_y

    ref_dx = moe_grouped_gemm_dx_torch(dy_ref, w_ref, m_sizes)
    add("dx", "qmoe", lambda: moe_grouped_gemm_dx(dy, w, m_sizes), ref_dx, gemm_flops)
    add("dx", "torch._grouped_mm", lambda: torch._grouped_mm(dy, w, offs=offs), ref_dx, gemm_flops)
    add("dx", "per-expert loop", loop_dx, ref_dx, gemm_flops)
    add("dx", "dense (same FLOPs)", lambda: dense_a @ dense_b, None, gemm_flops)
    del ref_dx

    ref_dw = moe_grouped_gemm_dw_torch(dy_ref, x_ref, m_sizes)
    add("dw", "qmoe", lambda: moe_grouped_gemm_dw(dy, x, m_sizes), ref_dw, gemm_flops)
    add("dw", "torch._grouped_mm", lambda: torch._grouped_mm(dy.T, x, offs=offs), ref_dw, gemm_flops)
    add("dw", "per-expert loop", loop_dw, ref_dw, gemm_flops)
    add("dw", "dense (same FLOPs)", lambda: dense_a @ dense_b, None, gemm_flops)
    del ref_dw, x_ref, dy_ref, w_ref

    if not args.no_block:
        shape = MoEShape(
            name=f"{preset.name}-bench", num_experts=e, top_k=top_k, hidden=k, intermediate=max(1, n // 2)
        )
        rows.extend(_bench_block(shape, tokens, device, dtype, ref_dtype, bench, rel_err, log))

    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "qmoe-bench-kernels",
        "timed": timed,
        "interpreter": os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "preset": preset.name,
        "dtype": str(dtype).removeprefix("torch."),
        "shape": {"m": m, "e": e, "n": n, "k": k, "top_k": top_k, "tokens": tokens},
        "flop_convention": "2*M*N*K per GEMM; block forward 6*M*H*I, forward+backward 3x",
        "created_unix": time.time(),
        "rows": [asdict(r) for r in rows],
    }


Bench = Callable[..., "float | None"]


def _bench_block(
    shape: Any,  # qmoe_doctor.presets.MoEShape
    tokens: int,
    device: torch.device,
    dtype: torch.dtype,
    ref_dtype: torch.dtype,
    bench: Bench,
    rel_err: Callable[[torch.Tensor, torch.Tensor], float],
    log: Callable[[str], None],
) -> list[Row]:
    """The whole block: ours, ours with torch._grouped_mm as the forward kernel, the loop twin."""
    from qmoe_doctor.kernels.moe_block import MoEBlock, MoEBlockTorch

    def grouped_mm_kernel(x: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(x, w.transpose(1, 2), offs=torch.cumsum(m_sizes, 0).to(torch.int32))

    torch.manual_seed(0)
    ours = MoEBlock(shape, device=device, dtype=dtype)
    with_grouped_mm = MoEBlock(shape, kernel=grouped_mm_kernel, device=device, dtype=dtype)
    twin = MoEBlockTorch(shape, device=device, dtype=dtype)
    with_grouped_mm.load_state_dict(ours.state_dict())
    twin.load_state_dict(ours.state_dict())
    reference = MoEBlockTorch(shape, device=device, dtype=ref_dtype)
    reference.load_state_dict(ours.state_dict())
    hidden = torch.randn(tokens, shape.hidden, device=device, dtype=dtype)
    ref_out = reference(hidden.to(ref_dtype))[0].detach()
    del reference
    flops = 6.0 * tokens * shape.top_k * shape.hidden * shape.intermediate
    rows: list[Row] = []
    for impl, module in (
        ("qmoe MoEBlock", ours),
        ("MoEBlock + torch._grouped_mm", with_grouped_mm),
        ("per-expert loop twin", twin),
    ):
        log(f"  block {impl}")
        x = hidden.clone().requires_grad_(True)
        params = [*module.parameters(), x]
        try:
            with torch.no_grad():
                out = module(hidden)[0]
                err = rel_err(out, ref_out)
                ms_fwd = bench(lambda m=module: m(hidden))

            def step(m: torch.nn.Module = module, x: torch.Tensor = x) -> None:
                m(x)[0].float().sum().backward()

            step()
            ms_both = bench(step, grad_to_none=params)
        except Exception as exc:
            note = f"{type(exc).__name__}: {exc}"[:160]
            rows.append(Row(op="block-forward", impl=impl, ms=None, tflops=None, rel_err=None, note=note))
            continue
        rows.append(
            Row(
                op="block-forward",
                impl=impl,
                ms=ms_fwd,
                tflops=flops / (ms_fwd * 1e-3) / 1e12 if ms_fwd else None,
                rel_err=err,
            )
        )
        rows.append(
            Row(
                op="block-forward-backward",
                impl=impl,
                ms=ms_both,
                tflops=3 * flops / (ms_both * 1e-3) / 1e12 if ms_both else None,
                rel_err=None,
            )
        )
    return rows


def render(report: dict[str, Any]) -> str:
    s = report["shape"]
    head = (
        f"{report['device']} | torch {report['torch']} | triton {report['triton']} | {report['dtype']} | "
        f"preset {report['preset']}: M={s['m']} E={s['e']} N={s['n']} K={s['k']} top_k={s['top_k']}"
    )
    lines = [head]
    if not report["timed"]:
        lines.append("CPU smoke run (Triton interpreter): nothing timed, no speed claims")
    lines.append(f"{'op':<24} {'impl':<30} {'ms':>9} {'TFLOP/s':>9} {'rel err':>9}  note")
    for r in report["rows"]:
        ms = f"{r['ms']:.3f}" if r["ms"] is not None else "-"
        tf = f"{r['tflops']:.1f}" if r["tflops"] is not None else "-"
        err = f"{r['rel_err']:.1e}" if r["rel_err"] is not None else "-"
        lines.append(f"{r['op']:<24} {r['impl']:<30} {ms:>9} {tf:>9} {err:>9}  {r['note']}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
