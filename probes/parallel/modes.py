"""The parallel modes, one runner each (child side; imports torch).

Every rank builds the same MoE block from the seed (``pipeline.make_block``: same weights in
every rank) and the same global batch of ``tokens`` tokens, then:

1. **reference**: the block on this rank's own device, under a device guard, forward and
   backward on the *whole* batch (the single-device run the mode must match), once;
2. **twin**: the same against ``MoEBlockTorch`` (the stock per-expert loop): the single-device
   run itself is right (``parallel.single``), so a failure in step 3 is the mode's;
3. **checked step**: one forward and backward of the mode, this rank's share, with diagnostics
   on (kernel calls watched, expert ids checked before the expert call);
4. **compare** this rank's outputs and gradients with the matching part of the reference, as
   ``||got - ref|| / ||ref||`` against the block tolerance (twice the dtype's GEMM tolerance);
5. **timing**: ``warmup`` untimed steps, then ``steps`` timed ones, each synchronized.

The loss is ``sum(out * upstream)`` over the global batch, ``upstream`` a fixed random tensor,
so every gradient is a sum over tokens and the ranks' shares add up to the reference's:

* **dp**: DistributedDataParallel over ``tokens / W`` tokens per rank; DDP *averages* the
  gradients, so W x the averaged gradient must equal the reference's;
* **tp**: every rank all tokens, a slice of every expert (``tp.py``); outputs and input
  gradients whole, weight gradients per slice, the router's all-reduced;
* **ep**: ``tokens / W`` tokens per rank, ``E / W`` experts per rank (``ep.py``); expert
  gradients per slice, the router's all-reduced. The diagnostic pass also checks the local ids
  before the expert call and recomputes the rank's expert rows with the full weights at their
  global ids (``ep.local_expert_rel_error``): a fault in one rank's experts shows there only,
  although the combine spreads wrong rows to every rank's tokens;
* **pp**: one process, layers over the devices as ``device_map="auto"`` places them (first
  device current, ``.to()`` between layers; ``pipeline.layer_placement``), each layer checked
  teacher-forced against the same block on the first device (its weights, the input it got, the
  gradient that reached its output), so a router decision never flips because an earlier layer
  drifted by a rounding;
* **single**: the reference alone, timed: the one-GPU tokens/s the modes are scaled against.

Facts are namespaced ``parallel.*`` (all modes), ``ep.*`` and ``pp.*``; docs/parallel.md lists
them.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from qmoe_doctor.core import knobs
from qmoe_doctor.core.records import Condition, Phase, ProbeSpec, Status
from qmoe_doctor.core.shapes import PRESETS, MoEShape, get_preset
from qmoe_doctor.kernels.backward import GroupedGemm, moe_fused_linear
from qmoe_doctor.kernels.combine import (
    combine_rows,
    gather_rows,
    grouping,
    segment_counts,
    segment_starts,
    sum_rows,
)
from qmoe_doctor.kernels.grouped_gemm import reserved_sms
from qmoe_doctor.kernels.moe_block import MoEBlock, MoEBlockTorch, resolve_shape, route_tokens
from qmoe_doctor.kernels.routing import sort_by_expert
from qmoe_doctor.probes.parallel import ep as ep_ops
from qmoe_doctor.probes.parallel import ep_gather
from qmoe_doctor.probes.parallel import tp as tp_ops
from qmoe_doctor.probes.parallel.hooks import LOCAL_IDS_HOOK, RankHooks
from qmoe_doctor.probes.pipeline import block_tolerance, layer_placement, make_block, rel_error

if TYPE_CHECKING:  # rank imports this module when it runs a mode
    from qmoe_doctor.probes.parallel.rank import RankContext

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
#: Salt of the input generator, so inputs and weights never share a seed.
INPUT_SALT = 7919
#: Kernel calls whose current device differs from x's device, kept with their details.
SPY_EXAMPLES = 4
#: Out-of-range expert ids reported as examples.
BAD_ID_EXAMPLES = 8

MODE_OF = {
    Condition.PARALLEL_SINGLE: "single",
    Condition.PARALLEL_DP: "dp",
    Condition.PARALLEL_PP: "pp",
    Condition.PARALLEL_TP: "tp",
    Condition.PARALLEL_EP: "ep",
}


# ---------------------------------------------------------------------------------------------
# Parameters, world, checks
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class RunParams:
    """``ProbeSpec.params`` of a parallel run, read and checked."""

    preset: str
    tokens: int  # global tokens per step (the batch every mode and the baseline process)
    layers: int  # pp: blocks in the stack (default 2 per device); other modes: 1
    steps: int  # timed steps
    warmup: int  # untimed steps after the checked step
    backend: str  # "nccl" or "gloo"
    devices: tuple[int | None, ...]  # CUDA ordinal of each local rank (pp: of each stage); None: CPU
    pg_timeout_s: float
    inject: dict[str, Any] | None = None  # self-tests: {"rank", "stage", "action", ...}

    @classmethod
    def from_spec(cls, spec: ProbeSpec) -> RunParams:
        params = spec.params
        devices = params.get("devices")
        if not isinstance(devices, (list, tuple)) or not devices:
            raise ValueError(f"params['devices'] must list the local devices, got {devices!r}")
        if not all(d is None or (isinstance(d, int) and d >= 0) for d in devices):
            raise ValueError(f"params['devices'] must hold CUDA ordinals or None (CPU): {devices!r}")
        inject = params.get("inject")
        out = cls(
            preset=str(params.get("preset", "tiny")),
            tokens=int(params.get("tokens", 64)),
            layers=int(params.get("layers", 2 * len(devices))),
            steps=int(params.get("steps", 3)),
            warmup=int(params.get("warmup", 1)),
            backend=str(params.get("backend", "gloo")),
            devices=tuple(devices),
            pg_timeout_s=float(params.get("pg_timeout_s", 300.0)),
            inject=dict(inject) if isinstance(inject, dict) else None,
        )
        if out.tokens < 1 or out.layers < 1 or out.steps < 0 or out.warmup < 0:
            raise ValueError(f"tokens and layers must be positive, steps and warmup >= 0: {out}")
        if out.preset not in PRESETS:
            raise ValueError(f"unknown preset {out.preset!r}; known: {', '.join(PRESETS)}")
        if out.backend not in ("nccl", "gloo"):
            raise ValueError(f"backend must be nccl or gloo, got {out.backend!r}")
        return out


@dataclass(frozen=True, slots=True)
class World:
    """This rank's place: global rank, local rank, world size, its device, its backend."""

    rank: int
    local_rank: int
    size: int
    device: torch.device
    backend: str
    distributed: bool  # a process group exists (torchrun); False for pp and the baseline

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # this device only: never touch another's context

    def barrier(self) -> None:
        if not self.distributed:
            return
        if self.backend == "nccl" and self.device.index is not None:
            dist.barrier(device_ids=[self.device.index])  # else NCCL guesses the device
        else:
            dist.barrier()

    def label(self) -> str:
        return f"rank {self.rank} ({self.device})"


@dataclass(frozen=True, slots=True)
class Check:
    """One output or gradient against its reference."""

    name: str  # "out", "dx", "grad:gate_up_proj", "layer 2 out", ...
    rel_error: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.rel_error <= self.tolerance  # NaN and inf fail

    def as_fact(self) -> dict[str, Any]:
        return {"name": self.name, "rel_error": self.rel_error, "ok": self.ok}


def compare(name: str, got: Any, expected: torch.Tensor | None, tol: float) -> Check:
    if expected is None:
        return Check(name, math.inf, tol)
    return Check(name, rel_error(got, expected), tol)


@dataclass
class Pass:
    """Output, input gradient and parameter gradients of one forward and backward."""

    out: torch.Tensor
    dx: torch.Tensor | None
    grads: dict[str, torch.Tensor] = field(default_factory=dict)


def loss_of(out: torch.Tensor, upstream: torch.Tensor) -> torch.Tensor:
    """``sum(out * upstream)`` in float32: d loss / d out = upstream, for every token."""
    return (out.float() * upstream).sum()


def run_block(module: nn.Module, x: torch.Tensor, upstream: torch.Tensor) -> Pass:
    """Forward and backward of a block (MoEBlock or its twin) on ``x``; gradients copied out and
    cleared from the module."""
    xr = x.detach().requires_grad_()
    out, _ = module(xr)
    loss_of(out, upstream).backward()
    grads = {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}
    module.zero_grad(set_to_none=True)
    return Pass(out=out.detach(), dx=None if xr.grad is None else xr.grad.detach(), grads=grads)


@contextmanager
def device_guard(device: torch.device) -> Iterator[None]:
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield


# ---------------------------------------------------------------------------------------------
# The kernel spy: where each call ran from, where its output landed
# ---------------------------------------------------------------------------------------------


class KernelSpy:
    """Wraps the forward kernel (the ``GroupedGemm`` seam of ``MoEBlock``): counts calls whose
    current device is not x's device (a launch that follows the current device runs on the
    wrong GPU) and outputs that come back on another device. Host-side only: no sync."""

    def __init__(self, kernel: Callable[..., Any]) -> None:
        self.kernel = kernel
        self.stage = "setup"
        self.calls: dict[str, int] = {}
        self.off_device: dict[str, int] = {}
        self.misplaced: dict[str, int] = {}
        self.examples: list[dict[str, Any]] = []

    def __call__(self, x: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor, /) -> torch.Tensor:
        stage = self.stage
        self.calls[stage] = self.calls.get(stage, 0) + 1
        current = torch.cuda.current_device() if x.device.type == "cuda" else None
        off = current is not None and current != x.device.index
        if off:
            self.off_device[stage] = self.off_device.get(stage, 0) + 1
            self._example(stage, "current device differs", current, x, None)
        y: torch.Tensor = self.kernel(x, w, m_sizes)
        if isinstance(y, torch.Tensor) and y.device != x.device:
            self.misplaced[stage] = self.misplaced.get(stage, 0) + 1
            self._example(stage, "output on another device", current, x, y)
        return y

    def _example(self, stage: str, what: str, current: int | None, x: torch.Tensor, y: Any) -> None:
        if len(self.examples) < SPY_EXAMPLES:
            self.examples.append(
                {
                    "stage": stage,
                    "what": what,
                    "current_device": current,
                    "x_device": str(x.device),
                    "out_device": None if y is None else str(y.device),
                }
            )

    def summary(self) -> dict[str, Any]:
        return {
            "calls": dict(self.calls),
            "off_device": dict(self.off_device),
            "misplaced": dict(self.misplaced),
            "examples": list(self.examples),
        }


# ---------------------------------------------------------------------------------------------
# Set-up shared by the modes
# ---------------------------------------------------------------------------------------------


@dataclass
class Setup:
    ctx: RankContext
    p: RunParams
    world: World
    shape: MoEShape
    dtype: torch.dtype
    dtype_name: str
    tol: float
    spy: KernelSpy
    hooks: RankHooks
    seed: int


def make_inputs(s: Setup, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (tokens, H) in the run's dtype and the float32 upstream gradient: the
    same in every rank (a seeded generator on the device)."""
    gen = torch.Generator(device=device).manual_seed(s.seed * 1000 + INPUT_SALT)
    shape = (s.p.tokens, s.shape.hidden)
    x = torch.randn(shape, generator=gen, device=device).to(s.dtype)
    upstream = torch.randn(shape, generator=gen, device=device)
    return x, upstream


class PinnedTwin(MoEBlockTorch):
    """The twin with its expert *choice* pinned to ``topk_ids`` (the weights still come from its
    own softmax, so the router's gradient is compared too). Teacher-forced routing: in bf16 a
    near-tie between the k-th and (k+1)-th logit can flip on a rounding, and one flipped choice
    is an O(1) difference on that token that says nothing about the kernels."""

    topk_ids: torch.Tensor | None = None  # None: the twin's own choice

    def route(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.topk_ids is None:
            return super().route(hidden_states)
        router_logits = self.gate(hidden_states)
        probs = F.softmax(router_logits, dim=1, dtype=torch.float32)
        weights = probs.gather(1, self.topk_ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return router_logits, weights.to(hidden_states.dtype), self.topk_ids


def twin_checks(s: Setup, block: MoEBlock, x: torch.Tensor, upstream: torch.Tensor, ref: Pass) -> list[Check]:
    """The single-device run against the stock per-expert loop in float32 (the block's weights
    and inputs upcast, exactly), with the block's own expert choice pinned (``PinnedTwin``)."""
    device = block.gate_up_proj.device
    with torch.no_grad(), device_guard(device):
        _, _, topk_ids = block.route(x)
    twin = PinnedTwin(block.shape, device="meta", dtype=torch.float32).to_empty(device=device)
    twin.load_state_dict(block.state_dict())  # copy_ upcasts: the same weights, exactly
    twin.topk_ids = topk_ids
    with device_guard(device):
        tw = run_block(twin, x.float(), upstream)
    checks = [compare("out", ref.out, tw.out, s.tol), compare("dx", ref.dx, tw.dx, s.tol)]
    checks += [compare(f"grad:{n}", ref.grads.get(n), g, s.tol) for n, g in sorted(tw.grads.items())]
    return checks


def record_single(s: Setup, checks: list[Check]) -> None:
    s.ctx.fact(
        "parallel.single",
        {
            "ok": all(c.ok for c in checks),
            "rel_error": max((c.rel_error for c in checks), default=0.0),
            "checks": [c.as_fact() for c in checks],
        },
    )


def record_devices(s: Setup) -> None:
    """Where this rank's memory and contexts are: the evidence of work on a device not its own.

    Contexts first (``_cuda_hasPrimaryContext`` creates none), then the peak of torch's
    allocator on each device that has one (the allocator's counters are host-side)."""
    s.ctx.fact("parallel.kernel_calls", s.spy.summary())
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    contexts = [i for i in range(torch.cuda.device_count()) if has_context is None or has_context(i)]
    s.ctx.fact("parallel.contexts", contexts)
    s.ctx.fact("parallel.peak_allocated", {str(i): int(torch.cuda.max_memory_allocated(i)) for i in contexts})
    s.ctx.fact("parallel.current_device", torch.cuda.current_device())


def foreign_allocations(s: Setup, own: set[int]) -> dict[str, int]:
    peaks = s.ctx.facts.get("parallel.peak_allocated") or {}
    return {d: int(b) for d, b in peaks.items() if int(d) not in own and int(b) > 0}


def time_steps(s: Setup, step: Callable[[], None], sync: Callable[[], None]) -> list[float]:
    """``warmup`` untimed steps, a barrier, then ``steps`` timed ones (ms, each synchronized)."""
    s.ctx.stage("warmup")
    s.spy.stage = "timing"
    for _ in range(s.p.warmup):
        step()
    sync()
    s.world.barrier()
    s.ctx.stage("timing")
    times: list[float] = []
    for _ in range(s.p.steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def record_timing(s: Setup, times: list[float]) -> None:
    if not times:
        return
    step_ms = statistics.median(times)
    s.ctx.fact("parallel.step_ms", step_ms)
    s.ctx.fact("parallel.step_ms_all", times)
    s.ctx.fact("parallel.tokens_per_step", s.p.tokens)
    s.ctx.fact("parallel.tokens_per_s", s.p.tokens / (step_ms / 1e3) if step_ms > 0 else None)


def finish(s: Setup, checks: list[Check], out_device: str, own: set[int]) -> dict[str, Any]:
    """Outcome fields from the checks, the single-device run and the placement."""
    s.ctx.fact("parallel.checks", [c.as_fact() for c in checks])
    s.ctx.fact("parallel.out_device", out_device)
    single = s.ctx.facts.get("parallel.single") or {}
    foreign = foreign_allocations(s, own)
    wrong = [c.name for c in checks if not c.ok]
    if wrong:
        s.ctx.note(f"{s.world.label()}: {', '.join(wrong)} differ from the single-device run")
    if single and not single.get("ok", True):
        s.ctx.note(f"{s.world.label()}: the single-device run itself differs from the torch twin")
    if foreign:
        s.ctx.note(
            f"{s.world.label()}: torch allocated on cuda:{', cuda:'.join(foreign)}, not its own device"
        )
    ok = not wrong and single.get("ok", True) and not foreign
    return {
        "status": Status.PASS if ok else Status.WRONG,
        "rel_error": max((c.rel_error for c in checks), default=0.0),
        "tolerance": s.tol,
        "out_device": out_device,
    }


def own_ordinals(devices: list[torch.device]) -> set[int]:
    return {d.index for d in devices if d.type == "cuda" and d.index is not None}


def _full_block(s: Setup, device: torch.device) -> tuple[MoEBlock, torch.Tensor, torch.Tensor, Pass]:
    """Steps 1-2 of every mode: the block, the batch, the reference pass, its twin check."""
    s.ctx.stage("weights")
    block = make_block(s.shape, s.spy, device, s.dtype, s.seed * 1000)
    x, upstream = make_inputs(s, device)
    s.ctx.crumb(Phase.COMPILE)  # the first kernel calls: Triton compiles here
    s.ctx.stage("reference")
    s.spy.stage = "reference"
    with device_guard(device):
        ref = run_block(block, x, upstream)
    s.ctx.stage("twin")
    record_single(s, twin_checks(s, block, x, upstream, ref))
    return block, x, upstream, ref


def _checked_step(s: Setup) -> None:
    s.ctx.crumb(Phase.LAUNCH)
    s.ctx.stage("parallel-step")
    s.spy.stage = "parallel"
    s.ctx.inject("forward")


# ---------------------------------------------------------------------------------------------
# single: the one-device baseline
# ---------------------------------------------------------------------------------------------


def run_single(s: Setup) -> dict[str, Any]:
    device = s.world.device
    block, x, upstream, ref = _full_block(s, device)
    s.ctx.crumb(Phase.SYNC)
    s.world.sync()
    record_devices(s)
    s.ctx.crumb(Phase.COMPARE)
    single = s.ctx.facts["parallel.single"]
    checks = [Check(f"twin {c['name']}", float(c["rel_error"]), s.tol) for c in single["checks"]]

    def step() -> None:
        xr = x.detach().requires_grad_()
        out, _ = block(xr)
        loss_of(out, upstream).backward()
        block.zero_grad(set_to_none=True)

    with device_guard(device):
        record_timing(s, time_steps(s, step, s.world.sync))
    return finish(s, checks, str(ref.out.device), own_ordinals([device]))


# ---------------------------------------------------------------------------------------------
# dp: DistributedDataParallel
# ---------------------------------------------------------------------------------------------


def run_dp(s: Setup) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    w = s.world
    device = w.device
    block, x, upstream, ref = _full_block(s, device)
    mine = tp_ops.tp_slice(s.p.tokens, w.rank, w.size)  # this rank's tokens
    s.ctx.fact("parallel.tokens", [mine.start, mine.stop])
    s.ctx.stage("ddp")
    model = DistributedDataParallel(block, device_ids=[device.index] if device.type == "cuda" else None)
    xs, us = x[mine], upstream[mine]

    def forward_backward() -> tuple[torch.Tensor, torch.Tensor]:
        xr = xs.detach().requires_grad_()
        out, _ = model(xr)
        loss_of(out, us).backward()
        return out.detach(), xr

    _checked_step(s)
    out, xr = forward_backward()
    s.ctx.crumb(Phase.SYNC)
    w.sync()
    record_devices(s)
    s.ctx.crumb(Phase.COMPARE)
    s.ctx.stage("compare")
    checks = [
        compare("out", out, ref.out[mine], s.tol),
        compare("dx", xr.grad, ref.dx[mine] if ref.dx is not None else None, s.tol),
    ]
    for name, param in sorted(block.named_parameters()):
        got = None if param.grad is None else param.grad.float() * w.size  # DDP averages
        checks.append(compare(f"grad:{name}", got, ref.grads.get(name), s.tol))
    block.zero_grad(set_to_none=True)

    def step() -> None:
        forward_backward()
        block.zero_grad(set_to_none=True)

    record_timing(s, time_steps(s, step, w.sync))
    return finish(s, checks, str(out.device), own_ordinals([device]))


# ---------------------------------------------------------------------------------------------
# tp: gate_up by columns, down by rows, partial outputs all-reduced
# ---------------------------------------------------------------------------------------------


def tp_block(full: MoEBlock, kernel: GroupedGemm, rank: int, world: int, dtype: torch.dtype) -> MoEBlock:
    """This rank's slice of ``full``: a block of intermediate I / W whose forward is the partial
    output (see tp.py); the router is copied whole."""
    mine = tp_ops.tp_slice(full.shape.intermediate, rank, world)
    shape = resolve_shape(full.shape, intermediate=mine.stop - mine.start)
    device = full.gate_up_proj.device
    shard = MoEBlock(shape, kernel=kernel, device="meta", dtype=dtype).to_empty(device=device)
    with torch.no_grad():
        shard.gate.weight.copy_(full.gate.weight)
        shard.gate_up_proj.copy_(tp_ops.shard_gate_up(full.gate_up_proj, rank, world))
        shard.down_proj.copy_(tp_ops.shard_down(full.down_proj, rank, world))
    return shard


def run_tp(s: Setup) -> dict[str, Any]:
    w = s.world
    device = w.device
    block, x, upstream, ref = _full_block(s, device)
    s.ctx.stage("shard")
    shard = tp_block(block, s.spy, w.rank, w.size, s.dtype)
    s.ctx.fact("tp.intermediate_per_rank", shard.shape.intermediate)

    def forward_backward() -> tuple[torch.Tensor, torch.Tensor]:
        xr = x.detach().requires_grad_()
        partial, _ = shard(tp_ops.copy_to_tensor_parallel(xr))
        out = tp_ops.reduce_from_tensor_parallel(partial)
        loss_of(out, upstream).backward()
        if shard.gate.weight.grad is not None:  # the router's gradient is a partial sum too
            dist.all_reduce(shard.gate.weight.grad)
        return out.detach(), xr

    _checked_step(s)
    out, xr = forward_backward()
    s.ctx.crumb(Phase.SYNC)
    w.sync()
    record_devices(s)
    s.ctx.crumb(Phase.COMPARE)
    s.ctx.stage("compare")
    expected = {
        "gate.weight": ref.grads.get("gate.weight"),
        "gate_up_proj": tp_ops.shard_gate_up(ref.grads["gate_up_proj"], w.rank, w.size)
        if "gate_up_proj" in ref.grads
        else None,
        "down_proj": tp_ops.shard_down(ref.grads["down_proj"], w.rank, w.size)
        if "down_proj" in ref.grads
        else None,
    }
    checks = [compare("out", out, ref.out, s.tol), compare("dx", xr.grad, ref.dx, s.tol)]
    for name, param in sorted(shard.named_parameters()):
        checks.append(compare(f"grad:{name}", param.grad, expected.get(name), s.tol))
    shard.zero_grad(set_to_none=True)

    def step() -> None:
        forward_backward()
        shard.zero_grad(set_to_none=True)

    record_timing(s, time_steps(s, step, w.sync))
    return finish(s, checks, str(out.device), own_ordinals([device]))


# ---------------------------------------------------------------------------------------------
# ep: experts sharded, tokens dispatched and combined by all-to-all
# ---------------------------------------------------------------------------------------------


class ExpertParallelBlock(nn.Module):
    """The MoE block with this rank's experts only. Parameter names are the block's
    (``gate.weight``, ``gate_up_proj``, ``down_proj``); the stacks hold ``E / W`` experts.

    Forward (``ep.py`` describes the dispatch): route this rank's tokens; cut them into
    ``micro_batches`` contiguous spans; ONE count exchange plans every span (pairs per rank and
    the slots each receiver owns, so nothing is read from the device again); each span sends
    each token once to every rank owning one of its experts, its row, k weights and k global ids
    in one message. The receiver keeps the slots it owns, remaps their ids (the
    ``local_expert_ids`` hook), runs its experts, weights and sums each pair's rows and sends the
    sums back; the sender adds them into its tokens.

    On a GPU with two or more micro-batches each span runs on its own CUDA stream, issued in the
    order send A, send B, experts A, return A, experts B, return B: NCCL runs one span's
    exchange while the other's experts compute, and autograd (each backward op on its forward
    op's stream, in reverse creation order) overlaps the backward the same way.
    ``reserve_sms`` SMs are left free by our persistent GEMMs meanwhile, for NCCL's kernels."""

    def route(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block's own router: softmax in float32, top-k, renormalize, cast back."""
        return route_tokens(self.gate, self.shape, hidden_states)

    def __init__(
        self,
        full: MoEBlock,
        *,
        rank: int,
        world: int,
        kernel: GroupedGemm,
        hooks: RankHooks,
        group: Any = None,
        micro_batches: int = 1,
        reserve_sms: int = 0,
        dispatch: str = "a2a",
        transport: str = "auto",
    ) -> None:
        super().__init__()
        s = full.shape
        self.shape = s
        self.num_experts = s.num_experts
        self.top_k = s.top_k
        self.norm_topk_prob = s.norm_topk_prob
        self.rank = rank
        self.world = world
        self.per_rank = ep_ops.experts_per_rank(s.num_experts, world)
        self.first = ep_ops.first_expert(rank, self.per_rank)
        if micro_batches < 1 or reserve_sms < 0:
            raise ValueError(f"micro_batches >= 1 and reserve_sms >= 0, got {micro_batches}, {reserve_sms}")
        self.micro_batches = micro_batches
        self.reserve_sms = reserve_sms
        if dispatch not in EP_DISPATCHES:
            raise ValueError(f"dispatch must be one of {', '.join(EP_DISPATCHES)}, got {dispatch!r}")
        if dispatch == "gather" and world < 2:
            raise ValueError("the gather dispatch exchanges with other ranks: it needs at least two")
        if dispatch == "gather" and micro_batches != 1:
            raise ValueError("the gather dispatch overlaps its exchanges itself: use one micro-batch")
        self.dispatch = dispatch
        self.transport_kind = transport
        self._transport: Any = None
        own = slice(self.first, self.first + self.per_rank)
        device, dtype = full.gate_up_proj.device, full.gate_up_proj.dtype
        if s.num_experts > ep_ops.max_packed_experts(dtype):
            raise ValueError(f"{s.num_experts} experts do not fit the id field of a {dtype} row")
        self.gate = nn.Linear(s.hidden, s.num_experts, bias=False, device=device, dtype=dtype)
        with torch.no_grad():
            self.gate.weight.copy_(full.gate.weight)
        self.gate_up_proj = nn.Parameter(full.gate_up_proj.detach()[own].clone())  # (E/W, 2I, H)
        self.down_proj = nn.Parameter(full.down_proj.detach()[own].clone())  # (E/W, H, I)
        self.kernel = kernel
        self.hooks = hooks
        self.group = group
        self._streams: list[torch.cuda.Stream] | None = None
        # diagnostic pass: called once with (global ids, local ids) of every received slot this
        # rank owns before the expert calls, and per micro-batch with (expert inputs, outputs,
        # global ids), rows sorted by expert, after them
        self.before_experts: Callable[[torch.Tensor, torch.Tensor], None] | None = None
        self.after_experts: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None] | None = None

    def _side_streams(self, device: torch.device, count: int) -> list[torch.cuda.Stream] | None:
        if device.type != "cuda" or count < 2:
            return None
        if self._streams is None or len(self._streams) < count:
            self._streams = [torch.cuda.Stream(device) for _ in range(count)]
        return self._streams[:count]

    def expert_sums(
        self,
        x_in: torch.Tensor,
        w_in: torch.Tensor,
        pair: torch.Tensor,
        slot: torch.Tensor,
        local_ids: torch.Tensor,
        global_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Received pairs -> this rank's share of each pair's output.

        x_in (P, H) tokens, w_in (P, k) their routing weights, (pair, slot) the received slots
        this rank owns (pair-major) with their local and global ids -> (P, H): the weighted sum
        of the pair's rows on this rank's experts. Local ids outside [0, E/W) are counted by no
        expert (their rows are zero)."""
        routing = sort_by_expert(local_ids[:, None], self.per_rank)
        src = pair[routing.perm]  # the pair of each row, rows sorted by local expert
        # pair p's rows sit at sorted positions inv_perm[starts[p] : starts[p + 1]]
        starts = segment_starts(segment_counts(pair, x_in.shape[0]))
        xs = gather_rows(x_in, src, routing.inv_perm, starts)  # (R, H)
        with reserved_sms(self.reserve_sms):
            gate_up = moe_fused_linear(xs, self.gate_up_proj, routing.m_sizes, kernel=self.kernel)
            gate, up = gate_up.chunk(2, dim=-1)
            down = moe_fused_linear(F.silu(gate) * up, self.down_proj, routing.m_sizes, kernel=self.kernel)
        if self.after_experts is not None:
            self.after_experts(xs, down, global_ids[routing.perm])
        # each pair's weighted sum over its local rows: one pass, no atomics
        return combine_rows(down, routing.inv_perm, starts, w_in[pair, slot])

    @property
    def transport_name(self) -> str | None:
        """The gather dispatch's transport once made (``symm`` or ``collective``), else None."""
        return None if self._transport is None else str(self._transport.name)

    def transport(self, device: torch.device) -> Any:
        """The gather dispatch's exchange (``ep_gather.make_transport``), made on first use."""
        if self._transport is None:
            self._transport = ep_gather.make_transport(
                self.transport_kind, self.rank, self.world, self.group, device
            )
        return self._transport

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        router_logits, topk_weights, topk_ids = self.route(hidden_states)
        if self.dispatch == "gather":
            grad = torch.is_grad_enabled() and (hidden_states.requires_grad or topk_weights.requires_grad)
            transport = self.transport(hidden_states.device)
            out = ep_gather.GatherExperts.apply(hidden_states, topk_weights, topk_ids, self, transport, grad)  # type: ignore[no-untyped-call, unused-ignore]  # torch before 2.14 leaves Function.apply untyped
            return out, router_logits
        tokens, hidden = hidden_states.shape
        k = self.top_k
        # one count exchange (one host synchronization) for every micro-batch
        plans = ep_ops.plan_micro_batches(
            topk_ids, self.num_experts, self.world, self.micro_batches, self.group
        )
        packed = ep_ops.pack_tokens(hidden_states, topk_weights, topk_ids)  # (T, H + 2k)
        streams = self._side_streams(hidden_states.device, len(plans))
        here = torch.cuda.current_stream(hidden_states.device) if streams else None
        if streams and here is not None:
            for m, st in enumerate(streams):
                st.wait_stream(here)
                # made on this stream, read on st (also by the backward): not reused before st is done
                packed.record_stream(st)
                plans[m].tokens.record_stream(st)

        def on(m: int) -> Any:
            return torch.cuda.stream(streams[m]) if streams else nullcontext()

        # 1. every micro-batch's dispatch first: NCCL moves B while A's experts compute
        received = []
        for m, plan in enumerate(plans):
            with on(m):
                order, starts = grouping(plan.tokens, tokens)  # each token's pairs (gather backward)
                send = gather_rows(packed, plan.tokens, order, starts)  # (P, H + 2k)
                buf = ep_ops.all_to_all(send, plan.recv_counts, plan.send_counts, self.group)
                x_in, w_in, ids_in = ep_ops.unpack_pairs(buf, hidden, k)
                pair, slot = ep_ops.local_slots(ids_in, self.rank, self.per_rank, plan.recv_slots)
                global_ids = ids_in[pair, slot]  # (R,) one row per (pair, local slot)
                local_ids = self.hooks.local_expert_ids(global_ids, self.first, self.per_rank)
                received.append((x_in, w_in, pair, slot, local_ids, global_ids))
        if self.before_experts is not None:  # the diagnostic pass (synchronizes)
            if streams:
                torch.cuda.synchronize(hidden_states.device)
            self.before_experts(torch.cat([r[5] for r in received]), torch.cat([r[4] for r in received]))
        # 2. per micro-batch: experts, then the sums go back
        outs = []
        for m, (plan, got) in enumerate(zip(plans, received, strict=True)):
            with on(m):
                sums = self.expert_sums(*got)
                back = ep_ops.all_to_all(sums, plan.send_counts, plan.recv_counts, self.group)
                lo, hi = plan.span
                order, starts = grouping(plan.tokens - lo, hi - lo)
                outs.append(sum_rows(back, plan.tokens - lo, order, starts))  # (hi - lo, H)
        if streams and here is not None:
            for st in streams:
                here.wait_stream(st)
            for t in outs:
                t.record_stream(here)
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out, router_logits


EP_DISPATCHES = knobs.EP_DISPATCHES  # and the variables that choose: core/knobs.py


# The gather dispatch sends every token to every rank: on W ranks with top-8 of 128 experts a
# token misses a rank's experts with probability 0.4% (W=2), 10% (W=4), 34% (W=8). Measured on
# H200s (2026-11-22, 30B preset): on 2 ranks it is at least as fast as the all-to-all at every
# batch (32,768 tokens: 12.2 vs 12.3 ms; 131,072: 39.8-41.2 vs 44.4 ms); on 4 ranks it wins at
# 32,768 tokens per rank (22.9-24.4 vs 25.6 ms) and loses at 8,192 (9.5-10.6 vs 8.6 ms).
GATHER_MAX_RANKS = 4
GATHER_MIN_TOKENS_PER_RANK = 32768  # on more than two ranks


def auto_dispatch(world: int, tokens_per_rank: int) -> str:
    """The dispatch ``auto`` picks (see the measurements above)."""
    if world < 2 or world > GATHER_MAX_RANKS:
        return "a2a"
    if world > 2 and tokens_per_rank < GATHER_MIN_TOKENS_PER_RANK:
        return "a2a"
    return "gather"


def ep_dispatch(world: int, tokens_per_rank: int) -> tuple[str, str]:
    """(dispatch, transport) of the ep mode's block: ``$QMOE_EP_DISPATCH`` (``a2a``: each token
    to the ranks owning its experts, by NCCL all-to-all; ``gather``: every token to every rank by
    pushes that overlap the experts, ``ep_gather.py``; ``auto``, the default: ``auto_dispatch``)
    and ``$QMOE_EP_TRANSPORT`` (``auto``, ``symm``, ``collective``); both read, and refused when
    unknown (ValueError naming the variable), by ``core.knobs``."""
    dispatch = knobs.ep_dispatch()
    transport = knobs.ep_transport()
    if dispatch == "auto":  # micro-batches are the all-to-all dispatch's way to overlap
        dispatch = auto_dispatch(world, tokens_per_rank) if ep_micro_batches() == 1 else "a2a"
    return dispatch, transport


def ep_micro_batches() -> int:
    """Micro-batches of the ep mode's block: ``$QMOE_EP_MICRO_BATCHES`` or the default, 1 (two
    overlap one micro-batch's all-to-all with the other's experts, but measured slower on 2x
    H200: 18.7 against 12.8 ms per step, 2026-11-22; docs/parallel.md)."""
    return knobs.ep_micro_batches()  # ValueError naming the variable for anything but 1, 2, ...


def expected_expert_rows(full: MoEBlock, rows: torch.Tensor, global_ids: torch.Tensor) -> torch.Tensor:
    """What the rank's experts must return for ``rows``: the full block's experts at the rows'
    *global* ids (no remap involved), with the same kernel, in the order given."""
    routing = sort_by_expert(global_ids[:, None], full.num_experts)
    xs = rows[routing.token_idx]
    gate_up = moe_fused_linear(xs, full.gate_up_proj, routing.m_sizes, kernel=full.kernel)
    gate, up = gate_up.chunk(2, dim=-1)
    down = moe_fused_linear(F.silu(gate) * up, full.down_proj, routing.m_sizes, kernel=full.kernel)
    return down[routing.inv_perm]


def run_ep(s: Setup) -> dict[str, Any]:
    w = s.world
    device = w.device
    block, x, upstream, ref = _full_block(s, device)
    mine = tp_ops.tp_slice(s.p.tokens, w.rank, w.size)
    s.ctx.fact("parallel.tokens", [mine.start, mine.stop])
    s.ctx.stage("shard")
    dispatch, transport = ep_dispatch(w.size, mine.stop - mine.start)
    layer = ExpertParallelBlock(
        block,
        rank=w.rank,
        world=w.size,
        kernel=s.spy,
        hooks=s.hooks,
        micro_batches=ep_micro_batches(),
        dispatch=dispatch,
        transport=transport,
    )
    s.ctx.fact("ep.micro_batches", layer.micro_batches)
    s.ctx.fact("ep.dispatch", dispatch)
    s.ctx.fact("ep.experts_per_rank", layer.per_rank)
    s.ctx.fact("ep.first_expert", layer.first)
    s.ctx.fact("ep.remap_hook", "kernel module" if LOCAL_IDS_HOOK in s.hooks.overridden else "default")
    xs, us = x[mine], upstream[mine]
    seen: dict[str, list[torch.Tensor]] = {"rows": [], "y": [], "global_ids": []}

    def before(global_ids: torch.Tensor, local_ids: torch.Tensor) -> None:
        # the diagnostic pass proper: ids checked on the host before the expert call
        bad = ep_ops.out_of_range(local_ids, layer.per_rank)
        n_bad = int(bad.sum())
        s.ctx.fact("ep.recv_rows", int(local_ids.numel()))
        s.ctx.fact("ep.ids_out_of_range", n_bad)
        if local_ids.numel():
            s.ctx.fact("ep.local_id_range", [int(local_ids.min()), int(local_ids.max())])
            s.ctx.fact("ep.global_id_range", [int(global_ids.min()), int(global_ids.max())])
        if n_bad:
            where = bad.nonzero().flatten()[:BAD_ID_EXAMPLES]
            s.ctx.fact(
                "ep.bad_id_examples",
                [{"global": int(global_ids[i]), "local": int(local_ids[i])} for i in where.tolist()],
            )

    def after(rows: torch.Tensor, y: torch.Tensor, global_ids: torch.Tensor) -> None:
        # once per micro-batch: the rank's rows are all of them together
        for key, t in (("rows", rows), ("y", y), ("global_ids", global_ids)):
            seen[key].append(t.detach())

    layer.before_experts, layer.after_experts = before, after

    def forward_backward() -> tuple[torch.Tensor, torch.Tensor]:
        xr = xs.detach().requires_grad_()
        out, _ = layer(xr)
        loss_of(out, us).backward()
        if layer.gate.weight.grad is not None:  # every rank's tokens train the one router
            dist.all_reduce(layer.gate.weight.grad)
        return out.detach(), xr

    _checked_step(s)
    out, xr = forward_backward()
    layer.before_experts = layer.after_experts = None
    if layer.transport_name is not None:
        s.ctx.fact("ep.transport", layer.transport_name)
    s.ctx.crumb(Phase.SYNC)
    w.sync()
    record_devices(s)
    s.ctx.crumb(Phase.COMPARE)
    s.ctx.stage("compare")
    if seen["y"]:
        got = {key: torch.cat(parts) for key, parts in seen.items()}
        with torch.no_grad(), device_guard(device):
            s.spy.stage = "diagnostic"
            expected_rows = expected_expert_rows(block, got["rows"], got["global_ids"])
        local = compare("local experts", got["y"], expected_rows, s.tol)
        s.ctx.fact("ep.local_expert_rel_error", local.rel_error)
        s.ctx.fact("ep.local_expert_ok", local.ok)
    own = slice(layer.first, layer.first + layer.per_rank)
    expected = {
        "gate.weight": ref.grads.get("gate.weight"),
        "gate_up_proj": ref.grads["gate_up_proj"][own] if "gate_up_proj" in ref.grads else None,
        "down_proj": ref.grads["down_proj"][own] if "down_proj" in ref.grads else None,
    }
    checks = [
        compare("out", out, ref.out[mine], s.tol),
        compare("dx", xr.grad, ref.dx[mine] if ref.dx is not None else None, s.tol),
    ]
    for name, param in sorted(layer.named_parameters()):
        checks.append(compare(f"grad:{name}", param.grad, expected.get(name), s.tol))
    if s.ctx.facts.get("ep.local_expert_ok") is False:
        checks.append(Check("local experts", float(s.ctx.facts["ep.local_expert_rel_error"]), s.tol))
    layer.zero_grad(set_to_none=True)
    seen.clear()

    def step() -> None:
        forward_backward()
        layer.zero_grad(set_to_none=True)

    record_timing(s, time_steps(s, step, w.sync))
    return finish(s, checks, str(out.device), own_ordinals([device]))


# ---------------------------------------------------------------------------------------------
# pp: layers over the devices of one process, as device_map="auto"
# ---------------------------------------------------------------------------------------------


def run_pp(s: Setup) -> dict[str, Any]:
    devices = [torch.device("cpu") if o is None else torch.device("cuda", o) for o in s.p.devices]
    first = devices[0]
    placement = layer_placement(s.p.layers, len(devices))
    layer_devs = [devices[j] for j in placement]
    s.ctx.fact("pp.placement", placement)
    s.ctx.fact("pp.layer_devices", [str(d) for d in layer_devs])
    s.ctx.stage("weights")
    blocks = [
        make_block(s.shape, s.spy, layer_devs[i], s.dtype, s.seed * 1000 + i) for i in range(s.p.layers)
    ]
    x, upstream = make_inputs(s, first)
    s.ctx.crumb(Phase.COMPILE)
    s.ctx.stage("reference")
    s.spy.stage = "reference"
    with device_guard(first):  # layer 0 lives on the first device: the single-device run
        ref0 = run_block(blocks[0], x, upstream)
    s.ctx.stage("twin")
    record_single(s, twin_checks(s, blocks[0], x, upstream, ref0))

    def sync_all() -> None:
        for d in dict.fromkeys(layer_devs):
            if d.type == "cuda":
                torch.cuda.synchronize(d)

    def forward_backward() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        h = x.detach().requires_grad_()
        ins: list[torch.Tensor] = []
        outs: list[torch.Tensor] = []
        for i, block in enumerate(blocks):
            h_in = h.to(layer_devs[i])  # what accelerate's pre-forward hook does
            if not h_in.is_leaf:
                h_in.retain_grad()
            out, _ = block(h_in)
            out.retain_grad()
            ins.append(h_in)
            outs.append(out)
            h = out
        loss_of(h, upstream.to(h.device)).backward()
        return ins, outs

    _checked_step(s)
    ins, outs = forward_backward()
    s.ctx.crumb(Phase.SYNC)
    sync_all()
    record_devices(s)
    s.ctx.crumb(Phase.COMPARE)
    s.ctx.stage("compare")
    reference = MoEBlock(s.shape, kernel=s.spy, device="meta", dtype=s.dtype).to_empty(device=first)
    checks: list[Check] = []
    results: list[dict[str, Any]] = []
    s.spy.stage = "reference"
    for i, block in enumerate(blocks):  # teacher-forced: the input and upstream gradient it got
        reference.load_state_dict(block.state_dict())
        grad_out = outs[i].grad
        upstream_i = (
            grad_out.float() if grad_out is not None else torch.zeros_like(outs[i], dtype=torch.float32)
        )
        with device_guard(first):
            ref = run_block(reference, ins[i].detach().to(first), upstream_i.to(first))
        layer_checks = [
            compare(f"layer {i} out", outs[i], ref.out, s.tol),
            compare(f"layer {i} dx", ins[i].grad, ref.dx, s.tol),
        ]
        layer_checks += [
            compare(f"layer {i} grad:{n}", p.grad, ref.grads.get(n), s.tol)
            for n, p in sorted(block.named_parameters())
        ]
        checks += layer_checks
        results.append(
            {
                "layer": i,
                "device": str(layer_devs[i]),
                "out_device": str(outs[i].device),
                "ok": all(c.ok for c in layer_checks) and outs[i].device == layer_devs[i],
                "worst": max(
                    layer_checks, key=lambda c: c.rel_error if c.rel_error == c.rel_error else math.inf
                ).as_fact(),
            }
        )
    s.ctx.fact("pp.results", results)
    misplaced = [r["layer"] for r in results if r["out_device"] != r["device"]]
    if misplaced:
        checks.append(Check(f"layers {misplaced} output device", math.inf, s.tol))
    for block in blocks:
        block.zero_grad(set_to_none=True)
    del reference

    def step() -> None:
        forward_backward()
        for block in blocks:
            block.zero_grad(set_to_none=True)

    with device_guard(first):
        record_timing(s, time_steps(s, step, sync_all))
    return finish(s, checks, str(outs[-1].device), own_ordinals(devices))


RUNNERS: dict[str, Callable[[Setup], dict[str, Any]]] = {
    "single": run_single,
    "dp": run_dp,
    "tp": run_tp,
    "ep": run_ep,
    "pp": run_pp,
}


def setup(ctx: RankContext, spec: ProbeSpec, p: RunParams, world: World, kernel: GroupedGemm, hooks: RankHooks) -> Setup:
    shape = get_preset(p.preset)
    dtype_name = spec.shape.dtype
    return Setup(
        ctx=ctx,
        p=p,
        world=world,
        shape=shape,
        dtype=DTYPES[dtype_name],
        dtype_name=dtype_name,
        tol=block_tolerance(dtype_name),
        spy=KernelSpy(kernel),
        hooks=hooks,
        seed=spec.seed,
    )


__all__ = [
    "MODE_OF",
    "RUNNERS",
    "Check",
    "ExpertParallelBlock",
    "KernelSpy",
    "Pass",
    "RunParams",
    "Setup",
    "World",
    "compare",
    "expected_expert_rows",
    "make_inputs",
    "run_block",
    "setup",
    "tp_block",
]
