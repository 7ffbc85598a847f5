"""A small random Qwen3-MoE model from Transformers, its MoE blocks on a fused grouped-GEMM kernel,
placed over GPUs with ``device_map`` and trained for a few steps: a user's program for
``qmoe-doctor run`` to watch (docs/run.md).

    python examples/qwen3_moe_device_map.py --gpus 0,1                       # ours: no finding
    qmoe-doctor run -- python examples/qwen3_moe_device_map.py --gpus 0,1 --kernel specimen:unguarded
    qmoe-doctor run --blocking -- python examples/qwen3_moe_device_map.py --gpus 0 \\
        --kernel specimen:unmasked_rows --over-route 1000000
    qmoe-doctor run -- python examples/qwen3_moe_device_map.py --gpus 0 --kernel specimen:int32_offsets \\
        --preset qwen3-coder-480b-a35b --layers 1 --tokens 256 --steps 1
    qmoe-doctor run -- python examples/qwen3_moe_device_map.py --gpus 0,1 --side-stream \\
        --kernel specimen:wrong_stream                                       # a kernel on the default stream
    qmoe-doctor run --compare blocking -- python examples/qwen3_moe_device_map.py --gpus 0 \\
        --race side-stream                                                   # only a compare sees it
    python examples/qwen3_moe_device_map.py --cpu --steps 1                  # Triton interpreter, float32

The model is built from a config (no download): attention, norms and embeddings are Transformers'
own; every decoder layer's MLP is replaced by ``FusedMoE``, the Qwen3-MoE sparse block on
``qmoe_doctor.kernels.moe_block.MoEBlock`` whose forward grouped GEMM is the ``--kernel`` reference
(``builtin``, ``specimen:NAME``, ``module:function``, ``path/to/file.py:function``, as every
qmoe-doctor command reads it). ``accelerate.dispatch_model`` places the layers as
``from_pretrained(device_map=...)`` does: hidden states move between GPUs through its hooks and the
first GPU stays the current device, which is what an unguarded kernel trips over.

``--over-route ROWS`` adds ROWS to the last expert's row count the forward kernel is given (a
routing bug: counts that no longer describe the rows). ``--side-stream`` runs the training steps
with a new stream current on every GPU the model uses, as a program that overlaps work does: a
kernel that launches on the default stream instead of the caller's current one then stands out
(on the CPU there is no stream: it is ignored, with a message).

``--race side-stream`` plants a fault no launch shows by itself, which only ``run --compare
blocking`` sees: the forward kernel's input is produced on its device's current stream behind a
hold of that stream (``RACE_HOLD_S``), and the kernel is called on a side stream of the same
device that does not wait for it (a consumer without ``wait_stream`` on its producer): it reads
the input before it is written. Every tensor is on the launch device, so the device checks see
nothing; with ``CUDA_LAUNCH_BLOCKING=1`` the producer is done before the kernel is called, so the
blocking run is right. Over ``--gpus 0,1`` it happens on both GPUs, the second GPU's layers
reading hidden states that came across from the first. ``--race producer`` makes only the held
producer: a kernel launched on the current stream of its tensors' device is ordered after it
(ours: no divergence); an unguarded one (``--kernel specimen:unguarded`` over two GPUs) runs on
the first GPU's stream, unordered against it (a cross-device race, placement compare:
``run --compare "python ... --gpus 0 --layers 4 ..."`` over ``--gpus 0,1 --layers 4``). On the
CPU there is no stream: ignored, with a message.

Needs ``pip install "qmoe-doctor[example]"`` (transformers, accelerate).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

#: ``--race``: a consumer on a side stream without a wait on its producer, or the held producer only.
RACES = ("side-stream", "producer")
#: Seconds the forward kernel's input waits on its stream under ``--race`` (the host is on to the
#: kernel's launch within microseconds; a stream held this long is still busy then).
RACE_HOLD_S = 0.02
#: Attention head size of the presets (Qwen3-MoE's); tiny hidden sizes use smaller heads.
HEAD_DIM = 128
VOCAB = 512


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", "-k", default="builtin", help="the forward grouped GEMM (a qmoe-doctor kernel reference)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--gpus", default=None, help="CUDA devices to place the layers over, e.g. 0,1 (default: all)")
    where.add_argument("--cpu", action="store_true", help="the Triton interpreter on the CPU, float32 (CI)")
    p.add_argument("--preset", default=None, help="MoE shape preset (default: tiny on --cpu, qwen3-30b-a3b on GPUs)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: 2 per GPU, 2 on the CPU)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per step (default: 512; 16 on the CPU)")
    p.add_argument("--steps", type=int, default=3, help="training steps")
    p.add_argument("--over-route", type=int, default=0, metavar="ROWS", help="rows added to the last expert's count")
    p.add_argument("--side-stream", action="store_true", help="train with a side stream current on every GPU")
    p.add_argument(
        "--race",
        choices=RACES,
        default=None,
        help="plant a stream race no launch shows by itself: the forward kernel's input produced behind a hold of "
        "its stream, and (side-stream) the kernel called on a side stream that does not wait for it",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("layers", "tokens", "steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name} must be at least 1")
    return args


def over_routed(kernel: Callable[..., Any], rows: int) -> Callable[..., Any]:
    """``kernel`` given ``m_sizes`` with ``rows`` more on the last expert (the rows do not exist)."""

    def forward(x: Any, w: Any, m_sizes: Any, **kwargs: Any) -> Any:
        counts = m_sizes.clone()
        counts[-1] += rows
        return kernel(x, w, counts, **kwargs)

    return forward


def raced(kernel: Callable[..., Any], race: str) -> Callable[..., Any]:
    """``kernel`` whose input is produced behind a hold of its device's current stream, called
    (``race == "side-stream"``) on a side stream of that device that does not wait for it. Under
    ``CUDA_LAUNCH_BLOCKING=1`` the producer is done before the call, so the result is right."""
    import torch

    from qmoe_doctor.probes.stream_hold import hold_stream

    sides: dict[Any, Any] = {}

    def forward(x: Any, w: Any, m_sizes: Any, **kwargs: Any) -> Any:
        if x.device.type != "cuda":
            return kernel(x, w, m_sizes, **kwargs)
        with torch.cuda.device(x.device):
            # what came before (routing: m_sizes) is finished, so the one input that races is x_in
            torch.cuda.current_stream(x.device).synchronize()
            hold_stream(RACE_HOLD_S)  # the stream that produces the kernel's input is busy ...
            x_in = x.clone()  # ... so this producer is still queued when the kernel is called
        if race == "producer":  # ordered after it on the current stream of x's device, unless unguarded
            return kernel(x_in, w, m_sizes, **kwargs)
        side = sides.get(x.device)
        if side is None:
            side = sides[x.device] = torch.cuda.Stream(device=x.device)
        # PLANTED: the consumer runs on a side stream with no side.wait_stream(current): it reads x_in
        # before the clone has written it
        with torch.cuda.stream(side):
            y = kernel(x_in, w, m_sizes, **kwargs)
        torch.cuda.current_stream(x.device).wait_stream(side)  # what follows waits for y: only the input races
        return y

    return forward


def use_side_streams(devices: list[Any]) -> list[Any]:
    """A new stream made current on each of ``devices`` (ordered after the set-up queued on its
    default stream), then the first device current again: ``torch.cuda.set_stream`` makes the
    stream's device current too."""
    import torch

    streams = []
    for device in devices:
        stream = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        torch.cuda.set_stream(stream)
        streams.append(stream)
    torch.cuda.set_device(devices[0])
    return streams


def build(args: argparse.Namespace, devices: list[Any], dtype: Any) -> tuple[Any, dict[str, Any]]:
    """The model with its MLPs replaced by FusedMoE blocks, placed over ``devices``."""
    import torch
    from torch import nn
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from qmoe_doctor.core.shapes import get_preset
    from qmoe_doctor.kernels.moe_block import MoEBlock
    from qmoe_doctor.probes.loader import load_kernel

    shape = get_preset(args.preset or ("tiny" if args.cpu else "qwen3-30b-a3b"))
    layers = args.layers or 2 * max(1, len(devices) if not args.cpu else 1)
    head_dim = min(HEAD_DIM, shape.hidden // 4)
    heads = shape.hidden // head_dim
    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=shape.hidden,
        intermediate_size=64,  # the dense MLP each layer is built with, then replaced
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 8),
        head_dim=head_dim,
        moe_intermediate_size=shape.intermediate,
        num_experts=shape.num_experts,
        num_experts_per_tok=shape.top_k,
        norm_topk_prob=shape.norm_topk_prob,
        mlp_only_layers=list(range(layers)),  # no expert stack is allocated on the CPU first
        max_position_embeddings=max(4096, args.tokens or 0),
        tie_word_embeddings=False,
    )
    kernel = load_kernel(args.kernel)
    if args.over_route:
        kernel = over_routed(kernel, args.over_route)
    if args.race and not args.cpu:
        kernel = raced(kernel, args.race)

    class FusedMoE(nn.Module):
        """The Qwen3-MoE sparse block on the fused kernel: (batch, seq, hidden) in and out."""

        def __init__(self, device: Any) -> None:
            super().__init__()
            self.block = MoEBlock(shape, kernel=kernel, device=device, dtype=dtype)

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            batch, seq, hidden = hidden_states.shape
            out, _router_logits = self.block(hidden_states.reshape(-1, hidden))
            return out.reshape(batch, seq, hidden)

    torch.manual_seed(args.seed)
    model = Qwen3MoeForCausalLM(config).to(dtype)
    # layer i on GPU i * len(devices) // layers: as device_map="auto" splits equal layers
    device_map: dict[str, Any] = {"model.embed_tokens": devices[0], "model.rotary_emb": devices[0]}
    for i, layer in enumerate(model.model.layers):
        device = devices[i * len(devices) // layers]
        layer.mlp = FusedMoE(device)
        device_map[f"model.layers.{i}"] = device
    device_map["model.norm"] = devices[-1]
    device_map["lm_head"] = devices[-1]
    from accelerate import dispatch_model

    return dispatch_model(model, device_map=device_map), device_map


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import torch

    if args.cpu:
        devices: list[Any] = ["cpu"]
        dtype = torch.float32  # the interpreter's tl.dot is wrong in bfloat16
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: pass --cpu to run on the Triton interpreter", file=sys.stderr)
            return 2
        wanted = [int(g) for g in args.gpus.split(",")] if args.gpus else list(range(torch.cuda.device_count()))
        devices = [torch.device("cuda", g) for g in wanted]
        dtype = torch.bfloat16
    model, device_map = build(args, devices, dtype)
    placed = sorted({str(d) for d in device_map.values()})
    tokens = args.tokens or (16 if args.cpu else 512)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(args.seed)
    print(f"{args.kernel}: {len(model.model.layers)} layers over {', '.join(placed)}, {tokens} tokens a step", flush=True)
    if args.race and args.cpu:
        print("--race: the CPU has no CUDA stream; ignored", file=sys.stderr)
    if args.side_stream and args.cpu:
        print("--side-stream: the CPU has no CUDA stream; ignored", file=sys.stderr)
    elif args.side_stream:
        streams = use_side_streams(devices)
        print(f"side streams current: {', '.join(f'{s.device} 0x{s.cuda_stream:x}' for s in streams)}", flush=True)
    step_s: list[float] = []
    for step in range(1, args.steps + 1):
        ids = torch.randint(0, VOCAB, (1, tokens), generator=generator).to(devices[0])
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.item()  # waits for the loss's GPU; the other GPU's last work is waited for by the next step's
        step_s.append(time.perf_counter() - t0)
        print(f"step {step}/{args.steps}: loss {value:.4f} ({step_s[-1]:.2f} s)", flush=True)
    if len(step_s) > 1:  # the first step compiles: left out
        print(f"median step {statistics.median(step_s[1:]) * 1e3:.2f} ms over steps 2-{len(step_s)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
