"""Planning the parallel modes: options -> one launch per mode (pure).

``qmoe-doctor parallel --modes dp,pp,tp,ep`` runs our MoE block (forward and backward) the four
ways users scale it (``core.modes`` says how each is launched), one launch per mode, each rank
compared with a single-device run of the same weights and inputs that the rank makes itself
(``probes/parallel/modes.py``). A launch's spec is the template every rank reads: its probe id
and placement name the mode ("dp"); each rank gives itself "rank R" (``core.records.rank_spec``).
Sizes that do not split over the ranks are refused here, before anything starts.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast, get_args

from qmoe_doctor.core import knobs
from qmoe_doctor.core.modes import CONDITION_OF, TORCHRUN_MODES, USER_MODES, Mode
from qmoe_doctor.core.options import ParallelOptions
from qmoe_doctor.core.records import Placement, ProbeSpec, Shape
from qmoe_doctor.core.shapes import PRESETS, get_preset
from qmoe_doctor.plan.scan import PlannedGpu

DType = Literal["bfloat16", "float16", "float32"]


class ParallelPlanError(ValueError):
    """The options cannot make a run (sizes that do not split over the ranks, too few GPUs)."""


def parse_modes(text: str) -> tuple[Mode, ...]:
    """``"dp,pp,tp,ep"`` -> modes in the order given; a ParallelPlanError names a bad one."""
    modes: list[Mode] = []
    for part in (p.strip().lower() for p in text.split(",")):
        if not part:
            continue
        try:
            mode = Mode(part)
        except ValueError:
            known = ", ".join(m.value for m in USER_MODES)
            raise ParallelPlanError(f"unknown parallel mode {part!r}; known: {known}") from None
        if mode not in modes:
            modes.append(mode)
    if not modes:
        raise ParallelPlanError("no parallel mode given; use e.g. --parallel dp,pp,tp,ep")
    return tuple(modes)


@dataclass(frozen=True, slots=True, kw_only=True)
class PlannedRun:
    """One launch: a mode, its spec (written to ``spec.json``), how many local processes."""

    mode: Mode
    spec: ProbeSpec  # the template each rank reads; probe_id is the mode
    nproc: int  # local processes (1: pp and single, no torchrun)
    world_size: int  # nproc x nnodes
    devices_used: int  # GPUs (or CPU processes) one step of the mode uses, for the efficiency
    env: dict[str, str]  # environment on top of os.environ (CUDA_VISIBLE_DEVICES, ...)

    @property
    def torchrun(self) -> bool:
        return self.mode in TORCHRUN_MODES


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelPlan:
    kernel: str
    tier: str  # "gpu" or "cpu"
    options: ParallelOptions  # resolved
    runs: tuple[PlannedRun, ...]
    gpus: tuple[int, ...] = ()  # NVML indices, in --gpus order
    gpu_of_ordinal: dict[int, int] = field(default_factory=dict)  # child ordinal -> NVML index
    skipped: tuple[str, ...] = ()


_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,253})?")


def check_endpoint(endpoint: str) -> None:
    """``--rdzv-endpoint`` is ``HOST:PORT``: a host name, an IPv4 address or a ``[IPv6]``
    address, and a port from 1 to 65535; anything else is refused before a rank starts (torchrun
    would spend its rendezvous timeout on it)."""
    shown = repr(endpoint) if len(endpoint) <= 80 else repr(endpoint[:80]) + "..."
    host, colon, port = endpoint.rpartition(":")
    if not colon or not (port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536):
        raise ParallelPlanError(f"--rdzv-endpoint {shown}: give HOST:PORT with a port from 1 to 65535")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
            return
        except ValueError:
            pass
    elif _HOST.fullmatch(host):
        return
    raise ParallelPlanError(f"--rdzv-endpoint {shown}: {host[:80]!r} is not a host name or address")


def plan_parallel(
    kernel: str, gpus: Sequence[PlannedGpu], opts: ParallelOptions | None = None, *, cpu: bool = False
) -> ParallelPlan:
    """The launches for ``opts.modes`` over the selected GPUs (or CPU processes with ``cpu``).

    Raises ParallelPlanError when the sizes do not split over the ranks."""
    opts = opts or ParallelOptions()
    cpu = cpu or not gpus
    o = opts.resolved(cpu=cpu, n_devices=len(gpus))
    assert o.preset is not None and o.tokens is not None and o.nproc_per_node is not None  # resolved
    if o.preset not in PRESETS:
        raise ParallelPlanError(f"unknown preset {o.preset!r}; known: {', '.join(PRESETS)}")
    if o.nnodes < 1 or o.nproc_per_node < 1 or o.tokens < 1:
        raise ParallelPlanError("--nnodes, processes per node and --tokens must be positive")
    if o.nnodes > 1 and not o.rdzv_endpoint:
        raise ParallelPlanError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
    if o.rdzv_endpoint:
        check_endpoint(o.rdzv_endpoint)
    if cpu and o.backend == "nccl":
        raise ParallelPlanError("--backend nccl needs GPUs: CPU ranks talk through gloo (leave --backend out)")
    if not cpu and o.nproc_per_node > len(gpus):
        raise ParallelPlanError(f"{o.nproc_per_node} processes per node but {len(gpus)} GPU(s) selected")
    if o.dtype not in get_args(DType):
        raise ParallelPlanError(f"dtype must be one of {', '.join(get_args(DType))}, got {o.dtype!r}")
    dtype = cast(DType, o.dtype)
    shape = get_preset(o.preset)
    world = o.nproc_per_node * o.nnodes
    devices: list[int | None] = [None] * o.nproc_per_node if cpu else list(range(o.nproc_per_node))
    env: dict[str, str] = (
        {knobs.TRITON_INTERPRET: "1", knobs.CUDA_VISIBLE_DEVICES: ""}
        if cpu
        else knobs.pin_gpus(g.uuid for g in gpus[: o.nproc_per_node])
    )
    skipped: list[str] = []
    runs: list[PlannedRun] = []
    n_local_devices = len(devices)
    modes = list(o.modes)
    if o.baseline and Mode.SINGLE not in modes:
        modes.insert(0, Mode.SINGLE)
    for mode in modes:
        reason = _does_not_fit(
            mode, shape.num_experts, shape.intermediate, o.tokens, world, n_local_devices, cpu
        )
        if reason:
            if mode in o.modes and world > 1:
                raise ParallelPlanError(f"{mode}: {reason}")
            skipped.append(f"{mode}: {reason}")
            continue
        layers = (o.layers or 2 * n_local_devices) if mode is Mode.PP else 1
        params: dict[str, Any] = {
            "mode": mode.value,
            "preset": o.preset,
            "tokens": o.tokens,
            "layers": layers,
            "steps": o.steps,
            "warmup": o.warmup,
            "backend": o.backend,
            "devices": devices if mode in TORCHRUN_MODES or mode is Mode.PP else devices[:1],
            "pg_timeout_s": o.timeout_s,
        }
        if o.inject:
            params["inject"] = dict(o.inject)
        n, k = shape.gate_up_nk
        where = Placement(group=mode.value)  # each rank's spec takes "rank R" (core.records.rank_spec)
        spec = ProbeSpec(
            probe_id=mode.value,
            kernel=kernel,
            condition=CONDITION_OF[mode],
            placement=where,
            device=devices[0],
            current=devices[0],
            shape=Shape(
                m=o.tokens * shape.top_k, e=shape.num_experts, n=n, k=k, dtype=dtype, routing="random"
            ),
            seed=o.seed,
            params=params,
            timeout_s=o.timeout_s,
        )
        torchrun = mode in TORCHRUN_MODES
        runs.append(
            PlannedRun(
                mode=mode,
                spec=spec,
                nproc=o.nproc_per_node if torchrun else 1,
                world_size=world if torchrun else 1,
                devices_used=world if torchrun else (n_local_devices if mode is Mode.PP else 1),
                env=dict(env),
            )
        )
    if cpu:
        skipped.append(
            "CPU tier: ranks are CPU processes (gloo, Triton interpreter, float32): the orchestration, "
            "sharding and collectives are checked; device placement and NCCL need GPUs"
        )
    return ParallelPlan(
        kernel=kernel,
        tier="cpu" if cpu else "gpu",
        options=o,
        runs=tuple(runs),
        gpus=tuple(g.index for g in gpus[: o.nproc_per_node]) if not cpu else (),
        gpu_of_ordinal={} if cpu else {i: g.index for i, g in enumerate(gpus[: o.nproc_per_node])},
        skipped=tuple(skipped),
    )


def _does_not_fit(
    mode: Mode, experts: int, intermediate: int, tokens: int, world: int, local: int, cpu: bool
) -> str | None:
    where = "processes" if cpu else "GPUs"
    if mode is Mode.PP:
        return None if local >= 2 else f"needs two {where} in one process (one selected)"
    if mode is Mode.SINGLE:
        return None
    if world < 2:
        return f"needs two {where} or more (one selected)"
    if mode in (Mode.DP, Mode.EP) and tokens % world:
        return f"{tokens} tokens do not split evenly over {world} ranks (--tokens)"
    if mode is Mode.EP and experts % world:
        return f"{experts} experts do not split evenly over {world} ranks"
    if mode is Mode.TP and intermediate % world:
        return f"moe_intermediate_size {intermediate} does not split evenly over {world} ranks"
    return None


__all__ = [
    "DType",
    "ParallelPlan",
    "ParallelPlanError",
    "PlannedRun",
    "parse_modes",
    "plan_parallel",
]
