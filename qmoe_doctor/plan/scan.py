"""Planning: which probes a scan runs, grouped into sessions (one warm child each).

A session is an ordered list of probes run back to back in one child process. Order matters
because some states cannot be undone in a live process: a CUDA context, once created on a
device, stays; peer access, once enabled in a direction, stays. So each ordered pair (a, b)
gets its own session whose child sees exactly ``CUDA_VISIBLE_DEVICES=<uuid a>,<uuid b>``:
inside it a is ordinal 0 (the process's default current device, never touched until the
untouched-context cell has run) and b is ordinal 1. The probes then go from least to most
state: first call of the process, single-device cells on b, the guarded baseline, the
untouched-context cell, no peer access, peer access a->b, and the two races.

Pair sessions come in rounds of pairs that share no GPU (``plan.pair_rounds``): the sessions of
one round run at once (``Session.round``; ``ScanOptions.pairs_at_once`` caps a round), and the
report lists them in plan order whatever order they finish in. Every spec carries the scan's
autotune policy in its params, every session the environment that policy needs
(``core.autotune``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from qmoe_doctor.core import knobs
from qmoe_doctor.core.audit import first_wrapping_expert
from qmoe_doctor.core.autotune import DEFAULT_AUTOTUNE, AutotunePolicy, probe_params, session_env
from qmoe_doctor.core.conditions import (
    CPU_CONDITIONS,
    M_SIZES_EDGES,
    PAIR_ORDER,
    ROUTED_CPU,
    ROUTED_ORDER,
    SINGLE_ORDER,
    SWEEP_CONDITIONS,
)
from qmoe_doctor.core.kernel_ref import KernelRef, KernelRefError
from qmoe_doctor.core.kernel_ref import Protocol as KernelProtocol
from qmoe_doctor.core.launch_configs import GEMM_CONFIGS
from qmoe_doctor.core.options import ScanOptions
from qmoe_doctor.core.records import (
    CPU_PLACEMENT,
    Condition,
    Placement,
    ProbeSpec,
    Shape,
    gpu_placement,
    pair_placement,
)
from qmoe_doctor.core.shapes import MoEShape, get_preset
from qmoe_doctor.plan.pair_rounds import pair_rounds


class PlannedGpu(Protocol):
    """What the planner needs to know of a GPU (inventory.GpuInfo satisfies it)."""

    @property
    def index(self) -> int: ...  # NVML / nvidia-smi index

    @property
    def uuid(self) -> str: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Session:
    label: str  # "GPU 0 -> GPU 1", "GPU 0" or "CPU"
    env: dict[str, str]  # environment of the child (CUDA_VISIBLE_DEVICES, TRITON_INTERPRET, ...)
    specs: tuple[ProbeSpec, ...]
    gpu_of_ordinal: dict[int, int] = field(default_factory=dict)  # child ordinal -> NVML index
    round: int = 0  # sessions of one round pin disjoint GPUs and run at once; rounds run in order


@dataclass(frozen=True, slots=True, kw_only=True)
class ScanPlan:
    kernel: str
    sessions: tuple[Session, ...]  # in plan order: round by round
    skipped: tuple[str, ...] = ()  # what was not planned, and why
    autotune: AutotunePolicy = DEFAULT_AUTOTUNE  # in every spec's params and session's env

    @property
    def specs(self) -> tuple[ProbeSpec, ...]:
        return tuple(s for session in self.sessions for s in session.specs)

    @property
    def rounds(self) -> tuple[tuple[Session, ...], ...]:
        """The sessions grouped by round, in plan order (one round per session of a CPU or
        one-GPU scan, and of a pair scan run one pair at a time)."""
        grouped: list[list[Session]] = []
        for session in self.sessions:
            if grouped and grouped[-1][0].round == session.round:
                grouped[-1].append(session)
            else:
                grouped.append([session])
        return tuple(tuple(g) for g in grouped)


def main_shape(opts: ScanOptions) -> Shape:
    """The gate_up grouped GEMM of the preset: N = 2 * intermediate, K = hidden."""
    p = get_preset(opts.preset)
    n, k = p.gate_up_nk
    return Shape(m=opts.rows, e=p.num_experts, n=n, k=k, dtype=opts.dtype, routing="random")  # type: ignore[arg-type]


def over_routed_shape(opts: ScanOptions) -> Shape:
    # y stays under 1 MiB so the caching allocator can put a canary right after it
    return Shape(m=256, e=8, n=256, k=256, dtype=opts.dtype, routing="uniform")  # type: ignore[arg-type]


def boundary_shape(opts: ScanOptions) -> Shape | None:
    """E is one past the first expert whose base offset e * N * K passes 2**31 - 1."""
    p: MoEShape = get_preset(opts.boundary_preset)
    n, k = p.gate_up_nk
    first = first_wrapping_expert(n, k)
    if first is None or first >= p.num_experts:
        return None
    return Shape(m=256, e=first + 1, n=n, k=k, dtype=opts.dtype, routing=f"expert:{first}")  # type: ignore[arg-type]


CPU_SHAPE = Shape(m=64, e=4, n=32, k=32, dtype="float32", routing="random")

#: The routed cells (``probes/routed_conditions.py``): Shape.m is T tokens, Shape.k the hidden
#: size H, ``params["top_k"]`` k. Small: each edge cell calls the kernel twice.
ROUTED_CPU_SHAPE = Shape(m=32, e=4, n=32, k=32, dtype="float32", routing="random")
ROUTED_CPU_TOP_K = 2
ROUTED_GPU_TOP_K = 4
#: The gathered int32 boundary: (T*k, N) rows of N = 256 with 4,096 rows past 2**31 elements
#: (row 8,388,608 is the first whose offset row * N passes 2**31 - 1); H = 64 keeps hidden_states
#: at 128 MiB in bf16, the rows 4 GiB.
GATHERED_INT32_N = 256
GATHERED_INT32_H = 64
GATHERED_INT32_E = 16
GATHERED_INT32_TOP_K = 8
GATHERED_INT32_EXTRA_ROWS = 4096


def kernel_protocol(kernel: str) -> KernelProtocol:
    """The protocol a ``--kernel`` reference is called with (``KernelRef.protocol``)."""
    try:
        return KernelRef.parse(kernel).protocol
    except KernelRefError:
        return "m_sizes"  # the probes say what is wrong with it


def routed_shape(opts: ScanOptions, *, cpu: bool) -> tuple[Shape, int]:
    """(shape, top_k) of the routed cells."""
    if cpu:
        return ROUTED_CPU_SHAPE, ROUTED_CPU_TOP_K
    return Shape(m=256, e=8, n=256, k=256, dtype=opts.dtype, routing="random"), ROUTED_GPU_TOP_K  # type: ignore[arg-type]


def gathered_int32_shape(opts: ScanOptions) -> tuple[Shape, int]:
    """(shape, top_k) whose (T*k, N) rows pass 2**31 elements: the last rows' offsets wrap."""
    rows = (2**31 - 1) // GATHERED_INT32_N + 1 + GATHERED_INT32_EXTRA_ROWS
    tokens = -(-rows // GATHERED_INT32_TOP_K)
    shape = Shape(
        m=tokens, e=GATHERED_INT32_E, n=GATHERED_INT32_N, k=GATHERED_INT32_H, dtype=opts.dtype, routing="random"  # type: ignore[arg-type]
    )
    return shape, GATHERED_INT32_TOP_K

#: Offset-sweep variants (probes/conditions.OFFSET_VARIANTS documents each) and how the shape
#: changes for the routing edges. Each is a cell's ``Placement.variant``.
OFFSET_SWEEP = (
    "storage-offset-1",
    "storage-offset-8",
    "padded-rows",
    "transposed-w",
    "empty-experts",
    "hot-expert",
    "last-expert",
    "m-not-multiple",
)


def _sweep_specs(kernel: str, where: Placement, ordinal: int | None, opts: ScanOptions) -> list[ProbeSpec]:
    cpu = ordinal is None
    base = CPU_SHAPE if cpu else main_shape(opts)
    specs: list[ProbeSpec] = []
    if Condition.OFFSETS in opts.conditions:
        for variant in OFFSET_SWEEP:
            shape = base
            if variant in ("empty-experts", "hot-expert", "last-expert"):
                shape = replace(base, routing=variant)
            elif variant == "m-not-multiple":
                shape = replace(base, m=61 if cpu else 4093)
            placement = replace(where, variant=variant)
            specs.append(
                ProbeSpec(
                    probe_id=placement.probe_id(Condition.OFFSETS),
                    kernel=kernel,
                    condition=Condition.OFFSETS,
                    placement=placement,
                    device=ordinal,
                    current=ordinal,
                    shape=shape,
                    seed=opts.seed,
                    params={"variant": variant},
                    timeout_s=opts.timeout_s,
                )
            )
    if Condition.LAUNCH_CONFIG in opts.conditions:
        configs = opts.launch_configs or tuple(
            c for name, c in GEMM_CONFIGS.items() if (name == "interpreter") == cpu
        )
        for cfg in configs:
            placement = replace(where, variant=cfg.name)
            specs.append(
                ProbeSpec(
                    probe_id=placement.probe_id(Condition.LAUNCH_CONFIG),
                    kernel=kernel,
                    condition=Condition.LAUNCH_CONFIG,
                    placement=placement,
                    device=ordinal,
                    current=ordinal,
                    shape=base,
                    seed=opts.seed,
                    params={"variant": cfg.name, **cfg._asdict()},
                    timeout_s=opts.timeout_s,
                )
            )
    return specs


def _single_specs(
    kernel: str,
    where: Placement,
    ordinal: int | None,
    opts: ScanOptions,
    *,
    with_boundary: bool,
    with_sweeps: bool = False,
) -> list[ProbeSpec]:
    """The single-device cells on ``where``; ``with_sweeps``: the sweeps follow them, and
    ``single`` is planned whatever ``--only`` says (a sweep cell the kernel refuses is
    ``rejected`` only when ``single`` passed: diagnose.baseline)."""
    cpu = ordinal is None
    specs = []
    routed = kernel_protocol(kernel) != "m_sizes"
    order = CPU_CONDITIONS if cpu else SINGLE_ORDER
    wanted = set(opts.conditions)
    if with_sweeps and wanted & set(SWEEP_CONDITIONS):
        wanted.add(Condition.SINGLE)
    for cond in order:
        if cond not in wanted or (routed and cond in M_SIZES_EDGES):
            continue  # a routed kernel has no m_sizes: its routing edges are the routed cells
        if cond in (Condition.OVER_ROUTED, Condition.NEGATIVE_SIZES):
            shape = CPU_SHAPE if cpu else over_routed_shape(opts)
            shape = replace(shape, routing="uniform")
        elif cond is Condition.INT32_BOUNDARY:
            if not with_boundary:
                continue
            maybe = boundary_shape(opts)
            if maybe is None:
                continue
            shape = maybe
        else:
            shape = CPU_SHAPE if cpu else main_shape(opts)
        specs.append(
            ProbeSpec(
                probe_id=where.probe_id(cond),
                kernel=kernel,
                condition=cond,
                placement=where,
                device=ordinal,
                current=ordinal,
                shape=shape,
                seed=opts.seed,
                timeout_s=opts.timeout_s,
            )
        )
    if routed:
        specs += _routed_specs(kernel, where, ordinal, opts, wanted, with_boundary=with_boundary)
    return specs


def _routed_specs(
    kernel: str,
    where: Placement,
    ordinal: int | None,
    opts: ScanOptions,
    wanted: set[Condition],
    *,
    with_boundary: bool,
) -> list[ProbeSpec]:
    """The routed protocol's cells on ``where``, after its single-device cells."""
    cpu = ordinal is None
    specs = []
    for cond in ROUTED_CPU if cpu else ROUTED_ORDER:
        if cond not in wanted:
            continue
        if cond is Condition.GATHERED_INT32:
            if not with_boundary:
                continue
            shape, k = gathered_int32_shape(opts)
        else:
            shape, k = routed_shape(opts, cpu=cpu)
        specs.append(
            ProbeSpec(
                probe_id=where.probe_id(cond),
                kernel=kernel,
                condition=cond,
                placement=where,
                device=ordinal,
                current=ordinal,
                shape=shape,
                seed=opts.seed,
                params={"top_k": k},
                timeout_s=opts.timeout_s,
            )
        )
    return specs


def plan_scan(kernel: str, gpus: Sequence[PlannedGpu], opts: ScanOptions | None = None) -> ScanPlan:
    """Plan a scan of ``kernel`` over the selected GPUs (in --gpus order)."""
    opts = opts or ScanOptions()
    plan = _plan(kernel, gpus, opts)
    tuned = probe_params(opts.autotune)
    env = session_env(opts.autotune, None)  # the run pins the scan's own cache folder (run_scan)
    return replace(
        plan,
        autotune=opts.autotune,
        sessions=tuple(
            replace(
                session,
                env={**session.env, **env},
                specs=tuple(replace(spec, params={**spec.params, **tuned}) for spec in session.specs),
            )
            for session in plan.sessions
        ),
    )


def _plan(kernel: str, gpus: Sequence[PlannedGpu], opts: ScanOptions) -> ScanPlan:
    if not gpus:
        check = ProbeSpec(
            probe_id=CPU_PLACEMENT.probe_id(Condition.INTERPRETER_CHECK),
            kernel=kernel,
            condition=Condition.INTERPRETER_CHECK,
            placement=CPU_PLACEMENT,
            shape=CPU_SHAPE,
            timeout_s=opts.timeout_s,
        )
        specs = [check] + _single_specs(
            kernel, CPU_PLACEMENT, None, opts, with_boundary=False, with_sweeps=opts.sweeps
        )
        if opts.sweeps:
            specs += _sweep_specs(kernel, CPU_PLACEMENT, None, opts)
        env = {knobs.TRITON_INTERPRET: "1", knobs.CUDA_VISIBLE_DEVICES: ""}
        return ScanPlan(
            kernel=kernel,
            sessions=(Session(label="CPU", env=env, specs=tuple(specs)),),
            skipped=(
                "no GPU: ran the CPU tier (Triton interpreter, float32); placement, peer-access "
                "and stream conditions need CUDA GPUs",
            ),
        )
    if len(gpus) == 1:
        g = gpus[0]
        where = gpu_placement(g.index)
        specs = _single_specs(kernel, where, 0, opts, with_boundary=True, with_sweeps=opts.sweeps)
        if opts.sweeps:
            specs += _sweep_specs(kernel, where, 0, opts)
        return ScanPlan(
            kernel=kernel,
            sessions=(
                Session(label=where.label, env=_cvd(g), specs=tuple(specs), gpu_of_ordinal={0: g.index}),
            ),
            skipped=(
                "one GPU selected: ran the single-GPU cells; placement, peer-access and cross-device "
                "stream conditions need two GPUs (--gpus 0,1)",
            ),
        )
    by_index = {g.index: g for g in gpus}
    rounds = _scheduled(list(by_index), opts)
    sessions: list[Session] = []
    singles_done: set[int] = set()
    boundary_done = False
    for number, pairs in enumerate(rounds):
        for a_index, b_index in pairs:
            a, b = by_index[a_index], by_index[b_index]
            pair = pair_placement(a.index, b.index)
            specs = []
            if b.index not in singles_done:
                on_b = gpu_placement(b.index)
                sweeps_here = opts.sweeps and not boundary_done
                specs += _single_specs(
                    kernel, on_b, 1, opts, with_boundary=not boundary_done, with_sweeps=sweeps_here
                )
                if opts.sweeps and not boundary_done:  # sweeps on the first session's GPU only
                    specs += _sweep_specs(kernel, on_b, 1, opts)
                boundary_done = True
                singles_done.add(b.index)
            for cond in PAIR_ORDER:
                if cond not in opts.conditions:
                    continue
                specs.append(
                    ProbeSpec(
                        probe_id=pair.probe_id(cond),
                        kernel=kernel,
                        condition=cond,
                        placement=pair,
                        device=1,
                        current=0,
                        shape=main_shape(opts),
                        seed=opts.seed,
                        timeout_s=opts.timeout_s,
                        # A launch from an untouched device loads the kernel in the operand
                        # device's context and Triton caches that handle under the untouched
                        # device: every later launch from that device, once touched, fails with
                        # "invalid resource handle" (measured on 2x H200, 2026-11-22). So this cell
                        # gets a child of its own.
                        fresh_process=cond is Condition.UNTOUCHED,
                    )
                )
            sessions.append(
                Session(
                    label=pair.label,
                    env=_cvd(a, b),
                    specs=tuple(specs),
                    gpu_of_ordinal={0: a.index, 1: b.index},
                    round=number,
                )
            )
    skipped: list[str] = []
    n_pairs = len(by_index) * (len(by_index) - 1)
    if len(sessions) < n_pairs:
        skipped.append(
            f"{len(sessions)} of {n_pairs} ordered GPU pairs scanned (max_pairs={opts.max_pairs}); "
            "`qmoe-doctor scan` runs them all"
        )
    return ScanPlan(kernel=kernel, sessions=tuple(sessions), skipped=tuple(skipped))


def _scheduled(gpus: list[int], opts: ScanOptions) -> list[list[tuple[int, int]]]:
    """The ordered pairs a scan runs, in rounds of disjoint pairs: every pair, or the first
    ``max_pairs`` in --gpus order (a -> every b, then the next a), each in its round; a round
    split into runs of at most ``pairs_at_once`` pairs."""
    rounds = pair_rounds(gpus)
    if opts.max_pairs is not None:
        wanted = set([(a, b) for a in gpus for b in gpus if a != b][: max(opts.max_pairs, 0)])
        rounds = [[p for p in r if p in wanted] for r in rounds]
    step = opts.pairs_at_once
    if step is not None and step >= 1:
        rounds = [r[i : i + step] for r in rounds for i in range(0, len(r), step)]
    return [r for r in rounds if r]


def _cvd(*gpus: PlannedGpu) -> dict[str, str]:
    """The child sees exactly these GPUs, in this order, as ordinals 0, 1, ..."""
    return {
        knobs.CUDA_VISIBLE_DEVICES: ",".join(g.uuid for g in gpus),
        knobs.CUDA_DEVICE_ORDER: "PCI_BUS_ID",
    }


def debug_rerun(spec: ProbeSpec) -> ProbeSpec:
    """The same probe in a fresh process with TRITON_DEBUG=1: Triton's int32 overflow check
    and device asserts name the overflowing source line."""
    placement = replace(spec.placement, rerun="debug")
    return replace(
        spec,
        probe_id=placement.probe_id(spec.condition),
        placement=placement,
        env={**spec.env, knobs.TRITON_DEBUG: "1"},
        fresh_process=True,
    )
