"""One grouped GEMM under Nsight Compute: warm up, then exactly one profiled call (GPU).

    ncu --profile-from-start off --section SpeedOfLight ... \\
        python3 tools/profile/ncu_target.py --op dw --impl ours --config 64x128x128-w8-s3-tma-r3

The operands are benchmarks/tune_kernels.py's at ``--shape`` (default the issue's point,
30b-gate_up at 2048 tokens: M=16384, E=128, N=1536, K=2048, bf16). ``--impl torch`` profiles
``torch._grouped_mm`` on the same operands, ``--impl peer`` the public design's fixed tile
(``benchmarks/public_peer.py``, called as the side by side calls it; ``--tile``); ``--config`` picks our launch
config (the packaged table's choice when omitted). Only the call between
cudaProfilerStart/Stop is profiled. Keep ``--clock-control none`` on the ncu command line: the
device's clocks are not ours to lock.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root


def main(argv: list[str] | None = None) -> int:
    import torch

    from benchmarks.tune_kernels import PRESET_GEMMS, Point
    from qmoe_doctor.kernels.tuning import config_from_name

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", default="dw", choices=["forward", "dx", "dw"])
    ap.add_argument("--impl", default="ours", choices=["ours", "torch", "peer"])
    ap.add_argument("--config", default="")
    ap.add_argument("--tile", default="128x256x64-w8-s4", help="the peer's tile, BMxBNxBK-wWARPS-sSTAGES")
    ap.add_argument("--shape", default="30b-gate_up:2048")
    args = ap.parse_args(argv)
    label, tokens = args.shape.split(":")
    e, n, k = PRESET_GEMMS[label]
    point = Point(label, e, n, k, int(tokens), torch.device("cuda", 0), torch.bfloat16, 8)
    cfg = config_from_name(args.config) if args.config else None
    if args.impl == "peer":  # the side by side's own peer call (dx: the forward kernel on w's transposed view)
        from benchmarks.side_by_side import peer_fns

        ((_, fn),) = peer_fns(point, args.op, [config_from_name(args.tile).tile])
    elif args.impl == "torch":
        fn = point.theirs(args.op)
    else:
        fn = point.ours(args.op, cfg)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
