"""Where a MoEBlock forward + backward step spends its GPU time (GPU): ours, and ours with
``torch._grouped_mm`` as the forward kernel (the benchmark's two block rows).

    python3 tools/profile/block_profile.py --preset qwen3-30b-a3b --tokens 2048

Both variants share one parameter set and run the same backward (``moe_fused_linear``'s); each
is warmed up, then three steps are profiled (torch.profiler) and the CUDA kernels are summed
by name, largest first, with the step's wall time from CUDA events beside it.
"""

from __future__ import annotations

import argparse
from collections import defaultdict


def main(argv: list[str] | None = None) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from qmoe_doctor.kernels.moe_block import MoEBlock

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--top", type=int, default=14)
    args = ap.parse_args(argv)
    dev = torch.device("cuda", 0)

    def grouped_mm_kernel(x: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor) -> torch.Tensor:
        return torch._grouped_mm(x, w.transpose(1, 2), offs=torch.cumsum(m_sizes, 0).to(torch.int32))

    torch.manual_seed(0)
    ours = MoEBlock(args.preset, device=dev, dtype=torch.bfloat16)
    theirs = MoEBlock(args.preset, kernel=grouped_mm_kernel, device=dev, dtype=torch.bfloat16)
    theirs.load_state_dict(ours.state_dict())
    hidden = torch.randn(args.tokens, ours.shape.hidden, device=dev, dtype=torch.bfloat16)
    for name, block in (("ours", ours), ("grouped_mm forward", theirs)):
        x = hidden.clone().requires_grad_(True)

        def step(block: torch.nn.Module = block, x: torch.Tensor = x) -> None:
            for p in (*block.parameters(), x):
                p.grad = None
            block(x)[0].float().sum().backward()

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            step()
        end.record()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step()
            torch.cuda.synchronize()
        totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                totals[ev.name][0] += ev.device_time / 3.0
                totals[ev.name][1] += 1
        busy = sum(v[0] for v in totals.values())
        print(f"== {name}: step {start.elapsed_time(end) / 5:.3f} ms, GPU busy {busy / 1000:.3f} ms per step")
        for kname, (us, count) in sorted(totals.items(), key=lambda kv: -kv[1][0])[: args.top]:
            print(f"   {us / 1000:8.4f} ms  x{count // 3:<3} {kname[:110]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
