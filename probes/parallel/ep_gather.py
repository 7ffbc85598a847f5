"""Expert parallelism with a static dispatch whose exchanges overlap the experts (issue 7).

``ExpertParallelBlock(dispatch="gather")`` (probes/parallel/modes.py) runs this. Every rank sends
its whole token block (rows, k routing weights, k expert ids) to every other rank, instead of each token only to the ranks that own one of its experts: with top-8 of
128 experts on 2 ranks a token misses a rank's 64 experts with probability 0.4%, on 4 ranks 10%,
so the bytes are nearly those of the exact all-to-all, but every size is known in advance. That
lets each exchange be a push into fixed buffers on the peers, and the rank computes what needs no
exchange while the bytes travel:

    forward   send my tokens  ||  my experts on MY tokens
              my experts on the peers' tokens; send each peer its sums; add the sums I got
    backward  send my output gradient  ||  input gradients of my experts on MY tokens
              input gradients on the peers' tokens; send them back  ||  every weight gradient

On a GPU the pushes are copy-engine transfers into the peers' symmetric-memory buffers
(``SymmTransport``: ``peer_buffer.copy_`` between two ``barrier``s on a stream of its own), which
use no SM, so the GEMMs keep every SM while the exchange runs (NCCL's all-to-all beside a GEMM
took longer than the two in a row: 2x H200, 2026-11-22). Elsewhere (gloo on the CPU, or no symmetric memory)
``CollectiveTransport`` does the same exchange with ``all_to_all_single``, synchronously, so the
CPU tests check the same arithmetic.

Sizes: one count exchange per forward (every rank's slots per owner and token count, ONE host
synchronization) sizes the slot selections; every rank must hold the same number of tokens.
The weight gradients are computed after the input gradients are sent
(``kernels.backward.deferred_weight_grads``) and added into the parameters' ``.grad`` directly.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from qmoe_doctor.kernels.backward import deferred_weight_grads
from qmoe_doctor.probes.parallel import ep as ep_ops

TRANSPORTS = ("symm", "collective")


# Slots. A rank receives into W - 1 slots, never from itself: slot j - 1 holds what rank
# (rank + j) % W sent (j = 1 .. W - 1), so the peers' rows are always one contiguous block. A
# per-peer part (W - 1, rows, cols) is laid out the same way: block j - 1 goes to rank
# (rank + j) % W, which is where the sums for the rows received in slot j - 1 must go.


def peer_of(rank: int, slot: int, world: int) -> int:
    """The rank whose rows sit in (or go to) slot ``slot`` (0 .. W - 2) of rank ``rank``."""
    return (rank + slot + 1) % world


def slot_of(rank: int, peer: int, world: int) -> int:
    """The slot of rank ``rank``'s buffers that holds what ``peer`` sends it."""
    return (peer - rank) % world - 1


class Pending:
    """Received buffers, (W - 1, rows, cols) each (slot layout above); ``wait()`` makes the
    current stream wait for them and returns them."""

    def __init__(self, tensors: list[torch.Tensor], event: Any = None) -> None:
        self._tensors, self._event = tensors, event

    def wait(self) -> list[torch.Tensor]:
        if self._event is not None:
            torch.cuda.current_stream(self._tensors[0].device).wait_event(self._event)
        return self._tensors


def _per_peer(part: torch.Tensor, world: int) -> bool:
    """A 3-D part holds one block per peer (slot layout above); a 2-D part goes to every peer."""
    if part.dim() == 3:
        if part.shape[0] != world - 1:
            raise ValueError(f"a per-peer part needs {world - 1} blocks, got shape {tuple(part.shape)}")
        return True
    if part.dim() != 2:
        raise ValueError(f"a part is (rows, cols) or (W - 1, rows, cols), got shape {tuple(part.shape)}")
    return False


class CollectiveTransport:
    """The exchange by ``all_to_all_single`` on the process group (any backend), synchronous."""

    name = "collective"

    def __init__(self, rank: int, world: int, group: Any = None) -> None:
        self.rank, self.world, self.group = rank, world, group

    def prepare(self, specs: dict[str, list[tuple[int, int, torch.dtype]]]) -> None:
        del specs  # no buffers kept

    def send(self, name: str, parts: Sequence[torch.Tensor]) -> Pending:
        del name
        rank, world = self.rank, self.world
        got = []
        for part in parts:
            per_peer = _per_peer(part, world)
            send = part.new_zeros((world, *part.shape[-2:]))  # by destination rank
            for p in range(world):
                if p != rank:
                    send[p] = part[slot_of(rank, p, world)] if per_peer else part
            recv = torch.empty_like(send)  # by source rank
            dist.all_to_all_single(recv, send, group=self.group)
            got.append(torch.stack([recv[peer_of(rank, j, world)] for j in range(world - 1)]))
        return Pending(got)


@dataclass
class _Exchange:
    key: tuple[tuple[int, int, torch.dtype], ...]
    local: list[torch.Tensor]  # my buffers, (W - 1, rows, cols) each
    peers: list[list[torch.Tensor]]  # [i][p]: rank p's buffer i, mapped here
    handle: Any  # the symmetric-memory handle whose barrier orders this exchange


class SymmTransport:
    """The exchange by copy-engine pushes into the peers' symmetric-memory buffers (GPUs of one
    host). Per named exchange, buffers (W - 1, rows, cols) on every rank; a send, on its
    own stream after everything issued so far: barrier (every rank is done reading what it last
    received there), one copy per peer into that peer's slot for this rank, barrier (every
    rank's rows have landed)."""

    name = "symm"

    def __init__(self, rank: int, world: int, group: Any, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self._symm = symm_mem
        self.rank, self.world, self.device = rank, world, device
        group = group if group is not None else dist.group.WORLD
        self.group_name = group.group_name
        enabled = getattr(symm_mem, "is_symm_mem_enabled_for_group", lambda name: True)
        if not enabled(self.group_name):  # older torch: a group must be enabled first
            symm_mem.enable_symm_mem_for_group(self.group_name)
        self.stream = torch.cuda.Stream(device)
        self._exchanges: dict[str, _Exchange] = {}

    def prepare(self, specs: dict[str, list[tuple[int, int, torch.dtype]]]) -> None:
        """Every exchange's buffers for these shapes, made now when missing or of other shapes.

        Call it where every rank is in step (the forward's count exchange has just synchronized
        them) and no barrier of this transport is pending: making buffers is a host-side
        collective (``rendezvous``), and one rank inside it while the other's GPU spins in a
        barrier waiting for it deadlocks the pair (2x H200, 2026-11-22: the first backward made its buffers
        lazily and hung on 2x H200)."""
        wanted = {name: tuple(spec) for name, spec in specs.items()}
        if all(name in self._exchanges and self._exchanges[name].key == key for name, key in wanted.items()):
            return
        torch.cuda.synchronize(self.device)  # nothing of ours in flight while buffers change
        for name, key in sorted(wanted.items()):  # the same order on every rank
            self._exchanges[name] = self._allocate(key)
        torch.cuda.synchronize(self.device)

    def _buffers(self, name: str, key: tuple[tuple[int, int, torch.dtype], ...]) -> _Exchange:
        ex = self._exchanges.get(name)
        if ex is None or ex.key != key:
            raise RuntimeError(
                f"exchange {name!r} was not prepared for {key}: buffers are made in prepare(), where "
                "every rank is in step, never during a send"
            )
        return ex

    def _allocate(self, key: tuple[tuple[int, int, torch.dtype], ...]) -> _Exchange:
        local, peers, handle = [], [], None
        for rows, cols, dtype in key:  # collective: every rank allocates the same, in the same order
            shape = (self.world - 1, rows, cols)
            buf = self._symm.empty(*shape, dtype=dtype, device=self.device)
            hdl = self._symm.rendezvous(buf, self.group_name)
            handle = handle or hdl
            local.append(buf)
            peers.append([hdl.get_buffer(p, shape, dtype) for p in range(self.world)])
        return _Exchange(key, local, peers, handle)

    def send(self, name: str, parts: Sequence[torch.Tensor]) -> Pending:
        per_peer = [_per_peer(p, self.world) for p in parts]
        ex = self._buffers(name, tuple((int(p.shape[-2]), int(p.shape[-1]), p.dtype) for p in parts))
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            ex.handle.barrier(channel=0)
            for i, part in enumerate(parts):
                part.record_stream(self.stream)  # read here: not reused before the copies are done
                for j in range(self.world - 1):
                    p = peer_of(self.rank, j, self.world)
                    ex.peers[i][p][slot_of(p, self.rank, self.world)].copy_(part[j] if per_peer[i] else part)
            ex.handle.barrier(channel=0)
            event = torch.cuda.Event()
            event.record(self.stream)
        return Pending(ex.local, event)


def single_host(env: dict[str, str] | None = None) -> bool:
    """Whether every rank of the launch runs on this host (torchrun's LOCAL_WORLD_SIZE equals
    WORLD_SIZE; True outside torchrun): symmetric memory maps peers' memory, which only a host's
    own GPUs can."""
    env = dict(os.environ) if env is None else env
    local, world = env.get("LOCAL_WORLD_SIZE"), env.get("WORLD_SIZE")
    return local is None or world is None or local == world


def make_transport(kind: str, rank: int, world: int, group: Any, device: torch.device) -> Any:
    """``symm`` on the GPUs of one host when symmetric memory imports, ``collective`` otherwise
    (across nodes, on a CPU, or when asked)."""
    if kind not in (*TRANSPORTS, "auto"):
        raise ValueError(f"transport must be one of auto, {', '.join(TRANSPORTS)}; got {kind!r}")
    if kind == "auto" and not single_host():
        kind = "collective"
    if kind != "collective" and device.type == "cuda":
        try:
            return SymmTransport(rank, world, group, device)
        except (ImportError, AttributeError, RuntimeError):
            if kind == "symm":
                raise
    elif kind == "symm":
        raise ValueError(f"the symm transport needs a GPU, got {device}")
    return CollectiveTransport(rank, world, group)


def gather_counts(
    ids: torch.Tensor, per_rank: int, rank: int, world: int, group: Any = None
) -> tuple[int, int]:
    """(slots of my tokens my experts own, slots of the peers' tokens my experts own), from one
    all-gather of every rank's slots per owner and token count: ONE host synchronization. A
    ValueError when the ranks hold different numbers of tokens (the buffers are per rank)."""
    owner = ep_ops.owner_of(ids, per_rank).reshape(-1)
    row = torch.zeros(world + 1, dtype=torch.int64, device=ids.device)
    row.index_add_(0, owner, torch.ones_like(owner))
    row[world] = ids.shape[0]
    rows = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(rows, row, group=group)
    table = torch.stack(rows).tolist()  # the one synchronization
    tokens = {t[world] for t in table}
    if len(tokens) != 1:
        raise ValueError(
            f"the gather dispatch needs the same token count on every rank, got {sorted(tokens)}"
        )
    return int(table[rank][rank]), sum(int(table[p][rank]) for p in range(world) if p != rank)


def exchange_shapes(
    tokens: int, hidden: int, k: int, dtype: torch.dtype, weight_dtype: torch.dtype, id_dtype: torch.dtype
) -> dict[str, list[tuple[int, int, torch.dtype]]]:
    """Per exchange of a step, the (rows, cols, dtype) of each part: the tokens (rows, routing
    weights, expert ids), the sums back, the output gradient, the input and routing-weight
    gradients back."""
    return {
        "dispatch": [(tokens, hidden, dtype), (tokens, k, weight_dtype), (tokens, k, id_dtype)],
        "return": [(tokens, hidden, dtype)],
        "grad": [(tokens, hidden, dtype)],
        "gradient back": [(tokens, hidden, dtype), (tokens, k, weight_dtype)],
    }


def select_slots(
    layer: Any, ids: torch.Tensor, count: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pair, slot, local ids, global ids) of the (P, k) ids' slots ``layer``'s rank owns."""
    mask = ep_ops.owner_of(ids, layer.per_rank) == layer.rank
    pair, slot = ep_ops.nonzero_sized(mask, count)
    global_ids = ids[pair, slot]
    local_ids = layer.hooks.local_expert_ids(global_ids, layer.first, layer.per_rank)
    return pair, slot, local_ids, global_ids


def _leaf(t: torch.Tensor, grad: bool) -> torch.Tensor:
    return t.detach().requires_grad_(grad)


def _add_slots(base: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    """base + every received block."""
    out = base
    for block in got:
        out = out + block
    return out


def _accumulate(weight: torch.Tensor, dw: torch.Tensor) -> None:
    if weight.grad is None:
        weight.grad = dw
    else:
        weight.grad += dw


def gather_forward(
    layer: Any, transport: Any, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, grad: bool
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """The forward above -> (out (T, H), what the backward needs, or None without grad)."""
    rank, world = layer.rank, layer.world
    tokens, hidden = x.shape
    k = ids.shape[1]
    own_count, peer_count = gather_counts(ids, layer.per_rank, rank, world, layer.group)
    transport.prepare(exchange_shapes(tokens, hidden, k, x.dtype, w.dtype, ids.dtype))
    # rows, weights and ids as three parts: no packing copy, the peers' rows arrive contiguous
    dispatch = transport.send(
        "dispatch", [x.detach().contiguous(), w.detach().contiguous(), ids.contiguous()]
    )
    peers = (world - 1) * tokens

    def received() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows, weights, peer_ids = dispatch.wait()
        return rows.view(peers, hidden), weights.view(peers, k), peer_ids.view(peers, k)

    with torch.enable_grad() if grad else torch.no_grad():
        xo, wo = _leaf(x, grad), _leaf(w, grad)
        own_sel = select_slots(layer, ids, own_count)
        if layer.before_experts is not None:  # the diagnostic pass: every slot checked first
            xp_in, wp_in, ids_p = received()
            peer_sel = select_slots(layer, ids_p, peer_count)
            layer.before_experts(torch.cat([own_sel[3], peer_sel[3]]), torch.cat([own_sel[2], peer_sel[2]]))
        own = layer.expert_sums(xo, wo, own_sel[0], own_sel[1], own_sel[2], own_sel[3])  # (T, H)
        if layer.before_experts is None:
            xp_in, wp_in, ids_p = received()
            peer_sel = select_slots(layer, ids_p, peer_count)
        xp, wp = _leaf(xp_in, grad), _leaf(wp_in, grad)
        peer = layer.expert_sums(xp, wp, *peer_sel)  # ((W - 1) * T, H): my share of the peers' tokens
    (got,) = transport.send("return", [peer.detach().view(world - 1, tokens, hidden)]).wait()
    out = _add_slots(own.detach(), got)
    return out, ((own, peer, xo, wo, xp, wp) if grad else None)


def gather_backward(
    layer: Any, transport: Any, saved: tuple[torch.Tensor, ...], g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward above: (gradient of x (T, H), of the routing weights (T, k))."""
    own, peer, xo, wo, xp, wp = saved
    world = layer.world
    tokens, hidden = xo.shape
    k = wo.shape[1]
    g = g.contiguous()
    grads = transport.send("grad", [g])
    with deferred_weight_grads() as later:
        gxo, gwo = torch.autograd.grad(own, (xo, wo), g, allow_unused=True, materialize_grads=True)
        (got,) = grads.wait()
        gxp, gwp = torch.autograd.grad(
            peer, (xp, wp), got.view((world - 1) * tokens, hidden), allow_unused=True, materialize_grads=True
        )
    back = transport.send(
        "gradient back", [gxp.reshape(world - 1, tokens, hidden), gwp.reshape(world - 1, tokens, k)]
    )
    for weight_grad in later:  # while the input gradients travel
        _accumulate(*weight_grad())
    got_x, got_w = back.wait()
    return _add_slots(gxo, got_x), _add_slots(gwo, got_w)


class GatherExperts(torch.autograd.Function):
    """(x (T, H), routing weights (T, k), ids (T, k)) -> this rank's tokens' outputs (T, H), through
    every rank's experts; gradients for x and the weights (and, directly, the expert stacks)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, layer: Any, transport: Any, grad: bool
    ) -> torch.Tensor:
        out, saved = gather_forward(layer, transport, x, w, ids, grad)
        ctx.layer, ctx.transport, ctx.saved = layer, transport, saved
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.saved is None:
            raise RuntimeError("the gather dispatch ran without gradients; nothing to differentiate")
        gx, gw = gather_backward(ctx.layer, ctx.transport, ctx.saved, g)
        ctx.saved = None
        return gx, gw, None, None, None, None


__all__ = [
    "TRANSPORTS",
    "CollectiveTransport",
    "GatherExperts",
    "Pending",
    "SymmTransport",
    "gather_backward",
    "gather_counts",
    "gather_forward",
    "exchange_shapes",
    "make_transport",
    "select_slots",
    "single_host",
]
