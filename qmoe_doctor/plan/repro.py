"""Planning ``qmoe-doctor repro``: the pipeline over the selected GPUs and the shrink ladders
(pure). ``workflows.repro`` runs them; its docstring says why the order is what it is.

Child 1 runs the three pair cells, the pipeline, then the rest of the pair ladder
(``ReproPlan.first_session``); the single-device ladder and a third GPU's pair ladder are planned
here too and run only when the shrink asks for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qmoe_doctor.core import knobs
from qmoe_doctor.core.options import ReproOptions, ScanOptions
from qmoe_doctor.core.records import Condition, Placement, ProbeSpec, Shape, gpu_placement, pair_placement
from qmoe_doctor.core.shapes import get_preset
from qmoe_doctor.plan.scan import PlannedGpu, plan_scan

PIPELINE_ID = "pipeline"
#: The pipeline's placement: its layers span every selected GPU.
PIPELINE_PLACEMENT = Placement(group=PIPELINE_ID)
#: Pair cells run in the warm child before the pipeline (their preconditions do not survive it).
BEFORE_PIPELINE = (Condition.GUARDED, Condition.NO_PEER, Condition.PEER)
#: After the pipeline, in the same child: the races, then the operand GPU's stream and routing cells.
AFTER_PIPELINE = (
    Condition.PRODUCER_RACE,
    Condition.SIZES_RACE,
    Condition.SIDE_STREAM,
    Condition.NEGATIVE_SIZES,
    Condition.OVER_ROUTED,
)
#: When the guarded baseline fails: the single-device ladder on b, in a fresh child.
SINGLE_LADDER = (
    Condition.REPEAT_CALL,
    Condition.SINGLE,
    Condition.SIDE_STREAM,
    Condition.NEGATIVE_SIZES,
    Condition.OVER_ROUTED,
)
PAIR_LADDER = BEFORE_PIPELINE + AFTER_PIPELINE
#: The shrink probes' shape preset when the pipeline uses "tiny": a remote launch is only
#: measurably slower (the evidence of a missing guard) at a real size.
SHRINK_PRESET = "qwen3-30b-a3b"


def shrink_scan_options(opts: ReproOptions) -> ScanOptions:
    """The scan options of the shrink probes: the ladders' conditions on one pair, no sweeps."""
    preset = opts.shrink_preset or (SHRINK_PRESET if opts.preset == "tiny" else opts.preset)
    return ScanOptions(
        preset=preset,
        rows=opts.rows,
        dtype=opts.dtype,
        seed=opts.seed,
        conditions=frozenset(PAIR_LADDER + SINGLE_LADDER),
        timeout_s=opts.timeout_s,
        sweeps=False,
        max_pairs=1,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class PairLadder:
    """The shrink probes of one ordered pair, from ``plan_scan`` restricted to that pair."""

    a: int  # NVML index, current at the call
    b: int  # NVML index, holds the operands
    env: dict[str, str]  # a child that sees exactly (a, b) as cuda:0, cuda:1
    pair: dict[Condition, ProbeSpec]
    single: dict[Condition, ProbeSpec]  # single-device cells on b (ordinal 1)

    def specs(self, conditions: Sequence[Condition]) -> list[ProbeSpec]:
        out = []
        for cond in conditions:
            spec = self.pair.get(cond) or self.single.get(cond)
            if spec is not None:
                out.append(spec)
        return out

    @property
    def names(self) -> dict[str, str]:
        """Its probes' groups -> how the report names them ("0->1" -> "GPU 0 -> GPU 1")."""
        return {p.group: p.label for p in (pair_placement(self.a, self.b), gpu_placement(self.b))}


@dataclass(frozen=True, slots=True, kw_only=True)
class ReproPlan:
    kernel: str
    gpus: tuple[int, ...]  # NVML indices in pipeline order (--gpus order)
    env: dict[str, str]  # child 1: every selected GPU, in order, as cuda:0, cuda:1, ...
    gpu_of_ordinal: dict[int, int]
    pipeline: ProbeSpec
    ladder: PairLadder  # (first GPU, second GPU)

    @property
    def first_session(self) -> tuple[ProbeSpec, ...]:
        return (
            *self.ladder.specs(BEFORE_PIPELINE),
            self.pipeline,
            *self.ladder.specs(AFTER_PIPELINE),
        )


def plan_pair(kernel: str, a: PlannedGpu, b: PlannedGpu, opts: ReproOptions) -> PairLadder:
    plan = plan_scan(kernel, [a, b], shrink_scan_options(opts))
    session = plan.sessions[0]  # max_pairs=1: the session of a -> b
    pair = {s.condition: s for s in session.specs if s.condition.is_pair}
    single = {s.condition: s for s in session.specs if not s.condition.is_pair}
    return PairLadder(a=a.index, b=b.index, env=dict(session.env), pair=pair, single=single)


def pipeline_spec(kernel: str, n_gpus: int, opts: ReproOptions) -> ProbeSpec:
    p = get_preset(opts.preset)
    n, k = p.gate_up_nk
    return ProbeSpec(
        probe_id=PIPELINE_ID,
        kernel=kernel,
        condition=Condition.PIPELINE,
        placement=PIPELINE_PLACEMENT,
        device=0,
        current=0,
        # descriptive: the gate_up GEMM of one layer (tokens x top-k rows)
        shape=Shape(m=opts.tokens * p.top_k, e=p.num_experts, n=n, k=k, dtype=opts.dtype, routing="random"),
        seed=opts.seed,
        params={
            "layers": opts.n_layers(n_gpus),
            "steps": opts.steps,
            "devices": list(range(n_gpus)),
            "preset": opts.preset,
            "tokens": opts.tokens,
            "busy_s": opts.busy_s,
        },
        timeout_s=opts.timeout_s,
    )


def plan_repro(kernel: str, gpus: Sequence[PlannedGpu], opts: ReproOptions | None = None) -> ReproPlan:
    """Plan child 1: the pipeline over every selected GPU and the ladder of (gpus[0], gpus[1])."""
    opts = opts or ReproOptions()
    if len(gpus) < 2:
        raise ValueError(f"repro needs two GPUs, got {len(gpus)}")
    if opts.n_layers(len(gpus)) < len(gpus):
        raise ValueError(f"{opts.n_layers(len(gpus))} layers cannot span {len(gpus)} GPUs")
    ladder = plan_pair(kernel, gpus[0], gpus[1], opts)
    return ReproPlan(
        kernel=kernel,
        gpus=tuple(g.index for g in gpus),
        env=knobs.pin_gpus(g.uuid for g in gpus),
        gpu_of_ordinal={i: g.index for i, g in enumerate(gpus)},
        pipeline=pipeline_spec(kernel, len(gpus), opts),
        ladder=ladder,
    )


__all__ = [
    "AFTER_PIPELINE",
    "BEFORE_PIPELINE",
    "PAIR_LADDER",
    "PIPELINE_ID",
    "PIPELINE_PLACEMENT",
    "SHRINK_PRESET",
    "SINGLE_LADDER",
    "PairLadder",
    "ReproPlan",
    "pipeline_spec",
    "plan_pair",
    "plan_repro",
    "shrink_scan_options",
]
