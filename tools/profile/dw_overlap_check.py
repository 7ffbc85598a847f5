"""One dw shape on the GPU: the overlapped Gluon kernel (``-ovN``) against the resident Triton
kernel and ``torch._grouped_mm``: does it take the Gluon path, does it agree, how fast.

    python3 tools/profile/dw_overlap_check.py --shape 30b-gate_up --tokens 2048 \\
        --configs 64x128x128-w8-s2-tma-ov3,64x128x128-w8-s3-tma-r3

Uniform random top-8 routing (``--hot F``: a fraction F of the rows to expert 0); the last 1% of rows are left unrouted and hold NaN (they must not
reach dw). Exit status 1 if any config disagrees with ``torch._grouped_mm`` (relative
difference over 2e-2) or writes a non-finite value. Prints one line per config, then the
reference's line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root


def main(argv: list[str] | None = None) -> int:
    import torch
    import triton.testing

    from qmoe_doctor.kernels.backward import moe_grouped_gemm_dw, pick_dw_config
    from qmoe_doctor.kernels.dw_overlap import dw_overlap_plan
    from qmoe_doctor.kernels.tuning import config_from_name
    from tools.profile.probe_common import add_shape_args, parse_gpu_shape

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(ap)
    ap.add_argument(
        "--configs", default="table,64x128x128-w8-s2-tma-ov3,64x128x128-w8-s3-tma-r3",
        help="configs to measure; 'table' is the packaged table's pick for this shape (no config passed)",
    )  # fmt: skip
    ap.add_argument(
        "--hot", type=float, default=0.0,
        help="fraction of the rows routed to expert 0 (skewed routing: experts past the resident chunks)",
    )  # fmt: skip
    args, (e, n, k, dev, gen, m) = parse_gpu_shape(ap, argv)
    routed = m - m // 100
    hot = int(routed * args.hot)
    counts = torch.bincount(torch.randint(0, e, (routed - hot,), generator=gen, device=dev), minlength=e)
    counts[0] += hot
    x = torch.randn(m, k, generator=gen, device=dev).bfloat16()
    dy = torch.randn(m, n, generator=gen, device=dev).bfloat16()
    x[routed:] = float("nan")
    dy[routed:] = float("nan")
    offs = torch.cumsum(counts, 0).to(torch.int32)
    ref = torch._grouped_mm(dy[:routed].T, x[:routed], offs=offs)
    flops = 2.0 * routed * n * k
    failed = False
    for name in args.configs.split(","):
        pinned = None if name == "table" else config_from_name(name)
        cfg = pinned or pick_dw_config(n, k, dev, torch.bfloat16, avg_rows=m / e)
        if pinned is None:
            name = f"table: {cfg.name}"
        probe = torch.empty((e, n, k), device=dev, dtype=torch.bfloat16)
        path = "gluon" if dw_overlap_plan(dy, x, probe, cfg) is not None else "triton"
        del probe
        try:
            dw = moe_grouped_gemm_dw(dy, x, counts, config=pinned)
            torch.cuda.synchronize()
        except Exception as exc:  # report and go on to the next config
            print(f"{name:32} {path:6} FAILED {type(exc).__name__}: {str(exc)[:300]}")
            failed = True
            continue
        finite = bool(torch.isfinite(dw).all())
        diff = float((dw.float() - ref.float()).norm() / ref.float().norm())
        ms = triton.testing.do_bench(lambda cfg=pinned: moe_grouped_gemm_dw(dy, x, counts, config=cfg))
        ok = finite and diff < 2e-2
        failed |= not ok
        print(
            f"{name:32} {path:6} {flops / ms / 1e9:7.1f} TFLOP/s  {ms * 1e3:8.1f} us  rel.diff {diff:.2e}"
            f"  finite {finite}  {'ok' if ok else 'WRONG'}"
        )
        del dw
    ms = triton.testing.do_bench(lambda: torch._grouped_mm(dy[:routed].T, x[:routed], offs=offs))
    print(f"{'torch._grouped_mm':32} {'cutlass':6} {flops / ms / 1e9:7.1f} TFLOP/s  {ms * 1e3:8.1f} us")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
