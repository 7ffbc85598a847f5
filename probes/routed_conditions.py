"""The routed protocol's cells (child side; imports torch): routing edges of kernels that take
the router's token ids, ``fn(hidden_states, w, topk_ids, topk_weights[, expert_map])``.

Each edge cell calls the kernel twice on the same operands: first with valid routing (its
baseline, the fact ``baseline_ok``), then with exactly one routing edge, and compares each call
with the routed twin (``kernels/routed.py``). What a correct kernel does with each edge, and what
the cell counts as outside its tensors (docs/cells.md, docs/causes/invalid-routing.md):

==================  ==========================================  ===============================
cell                the edge                                    a correct kernel
==================  ==========================================  ===============================
routed              none: valid top-k routing, k > 1            matches the twin
ids-out-of-range    ids E and -2 in some slots                  skips those slots, or refuses
                                                                before launch (``rejected``)
dropped-slots       -1 in some slots, no expert_map             skips them (or refuses)
expert-map          global ids, expert_map -1 for remote        skips the remote slots
                    experts (expert parallelism)
map-past-local      expert_map entries >= the local count       skips those slots (or refuses)
padded-count        its own routing (sorted-token-ids style),   bounds its blocks by the buffer
                    num_tokens_post_padded past the buffer      it was given, not the count
gather-past-t       its own routing (gather/scatter style),     masks the index (the slot adds
                    one gather index whose token is past T      nothing), or refuses
gathered-int32      T*k*N past 2**31 (GPU)                      right in every row
==================  ==========================================  ===============================

**What counts as outside.** ``w`` sits between guard experts and ``hidden_states`` before guard
rows, all NaN: the ids an edge plants point into them (E and -2 with E guard experts on each
side; a global id reads at most 2E - 1). No arithmetic makes a NaN from the finite operands, so
a NaN in the output where the twin is finite, absent from the baseline call, was read from a
guard: a canary hit ("read outside w"), the fault ``invalid-routing``. Guard rows around the
output the kernel allocates (``OutputGuard``) catch writes past it, as in the ``m_sizes`` cells.
The padded-count cell takes one slot out of ``sorted_token_ids`` (its position holds the padding
id) and puts it past the end (and past ``expert_ids`` another expert for it): no block inside the
buffer writes that slot's row, so a kernel that trusts the count is the only one that can, and
that row alone differs, which only a read past the two buffers explains.
Wrong values with every access in bounds (a clamped id) are a hardening finding, except in the
expert-map cell, whose input is valid expert-parallel routing: there any failure is a fault.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch

from qmoe_doctor.core.records import Condition, Phase, ProbeSpec, Status
from qmoe_doctor.core.tolerances import tolerance
from qmoe_doctor.kernels.routed import routed_moe_rows_torch, routed_moe_torch
from qmoe_doctor.probes.conditions import _DTYPES, GUARD_ROWS, _device, _poison_bits, _skip, compare, sync_all
from qmoe_doctor.probes.context import ProbeContext
from qmoe_doctor.probes.kernel_call import watch
from qmoe_doctor.probes.loader import KernelFn
from qmoe_doctor.probes.output_guard import OutputGuard
from qmoe_doctor.probes.routed import RoutedKernel, as_routed, routing_style

#: The top-k of the routed cells when the spec does not say.
DEFAULT_TOP_K = 2
#: Guard rows of NaN after hidden_states (the gather-past-T index lands in the second).
HIDDEN_GUARD_ROWS = 4
#: Blocks of guard past sorted_token_ids / expert_ids in the padded-count cell.
PADDED_GUARD_BLOCKS = 2
#: Tokens of the gathered-int32 cell's own baseline (small offsets) and of its sampled check.
INT32_BASELINE_TOKENS = 256
INT32_SAMPLE_TOKENS = 64

Call = Callable[[], Any]


# ---------------------------------------------------------------------------------------------
# Operands, references, calls
# ---------------------------------------------------------------------------------------------


def top_k(spec: ProbeSpec) -> int:
    return max(1, min(int(spec.params.get("top_k", DEFAULT_TOP_K)), spec.shape.e))


def routed_operands(
    spec: ProbeSpec, device: torch.device, *, experts: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden_states (T, H), w (E, N, H), topk_ids (T, k) int64 (distinct experts per token, as
    torch.topk gives them, over ``experts`` ids: E unless said), topk_weights (T, k) (the top
    probabilities, renormalized), on ``device`` only, deterministic from the seed."""
    s = spec.shape
    dtype = _DTYPES[s.dtype]
    k = top_k(spec)
    gen = torch.Generator(device=device).manual_seed(spec.seed)
    hidden = torch.randn((s.m, s.k), device=device, dtype=torch.float32, generator=gen).to(dtype)
    w = (torch.randn((s.e, s.n, s.k), device=device, dtype=torch.float32, generator=gen) / math.sqrt(s.k)).to(
        dtype
    )
    scores = torch.rand((s.m, experts or s.e), device=device, generator=gen)
    probs, topk_ids = torch.topk(torch.softmax(scores, dim=1), k, dim=1)
    topk_weights = (probs / probs.sum(dim=1, keepdim=True)).to(dtype)
    return hidden, w, topk_ids, topk_weights


def guarded(t: torch.Tensor, before: int, after: int) -> torch.Tensor:
    """The values of ``t`` as a contiguous view into a buffer with ``before`` and ``after`` NaN
    slices along its first dimension (a read past either end reads NaN)."""
    buf = torch.full(
        (t.shape[0] + before + after, *t.shape[1:]), float("nan"), dtype=t.dtype, device=t.device
    )
    view = buf[before : before + t.shape[0]]
    view.copy_(t)
    return view


def reference(
    kernel: RoutedKernel,
    hidden: torch.Tensor,
    w: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    twin = routed_moe_rows_torch if kernel.rows else routed_moe_torch
    return twin(hidden, w, ids, weights, expert_map, out_dtype=torch.float32)


def _map_keyword(fn: KernelFn) -> bool:
    """The kernel names its map ``expert_map`` (pass it by name), else it is the 5th positional."""
    try:
        return "expert_map" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _register(ctx: ProbeContext, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None:
            ctx.add_tensor(name, t)


class _Cell:
    """One routed cell: the kernel under test watched, its output guarded, each call judged."""

    def __init__(self, ctx: ProbeContext, kernel: RoutedKernel) -> None:
        self.ctx = ctx
        self.kernel = kernel
        self.fn = watch(ctx, kernel.routed_fn)
        self.by_name = _map_keyword(kernel.routed_fn)

    def out_shape(self, ids: torch.Tensor, w: torch.Tensor) -> tuple[int, int]:
        tokens, k = ids.shape
        return (tokens * k if self.kernel.rows else tokens, int(w.shape[1]))

    def call(
        self,
        hidden: torch.Tensor,
        w: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        expert_map: torch.Tensor | None = None,
        routing: dict[str, torch.Tensor] | None = None,
    ) -> Any:
        args: list[Any] = [hidden, w, ids, weights]
        kwargs: dict[str, Any] = {}
        if expert_map is not None:
            if self.by_name:
                kwargs["expert_map"] = expert_map
            else:
                args.append(expert_map)
        if routing is not None:
            kwargs["routing"] = routing
        return self.fn(*args, **kwargs)

    def judge(
        self,
        ref: torch.Tensor,
        run: Call,
        out_shape: tuple[int, int],
        *,
        nan_guards: str = "",
        lone_row: int | None = None,
        lone_what: str = "",
        unwritten_ok: int | None = None,
    ) -> dict[str, Any]:
        """One watched call, synchronized and compared. ``nan_guards`` names the NaN-guarded
        buffers a NaN in the output was read from; ``lone_row``: when that output row alone is
        wrong, the kernel read ``lone_what``; ``unwritten_ok``: a row the routing handed to the
        kernel names no slot of, which may stay as the output's allocation left it (compared as
        zero)."""
        ctx = self.ctx
        ctx.crumb(Phase.LAUNCH)
        guard = OutputGuard(out_shape, GUARD_ROWS)
        with guard:
            out = run()
        ctx.crumb(Phase.SYNC)
        sync_all()
        judged = out
        if unwritten_ok is not None and isinstance(out, torch.Tensor) and out.dim() == 2:
            poison = _poison_bits(out)
            if poison is not None and bool(poison[unwritten_ok].all()):
                judged = out.clone()
                judged[unwritten_ok] = 0
                ctx.fact("row_left_unwritten", unwritten_ok)
        fields = compare(ctx, judged, ref, ref.device)
        hits = guard.report(ctx, out)  # the guard rows around the output the kernel returned
        if nan_guards and int(fields.get("nan_written") or 0) > 0:
            hits.append(f"read {nan_guards}")
            ctx.fact("nan_from_guards", int(fields["nan_written"]))
        if lone_row is not None and fields["status"] is Status.WRONG and isinstance(judged, torch.Tensor):
            wrong = wrong_rows(judged, ref, ctx.spec.shape.dtype)
            ctx.fact("wrong_rows", wrong[:16])
            if wrong == [lone_row]:
                hits.append(lone_what)
        if hits:
            fields["canary_hits"] = tuple(hits)
            fields["status"] = Status.WRONG
        return fields

    def with_baseline(
        self,
        base_ref: torch.Tensor,
        base: Call,
        variant: Callable[[], dict[str, Any]],
        out_shape: tuple[int, int],
    ) -> dict[str, Any]:
        """The valid call first (``baseline_ok``), then the variant: the cell is its own
        differential. A baseline that raises ends the cell with ``baseline_ok`` False."""
        ctx = self.ctx
        ctx.crumb(Phase.LAUNCH, step="baseline")
        try:
            out = base()
        except BaseException:
            ctx.fact("baseline_ok", False)
            ctx.fact("baseline_raised", True)
            raise
        sync_all()
        fields = compare(ctx, out, base_ref, base_ref.device)
        del out
        ok = fields["status"] is Status.PASS
        ctx.fact("baseline_ok", ok)
        ctx.fact("baseline_rel_error", fields.get("rel_error"))
        got = variant()
        ctx.fact("variant_ok", got["status"] is Status.PASS)
        if not ok and got["status"] is Status.PASS:
            ctx.note("the baseline call (valid routing, same operands) was wrong; the variant call was right")
            got["status"] = Status.WRONG
        return got


def wrong_rows(out: torch.Tensor, ref: torch.Tensor, dtype: str) -> list[int]:
    """Output rows whose largest error passes ten times the dtype's tolerance of the row's
    largest value (NaN counts as wrong): the rows a planted entry changed, not rounding."""
    diff = torch.nan_to_num(out.detach().to(ref.device, torch.float32) - ref, nan=float("inf"))
    scale = ref.abs().amax(dim=1).clamp_min(1e-6)
    rel = diff.abs().amax(dim=1) / scale
    return [int(i) for i in (rel > 10 * tolerance(dtype)).nonzero().flatten().tolist()]


def _routed_or_skip(ctx: ProbeContext, kernel: KernelFn) -> RoutedKernel | dict[str, Any]:
    routed = as_routed(kernel)
    if routed is None:
        return _skip(ctx, "the routed cells need a kernel of the routed protocol (adapter:routed:TARGET)")
    return routed


# ---------------------------------------------------------------------------------------------
# The cells
# ---------------------------------------------------------------------------------------------


def _routed(ctx: ProbeContext, kernel: KernelFn) -> dict[str, Any]:
    """Valid top-k routing, k > 1: the routed protocol's own baseline."""
    routed = _routed_or_skip(ctx, kernel)
    if isinstance(routed, dict):
        return routed
    dev = _device(ctx.spec.device)
    ctx.crumb(Phase.SETUP)
    hidden, w, ids, weights = routed_operands(ctx.spec, dev)
    _register(ctx, hidden_states=hidden, w=w, topk_ids=ids, topk_weights=weights)
    ctx.fact("top_k", ids.shape[1])
    cell = _Cell(ctx, routed)
    ref = reference(routed, hidden, w, ids, weights)
    return cell.judge(ref, lambda: cell.call(hidden, w, ids, weights), cell.out_shape(ids, w))


def _edge_ids(
    ctx: ProbeContext, kernel: KernelFn, plant: Callable[[torch.Tensor, int], list[int]], what: str
) -> dict[str, Any]:
    """An edge planted in the ids (``plant(ids, E)`` edits a copy in place and returns the ids
    it planted); w between E NaN guard experts on each side."""
    routed = _routed_or_skip(ctx, kernel)
    if isinstance(routed, dict):
        return routed
    spec = ctx.spec
    dev = _device(spec.device)
    ctx.crumb(Phase.SETUP)
    hidden, w_plain, ids, weights = routed_operands(spec, dev)
    e = spec.shape.e
    w = guarded(w_plain, e, e)
    bad = ids.clone()
    planted = plant(bad, e)
    ctx.fact("planted_ids", sorted(set(planted)))
    ctx.fact("planted_slots", len(planted))
    ctx.note(what)
    _register(ctx, hidden_states=hidden, w=w, topk_ids=bad, topk_weights=weights)
    cell = _Cell(ctx, routed)
    shape = cell.out_shape(ids, w)
    base_ref = reference(routed, hidden, w, ids, weights)

    def variant() -> dict[str, Any]:
        ref = reference(routed, hidden, w, bad, weights)  # the twin: those slots add nothing
        return cell.judge(ref, lambda: cell.call(hidden, w, bad, weights), shape, nan_guards="outside w")

    return cell.with_baseline(base_ref, lambda: cell.call(hidden, w, ids, weights), variant, shape)


def _plant_out_of_range(ids: torch.Tensor, e: int) -> list[int]:
    planted = []
    for t in range(1, ids.shape[0], 5):  # every fifth token's first slot: E, then -2, ...
        ids[t, 0] = e if (t // 5) % 2 == 0 else -2
        planted.append(int(ids[t, 0]))
    return planted


def _plant_dropped(ids: torch.Tensor, e: int) -> list[int]:
    del e
    planted = []
    for t in range(1, ids.shape[0], 4):  # every fourth token's last slot dropped
        ids[t, -1] = -1
        planted.append(-1)
    return planted


def _ids_out_of_range(ctx: ProbeContext, kernel: KernelFn) -> dict[str, Any]:
    return _edge_ids(
        ctx,
        kernel,
        _plant_out_of_range,
        "expert ids E and -2 in every fifth token's first slot (w between NaN guards)",
    )


def _dropped_slots(ctx: ProbeContext, kernel: KernelFn) -> dict[str, Any]:
    return _edge_ids(ctx, kernel, _plant_dropped, "-1 in every fourth token's last slot, no expert_map")


def _ep_map(e: int, *, past_local: bool) -> torch.Tensor:
    """A global -> local map over 2E global experts: even ids are this rank's (g // 2), odd ones
    another rank's (-1); ``past_local``: every other odd id maps to E or E + 1 instead."""
    entries = []
    for g in range(2 * e):
        if g % 2 == 0:
            entries.append(g // 2)
        elif past_local and g % 4 == 1:
            entries.append(e + (g // 4) % 2)
        else:
            entries.append(-1)
    return torch.tensor(entries, dtype=torch.int32)


def _expert_map_cell(ctx: ProbeContext, kernel: KernelFn, *, past_local: bool) -> dict[str, Any]:
    routed = _routed_or_skip(ctx, kernel)
    if isinstance(routed, dict):
        return routed
    if not routed.takes_expert_map:
        return _skip(
            ctx, "the kernel takes no expert_map (a parameter of that name, or a fifth positional one)"
        )
    spec = ctx.spec
    dev = _device(spec.device)
    e = spec.shape.e
    ctx.crumb(Phase.SETUP)
    hidden, w_plain, local_ids, weights = routed_operands(spec, dev)
    _, _, global_ids, _ = routed_operands(spec, dev, experts=2 * e)
    w = guarded(w_plain, e, e)
    identity = torch.arange(e, dtype=torch.int32, device=dev)
    ep_map = _ep_map(e, past_local=past_local).to(dev)
    ctx.fact("global_experts", 2 * e)
    ctx.fact("local_experts", e)
    ctx.fact("expert_map", ep_map.tolist())
    ctx.note(
        "global ids over 2E experts; expert_map: even ids local, "
        + (
            "every other odd id past the local count (E, E + 1), the rest -1"
            if past_local
            else "odd ids -1 (remote)"
        )
        + "; the baseline: local ids and the identity map"
    )
    _register(ctx, hidden_states=hidden, w=w, topk_ids=global_ids, topk_weights=weights, expert_map=ep_map)
    cell = _Cell(ctx, routed)
    shape = cell.out_shape(local_ids, w)
    base_ref = reference(routed, hidden, w, local_ids, weights, identity)

    def variant() -> dict[str, Any]:
        ref = reference(routed, hidden, w, global_ids, weights, ep_map)
        return cell.judge(
            ref, lambda: cell.call(hidden, w, global_ids, weights, ep_map), shape, nan_guards="outside w"
        )

    return cell.with_baseline(
        base_ref, lambda: cell.call(hidden, w, local_ids, weights, identity), variant, shape
    )


def _expert_map(ctx: ProbeContext, kernel: KernelFn) -> dict[str, Any]:
    return _expert_map_cell(ctx, kernel, past_local=False)


def _map_past_local(ctx: ProbeContext, kernel: KernelFn) -> dict[str, Any]:
    return _expert_map_cell(ctx, kernel, past_local=True)


def _own_routing(
    ctx: ProbeContext, routed: RoutedKernel, style: str, ids: torch.Tensor, weights: torch.Tensor, e: int
) -> dict[str, torch.Tensor] | dict[str, Any]:
    """The kernel's own routing of ``ids`` (its ``route``), or a skip when it has none of ``style``."""
    if routed.route is None:
        return _skip(
            ctx,
            "the kernel exposes no routing step (fn.route and a routing= parameter): its routing buffers "
            "cannot be handed to it",
        )
    ctx.crumb(Phase.SETUP, step="route")
    routing = routed.route(ids, weights, e)
    found = routing_style(routing)
    ctx.fact("routing_style", found)
    if found != style:
        want = "sorted-token-ids" if style == "sorted" else "gather/scatter"
        return _skip(
            ctx, f"the kernel's routing step is not of the {want} style (its keys: {sorted(routing)})"
        )
    return dict(routing)


def _padded_count(ctx: ProbeContext, kernel: KernelFn) -> dict[str, Any]:
    """The kernel's own alignment, its num_tokens_post_padded past the padded buffer."""
    routed = _routed_or_skip(ctx, kernel)
    if isinstance(routed, dict):
        return routed
    spec = ctx.spec
    dev = _device(spec.device)
    e = spec.shape.e
    ctx.crumb(Phase.SETUP)
    hidden, w, ids, weights = routed_operands(spec, dev)
    own = _own_routing(ctx, routed, "sorted", ids, weights, e)
    if "status" in own:
        return own
    sorted_ids, expert_ids = own["sorted_token_ids"], own["expert_ids"]
    padded, blocks = int(sorted_ids.shape[0]), int(expert_ids.shape[0])
    block_m = padded // max(blocks, 1)
    tokens, k = ids.shape
    # the slot the guard names: token T-1's first slot. It is taken out of the buffer (its
    # position holds the padding id, as a dropped slot's would), so no block inside the buffer
    # writes its row: only a block past the end can, with another expert (no race on a GPU).
    sentinel = (tokens - 1) * k
    wrong_expert = (int(ids[-1, 0]) + 1) % e
    sorted_buf = torch.full(
        (padded + PADDED_GUARD_BLOCKS * block_m,), sentinel, dtype=sorted_ids.dtype, device=dev
    )
    sorted_buf[:padded] = torch.where(sorted_ids == sentinel, tokens * k, sorted_ids)
    expert_buf = torch.full((blocks + PADDED_GUARD_BLOCKS,), wrong_expert, dtype=expert_ids.dtype, device=dev)
    expert_buf[:blocks] = expert_ids
    count = own["num_tokens_post_padded"]
    lying = torch.full_like(count, padded + PADDED_GUARD_BLOCKS * block_m)
    lie = {
        **own,
        "sorted_token_ids": sorted_buf[:padded],
        "expert_ids": expert_buf[:blocks],
        "num_tokens_post_padded": lying,
    }
    ctx.fact("padded_buffer", padded)
    ctx.fact("block_m", block_m)
    ctx.fact("num_tokens_post_padded", int(count.reshape(-1)[0]))
    ctx.fact("lying_count", int(lying.reshape(-1)[0]))
    ctx.fact("guard_slot", sentinel)
    ctx.note(
        f"num_tokens_post_padded {int(lying.reshape(-1)[0])} for a buffer of {padded}; past its end "
        f"sorted_token_ids holds slot {sentinel} and expert_ids expert {wrong_expert}"
    )
    _register(ctx, hidden_states=hidden, w=w, topk_ids=ids, topk_weights=weights)
    for name, t in lie.items():
        ctx.add_tensor(name, t)
    cell = _Cell(ctx, routed)
    shape = cell.out_shape(ids, w)
    base_ref = reference(routed, hidden, w, ids, weights)
    dropped = ids.clone()
    dropped.view(-1)[sentinel] = -1
    ref = reference(routed, hidden, w, dropped, weights)  # the slot the buffer no longer holds adds nothing
    lone = sentinel if routed.rows else sentinel // k

    def variant() -> dict[str, Any]:
        return cell.judge(
            ref,
            lambda: cell.call(hidden, w, ids, weights, routing=lie),
            shape,
            lone_row=lone,
            lone_what="read past sorted_token_ids and expert_ids (the guard's slot was computed)",
            unwritten_ok=sentinel if routed.rows else None,
        )

    return cell.with_baseline(
        base_ref, lambda: cell.call(hidden, w, ids, weights, routing=own), variant, shape
    )


def _gather_past_t(ctx: ProbeContext, kernel: KernelFn) -> dict[str, Any]:
    """The kernel's own gather/scatter routing, one gather index naming a token past T."""
    routed = _routed_or_skip(ctx, kernel)
    if isinstance(routed, dict):
        return routed
    spec = ctx.spec
    dev = _device(spec.device)
    e = spec.shape.e
    ctx.crumb(Phase.SETUP)
    hidden_plain, w, ids, weights = routed_operands(spec, dev)
    hidden = guarded(hidden_plain, 0, HIDDEN_GUARD_ROWS)
    own = _own_routing(ctx, routed, "gather", ids, weights, e)
    if "status" in own:
        return own
    tokens, k = ids.shape
    gather = own["gather_indx"]
    position = 0  # the first routed row: every slot of the valid routing is routed
    slot = int(gather[position])
    bad_gather = gather.clone()
    bad_gather[position] = (tokens + 1) * k  # token T + 1: the second guard row
    lie = {**own, "gather_indx": bad_gather}
    dropped = ids.clone()
    dropped.view(-1)[slot] = -1  # a correct kernel masks the index: the slot adds nothing
    ctx.fact("gather_position", position)
    ctx.fact("gather_index", int(bad_gather[position]))
    ctx.fact("slot_lost", slot)
    ctx.note(
        f"gather_indx[{position}] = {int(bad_gather[position])} (token {tokens + 1} of {tokens}); hidden_states "
        f"before {HIDDEN_GUARD_ROWS} NaN guard rows"
    )
    _register(ctx, hidden_states=hidden, w=w, topk_ids=ids, topk_weights=weights)
    for name, t in lie.items():
        ctx.add_tensor(name, t)
    cell = _Cell(ctx, routed)
    shape = cell.out_shape(ids, w)
    base_ref = reference(routed, hidden, w, ids, weights)

    def variant() -> dict[str, Any]:
        ref = reference(routed, hidden, w, dropped, weights)
        return cell.judge(
            ref,
            lambda: cell.call(hidden, w, ids, weights, routing=lie),
            shape,
            nan_guards="past hidden_states",
        )

    return cell.with_baseline(
        base_ref, lambda: cell.call(hidden, w, ids, weights, routing=own), variant, shape
    )


def _gathered_int32(ctx: ProbeContext, kernel: KernelFn) -> dict[str, Any]:
    """T*k*N past 2**31: gathered slot ids times the row stride of the (T*k, N) rows (the output
    of routed-rows, the intermediate of a kernel that reduces after) pass 2**31 - 1 for the last
    rows. The baseline: the first tokens alone. Checked on sampled tokens (the first and the
    last) and for unwritten elements everywhere."""
    routed = _routed_or_skip(ctx, kernel)
    if isinstance(routed, dict):
        return routed
    spec = ctx.spec
    if spec.device is None:
        return _skip(
            ctx, "the gathered int32 boundary needs (T*k, N) rows of more than 2**31 elements: GPU only"
        )
    dev = _device(spec.device)
    s = spec.shape
    k = top_k(spec)
    itemsize = torch.empty((), dtype=_DTYPES[s.dtype]).element_size()
    rows = s.m * k
    need = 2 * rows * s.n * itemsize + rows * s.n + s.m * s.k * itemsize * 2
    free, _total = torch.cuda.mem_get_info(dev)
    ctx.fact("bytes_needed", int(need))
    ctx.fact("bytes_free", int(free))
    ctx.fact("rows", rows)
    ctx.fact("row_elements", rows * s.n)
    ctx.fact("first_wrapping_row", (2**31 - 1) // s.n + 1)
    if need > free * 0.9:
        return _skip(ctx, f"the rows need {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free on the device")
    ctx.crumb(Phase.SETUP)
    hidden, w, ids, weights = routed_operands(spec, dev)
    _register(ctx, hidden_states=hidden, w=w, topk_ids=ids, topk_weights=weights)
    cell = _Cell(ctx, routed)
    few = INT32_BASELINE_TOKENS
    base_ref = reference(routed, hidden[:few], w, ids[:few], weights[:few])
    sample = torch.cat([torch.arange(INT32_SAMPLE_TOKENS), torch.arange(s.m - INT32_SAMPLE_TOKENS, s.m)]).to(
        dev
    )

    def variant() -> dict[str, Any]:
        ctx.crumb(Phase.LAUNCH)
        guard = OutputGuard(cell.out_shape(ids, w), GUARD_ROWS)
        with guard:
            out = cell.call(hidden, w, ids, weights)
        ctx.crumb(Phase.SYNC)
        sync_all()
        hits = guard.report(ctx, out)
        ref = reference(routed, hidden[sample], w, ids[sample], weights[sample])
        if isinstance(out, torch.Tensor) and out.dim() == 2:
            picked = (
                (sample[:, None] * k + torch.arange(k, device=dev)).reshape(-1) if routed.rows else sample
            )
            poison = out.detach().view(torch.int16 if itemsize == 2 else torch.int32) == -1
            ctx.fact("unwritten_total", int(poison.sum()))
            del poison
            fields = compare(ctx, out[picked], ref, ref.device)
            if ctx.facts.get("unwritten_total"):
                fields["unwritten"] = int(ctx.facts["unwritten_total"])
                fields["status"] = Status.WRONG
        else:
            fields = compare(ctx, out, ref, ref.device)
        if hits:
            fields["canary_hits"] = tuple(hits)
            fields["status"] = Status.WRONG
        return fields

    return cell.with_baseline(
        base_ref,
        lambda: cell.call(hidden[:few], w, ids[:few], weights[:few]),
        variant,
        cell.out_shape(ids, w),
    )


#: The routed cells' runners (``probes.conditions.run_probe`` dispatches to them).
RUNNERS: dict[Condition, Callable[[ProbeContext, KernelFn], dict[str, Any]]] = {
    Condition.ROUTED: _routed,
    Condition.IDS_OUT_OF_RANGE: _ids_out_of_range,
    Condition.DROPPED_SLOTS: _dropped_slots,
    Condition.EXPERT_MAP: _expert_map,
    Condition.MAP_PAST_LOCAL: _map_past_local,
    Condition.PADDED_COUNT: _padded_count,
    Condition.GATHER_PAST_T: _gather_past_t,
    Condition.GATHERED_INT32: _gathered_int32,
}

__all__ = ["RUNNERS", "guarded", "reference", "routed_operands", "top_k", "wrong_rows"]
