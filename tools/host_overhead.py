"""Host time per call of our grouped GEMMs against ``torch._grouped_mm`` (GPU), and where it goes.

    python3 tools/host_overhead.py --tokens 128

Small batches are launch-bound: the GPU finishes a 128-token grouped GEMM faster than Python
issues the next. This times N back-to-back calls on the host (no synchronization inside the
loop; the queue is drained before and after), per op and implementation, then profiles our
forward with cProfile and prints the functions that take the time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    import torch

    from benchmarks.tune_kernels import PRESET_GEMMS, Point

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="30b-gate_up")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args(argv)
    e, n, k = PRESET_GEMMS[args.shape]
    point = Point(args.shape, e, n, k, args.tokens, torch.device("cuda", 0), torch.bfloat16, 8)
    for op in ("forward", "dx", "dw"):
        for impl, fn in (("qmoe", point.ours(op, None)), ("torch._grouped_mm", point.theirs(op))):
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            host = (time.perf_counter() - t0) / args.calls
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / args.calls
            print(f"{op:8} {impl:18} host {host * 1e6:7.1f} us/call   host+GPU {wall * 1e6:7.1f} us/call")
    fn = point.ours("forward", None)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
    print(out.getvalue()[-4000:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
