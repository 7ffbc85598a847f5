"""A torchrun worker (gloo, CPU, the interpreter): ExpertParallelBlock with 1 and 3
micro-batches, and with the gather dispatch (ep_gather.py, collective transport), against the
whole block on every rank's tokens, forward and backward.

Writes OUT/rank{r}.json with the relative errors; asserts nothing itself (the test reads it).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(
        (a.detach().double() - b.detach().double()).norm() / b.detach().double().norm().clamp_min(1e-30)
    )


def prepared_transport() -> type:
    """The collective transport, checking what a GPU's symmetric-memory transport needs: every
    send goes to an exchange ``prepare`` made beforehand, with the same shapes (buffers made
    lazily during a send deadlocked two H200s, 2026-11-22)."""
    from qmoe_doctor.probes.parallel.ep_gather import CollectiveTransport

    class Prepared(CollectiveTransport):
        def prepare(self, specs: dict) -> None:
            self.specs = {name: tuple(spec) for name, spec in specs.items()}

        def send(self, name: str, parts: list) -> object:
            key = tuple((int(p.shape[-2]), int(p.shape[-1]), p.dtype) for p in parts)
            if getattr(self, "specs", {}).get(name) != key:
                raise RuntimeError(f"send {name!r} {key} was not prepared: {getattr(self, 'specs', None)}")
            return super().send(name, parts)

    return Prepared


def main() -> None:
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from qmoe_doctor.kernels.moe_block import MoEBlock
    from qmoe_doctor.kernels.specimens import global_expert_ids
    from qmoe_doctor.probes.parallel.hooks import hooks_for
    from qmoe_doctor.probes.parallel.modes import ExpertParallelBlock

    Prepared = prepared_transport()

    torch.manual_seed(0)
    full = MoEBlock("tiny", dtype=torch.float32)
    tokens = 10 * world
    x = torch.randn(tokens, full.shape.hidden)
    up = torch.randn(tokens, full.shape.hidden)
    xr = x.clone().requires_grad_()
    ref, _ = full(xr)
    (ref * up).sum().backward()
    mine = slice(rank * 10, (rank + 1) * 10)
    found: dict[str, dict[str, float]] = {}
    variants = {
        "micro=1": {"micro_batches": 1},
        "micro=3": {"micro_batches": 3},
        "gather": {"dispatch": "gather"},
    }
    if len(sys.argv) > 2:  # a subset, e.g. "gather" on four ranks
        variants = {name: kw for name, kw in variants.items() if name in sys.argv[2].split(",")}
    for name, kw in variants.items():
        layer = ExpertParallelBlock(
            full, rank=rank, world=world, kernel=full.kernel, hooks=hooks_for(None), **kw
        )
        if name == "gather":
            layer._transport = Prepared(rank, world)
        xs = x[mine].clone().requires_grad_()
        out, _ = layer(xs)
        (out * up[mine]).sum().backward()
        dist.all_reduce(layer.gate.weight.grad)
        per = layer.per_rank
        own = slice(rank * per, (rank + 1) * per)
        found[name] = {
            "out": rel(out, ref[mine]),
            "dx": rel(xs.grad, xr.grad[mine]),
            "gate": rel(layer.gate.weight.grad, full.gate.weight.grad),
            "gate_up": rel(layer.gate_up_proj.grad, full.gate_up_proj.grad[own]),
            "down": rel(layer.down_proj.grad, full.down_proj.grad[own]),
        }
    # the planted remap: global ids reach the local stack, rows come out zero, the sums differ
    for name, kw in {"planted": {"micro_batches": 2}, "planted gather": {"dispatch": "gather"}}.items():
        hooks = hooks_for(global_expert_ids.moe_grouped_gemm)
        planted = ExpertParallelBlock(full, rank=rank, world=world, kernel=full.kernel, hooks=hooks, **kw)
        with torch.no_grad():
            bad, _ = planted(x[mine])
        found[name] = {"out": rel(bad, ref[mine].detach())}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    main()
