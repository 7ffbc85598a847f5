"""How much of a grouped GEMM's time is routing imbalance, and what the memory system allows:
one preset shape, forward and dw, ours (configs) and ``torch._grouped_mm``, under random
routing (uniform random top-8, the benchmark's) and balanced routing (every expert M/E rows:
no partial row tile anywhere), and the copy engine's ceilings on the weight stack.

    python3 tools/profile/routing_probe.py --shape 30b-gate_up --tokens 2048 \\
        --forward table,64x256x64-w4-s4-tma-flat --dw table,32x128x128-w8-s3-tma-ov5

Prints one line per (op, routing, implementation); each of ours is checked against
``torch._grouped_mm`` (relative difference under 2e-2, else the line says WRONG and the exit
status is 1). Ceilings: reading the (E, N, K) stack once (torch's sum, and a plain Triton
kernel of wide loads), writing it (``zero_``), copying it; as TB/s and as the TFLOP/s of this shape's forward if its bytes moved at that rate.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root


def stream_read(t):  # noqa: ANN001, ANN201 - torch objects
    """A callable reading every byte of contiguous ``t`` once with wide loads spread over a
    persistent grid (a sum per program): the read ceiling without a reduction's tail."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _read_kernel(ptr, out_ptr, n, PROGRAMS: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(pid * BLOCK, n, PROGRAMS * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            acc += tl.load(ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(acc, 0))

    flat = t.reshape(-1)
    programs = torch.cuda.get_device_properties(t.device).multi_processor_count * 4
    out = torch.empty(programs, device=t.device, dtype=torch.float32)
    return lambda: _read_kernel[(programs,)](
        flat, out, flat.numel(), PROGRAMS=programs, BLOCK=8192, num_warps=8
    )


def main(argv: list[str] | None = None) -> int:
    import torch
    import triton.testing

    from qmoe_doctor.kernels.backward import moe_grouped_gemm_dw, pick_dw_config
    from qmoe_doctor.kernels.grouped_gemm import moe_grouped_gemm, pick_config
    from qmoe_doctor.kernels.tuning import config_from_name
    from qmoe_doctor.probes.bench import routing_sizes
    from tools.profile.probe_common import add_shape_args, parse_gpu_shape

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(ap)
    ap.add_argument(
        "--forward", default="table", help="forward configs ('table': the packaged pick); '' for none"
    )
    ap.add_argument("--dw", default="table", help="dw configs ('table': the packaged pick); '' for none")
    ap.add_argument(
        "--routings", default="random,balanced", help="any of random,balanced (qmoe-doctor bench --routing)"
    )
    ap.add_argument("--no-ceilings", action="store_true")
    args, (e, n, k, dev, gen, m) = parse_gpu_shape(ap, argv)
    flops = 2.0 * m * n * k
    x = torch.randn(m, k, generator=gen, device=dev).bfloat16()
    w = (torch.randn(e, n, k, generator=gen, device=dev) / k**0.5).bfloat16()
    dy = torch.randn(m, n, generator=gen, device=dev).bfloat16()
    failed = False
    print(f"{args.shape}: E={e} N={n} K={k}, {args.tokens} tokens (M={m}), bf16")

    if not args.no_ceilings:
        stack = w.numel() * w.element_size()
        fwd_bytes = stack + (x.numel() + m * n) * 2  # weights + x read, y written
        out = torch.empty_like(w)
        for what, fn, moved in (
            ("read (sum)", lambda: w.sum(dtype=torch.float32), stack),
            ("read (stream)", stream_read(w), stack),
            ("write (zero_)", lambda: out.zero_(), stack),
            ("copy", lambda: out.copy_(w), 2 * stack),
        ):
            ms = triton.testing.do_bench(fn)
            rate = moved / ms / 1e9  # TB/s
            print(f"ceiling {what:16} {ms * 1e3:8.1f} us  {rate:5.2f} TB/s  forward at this rate: "
                  f"{flops / (fwd_bytes / rate / 1e12) / 1e12:6.1f} TFLOP/s")  # fmt: skip
        del out

    for routing in args.routings.split(","):
        counts = routing_sizes(m // 8, e, 8, gen, dev, routing)  # the benchmark's routings
        offs = torch.cumsum(counts, 0).to(torch.int32)
        waste = float((torch.ceil(counts / 128) * 128).sum() / m)
        print(f"-- {routing}: rows per expert {int(counts.min())}..{int(counts.max())}, "
              f"128-row tiles cover {waste:.2f}x the rows")  # fmt: skip
        for op, names in (("forward", args.forward), ("dw", args.dw)):
            if not names:
                continue
            if op == "forward":
                ref = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
                ms = triton.testing.do_bench(
                    lambda offs=offs: torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
                )
            else:
                ref = torch._grouped_mm(dy.T, x, offs=offs)
                ms = triton.testing.do_bench(lambda offs=offs: torch._grouped_mm(dy.T, x, offs=offs))
            print(
                f"{op:8} {routing:9} {'torch._grouped_mm':36} {flops / ms / 1e9:7.1f} TFLOP/s  {ms * 1e3:8.1f} us"
            )
            for name in names.split(","):
                pinned = None if name == "table" else config_from_name(name)
                if op == "forward":
                    cfg = pinned or pick_config(m, n, k, e, dev, torch.bfloat16, op="forward")

                    def call(cfg=pinned, counts=counts):  # noqa: ANN001, ANN202
                        return moe_grouped_gemm(x, w, counts, config=cfg)
                else:
                    cfg = pinned or pick_dw_config(n, k, dev, torch.bfloat16, avg_rows=m / e)

                    def call(cfg=pinned, counts=counts):  # noqa: ANN001, ANN202
                        return moe_grouped_gemm_dw(dy, x, counts, config=cfg)

                label = cfg.name if pinned else f"table: {cfg.name}"
                try:
                    got = call()
                    torch.cuda.synchronize()
                except Exception as exc:  # report and go on
                    print(f"{op:8} {routing:9} {label:36} FAILED {type(exc).__name__}: {str(exc)[:300]}")
                    failed = True
                    continue
                diff = float((got.float() - ref.float()).norm() / ref.float().norm())
                ok = bool(torch.isfinite(got).all()) and diff < 2e-2
                failed |= not ok
                del got
                ms = triton.testing.do_bench(call)
                print(f"{op:8} {routing:9} {label:36} {flops / ms / 1e9:7.1f} TFLOP/s  {ms * 1e3:8.1f} us"
                      f"  rel.diff {diff:.1e} {'ok' if ok else 'WRONG'}")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
