"""The conditions a probe runs a kernel under (child side; imports torch).

``run_probe(ctx)`` sets up exactly one condition from ``ctx.spec``, calls the kernel under
test, synchronizes every device, and compares with the torch twin. It returns Outcome
keyword fields; exceptions propagate to the worker, which classifies them. Facts observed on
the way (placement, whether a precondition held, what was recycled) go to ``ctx.fact`` so
the classifier can reason from them.

Pair conditions use ordinals ``a = spec.current`` and ``b = spec.device``: operands on b,
a current at the call. Preconditions that cannot be re-established in a live process (a's
context never created, peer access a->b still off) are checked, never assumed: a probe whose
precondition is gone is SKIPPED with the reason.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from qmoe_doctor.core.autotune import policy_of
from qmoe_doctor.core.kernel_ref import KernelRef, KernelRefError, RefKind
from qmoe_doctor.core.launch_configs import TileConfig
from qmoe_doctor.core.records import Condition, Phase, ProbeSpec, Status
from qmoe_doctor.core.tolerances import tolerance
from qmoe_doctor.kernels.routing import routing_sizes
from qmoe_doctor.probes import autotune
from qmoe_doctor.probes.adapters import not_applicable
from qmoe_doctor.probes.context import ProbeContext
from qmoe_doctor.probes.kernel_call import watch
from qmoe_doctor.probes.loader import KernelFn, load_kernel
from qmoe_doctor.probes.output_guard import OutputGuard
from qmoe_doctor.probes.stream_hold import hold_stream

# Peer access torch has enabled in this process, as (accessor, owner) ordinal pairs. Peer
# access is enabled per direction by the first copy and never disabled, so it is tracked.
_PEER_ENABLED: set[tuple[int, int]] = set()
# Kernel refs already called in this process (REPEAT_CALL needs the first call), and the
# (kernel, shapes, dtype) keys already called.
_CALLED: set[str] = set()
_CALLED_SHAPES: set[tuple[Any, ...]] = set()

HOLD_S = 0.2  # the stream held before the producer (stream_hold): still queued at the launch
STALE_SIZE = 1 << 20  # stale m_sizes value in a recycled block: far past any M
POISON_BYTE = 0xFF  # all-ones is NaN in bf16, fp16 and fp32
CANARY_BYTE = 0xA5
SMALL_POOL_MAX = 1 << 20  # the caching allocator serves blocks under 1 MiB from 2 MiB segments
LARGE_SPLIT_MAX = 10 << 20  # blocks under 10 MiB are split from 20 MiB segments
TIMING_REPEATS = 10
#: Guard rows around an output the kernel allocates itself (``OutputGuard``), at least; the
#: over-routed cell uses twice its extra rows.
GUARD_ROWS = 16

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

#: How ``run_probe`` gets the kernel under test. ``run_one`` wraps it, for the one probe its
#: process runs, to register every tensor the kernel returns.
kernel_loader: Callable[[str], KernelFn] = load_kernel


def run_probe(ctx: ProbeContext) -> dict[str, Any]:
    spec: ProbeSpec = ctx.spec
    ctx.crumb(Phase.IMPORT)
    if spec.condition is Condition.INTERPRETER_CHECK:
        return _interpreter_check(ctx)
    # the kernel's own import, after ours: a child that dies or hangs here died of the kernel
    ctx.crumb(Phase.IMPORT, step="kernel")
    kernel = kernel_loader(spec.kernel)
    # imported: what follows (our routed probes' import, the device guard, a cell's memory
    # check) is ours, and a death there is not the kernel's import
    ctx.crumb(Phase.IMPORT)
    reason = not_applicable(kernel, spec)  # an adapter's declared dtypes / layout / CPU support
    if reason is None and spec.device is None and _is_torch_control(spec.kernel):
        reason = (
            "torch:grouped_mm runs torch._grouped_mm, which needs a CUDA GPU (bfloat16, sm90+): "
            "the CPU tier does not apply; run it on a GPU"
        )
    if reason is not None:
        return _skip(ctx, reason)
    runner = _RUNNERS.get(spec.condition) or _routed_runners().get(spec.condition)
    if runner is None:
        return _skip(ctx, f"condition {spec.condition} is not implemented by this probe worker")
    # Every call of the kernel is watched (refusals, launches, what it returned, autotuning); its
    # autotuners follow the scan's policy, and the repeat-call probe autotunes for real.
    autotune.install()
    autotune.set_policy(policy_of(spec.params), real=spec.condition is Condition.REPEAT_CALL)
    ctx.fact("autotune_policy", str(policy_of(spec.params)))
    kernel = watch(ctx, kernel)
    if spec.condition in _PAIR_RUNNERS_OWN_DEVICE:
        return runner(ctx, kernel)
    # Single-device cells and the guarded baseline run inside a device guard, never through
    # torch.cuda.set_device: set_device creates a context, and leaving the guard restores the
    # previous device without creating one, so ordinal 0 stays untouched for UNTOUCHED.
    with _guard(_device(spec.device)):
        return runner(ctx, kernel)


# ---------------------------------------------------------------------------------------------
# Operands and comparison
# ---------------------------------------------------------------------------------------------


def _is_torch_control(kernel: str) -> bool:
    try:
        return KernelRef.parse(kernel).kind is RefKind.TORCH
    except KernelRefError:
        return False


def _device(ordinal: int | None) -> torch.device:
    return torch.device("cpu") if ordinal is None else torch.device("cuda", ordinal)


def make_operands(spec: ProbeSpec, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, K), w (E, N, K), m_sizes (E,) int32, generated on ``device`` only (no copies)."""
    s = spec.shape
    dtype = _DTYPES[s.dtype]
    gen = torch.Generator(device=device).manual_seed(spec.seed)
    x = torch.randn((s.m, s.k), device=device, dtype=torch.float32, generator=gen).to(dtype)
    w = (torch.randn((s.e, s.n, s.k), device=device, dtype=torch.float32, generator=gen) / math.sqrt(s.k)).to(
        dtype
    )
    sizes = routing_sizes(s.routing, s.m, s.e, seed=spec.seed)
    m_sizes = torch.tensor(sizes, dtype=torch.int32, device=device)
    return x, w, m_sizes


def reference(x: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor) -> torch.Tensor:
    from qmoe_doctor.kernels.grouped_gemm import moe_grouped_gemm_torch

    with _guard(x.device):
        return moe_grouped_gemm_torch(x, w, m_sizes, out_dtype=torch.float32)


def _guard(device: torch.device) -> Any:
    import contextlib

    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def compare(ctx: ProbeContext, y: Any, ref: torch.Tensor, operand_device: torch.device) -> dict[str, Any]:
    """Judge y against the twin: placement, unwritten (poison) elements, relative error."""
    ctx.crumb(Phase.COMPARE)
    fields: dict[str, Any] = {}
    if not isinstance(y, torch.Tensor):
        ctx.fact("returned", type(y).__name__)
        ctx.note(f"the kernel returned {_returned(y)}, not a tensor")
        return {"status": Status.WRONG}
    fields["out_device"] = str(y.device)
    tol = tolerance(ctx.spec.shape.dtype)
    fields["tolerance"] = tol
    wrong = False
    if y.device != operand_device:
        ctx.note(f"output returned on {y.device}, operands on {operand_device}")
        wrong = True
    if tuple(y.shape) != tuple(ref.shape):
        ctx.note(f"output shape {tuple(y.shape)} != expected {tuple(ref.shape)}")
        return {**fields, "status": Status.WRONG}
    out = y.detach().to(ref.device, torch.float32)
    finite_ref = torch.isfinite(ref)
    nan_out = torch.isnan(out) & finite_ref
    # Never written: still the poison, all-ones bits (POISON_BYTE), which no arithmetic makes
    # (a computed NaN is 0x7fff... on a GPU, 0xffc0... on an x86 CPU). Any other NaN was written.
    poison = _poison_bits(y)
    unwritten = int((nan_out & poison.to(ref.device)).sum()) if poison is not None else 0
    fields["unwritten"] = unwritten
    fields["nan_written"] = int(nan_out.sum()) - unwritten
    diff = torch.nan_to_num(out - ref, nan=float("inf"))
    ref_norm = float(ref.norm())
    err = float(diff.norm()) / ref_norm if ref_norm > 0 else float(diff.norm())
    fields["rel_error"] = err
    if not (err <= tol) or unwritten:
        wrong = True
    fields["status"] = Status.WRONG if wrong else Status.PASS
    return fields


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _poison_bits(y: torch.Tensor) -> torch.Tensor | None:
    """Where ``y`` holds the poison pattern (every byte POISON_BYTE: -1 as a signed integer of
    its width); None when its dtype cannot be viewed so."""
    as_int = _BITS.get(y.element_size())
    if as_int is None or not y.dtype.is_floating_point:
        return None
    try:
        return y.detach().contiguous().view(as_int) == -1
    except RuntimeError:
        return None


def _returned(y: Any) -> str:
    return "None" if y is None else f"a {type(y).__name__}"


def sync_all() -> None:
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            if _has_context(i):
                torch.cuda.synchronize(i)


def _has_context(ordinal: int) -> bool:
    probe = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    return True if probe is None else bool(probe(ordinal))


class OutputTrap:
    """Poison the block the kernel's output will get, and put a canary right after it.

    The caching allocator hands a freed block of the same size on the same stream to the
    next allocation, so freeing a NaN-filled block just before the call makes the kernel's
    ``torch.empty`` output start as NaN (unwritten elements show), and a live canary block
    allocated right after it catches writes past the end of y. Whether the kernel really got
    the block is checked, never assumed.
    """

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.device = device
        self.hole_ptr = 0
        self.canary: torch.Tensor | None = None
        self.adjacent = False
        if device.type != "cuda":
            return
        # Free cached blocks first: a freed temporary of the same size at a lower address would
        # otherwise win the allocator's best fit instead of the poisoned block.
        torch.cuda.empty_cache()
        hole = torch.full((nbytes,), POISON_BYTE, dtype=torch.uint8, device=device)
        self.hole_ptr = hole.data_ptr()
        if nbytes >= LARGE_SPLIT_MAX:
            return  # a segment of its own: nothing can be placed right after it
        # the canary must come from the same pool as y to be split from the same segment
        canary_bytes = 64 * 1024 if nbytes < SMALL_POOL_MAX else SMALL_POOL_MAX + 512
        want = self.hole_ptr + (nbytes + 511) // 512 * 512
        spare: list[torch.Tensor] = []
        for _ in range(64):  # free blocks elsewhere are handed out first: hold them until
            block = torch.full((canary_bytes,), CANARY_BYTE, dtype=torch.uint8, device=device)
            if block.data_ptr() == want:
                self.canary = block
                self.adjacent = True
                break
            spare.append(block)
        del spare
        del hole  # back to the pool, NaN inside

    def report(self, ctx: ProbeContext, y: Any) -> list[str]:
        if self.device.type != "cuda":
            return []
        got_block = isinstance(y, torch.Tensor) and y.data_ptr() == self.hole_ptr
        ctx.fact("poisoned_output", got_block)
        ctx.fact("canary_after_output", bool(got_block and self.adjacent))
        if self.canary is None:
            return []
        hits = []
        if got_block and self.adjacent and bool((self.canary != CANARY_BYTE).any()):
            hits.append("after y")
        return hits


def _time_calls(fn: Callable[[], Any], repeats: int = TIMING_REPEATS) -> float:
    """Median wall time of one call, each followed by a full synchronization (ms).

    Host wall time with a synchronize of every device, not events: a mis-launched kernel runs
    on another device's stream, which events on the operand device would not bracket.
    """
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync_all()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _call_and_check(
    ctx: ProbeContext,
    kernel: KernelFn,
    x: torch.Tensor,
    w: torch.Tensor,
    m_sizes: torch.Tensor,
    ref: torch.Tensor,
    *,
    trap: OutputTrap | None = None,
    guard: OutputGuard | None = None,
    watch_alloc_on: int | None = None,
    after_call: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """One watched call, synchronized and judged. ``guard`` serves the output the kernel
    allocates with guard rows around it; ``after_call`` runs between the call's return and the
    synchronization (what a race cell observes there)."""
    ctx.crumb(Phase.LAUNCH)
    if ctx.spec.kernel not in _CALLED:
        ctx.fact("first_call_in_process", True)
    _CALLED.add(ctx.spec.kernel)
    shape_key = (ctx.spec.kernel, tuple(x.shape), tuple(w.shape), str(x.dtype))
    if shape_key not in _CALLED_SHAPES:
        ctx.fact("first_call_for_shape", True)  # autotuners benchmark on the first call per key
    _CALLED_SHAPES.add(shape_key)
    if watch_alloc_on is not None:
        before = torch.cuda.memory_allocated(watch_alloc_on)
        torch.cuda.reset_peak_memory_stats(watch_alloc_on)
        try:
            y = kernel(x, w, m_sizes)
        finally:  # recorded when the call raises too: the allocation is the evidence
            grown = torch.cuda.max_memory_allocated(watch_alloc_on) - before
            ctx.fact("alloc_on_current_bytes", int(grown))
    elif guard is not None:
        with guard:
            y = kernel(x, w, m_sizes)
    else:
        y = kernel(x, w, m_sizes)
    if after_call is not None:
        after_call()
    ctx.crumb(Phase.SYNC)
    sync_all()
    fields = compare(ctx, y, ref, x.device)
    hits: list[str] = []
    if trap is not None:
        hits += trap.report(ctx, y)
    if guard is not None:  # after the trap: guard rows, when the output is ours, are the evidence
        hits += guard.report(ctx, y)
    if hits:
        fields["canary_hits"] = tuple(hits)
        fields["status"] = Status.WRONG
    return fields


def _with_baseline(
    ctx: ProbeContext,
    kernel: KernelFn,
    x: torch.Tensor,
    w: torch.Tensor,
    m_valid: torch.Tensor,
    run_variant: Callable[[], dict[str, Any]],
) -> dict[str, Any]:
    """Call the kernel on the same operands with valid routing first, then the variant: the
    two calls differ in exactly one condition, so the cell is its own differential.

    A baseline that already fails (an autotuner's first call for a new shape, say) makes the
    cell fail too, with ``baseline_ok`` False so the classifier does not blame the variant; one
    that raises ends the cell with that exception and ``baseline_ok`` False: it says nothing
    about the variant, and is never a refusal of it.
    """
    ref = reference(x, w, m_valid)
    _CALLED.add(ctx.spec.kernel)
    try:
        y = kernel(x, w, m_valid)
    except BaseException:
        ctx.fact("baseline_ok", False)
        ctx.fact("baseline_raised", True)
        raise
    sync_all()
    base = compare(ctx, y, ref, x.device)
    del y
    ctx.fact("baseline_ok", base["status"] == Status.PASS)
    ctx.fact("baseline_rel_error", base.get("rel_error"))
    fields = run_variant()
    ctx.fact("variant_ok", fields["status"] == Status.PASS)
    if base["status"] != Status.PASS and fields["status"] == Status.PASS:
        ctx.note("the baseline call (valid routing, same shape) was wrong; the variant call was right")
        fields["status"] = Status.WRONG
    return fields


def _skip(ctx: ProbeContext, reason: str) -> dict[str, Any]:
    ctx.note(reason)
    return {"status": Status.SKIPPED}


def _register(ctx: ProbeContext, x: torch.Tensor, w: torch.Tensor, m_sizes: torch.Tensor) -> None:
    for name, t in (("x", x), ("w", w), ("m_sizes", m_sizes)):
        ctx.add_tensor(name, t)


def _out_nbytes(spec: ProbeSpec) -> int:
    return spec.shape.m * spec.shape.n * torch.empty((), dtype=_DTYPES[spec.shape.dtype]).element_size()


# ---------------------------------------------------------------------------------------------
# Single-device conditions
# ---------------------------------------------------------------------------------------------


def _single(ctx: ProbeContext, kernel: KernelFn) -> dict[str, Any]:
    spec = ctx.spec
    dev = _device(spec.device)
    ctx.crumb(Phase.SETUP)
    x, w, m_sizes = make_operands(spec, dev)
    _register(ctx, x, w, m_sizes)
    ref = reference(x, w, m_sizes)
    trap = OutputTrap(_out_nbytes(spec), dev)
    fields = _call_and_check(ctx, kernel, x, w, m_sizes, ref, trap=trap)
    if fields["status"] == Status.PASS and dev.type == "cuda":
        fields["kernel_ms"] = _time_calls(lambda: kernel(x, w, m_sizes))
    return fields


def _side_stream(ctx: ProbeContext, kernel: KernelFn) -> dict[str, Any]:
    """Caller works on a side stream of b; x's producer is still queued there at the call."""
    spec = ctx.spec
    if spec.device is None:
        return _skip(ctx, "streams exist only on CUDA devices")
    dev = _device(spec.device)
    ctx.crumb(Phase.SETUP)
    x_src, w, m_sizes = make_operands(spec, dev)
    ref = reference(x_src, w, m_sizes)
    ctx.crumb(Phase.COMPILE)
    kernel(x_src, w, m_sizes)  # warm-up: compile before the race, or the hold runs out
    sync_all()
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        x = torch.full_like(x_src, float("nan"))  # stale contents: NaN
        _register(ctx, x, w, m_sizes)
        hold_stream(HOLD_S)
        x.copy_(x_src)  # the producer, still queued behind the hold at the launch
        produced = _recorded_event()
        ctx.fact("producer_stream", "side stream of operand device")
        fields = _call_and_check(ctx, kernel, x, w, m_sizes, ref, after_call=_pending(ctx, produced))
    return fields


def _recorded_event() -> Any:
    """An event recorded on the current stream: done once everything queued before it ran."""
    event = torch.cuda.Event()
    event.record()
    return event


def _pending(ctx: ProbeContext, produced: Any) -> Callable[[], None]:
    """Records whether the producer was still queued when the kernel call returned. When it was
    not, the race window had closed: either the wrapper waited for it (ordered: right) or the
    call took longer than the hold on the host (the order was not tested). docs/cells.md."""

    def check() -> None:
        pending = not produced.query()
        ctx.fact("producer_pending_after_call", pending)
        if not pending:
            ctx.note(
                "the producer had finished when the kernel call returned: the wrapper waited "
                "for it, or the race window closed before the launch"
            )

    return check


def _over_routed(ctx: ProbeContext, kernel: KernelFn) -> dict[str, Any]:
    """m_sizes sums past M (the last expert claims extra rows); x sits in a larger buffer."""
    spec = ctx.spec
    dev = _device(spec.device)
    ctx.crumb(Phase.SETUP)
    x_valid, w, m_sizes = make_operands(spec, dev)
    extra = int(spec.params.get("extra_rows", 64))
    backing = torch.full((spec.shape.m + extra, spec.shape.k), float("nan"), dtype=x_valid.dtype, device=dev)
    backing[: spec.shape.m] = x_valid
    x = backing[: spec.shape.m]  # rows past M hold NaN: a kernel that reads them shows it
    over = m_sizes.clone()
    over[-1] += extra
    ctx.fact("m_sizes_sum", int(over.sum()))
    ctx.fact("rows", spec.shape.m)
    _register(ctx, x, w, over)

    def variant() -> dict[str, Any]:
        ref = reference(x, w, over)  # the twin clamps at M: rows past M do not exist
        trap = OutputTrap(_out_nbytes(spec), dev)
        # the rows past M land in the guard after y, if the kernel writes them
        guard = OutputGuard((spec.shape.m, spec.shape.n), max(GUARD_ROWS, 2 * extra))
        return _call_and_check(ctx, kernel, x, w, over, ref, trap=trap, guard=guard)

    return _with_baseline(ctx, kernel, x, w, m_sizes, variant)


def _negative_sizes(ctx: ProbeContext, kernel: KernelFn) -> dict[str, Any]:
    """A -1 sentinel in m_sizes (dropped tokens, padding): its rows moved to the next expert,
    so the counts still sum to M + 1. A kernel that masks treats -1 as 0; one that trusts
    m_sizes walks its row cursor backwards and shifts every later expert's rows."""
    spec = ctx.spec
    dev = _device(spec.device)
    ctx.crumb(Phase.SETUP)
    x, w, m_valid = make_operands(spec, dev)
    sizes = m_valid.tolist()
    j = max(0, len(sizes) // 2 - 1)
    if len(sizes) < 2:
        return _skip(ctx, "a sentinel needs two experts")
    sizes[j + 1] += sizes[j] + 1
    sizes[j] = -1
    m_sizes = torch.tensor(sizes, dtype=m_valid.dtype, device=dev)
    ctx.fact("sentinel_expert", j)
    _register(ctx, x, w, m_sizes)

    def variant() -> dict[str, Any]:
        ref = reference(x, w, m_sizes)
        trap = OutputTrap(_out_nbytes(spec), dev)
        # a cursor walking back from the sentinel writes before y; one counting -1 as 0 runs a
        # row past its end
        guard = OutputGuard((spec.shape.m, spec.shape.n), GUARD_ROWS)
        return _call_and_check(ctx, kernel, x, w, m_sizes, ref, trap=trap, guard=guard)

    return _with_baseline(ctx, kernel, x, w, m_valid, variant)


def _interpreter_check(ctx: ProbeContext) -> dict[str, Any]:
    """Run a trivial Triton kernel of ours, with loops bounded by scalar arguments as every
    grouped GEMM has, on the CPU interpreter. If this fails, no kernel can be judged here.

    Seen on the GPU image (triton 3.6, NumPy 2.5): the interpreter passes scalar arguments as
    1-element arrays and ``range(n)`` raises "only 0-dimensional arrays can be converted to
    Python scalars"; triton 3.9 squeezes them first.
    """
    import triton

    from qmoe_doctor.probes import _reference_kernels as ref_kernels

    ctx.crumb(Phase.LAUNCH)
    n, width = 5, 16
    out = torch.zeros(width, dtype=torch.float32)
    ref_kernels.count_loop_kernel[(1,)](out, n, WIDTH=width)
    ctx.crumb(Phase.COMPARE)
    ok = bool((out == n).all())
    ctx.fact("triton_version", triton.__version__)
    return {"status": Status.PASS if ok else Status.WRONG}


# Offset / stride variants: (what the operands are, what edge it covers). Each is compared with
# the twin on the same values; the kernel must handle any strides and any storage offset.
OFFSET_VARIANTS: dict[str, str] = {
    # the pair that isolates alignment (scan_rules.misaligned_operand): the same values and strides,
    # a base off the 16-byte grid that TMA descriptors and vector loads need, and one on it
    "storage-offset-1": "x and w start 1 element into their buffers (2 bytes in bf16/fp16, 4 in fp32: not 16-byte aligned)",
    "storage-offset-8": "x and w start 8 elements into their buffers (16 bytes in bf16/fp16, 32 in fp32: 16-byte aligned)",
    "padded-rows": "x rows padded: row stride K + 24 (a slice of a wider buffer)",
    "transposed-w": "w is a transposed view of an (E, K, N) buffer (non-contiguous)",
    "empty-experts": "every other expert gets no rows",
    "hot-expert": "all rows on one expert",
    "last-expert": "all rows on the last expert",
    "m-not-multiple": "M = 4093, not a multiple of any tile",
}


def _view_into(t: torch.Tensor, offset: int) -> torch.Tensor:
    """The same values as ``t``, as a view starting ``offset`` elements into a larger buffer."""
    buf = torch.full((t.numel() + offset + 64,), float("nan"), dtype=t.dtype, device=t.device)
    view = buf[offset : offset + t.numel()].view(t.shape)
    view.copy_(t)
    return view


def _offsets(ctx: ProbeContext, kernel: KernelFn) -> dict[str, Any]:
    spec = ctx.spec
    variant = str(spec.params.get("variant", ""))
    if variant not in OFFSET_VARIANTS:
        return _skip(ctx, f"unknown offset variant {variant!r}; known: {', '.join(OFFSET_VARIANTS)}")
    dev = _device(spec.device)
    ctx.crumb(Phase.SETUP)
    x, w, m_sizes = make_operands(spec, dev)
    ctx.fact("variant", variant)
    ctx.note(OFFSET_VARIANTS[variant])
    if variant.startswith("storage-offset-"):
        off = int(variant.rsplit("-", 1)[1])
        x, w = _view_into(x, off), _view_into(w, off)
    elif variant == "padded-rows":
        wide = torch.full((x.shape[0], x.shape[1] + 24), float("nan"), dtype=x.dtype, device=dev)
        wide[:, : x.shape[1]] = x
        x = wide[:, : x.shape[1]]
    elif variant == "transposed-w":
        w = w.transpose(1, 2).contiguous().transpose(1, 2)
    ctx.fact("x_strides", list(x.stride()))
    ctx.fact("w_strides", list(w.stride()))
    _register(ctx, x, w, m_sizes)
    ref = reference(x, w, m_sizes)
    trap = OutputTrap(_out_nbytes(spec), dev)
    return _call_and_check(ctx, kernel, x, w, m_sizes, ref, trap=trap)


def _launch_config(ctx: ProbeContext, kernel: KernelFn) -> dict[str, Any]:
    """The kernel with one pinned launch config (kernels that take ``config=GemmConfig``)."""
    import inspect

    spec = ctx.spec
    try:
        accepts = "config" in inspect.signature(kernel).parameters
    except (TypeError, ValueError):
        accepts = False
    if not accepts:
        return _skip(ctx, "the kernel takes no config= argument: its launch configs cannot be pinned")
    from qmoe_doctor.kernels.grouped_gemm import GemmConfig

    cfg = GemmConfig.from_tile(TileConfig(*(int(spec.params[name]) for name in TileConfig._fields)))
    dev = _device(spec.device)
    ctx.crumb(Phase.SETUP)
    itemsize = torch.empty((), dtype=_DTYPES[spec.shape.dtype]).element_size()
    ctx.fact("config", f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}")
    ctx.fact("smem_bytes_estimate", cfg.smem_bytes(itemsize))
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        ctx.fact("smem_limit_bytes", int(getattr(props, "shared_memory_per_block_optin", 0)))
        ctx.fact("regs_per_block_limit", int(getattr(props, "regs_per_block", 0) or 0))
    x, w, m_sizes = make_operands(spec, dev)
    _register(ctx, x, w, m_sizes)
    ref = reference(x, w, m_sizes)
    return _call_and_check(ctx, lambda a, b, c: kernel(a, b, c, config=cfg), x, w, m_sizes, ref)


def _repeat_call(ctx: ProbeContext, kernel: KernelFn) -> dict[str, Any]:
    """First and second call of the process on identical inputs (autotuners run on the first)."""
    spec = ctx.spec
    if spec.kernel in _CALLED:
        return _skip(ctx, "the kernel was already called in this process; the first call is gone")
    dev = _device(spec.device)
    ctx.crumb(Phase.SETUP)
    x, w, m_sizes = make_operands(spec, dev)
    _register(ctx, x, w, m_sizes)
    ref = reference(x, w, m_sizes)
    errors = []
    statuses = []
    for call in range(2):
        fields = _call_and_check(ctx, kernel, x, w, m_sizes, ref)
        errors.append(float(fields.get("rel_error", float("nan"))))
        statuses.append(fields["status"])
        if call == 0:
            # whether the first call benchmarked is what this cell can see a first-call fault by
            launches = ctx.facts.get("autotuned_launches")
            ctx.fact("first_call_autotuned_launches", launches or 0)
            if launches:
                ctx.fact("first_call_autotune_benchmarked", bool(ctx.facts.get("autotune_benchmarked")))
    fields["calls_rel_error"] = tuple(errors)
    fields["rel_error"] = errors[0]
    fields["status"] = Status.PASS if all(s == Status.PASS for s in statuses) else Status.WRONG
    return fields


def _int32_boundary(ctx: ProbeContext, kernel: KernelFn) -> dict[str, Any]:
    """Rows routed to the first expert whose base offset e * N * K passes 2**31 - 1."""
    spec = ctx.spec
    if spec.device is None:
        return _skip(ctx, "the boundary probe needs a weight stack of >4 GiB: GPU only")
    dev = _device(spec.device)
    s = spec.shape
    itemsize = torch.empty((), dtype=_DTYPES[s.dtype]).element_size()
    need = s.e * s.n * s.k * itemsize + 3 * s.m * max(s.n, s.k) * 4
    free, _total = torch.cuda.mem_get_info(dev)
    ctx.fact("bytes_needed", int(need))
    ctx.fact("bytes_free", int(free))
    if need > free * 0.9:
        return _skip(
            ctx, f"the stack needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free on the device"
        )
    ctx.crumb(Phase.SETUP)
    dtype = _DTYPES[s.dtype]
    gen = torch.Generator(device=dev).manual_seed(spec.seed)
    x = torch.randn((s.m, s.k), device=dev, generator=gen).to(dtype)
    w = torch.empty((s.e, s.n, s.k), device=dev, dtype=dtype)
    hot = s.e - 1  # the planner sizes E so that the last expert is the first wrapping one
    w[1:hot].fill_(float("nan"))  # a wrapped pointer that lands in another expert reads NaN
    for expert in (0, hot):  # expert 0: the baseline (offset 0); hot: the first wrapping one
        w[expert] = (torch.randn((s.n, s.k), device=dev, generator=gen) / math.sqrt(s.k)).to(dtype)
    m_base = torch.zeros(s.e, dtype=torch.int32, device=dev)
    m_base[0] = s.m
    m_sizes = torch.zeros(s.e, dtype=torch.int32, device=dev)
    m_sizes[hot] = s.m
    ctx.fact("expert", hot)
    ctx.fact("expert_offset_elements", hot * s.n * s.k)
    _register(ctx, x, w, m_sizes)

    def variant() -> dict[str, Any]:
        ref = (x.float() @ w[hot].float().T).float()
        return _call_and_check(ctx, kernel, x, w, m_sizes, ref)

    return _with_baseline(ctx, kernel, x, w, m_base, variant)


# ---------------------------------------------------------------------------------------------
# Pair conditions: operands on b, a current
# ---------------------------------------------------------------------------------------------


def _pair_devices(spec: ProbeSpec) -> tuple[int, int]:
    if spec.device is None or spec.current is None:
        raise ValueError(f"{spec.condition} needs both device and current ordinals")
    return spec.current, spec.device


def _guarded(ctx: ProbeContext, kernel: KernelFn) -> dict[str, Any]:
    a, b = _pair_devices(ctx.spec)
    ctx.crumb(Phase.SETUP)
    x, w, m_sizes = make_operands(ctx.spec, _device(b))
    _register(ctx, x, w, m_sizes)
    ref = reference(x, w, m_sizes)
    trap = OutputTrap(_out_nbytes(ctx.spec), _device(b))
    fields = _call_and_check(ctx, kernel, x, w, m_sizes, ref, trap=trap)
    if fields["status"] == Status.PASS:
        fields["kernel_ms"] = _time_calls(lambda: kernel(x, w, m_sizes))
    return fields


def _untouched(ctx: ProbeContext, kernel: KernelFn) -> dict[str, Any]:
    """Current device a (the process default, ordinal 0) with no context ever created on it."""
    a, b = _pair_devices(ctx.spec)
    if a != 0:
        return _skip(ctx, "only the default device (ordinal 0) can be current without a context")
    if torch.cuda.is_initialized() and torch.cuda.current_device() != a:
        return _skip(ctx, f"current device is {torch.cuda.current_device()}, not {a}")
    if _has_context(a):
        return _skip(ctx, f"a CUDA context on device {a} already exists in this process")
    ctx.crumb(Phase.SETUP)
    x, w, m_sizes = make_operands(ctx.spec, _device(b))  # never sets the current device
    _register(ctx, x, w, m_sizes)
    ref = reference(x, w, m_sizes)
    ctx.fact("context_on_current_before", _has_context(a))
    fields = _call_and_check(ctx, kernel, x, w, m_sizes, ref)
    ctx.fact("context_on_current_after", _has_context(a))
    return fields


def _touch(ordinal: int) -> None:
    torch.cuda.set_device(ordinal)
    torch.ones(1, device=_device(ordinal)).add_(1)


def _enable_peer(a: int, b: int) -> None:
    """One copy a -> b, as every device_map pipeline does: torch enables a's access to b."""
    src = torch.ones(256, device=_device(a))
    src.to(_device(b))
    sync_all()
    _PEER_ENABLED.add((a, b))


def _no_peer(ctx: ProbeContext, kernel: KernelFn) -> dict[str, Any]:
    a, b = _pair_devices(ctx.spec)
    if (a, b) in _PEER_ENABLED:
        return _skip(ctx, f"peer access {a}->{b} was already enabled in this process")
    ctx.crumb(Phase.SETUP)
    x, w, m_sizes = make_operands(ctx.spec, _device(b))
    _register(ctx, x, w, m_sizes)
    ref = reference(x, w, m_sizes)
    _touch(a)
    ctx.fact("peer_enabled", False)
    return _call_and_check(ctx, kernel, x, w, m_sizes, ref, watch_alloc_on=a)


def _peer(ctx: ProbeContext, kernel: KernelFn) -> dict[str, Any]:
    a, b = _pair_devices(ctx.spec)
    ctx.crumb(Phase.SETUP)
    x, w, m_sizes = make_operands(ctx.spec, _device(b))
    _register(ctx, x, w, m_sizes)
    ref = reference(x, w, m_sizes)
    _touch(a)
    _enable_peer(a, b)
    ctx.fact("peer_enabled", True)
    fields = _call_and_check(ctx, kernel, x, w, m_sizes, ref, watch_alloc_on=a)
    if fields["status"] == Status.PASS:
        torch.cuda.set_device(a)
        fields["kernel_ms"] = _time_calls(lambda: kernel(x, w, m_sizes))
    return fields


def _producer_race(ctx: ProbeContext, kernel: KernelFn) -> dict[str, Any]:
    """PEER, and x is still being written on b's current stream when the kernel is called."""
    a, b = _pair_devices(ctx.spec)
    ctx.crumb(Phase.SETUP)
    x_src, w, m_sizes = make_operands(ctx.spec, _device(b))
    ref = reference(x_src, w, m_sizes)
    _touch(a)
    _enable_peer(a, b)
    ctx.crumb(Phase.COMPILE)
    kernel(x_src, w, m_sizes)  # warm-up from a: compile before the race
    sync_all()
    with torch.cuda.device(b):
        x = torch.full_like(x_src, float("nan"))
        sync_all()
        hold_stream(HOLD_S)  # b's current stream is busy ...
        x.copy_(x_src)  # ... and x's producer is queued behind it
        produced = _recorded_event()
    _register(ctx, x, w, m_sizes)
    ctx.fact("producer_stream", "current stream of operand device")
    return _call_and_check(ctx, kernel, x, w, m_sizes, ref, after_call=_pending(ctx, produced))


def _sizes_race(ctx: ProbeContext, kernel: KernelFn) -> dict[str, Any]:
    """PEER, and m_sizes is still being written on b's stream into a recycled block that
    holds large stale values."""
    a, b = _pair_devices(ctx.spec)
    ctx.crumb(Phase.SETUP)
    x, w, m_src = make_operands(ctx.spec, _device(b))
    ref = reference(x, w, m_src)
    _touch(a)
    _enable_peer(a, b)
    ctx.crumb(Phase.COMPILE)
    kernel(x, w, m_src)
    sync_all()
    with torch.cuda.device(b):
        # What a recycled allocator block holds when its new owner's producer has not run
        # yet: the previous owner's values. Written here directly, so the probe does not
        # depend on which free block the allocator picks.
        m_sizes = torch.full_like(m_src, STALE_SIZE)
        sync_all()
        hold_stream(HOLD_S)
        m_sizes.copy_(m_src)  # the producer, queued behind the hold
        produced = _recorded_event()
    ctx.fact("stale_m_size", STALE_SIZE)
    _register(ctx, x, w, m_sizes)
    return _call_and_check(ctx, kernel, x, w, m_sizes, ref, after_call=_pending(ctx, produced))


_PAIR_RUNNERS_OWN_DEVICE = frozenset(
    {Condition.UNTOUCHED, Condition.NO_PEER, Condition.PEER, Condition.PRODUCER_RACE, Condition.SIZES_RACE}
)

_RUNNERS: dict[Condition, Callable[[ProbeContext, KernelFn], dict[str, Any]]] = {
    Condition.SINGLE: _single,
    Condition.SIDE_STREAM: _side_stream,
    Condition.OVER_ROUTED: _over_routed,
    Condition.NEGATIVE_SIZES: _negative_sizes,
    Condition.OFFSETS: _offsets,
    Condition.LAUNCH_CONFIG: _launch_config,
    Condition.REPEAT_CALL: _repeat_call,
    Condition.INT32_BOUNDARY: _int32_boundary,
    Condition.GUARDED: _guarded,
    Condition.UNTOUCHED: _untouched,
    Condition.NO_PEER: _no_peer,
    Condition.PEER: _peer,
    Condition.PRODUCER_RACE: _producer_race,
    Condition.SIZES_RACE: _sizes_race,
}


def _routed_runners() -> dict[Condition, Callable[[ProbeContext, KernelFn], dict[str, Any]]]:
    """The routed protocol's cells (``probes/routed_conditions.py``, which imports this module)."""
    from qmoe_doctor.probes.routed_conditions import RUNNERS

    return RUNNERS
