"""The benchmark child: ``python -m qmoe_doctor.probes.bench REQUEST_JSON`` (child side; torch).

Started by ``qmoe_doctor.workflows.bench.run_bench`` in a fresh interpreter pinned to the chosen GPUs; it
reads one ``BenchRequest`` (JSON, the first argument), measures, writes one ``BenchReport``
(JSON) to ``request.result_path`` and exits 0. Progress goes to stderr, one line per row.
``benchmarks/bench_kernels.py`` calls ``run`` in its own process (no child). The records and the
implementation names are ``qmoe_doctor.core.bench``.

What is measured, per token count T (rows M = T * top_k, sorted by expert from a uniform random
top-k, the imbalance of an untrained router; or, with ``routing="balanced"``, M/E rows per
expert for the GEMM rows):

* forward ``y = x @ w[e].T``, dx ``dy @ w[e]``, dw ``dy_e.T @ x_e``: ours, ``torch._grouped_mm``
  (``offs`` = cumulative int32 row ends), the per-expert loop, one dense GEMM of the same FLOPs;
* the Qwen3-MoE block, forward and forward + backward: ``MoEBlock`` on our kernels, ``MoEBlock``
  with ``torch._grouped_mm`` as its forward kernel, the per-expert-loop twin (all three share one
  set of parameters), and a dense GEMM of the same FLOPs; on a GPU also the first two's forward
  replayed from a CUDA graph (no host launch path: what the GPU alone takes);
* with ``kernel`` (``--kernel REF``): the user's kernel beside ours, its forward and dx rows and
  ``MoEBlock(kernel=fn)`` (``qmoe_doctor.probes.bench_user``); a REF that does not resolve here
  ends the child with ``B.KERNEL_UNUSABLE_EXIT`` and one line naming it;
* with ``placement`` (2 GPUs): see ``qmoe_doctor.core.bench``.

Every row also gets its relative error against a float32 reference (float64 on the CPU). Under
``tiny`` (CPU, TRITON_INTERPRET=1) each row runs once and is compared; nothing is timed.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import platform
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TypedDict

import torch  # does not import triton: TRITON_INTERPRET can still be set after this

from qmoe_doctor.core import bench as B
from qmoe_doctor.core.records import from_json
from qmoe_doctor.probes.bench_user import UserKernel, load_user_kernel
from qmoe_doctor.probes.loader import KernelResolutionError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: Back-to-back calls per placement sample aim at this much wall time (ms), within CALLS_MAX.
PLACEMENT_SAMPLE_MS = 20.0
PLACEMENT_CALLS_MAX = 200
PLACEMENT_SAMPLES = 7

Bench = Callable[..., "float | None"]
Log = Callable[[str], None]


class _At(TypedDict):
    """Where a row was measured: its token count and rows M = tokens * top_k."""

    tokens: int
    m: int


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _note(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".replace("\n", " ")[:200]


def _config_text(pick: Callable[..., Any], *args: Any) -> str:
    """Our kernel's launch config as BMxBNxBK-wW-sS; "" when the kernel's helper says nothing."""
    try:
        c = pick(*args)
        name = getattr(c, "name", None)  # GemmConfig.name: with -pN, -tma, -flat where set
        return (
            name
            if isinstance(name, str)
            else f"{c.block_m}x{c.block_n}x{c.block_k}-w{c.num_warps}-s{c.num_stages}"
        )
    except Exception:  # the config helpers are the kernel's business; the bench only reports them
        return ""


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------


class _Measure:
    """Runs each implementation once (for its error), then times it, and collects rows."""

    def __init__(self, *, timed: bool, ref_dtype: torch.dtype, log: Log) -> None:
        import triton.testing

        self.timed = timed
        self.ref_dtype = ref_dtype
        self.log = log
        self.rows: list[B.BenchRow] = []
        self._do_bench = triton.testing.do_bench

    def time(self, fn: Callable[[], object], grad_to_none: list[torch.Tensor] | None = None) -> float | None:
        if not self.timed:
            return None  # smoke run: every fn has already run once (for its error); no timing
        return float(self._do_bench(fn, grad_to_none=grad_to_none, return_mode="median"))

    def rel_err(self, out: torch.Tensor, ref: torch.Tensor) -> float:
        ref = ref.to(self.ref_dtype)
        return float((out.to(self.ref_dtype) - ref).norm() / ref.norm().clamp_min(1e-30))

    def add(
        self,
        op: B.Op,
        impl: str,
        fn: Callable[[], torch.Tensor],
        ref: torch.Tensor | None,
        flops: float,
        *,
        tokens: int,
        m: int,
        config: str = "",
    ) -> None:
        self.log(f"  T={tokens:<6} {op:<24} {impl}")
        try:
            out = fn()
            err = self.rel_err(out, ref) if ref is not None else None
            del out
            ms = self.time(fn)
        except Exception as exc:  # an alternative missing on this build is a row, not a crash
            self.rows.append(
                B.BenchRow(
                    op=op, impl=impl, tokens=tokens, m=m, ms=None, tflops=None, config=config, note=_note(exc)
                )
            )
            return
        self.rows.append(
            B.BenchRow(
                op=op,
                impl=impl,
                tokens=tokens,
                m=m,
                ms=ms,
                tflops=B.tflops(flops, ms),
                rel_err=err,
                config=config,
            )
        )


def routing_sizes(
    tokens: int, e: int, top_k: int, gen: torch.Generator, device: torch.device, routing: str = "random"
) -> torch.Tensor:
    """m_sizes (E,) int32 of ``tokens`` tokens routed to top_k experts each: a uniform random
    top-k ("random"), or M = tokens * top_k rows spread evenly ("balanced": M // E each, the
    remainder one each to the first experts)."""
    from qmoe_doctor.kernels.routing import sort_by_expert

    if routing == "balanced":
        m = tokens * top_k
        sizes = torch.full((e,), m // e, dtype=torch.int32, device=device)
        sizes[: m % e] += 1
        return sizes
    if routing != "random":
        raise ValueError(f"routing {routing!r}: choose one of {', '.join(B.ROUTINGS)}")
    ids = torch.rand(tokens, e, generator=gen, device=device).topk(top_k, dim=-1).indices
    return sort_by_expert(ids, e).m_sizes


def _bench_gemms(
    meas: _Measure,
    *,
    tokens: int,
    top_k: int,
    w: torch.Tensor,  # (E, N, K)
    w_ref: torch.Tensor,
    gen: torch.Generator,
    routing: str = "random",
    user: UserKernel | None = None,
) -> None:
    from qmoe_doctor.kernels.backward import (
        moe_grouped_gemm_dw,
        moe_grouped_gemm_dw_torch,
        moe_grouped_gemm_dx,
        moe_grouped_gemm_dx_torch,
        pick_dw_config,
    )
    from qmoe_doctor.kernels.grouped_gemm import moe_grouped_gemm, moe_grouped_gemm_torch, pick_config

    e, n, k = w.shape
    device, dtype = w.device, w.dtype
    m = tokens * top_k
    m_sizes = routing_sizes(tokens, e, top_k, gen, device, routing)
    offs = torch.cumsum(m_sizes, 0).to(torch.int32)  # torch._grouped_mm: cumulative row ends
    ends = [0, *offs.tolist()]
    x = torch.randn(m, k, generator=gen, device=device).to(dtype)
    dy = torch.randn(m, n, generator=gen, device=device).to(dtype)
    dense_a = torch.randn(m, k, generator=gen, device=device).to(dtype)
    dense_b = torch.randn(k, n, generator=gen, device=device).to(dtype)
    flops = 2.0 * m * n * k
    at: _At = {"tokens": tokens, "m": m}

    def loop_forward() -> torch.Tensor:
        y = torch.empty(m, n, device=device, dtype=dtype)
        for expert in range(e):
            y[ends[expert] : ends[expert + 1]] = x[ends[expert] : ends[expert + 1]] @ w[expert].T
        return y

    def loop_dx() -> torch.Tensor:
        dx = torch.empty(m, k, device=device, dtype=dtype)
        for expert in range(e):
            dx[ends[expert] : ends[expert + 1]] = dy[ends[expert] : ends[expert + 1]] @ w[expert]
        return dx

    def loop_dw() -> torch.Tensor:
        dw = torch.empty(e, n, k, device=device, dtype=dtype)
        for expert in range(e):
            dw[expert] = dy[ends[expert] : ends[expert + 1]].T @ x[ends[expert] : ends[expert + 1]]
        return dw

    def dense() -> torch.Tensor:
        return dense_a @ dense_b

    x_ref, dy_ref = x.to(meas.ref_dtype), dy.to(meas.ref_dtype)
    ref = moe_grouped_gemm_torch(x_ref, w_ref, m_sizes)
    cfg = _config_text(pick_config, m, n, k, e, device, dtype)
    meas.add("forward", B.QMOE, lambda: moe_grouped_gemm(x, w, m_sizes), ref, flops, config=cfg, **at)
    meas.add(
        "forward", B.GROUPED_MM, lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs), ref, flops, **at
    )
    if user is not None:  # UserKernelSkipped (its adapter refuses these operands): the row's note
        meas.add("forward", user.label, user.forward(x, w, m_sizes), ref, flops, **at)
    meas.add("forward", B.LOOP, loop_forward, ref, flops, **at)
    meas.add("forward", B.DENSE, dense, None, flops, **at)
    del ref

    ref = moe_grouped_gemm_dx_torch(dy_ref, w_ref, m_sizes)
    cfg = _config_text(lambda *a: pick_config(*a, op="dx"), m, k, n, e, device, dtype)  # the forward on w.T
    meas.add("dx", B.QMOE, lambda: moe_grouped_gemm_dx(dy, w, m_sizes), ref, flops, config=cfg, **at)
    meas.add("dx", B.GROUPED_MM, lambda: torch._grouped_mm(dy, w, offs=offs), ref, flops, **at)
    if user is not None:  # no dw row: the forward signature has no weight gradient
        meas.add("dx", user.label, user.dx(dy, w, m_sizes), ref, flops, config=user.DX_NOTE, **at)
    meas.add("dx", B.LOOP, loop_dx, ref, flops, **at)
    meas.add("dx", B.DENSE, dense, None, flops, **at)
    del ref

    ref = moe_grouped_gemm_dw_torch(dy_ref, x_ref, m_sizes)
    del x_ref, dy_ref
    cfg = _config_text(lambda *a: pick_dw_config(*a, avg_rows=m / e), n, k, device, dtype)
    meas.add("dw", B.QMOE, lambda: moe_grouped_gemm_dw(dy, x, m_sizes), ref, flops, config=cfg, **at)
    meas.add("dw", B.GROUPED_MM, lambda: torch._grouped_mm(dy.T, x, offs=offs), ref, flops, **at)
    meas.add("dw", B.LOOP, loop_dw, ref, flops, **at)
    meas.add("dw", B.DENSE, dense, None, flops, **at)
    del ref


class _Blocks:
    """Ours, ours with torch._grouped_mm as the forward kernel, ours with the user's kernel as
    the forward kernel (``--kernel``), the loop twin (one set of parameters, shared), and a
    float32 (CPU: float64) twin with its own copy as the reference."""

    def __init__(
        self,
        shape: Any,
        device: torch.device,
        dtype: torch.dtype,
        ref_dtype: torch.dtype,
        *,
        user: UserKernel | None = None,
    ) -> None:
        from qmoe_doctor.kernels.moe_block import MoEBlock, MoEBlockTorch

        def grouped_mm_kernel(x: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor) -> torch.Tensor:
            return torch._grouped_mm(x, w.transpose(1, 2), offs=torch.cumsum(m_sizes, 0).to(torch.int32))

        torch.manual_seed(0)
        self.shape = shape
        self.ours = MoEBlock(shape, device=device, dtype=dtype)
        # built on the meta device, then given ours' parameters: no second copy of the stacks
        self.with_grouped_mm = self._share(
            MoEBlock(shape, kernel=grouped_mm_kernel, device="meta", dtype=dtype)
        )
        self.user = user
        self.with_user = (
            self._share(MoEBlock(shape, kernel=user.fn, device="meta", dtype=dtype)) if user is not None else None
        )
        self.twin = self._share(MoEBlockTorch(shape, device="meta", dtype=dtype))
        self.reference = MoEBlockTorch(shape, device=device, dtype=ref_dtype)
        self.reference.load_state_dict(self.ours.state_dict())
        self.reference.requires_grad_(False)

    def _share(self, module: torch.nn.Module) -> torch.nn.Module:
        module.get_submodule("gate").weight = self.ours.gate.weight
        module.gate_up_proj = self.ours.gate_up_proj
        module.down_proj = self.ours.down_proj
        return module

    def _user_blocks(self, suffix: str) -> tuple[tuple[str, torch.nn.Module], ...]:
        """The user's block row (none without --kernel), named ``suffix`` after its label."""
        if self.user is None or self.with_user is None:
            return ()
        return ((f"{self.user.block_label}{suffix}", self.with_user),)

    def measure(self, meas: _Measure, tokens: int, gen: torch.Generator) -> None:
        s = self.shape
        device, dtype = self.ours.gate_up_proj.device, self.ours.gate_up_proj.dtype
        m = tokens * s.top_k
        flops = 6.0 * m * s.hidden * s.intermediate
        hidden = torch.randn(tokens, s.hidden, generator=gen, device=device).to(dtype)
        with torch.no_grad():
            ref_out = self.reference(hidden.to(meas.ref_dtype))[0]
        at: _At = {"tokens": tokens, "m": m}
        for impl, module in (
            (B.BLOCK_QMOE, self.ours),
            (B.BLOCK_GROUPED_MM, self.with_grouped_mm),
            *self._user_blocks(""),
            (B.BLOCK_LOOP, self.twin),
        ):
            meas.log(f"  T={tokens:<6} block                    {impl}")
            x = hidden.clone().requires_grad_(True)
            params = [*module.parameters(), x]
            try:
                with torch.no_grad():
                    err = meas.rel_err(module(hidden)[0], ref_out)

                    def forward(mod: torch.nn.Module = module) -> object:
                        return mod(hidden)

                    ms_fwd = meas.time(forward)

                def step(mod: torch.nn.Module = module, x: torch.Tensor = x) -> None:
                    mod(x)[0].float().sum().backward()

                step()
                ms_both = meas.time(step, grad_to_none=params)
            except Exception as exc:
                for op in B.BLOCK_OPS:
                    meas.rows.append(
                        B.BenchRow(op=op, impl=impl, ms=None, tflops=None, note=_note(exc), **at)
                    )
                continue
            finally:
                for p in params:
                    p.grad = None
            meas.rows.append(
                B.BenchRow(
                    op="block-forward",
                    impl=impl,
                    ms=ms_fwd,
                    tflops=B.tflops(flops, ms_fwd),
                    rel_err=err,
                    **at,
                )
            )
            meas.rows.append(
                B.BenchRow(
                    op="block-forward-backward",
                    impl=impl,
                    ms=ms_both,
                    tflops=B.tflops(3 * flops, ms_both),
                    **at,
                )
            )
        if meas.timed:  # the same forward replayed from a CUDA graph: the GPU's part alone
            for impl, module in (
                (B.BLOCK_QMOE_GRAPH, self.ours),
                (B.BLOCK_GROUPED_MM_GRAPH, self.with_grouped_mm),
                *self._user_blocks(", CUDA graph"),
            ):
                meas.add("block-forward", impl, _GraphedForward(module, hidden), ref_out, flops, **at)
        del ref_out
        # one dense GEMM of the same FLOPs: (M, H) x (H, 3I) = 6*M*H*I; with backward (H, 9I)
        a = torch.randn(m, s.hidden, generator=gen, device=device).to(dtype)
        for op, cols, op_flops in (("block-forward", 3, flops), ("block-forward-backward", 9, 3 * flops)):
            b = torch.randn(s.hidden, cols * s.intermediate, generator=gen, device=device).to(dtype)
            meas.add(op, B.DENSE, _matmul(a, b), None, op_flops, **at)


class _GraphedForward:
    """``module(hidden)[0]`` captured in a CUDA graph on the first call (after warm-up calls on
    a side stream, as capture requires), replayed on every call; returns the graph's output.
    Capture fails on any host synchronization in the forward: the row then carries the error."""

    def __init__(self, module: torch.nn.Module, hidden: torch.Tensor) -> None:
        self.module = module
        self.hidden = hidden
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None

    def __call__(self) -> torch.Tensor:
        if self.graph is None:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.no_grad(), torch.cuda.stream(side):
                for _ in range(3):  # compile, pick configs, fill the allocator's cache
                    self.module(self.hidden)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.no_grad(), torch.cuda.graph(graph):
                self.out = self.module(self.hidden)[0]
            self.graph = graph
        self.graph.replay()
        assert self.out is not None
        return self.out


def _matmul(a: torch.Tensor, b: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: a @ b


# --------------------------------------------------------------------------------------------
# Placement (2 GPUs): guarded against remote execution over peer access
# --------------------------------------------------------------------------------------------


def _sync_all() -> None:
    for i in range(torch.cuda.device_count()):
        torch.cuda.synchronize(i)


def _wall_ms(fn: Callable[[], object]) -> float:
    """Median host wall time of one call over back-to-back calls, every device synchronized
    before and after each sample (a mis-launched kernel runs on another device's stream, which
    events on one device would not bracket)."""
    _sync_all()
    t0 = time.perf_counter()
    fn()
    _sync_all()
    one = max((time.perf_counter() - t0) * 1e3, 1e-3)
    calls = max(1, min(PLACEMENT_CALLS_MAX, int(PLACEMENT_SAMPLE_MS / one)))
    samples = []
    for _ in range(PLACEMENT_SAMPLES):
        _sync_all()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync_all()
        samples.append((time.perf_counter() - t0) * 1e3 / calls)
    return statistics.median(samples)


@contextlib.contextmanager
def _current(ordinal: int) -> Iterator[None]:
    previous = torch.cuda.current_device()
    torch.cuda.set_device(ordinal)
    try:
        yield
    finally:
        torch.cuda.set_device(previous)


def _bench_placement(
    tokens_list: tuple[int, ...], *, e: int, n: int, k: int, top_k: int, dtype: torch.dtype, log: Log
) -> tuple[list[B.PlacementRow], list[str]]:
    """Per token count: ours with b current (local), ours with a current (guarded), and the
    unguarded specimen with a current after one copy a -> b (remote), operands on b."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [], [f"placement needs 2 GPUs; this child sees {count}: skipped"]
    a, b = 0, 1
    dev_b = torch.device("cuda", b)
    notes: list[str] = []
    can_peer = torch.cuda.can_device_access_peer(a, b)
    if not can_peer:
        notes.append(f"cuda:{a} cannot access cuda:{b} over peer access: the remote row cannot run")
    gen = torch.Generator(device=dev_b).manual_seed(1)
    w = (torch.randn(e, n, k, generator=gen, device=dev_b) / k**0.5).to(dtype)
    state = {"peer_on": False}
    rows: list[B.PlacementRow] = []
    for tokens in tokens_list:
        rows.extend(
            _placement_rows(tokens, w=w, top_k=top_k, gen=gen, can_peer=can_peer, state=state, log=log)
        )
        _free(dev_b)
    return rows, notes


def _placement_rows(
    tokens: int,
    *,
    w: torch.Tensor,  # (E, N, K) on b
    top_k: int,
    gen: torch.Generator,
    can_peer: bool,
    state: dict[str, bool],  # peer_on: peer access a -> b, once on, stays on in this process
    log: Log,
) -> list[B.PlacementRow]:
    from qmoe_doctor.kernels.grouped_gemm import moe_grouped_gemm
    from qmoe_doctor.kernels.specimens.unguarded import moe_grouped_gemm as unguarded
    from qmoe_doctor.probes.conditions import _time_calls  # scan's own timer: the same "slow"

    a, b = 0, 1
    e, n, k = w.shape
    dev_b = w.device
    m = tokens * top_k
    flops = 2.0 * m * n * k
    with _current(b):
        m_sizes = routing_sizes(tokens, e, top_k, gen, dev_b)
        x = torch.randn(m, k, generator=gen, device=dev_b).to(w.dtype)
        ref = moe_grouped_gemm(x, w, m_sizes).float()
    cases: list[tuple[B.BenchPlacement, str, int, Callable[[], torch.Tensor]]] = [
        ("local", "builtin", b, lambda: moe_grouped_gemm(x, w, m_sizes)),
        ("guarded", "builtin", a, lambda: moe_grouped_gemm(x, w, m_sizes)),
        ("remote", "specimen:unguarded", a, lambda: unguarded(x, w, m_sizes)),
    ]
    rows: list[B.PlacementRow] = []
    for placement, kernel, current, fn in cases:
        log(
            f"  T={tokens:<6} placement {placement:<8} {kernel} (cuda:{current} current, operands on cuda:{b})"
        )
        if placement == "remote" and can_peer and not state["peer_on"]:
            with _current(a):
                torch.ones(256, device=torch.device("cuda", a)).to(dev_b)  # one copy a -> b: peer on
            _sync_all()
            state["peer_on"] = True
        common: dict[str, Any] = {
            "placement": placement,
            "kernel": kernel,
            "tokens": tokens,
            "m": m,
            "current": current,
            "device": b,
            "peer_enabled": state["peer_on"],
        }
        try:
            with _current(current):
                out = fn()
                _sync_all()
                err = float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))
                del out
                ms = _wall_ms(fn)
                ms_scan = float(_time_calls(fn))
        except Exception as exc:
            rows.append(B.PlacementRow(ms=None, ms_scan=None, tflops=None, note=_note(exc), **common))
            continue
        rows.append(B.PlacementRow(ms=ms, ms_scan=ms_scan, tflops=B.tflops(flops, ms), rel_err=err, **common))
    return rows


# --------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------


def run(request: B.BenchRequest, *, log: Log = _log, command: str = "") -> B.BenchReport:
    """Measure ``request`` in this process. TRITON_INTERPRET must already be set for tiny.
    Raises KernelResolutionError when ``request.kernel`` does not resolve here."""
    import triton

    from qmoe_doctor.core.shapes import MoEShape, get_preset

    t_start = time.monotonic()
    preset = get_preset("tiny" if request.tiny else request.preset)
    # the user's kernel first, before any GPU work: KernelResolutionError ends the run (child_main)
    user = load_user_kernel(request.kernel) if request.kernel else None
    if request.tiny:
        device = torch.device("cpu")
        dtype = torch.float32  # bf16 tl.dot is garbage in the interpreter
        ref_dtype = torch.float64
    else:
        if not torch.cuda.is_available():
            raise SystemExit(
                "no CUDA device is visible to the benchmark: run with --tiny for a CPU smoke run"
            )
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dtype = DTYPES[request.dtype]
        ref_dtype = torch.float32
    e = request.num_experts or preset.num_experts
    n = request.n or 2 * preset.intermediate
    k = request.k or preset.hidden
    top_k = min(preset.top_k, e)
    timed = device.type == "cuda"
    shape = B.BenchShape(e=e, n=n, k=k, top_k=top_k, hidden=k, intermediate=max(1, n // 2))
    log(
        f"shape E={e} N={n} K={k} top_k={top_k} {dtype} on {device}; tokens {', '.join(map(str, request.tokens))}"
    )

    meas = _Measure(timed=timed, ref_dtype=ref_dtype, log=log)
    gen = torch.Generator(device=device).manual_seed(0)
    w = (torch.randn(e, n, k, generator=gen, device=device) / k**0.5).to(dtype)
    w_ref = w.to(ref_dtype)
    notes: list[str] = []
    for tokens in request.tokens:
        try:
            _bench_gemms(
                meas, tokens=tokens, top_k=top_k, w=w, w_ref=w_ref, gen=gen, routing=request.routing, user=user
            )
        except Exception as exc:  # e.g. out of memory for a reference at a large token count
            notes.append(f"GEMM rows at {tokens} tokens stopped: {_note(exc)}")
        _free(device)
    del w, w_ref
    _free(device)
    if request.block:
        block_shape = MoEShape(
            name=f"{preset.name}-bench",
            num_experts=e,
            top_k=top_k,
            hidden=shape.hidden,
            intermediate=shape.intermediate,
        )
        try:
            blocks = _Blocks(block_shape, device, dtype, ref_dtype, user=user)
        except Exception as exc:  # e.g. out of memory for the float32 reference of a large preset
            notes.append(f"MoE block rows skipped: {_note(exc)}")
        else:
            for tokens in request.tokens:
                try:
                    blocks.measure(meas, tokens, gen)
                except Exception as exc:
                    notes.append(f"MoE block rows at {tokens} tokens stopped: {_note(exc)}")
                _free(device)
            del blocks
            _free(device)
    placement: list[B.PlacementRow] = []
    if request.placement:
        placement, more = _bench_placement(request.tokens, e=e, n=n, k=k, top_k=top_k, dtype=dtype, log=log)
        notes.extend(more)
    names = tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())) if timed else ()
    return B.BenchReport(
        timed=timed,
        interpreter=os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
        device=names[0] if names else f"cpu ({platform.processor() or platform.machine()})",
        devices=names,
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
        preset=preset.name,
        dtype=str(dtype).removeprefix("torch."),
        shape=shape,
        tokens=request.tokens,
        routing=request.routing,
        config_table=_config_table(timed),
        kernel=request.kernel,
        created_unix=time.time(),
        wall_s=time.monotonic() - t_start,
        rows=B.with_fractions(meas.rows),
        placement=B.with_slowdowns(placement),
        notes=tuple(notes),
        command=command,
    )


def _config_table(timed: bool) -> str:
    """Which launch-config table our kernels used on cuda:0, in words (the report's header)."""
    if not timed:
        return "interpreter config (CPU smoke run)"
    from qmoe_doctor.kernels.tuning import describe_device_table

    try:
        return describe_device_table(0)
    except ValueError as exc:  # a malformed table (ConfigTableError): the kernel calls raise it too
        return f"unreadable: {_note(exc)}"


def write_report(report: B.BenchReport, path: str) -> None:
    """The ``bench`` JSON document of ``report`` to ``path``, whole (a temp file and a rename)."""
    doc = B.report_document(report)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2, allow_nan=True)
        fh.write("\n")
    os.replace(tmp, path)


def child_main(argv: list[str] | None = None) -> int:
    """``python -m qmoe_doctor.probes.bench REQUEST_JSON``: measure, write the report file."""
    faulthandler.enable()
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1)  # the parent asks for the stacks before a timeout kill
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        _log("usage: python -m qmoe_doctor.probes.bench REQUEST_JSON (started by qmoe-doctor bench)")
        return 2
    request = from_json(B.BenchRequest, args[0])
    if request.tiny:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (the parent sets it too)
    try:
        report = run(request)
    except KernelResolutionError as exc:  # the user's code failed to import or has another signature
        _log(B.KERNEL_UNUSABLE_PREFIX + " ".join(str(exc).split()))
        return B.KERNEL_UNUSABLE_EXIT
    write_report(report, request.result_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(child_main())
