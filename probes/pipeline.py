"""The PIPELINE probe (child side; imports torch): a small model split across GPUs the way
``device_map="auto"`` splits it, trained for a few steps, checked layer by layer.

What it does, as a device_map user's process does it:

* layer ``i`` of ``layers`` lives on GPU ``placement[i] = i * n // layers`` of the ``n`` GPUs in
  ``params["devices"]`` (equal layers filled in order, as accelerate's balanced split does);
* the current device is the first GPU, set once at the start (the process default) and never
  per layer: each layer's input is moved to the layer's device with ``.to()`` (the first copy
  a -> b is what turns peer access a -> b on), and the kernel under test is called with the
  first GPU current, exactly as in a real pipeline;
* each layer first holds its device's stream for ``busy_s`` seconds (``probes/stream_hold.py``).
  It stands for the attention and norms a real layer queues there, and keeps that GPU behind the
  host as it always is in a real run (the host races ahead; only a synchronize waits);
* forward and backward, ``steps`` times, with an SGD update after each step. Weights come from
  a seeded generator per layer, so every run builds the same model.

Checked against the torch twin (``MoEBlockTorch``, the stock per-expert loop) on the first GPU,
teacher-forced: for each layer the twin gets the layer's weights, the input the layer really got
and the gradient that really reached its output. An error then shows in the layer that made it,
does not spread to later layers, and no router decision flips because an earlier layer drifted.
Compared: the layer's output, its input gradient and its parameter gradients, each as
``||out - ref|| / ||ref||`` against the block tolerance of ``core.tolerances``.

``params``: ``layers``, ``steps``, ``devices`` (CUDA ordinals in pipeline order; ``None`` entries
mean the CPU, for tests under the Triton interpreter), ``preset``, ``tokens``, ``busy_s``,
``lr``. Facts written (``Outcome.facts``):

* ``pipeline.placement``: the index into ``devices`` of each layer; ``pipeline.layer_devices``:
  each layer's device ("cuda:1");
* ``pipeline.at``: where the probe is (step, layer, stage, device), updated before every stage,
  so a crash is placed: an asynchronous CUDA error surfaces at the next synchronize, so a crash
  at stage "sync" happened in one of the kernels queued during that step;
* ``pipeline.results``: one entry per step and layer (errors, which parameter was worst, ok);
* ``pipeline.first_failure``: the first (step, layer) that diverged, its device and stage, or None;
* ``pipeline.current_device_kept``: the current device was the first GPU at every layer's call.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from qmoe_doctor.core.records import Phase, Status
from qmoe_doctor.core.shapes import PRESETS, MoEShape, get_preset
from qmoe_doctor.core.tolerances import tolerance
from qmoe_doctor.kernels.backward import GroupedGemm
from qmoe_doctor.kernels.moe_block import MoEBlock, MoEBlockTorch
from qmoe_doctor.probes.context import ProbeContext
from qmoe_doctor.probes.loader import load_kernel
from qmoe_doctor.probes.stream_hold import hold_stream

#: 10 ms of queued work per layer: far longer than the launch latency of the routing ops
#: behind it, far shorter than a probe's budget (layers x steps of it).
BUSY_S = 0.01
DEFAULT_TOKENS = 128
DEFAULT_LR = 1e-2
#: Salt of the input generator, so inputs and weights never share a seed.
_INPUT_SALT = 7919

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# ---------------------------------------------------------------------------------------------
# Pure helpers (no CUDA): placement, parameters, judging
# ---------------------------------------------------------------------------------------------


def layer_placement(layers: int, n_devices: int) -> list[int]:
    """The device index of each layer: ``i * n // layers``, so equal layers fill the devices in
    order, the first ones first, as ``device_map="auto"`` places a stack of equal blocks."""
    if layers < 1 or n_devices < 1:
        raise ValueError(f"need at least one layer and one device, got {layers} layers, {n_devices} devices")
    return [i * n_devices // layers for i in range(layers)]


def block_tolerance(dtype_name: str) -> float:
    """The MoE block's tolerance (``core.tolerances``: two GEMMs, an activation and a weighted sum)."""
    return tolerance(dtype_name, "block")


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineParams:
    layers: int
    steps: int
    devices: tuple[int | None, ...]
    preset: str
    tokens: int = DEFAULT_TOKENS
    busy_s: float = BUSY_S
    lr: float = DEFAULT_LR

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> PipelineParams:
        """Read and check ``ProbeSpec.params``; a ValueError names what is wrong."""
        devices = params.get("devices")
        if not isinstance(devices, (list, tuple)) or len(devices) < 1:
            raise ValueError(f"params['devices'] must list the pipeline's devices, got {devices!r}")
        if not all(d is None or (isinstance(d, int) and d >= 0) for d in devices):
            raise ValueError(f"params['devices'] must hold CUDA ordinals (or None for the CPU): {devices!r}")
        out = cls(
            layers=int(params.get("layers", 2 * len(devices))),
            steps=int(params.get("steps", 2)),
            devices=tuple(devices),
            preset=str(params.get("preset", "tiny")),
            tokens=int(params.get("tokens", DEFAULT_TOKENS)),
            busy_s=float(params.get("busy_s", BUSY_S)),
            lr=float(params.get("lr", DEFAULT_LR)),
        )
        if out.layers < 1 or out.steps < 1 or out.tokens < 1 or not out.busy_s >= 0:
            raise ValueError(f"layers, steps and tokens must be positive, busy_s >= 0: {out}")
        if out.preset not in PRESETS:
            raise ValueError(f"unknown preset {out.preset!r}; known: {', '.join(PRESETS)}")
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerCheck:
    """One layer of one step against its teacher-forced twin."""

    step: int
    layer: int
    device: str
    out_rel_error: float
    dx_rel_error: float
    dw_rel_error: float  # the worst parameter gradient
    dw_worst: str  # which parameter that was
    out_device: str  # where the layer's output came back
    tolerance: float

    @property
    def forward_ok(self) -> bool:
        return self.out_rel_error <= self.tolerance and self.out_device == self.device

    @property
    def backward_ok(self) -> bool:
        return self.dx_rel_error <= self.tolerance and self.dw_rel_error <= self.tolerance

    @property
    def ok(self) -> bool:
        return self.forward_ok and self.backward_ok

    def as_fact(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "layer": self.layer,
            "device": self.device,
            "out_device": self.out_device,
            "out_rel_error": self.out_rel_error,
            "dx_rel_error": self.dx_rel_error,
            "dw_rel_error": self.dw_rel_error,
            "dw_worst": self.dw_worst,
            "ok": self.ok,
        }


def first_failure(checks: Sequence[LayerCheck]) -> dict[str, Any] | None:
    """The first (step, layer) that diverged, with the stage that shows it: "forward" when its
    output is wrong or misplaced, else "backward". None when every layer matched."""
    for c in sorted(checks, key=lambda c: (c.step, c.layer)):
        if c.ok:
            continue
        if not c.forward_ok:
            stage = "forward"
            what = "misplaced" if c.out_device != c.device else "wrong"
            err = c.out_rel_error
        else:
            stage = "backward"
            what = "wrong"
            err = max(c.dx_rel_error, c.dw_rel_error)
        return {
            "step": c.step,
            "layer": c.layer,
            "device": c.device,
            "stage": stage,
            "what": what,
            "rel_error": err,
            "tolerance": c.tolerance,
        }
    return None


def rel_error(out: Any, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float32 on ref's device; inf for a missing, misshapen or
    non-finite ``out`` (NaN where ref is finite counts as infinitely wrong)."""
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(ref.shape):
        return math.inf
    o = out.detach().to(ref.device, torch.float32)
    r = ref.detach().to(torch.float32)
    diff = torch.nan_to_num(o - r, nan=math.inf)
    ref_norm = float(r.norm())
    err = float(diff.norm())
    return err / ref_norm if ref_norm > 0 else err


# ---------------------------------------------------------------------------------------------
# The probe
# ---------------------------------------------------------------------------------------------


def _device(ordinal: int | None) -> torch.device:
    return torch.device("cpu") if ordinal is None else torch.device("cuda", ordinal)


def _sync_all() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


def make_block(shape: MoEShape, kernel: GroupedGemm, device: torch.device, dtype: torch.dtype, seed: int) -> MoEBlock:
    """A block on ``device`` whose weights come from ``seed`` alone (std = fan_in ** -0.5, as
    ``MoEBlock.reset_parameters`` draws them). Built on the meta device first, so a real preset
    never fills its weights twice."""
    block = MoEBlock(shape, kernel=kernel, device="meta", dtype=dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(block.named_parameters()):  # a fixed order: same weights every run
            fan_in = param.shape[-1]
            param.copy_(torch.randn(param.shape, generator=gen, device=device) * fan_in**-0.5)
    return block


def _busy(device: torch.device, seconds: float) -> None:
    """Hold ``device``'s current stream for ``seconds``. The guard restores the current device on
    exit (aten ops do the same internally): the process's current device is unchanged."""
    if device.type != "cuda" or seconds <= 0:
        return
    with torch.cuda.device(device):
        hold_stream(seconds)


class _Where:
    """Keeps ``pipeline.at`` current so a crash is placed (step, layer, stage, device)."""

    def __init__(self, ctx: ProbeContext) -> None:
        self.ctx = ctx

    def __call__(self, step: int, layer: int | None, stage: str, device: torch.device | None = None) -> None:
        self.ctx.fact(
            "pipeline.at",
            {"step": step, "layer": layer, "stage": stage, "device": None if device is None else str(device)},
        )


def run_probe(ctx: ProbeContext) -> dict[str, Any]:
    spec = ctx.spec
    p = PipelineParams.from_params(spec.params)
    ctx.crumb(Phase.IMPORT)
    kernel = load_kernel(spec.kernel)
    devices = [_device(o) for o in p.devices]
    placement = layer_placement(p.layers, len(devices))
    layer_devs = [devices[j] for j in placement]
    first = devices[0]
    ctx.fact("pipeline.placement", placement)
    ctx.fact("pipeline.layer_devices", [str(d) for d in layer_devs])
    if first.type == "cuda":
        torch.cuda.set_device(first)  # once: the process default a device_map user runs with

    ctx.crumb(Phase.SETUP)
    shape = get_preset(p.preset)
    dtype = _DTYPES[spec.shape.dtype]
    tol = block_tolerance(spec.shape.dtype)
    ctx.fact("pipeline.tolerance", tol)
    blocks = [make_block(shape, kernel, layer_devs[i], dtype, spec.seed * 1000 + i) for i in range(p.layers)]
    twin = MoEBlockTorch(shape, device="meta", dtype=dtype).to_empty(device=first)
    where = _Where(ctx)
    checks: list[LayerCheck] = []
    current_kept = True

    for step in range(p.steps):
        ctx.crumb(Phase.LAUNCH)
        gen = torch.Generator().manual_seed(spec.seed * 1000 + _INPUT_SALT * (step + 1))
        x0 = torch.randn((p.tokens, shape.hidden), generator=gen).to(first, dtype).requires_grad_()
        upstream = torch.randn((p.tokens, shape.hidden), generator=gen)  # dloss/d(last output)
        ins: list[torch.Tensor] = []
        outs: list[torch.Tensor] = []
        h = x0
        for i, block in enumerate(blocks):
            where(step, i, "forward", layer_devs[i])
            h_in = h.to(layer_devs[i])  # what accelerate's pre-forward hook does
            h_in.retain_grad()  # a no-op on the leaf input of layer 0
            _busy(layer_devs[i], p.busy_s)
            if first.type == "cuda" and torch.cuda.current_device() != first.index:
                current_kept = False
            out, _logits = block(h_in)
            out.retain_grad()
            ins.append(h_in)
            outs.append(out)
            h = out
        where(step, None, "backward", h.device)
        loss = (h.float() * upstream.to(h.device)).sum()
        loss.backward()
        ctx.crumb(Phase.SYNC)
        where(step, None, "sync")
        _sync_all()  # where an asynchronous fault of this step surfaces (loss.item() in a real loop)

        ctx.crumb(Phase.COMPARE)
        for i, block in enumerate(blocks):
            where(step, i, "compare", layer_devs[i])
            checks.append(_check_layer(step, i, block, twin, ins[i], outs[i], layer_devs[i], tol))
        ctx.fact("pipeline.results", [c.as_fact() for c in checks])

        with torch.no_grad():  # SGD, each parameter on its own device
            for block in blocks:
                for param in block.parameters():
                    if param.grad is not None:
                        param.add_(param.grad, alpha=-p.lr)
                        param.grad = None
        _sync_all()

    ctx.fact("pipeline.current_device_kept", current_kept)
    failure = first_failure(checks)
    ctx.fact("pipeline.first_failure", failure)
    ctx.note(
        f"{p.layers} layers of {p.preset} over {', '.join(dict.fromkeys(str(d) for d in layer_devs))}, "
        f"{p.steps} steps of {p.tokens} tokens, {first} current"
    )
    worst = max((c.out_rel_error for c in checks), default=0.0)
    return {
        "status": Status.PASS if failure is None else Status.WRONG,
        "rel_error": worst,
        "tolerance": tol,
        "out_device": str(outs[-1].device) if outs else None,
    }


def _check_layer(
    step: int,
    layer: int,
    block: MoEBlock,
    twin: MoEBlockTorch,
    h_in: torch.Tensor,
    out: torch.Tensor,
    device: torch.device,
    tol: float,
) -> LayerCheck:
    """The twin, on the first GPU, with this layer's weights, input and upstream gradient."""
    ref_device = next(twin.parameters()).device
    twin.load_state_dict(block.state_dict())  # copy_ across devices; converts nothing
    twin.zero_grad(set_to_none=True)
    inp = h_in.detach().to(ref_device).requires_grad_()
    ref_out, _ = twin(inp)
    upstream = out.grad
    if upstream is not None:
        ref_out.backward(upstream.to(ref_device))
    out_err = rel_error(out, ref_out)
    dx_err = rel_error(h_in.grad, inp.grad) if inp.grad is not None else math.inf
    ref_params = dict(twin.named_parameters())
    dw_err, dw_worst = 0.0, ""
    for name, param in block.named_parameters():
        ref_grad = ref_params[name].grad
        err = rel_error(param.grad, ref_grad) if ref_grad is not None else math.inf
        if err > dw_err or not dw_worst:
            dw_err, dw_worst = err, name
    return LayerCheck(
        step=step,
        layer=layer,
        device=str(device),
        out_rel_error=out_err,
        dx_rel_error=dx_err,
        dw_rel_error=dw_err,
        dw_worst=dw_worst,
        out_device=str(out.device),
        tolerance=tol,
    )


__all__ = [
    "BUSY_S",
    "LayerCheck",
    "PipelineParams",
    "block_tolerance",
    "first_failure",
    "layer_placement",
    "make_block",
    "rel_error",
    "run_probe",
]
