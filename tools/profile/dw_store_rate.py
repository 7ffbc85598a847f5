"""dw's time against the stores it cannot avoid, on this GPU.

dw writes the whole (E, N, K) weight-gradient stack whatever the token count, so at few tokens
per expert it is bound by writes. This measures, per preset point: ``zero_()`` of the stack;
store-only persistent Triton kernels writing the same (BN, BK) tiles in dw's tile order, by
pointer stores and by TMA; our dw at each config on the point's routing and with one routed row
(every tile then stores zeros through the kernel's own epilogue); and ``torch._grouped_mm``.
Rates are bytes written per second (TB/s).

    python3 tools/profile/dw_store_rate.py [--points 30b-gate_up:512,...] [--configs A,B,...]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.tune_kernels import PRESET_GEMMS, TOP_K, Point  # noqa: E402
from qmoe_doctor.kernels.backward import moe_grouped_gemm_dw, pick_dw_config  # noqa: E402
from qmoe_doctor.kernels.tuning import config_from_name  # noqa: E402


@triton.jit
def _store_tiles(out_ptr, ROWS, K, NP, BN: tl.constexpr, BK: tl.constexpr):
    k_tiles = tl.cdiv(K, BK)
    zero = tl.zeros((BN, BK), dtype=out_ptr.dtype.element_ty)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    for tile in range(tl.program_id(0), (ROWS // BN) * k_tiles, NP):
        r0 = (tile // k_tiles) * BN
        k0 = (tile % k_tiles) * BK
        tl.store(out_ptr + (r0 + rn)[:, None].to(tl.int64) * K + (k0 + rk)[None, :], zero)


@triton.jit
def _tma_store_tiles(desc, ROWS, K, NP, BN: tl.constexpr, BK: tl.constexpr):
    k_tiles = tl.cdiv(K, BK)
    zero = tl.zeros((BN, BK), dtype=tl.bfloat16)
    for tile in range(tl.program_id(0), (ROWS // BN) * k_tiles, NP):
        desc.store([(tile // k_tiles) * BN, (tile % k_tiles) * BK], zero)


def rate(written: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, float]:
    """(us per call, TB/s written) of ``fn(*args, **kwargs)``: the median of ``do_bench``."""
    ms = do_bench(lambda: fn(*args, **kwargs), warmup=25, rep=200)
    return ms * 1e3, written / (ms * 1e-3) / 1e12


def main() -> int:
    from triton.tools.tensor_descriptor import TensorDescriptor

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--points", default="30b-gate_up:512,30b-down:512,480b-gate_up:2048", help="GEMM:TOKENS,... (preset points)"
    )
    ap.add_argument(
        "--configs",
        default="32x128x128-w4-s4-p2-tma-ws,64x128x128-w4-s4-tma-ws,32x128x128-w4-s8-tma-ws,64x128x128-w8-s2-tma-ov3",
        help="our dw configs timed beside the table's pick, routed and with one routed row",
    )
    ap.add_argument(
        "--tiles", default="64x128,128x128,128x256,32x256", help="BNxBK tiles of the store-only kernels"
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("dw_store_rate: no CUDA GPU here (it times kernels on one)", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}  torch {torch.__version__}  triton {triton.__version__}")
    for item in args.points.split(","):
        label, tokens = item.split(":")
        e, n, k = PRESET_GEMMS[label]
        pt = Point(label, e, n, k, int(tokens), dev, torch.bfloat16, TOP_K)
        written = e * n * k * 2
        print(f"\n== {item}  dw ({e}, {n}, {k}) {written / 1e6:.0f} MB written, M={pt.m}")
        dw = torch.empty((e, n, k), device=dev, dtype=torch.bfloat16)
        us, tb = rate(written, dw.zero_)
        print(f"  {'zero_()':44s} {us:9.1f} us {tb:6.2f} TB/s")
        flat = dw.view(e * n, k)
        for tile in args.tiles.split(","):
            bn, bk = (int(v) for v in tile.split("x"))
            for per_sm in (1, 2):
                np_ = sms * per_sm
                us, tb = rate(written, _store_tiles[(np_,)], flat, e * n, k, np_, BN=bn, BK=bk, num_warps=4)
                print(f"  {f'store tiles {tile} x{per_sm}/SM':44s} {us:9.1f} us {tb:6.2f} TB/s")
                desc = TensorDescriptor.from_tensor(flat, [bn, bk])
                us, tb = rate(
                    written, _tma_store_tiles[(np_,)], desc, e * n, k, np_, BN=bn, BK=bk, num_warps=4
                )
                print(f"  {f'tma store tiles {tile} x{per_sm}/SM':44s} {us:9.1f} us {tb:6.2f} TB/s")
        one = torch.zeros_like(pt.m_sizes)
        one[0] = 1
        table = pick_dw_config(n, k, dev, torch.bfloat16, avg_rows=pt.m / e).name
        for name in [table] + [c for c in args.configs.split(",") if c != table]:
            cfg = config_from_name(name)
            tag = " (table)" if name == table else ""
            for what, sizes in (("routed", pt.m_sizes), ("one row", one)):
                us, tb = rate(written, moe_grouped_gemm_dw, pt.dy, pt.x, sizes, config=cfg)
                print(f"  {f'ours {name}{tag} {what}':44s} {us:9.1f} us {tb:6.2f} TB/s")
        us, tb = rate(written, torch._grouped_mm, pt.dy.T, pt.x, offs=pt.offs)
        print(f"  {'torch._grouped_mm':44s} {us:9.1f} us {tb:6.2f} TB/s")
        del pt, dw, flat
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
