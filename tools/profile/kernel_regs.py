"""Registers, spills and shared memory of our compiled kernels for some launch configs (GPU).

    python3 tools/profile/kernel_regs.py --op dw --shape 30b-gate_up:2048 --configs 64x128x128-w8-s3-tma-r3,...

Runs each config once at the shape (benchmarks/tune_kernels.py's operands) and prints, for
every kernel Triton compiled for it, ``n_regs`` / ``n_spills`` / shared bytes: a config whose
resident operand does not fit in registers shows up as spills here before it shows up as time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root


def compiled_kernels(fn: Any) -> list[tuple[str, Any]]:
    """(name, CompiledKernel) for every specialisation of a JITFunction in this process."""
    out = []
    caches = getattr(fn, "device_caches", {})
    for entry in caches.values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        for kernel in getattr(cache, "values", lambda: [])():
            out.append((fn.__name__, kernel))
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    from benchmarks.tune_kernels import PRESET_GEMMS, Point
    from qmoe_doctor.kernels import backward, grouped_gemm
    from qmoe_doctor.kernels.tuning import config_from_name

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", default="dw", choices=["forward", "dx", "dw"])
    ap.add_argument("--shape", default="30b-gate_up:2048")
    ap.add_argument("--configs", required=True)
    args = ap.parse_args(argv)
    label, tokens = args.shape.split(":")
    e, n, k = PRESET_GEMMS[label]
    point = Point(label, e, n, k, int(tokens), torch.device("cuda", 0), torch.bfloat16, 8)
    fns = [v for mod in (grouped_gemm, backward) for v in vars(mod).values() if hasattr(v, "device_caches")]
    seen: set[int] = set()
    for name in args.configs.split(","):
        cfg = config_from_name(name)
        try:
            point.ours(args.op, cfg)()
            torch.cuda.synchronize()
        except Exception as exc:  # a config that does not compile or launch: say so, go on
            print(f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}")
            continue
        for fn in fns:
            for kname, kernel in compiled_kernels(fn):
                if id(kernel) in seen:
                    continue
                seen.add(id(kernel))
                meta = getattr(kernel, "metadata", None)
                print(
                    f"{name}: {kname} regs={getattr(kernel, 'n_regs', '?')} "
                    f"spills={getattr(kernel, 'n_spills', '?')} shared={getattr(meta, 'shared', '?')}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
