"""What the one-shape GPU tools (``dw_overlap_check.py``, ``routing_probe.py``) share: the
``--shape`` / ``--tokens`` arguments and, once parsed, the shape and a seeded generator on
cuda:0 (an argparse error without a GPU). Imports torch only when called."""

from __future__ import annotations

import argparse
from typing import Any


def add_shape_args(ap: argparse.ArgumentParser) -> None:
    from benchmarks.tune_kernels import PRESET_GEMMS

    ap.add_argument("--shape", default="30b-gate_up", choices=sorted(PRESET_GEMMS))
    ap.add_argument("--tokens", type=int, default=2048)


def parse_gpu_shape(ap: argparse.ArgumentParser, argv: list[str] | None) -> tuple[argparse.Namespace, Any]:
    """(args, (e, n, k, device, generator, m)) with m = tokens * 8 rows (top-8)."""
    import torch

    from benchmarks.tune_kernels import PRESET_GEMMS

    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    e, n, k = PRESET_GEMMS[args.shape]
    dev = torch.device("cuda", 0)
    return args, (e, n, k, dev, torch.Generator(device=dev).manual_seed(0), args.tokens * 8)
