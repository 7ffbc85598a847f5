"""The scan's conditions as sets and in run order: the vocabulary planners, rules and renderers share.

``Condition`` itself (one value per controlled condition) is a record field and lives in
``records``; this module says which of them a scan runs, in which order, and on which tier.
Order matters: some process state cannot be undone (a CUDA context, peer access), so a session
runs its probes from least to most state.
"""

from __future__ import annotations

from qmoe_doctor.core.records import PAIR_CONDITIONS, Condition

#: Conditions of a pair session, in the order they run (least state first): ``Condition``
#: declares them in that order (guarded, untouched, no-peer, peer, producer-race, sizes-race).
PAIR_ORDER = tuple(c for c in Condition if c in PAIR_CONDITIONS)
#: Single-device conditions, in order (REPEAT_CALL must be the process's first kernel call).
SINGLE_ORDER = (
    Condition.REPEAT_CALL,
    Condition.SINGLE,
    Condition.SIDE_STREAM,
    Condition.OVER_ROUTED,
    Condition.NEGATIVE_SIZES,
    Condition.INT32_BOUNDARY,
)
#: What the CPU tier (no GPU, TRITON_INTERPRET=1) can run.
CPU_CONDITIONS = (Condition.REPEAT_CALL, Condition.SINGLE, Condition.OVER_ROUTED, Condition.NEGATIVE_SIZES)
SWEEP_CONDITIONS = (Condition.OFFSETS, Condition.LAUNCH_CONFIG)
#: The routed protocol's cells (``fn(hidden_states, w, topk_ids, topk_weights[, expert_map])``),
#: in run order, after the single-device cells; a routed kernel runs them instead of the
#: ``m_sizes`` routing edges (over-routed, negative-sizes), which it has no argument for.
ROUTED_ORDER = (
    Condition.ROUTED,
    Condition.IDS_OUT_OF_RANGE,
    Condition.DROPPED_SLOTS,
    Condition.EXPERT_MAP,
    Condition.MAP_PAST_LOCAL,
    Condition.PADDED_COUNT,
    Condition.GATHER_PAST_T,
    Condition.GATHERED_INT32,
)
#: The routing-edge cells of the routed protocol (the ``m_sizes`` protocol's: over-routed,
#: negative-sizes): what a routed kernel runs in their place.
ROUTED_EDGES = ROUTED_ORDER[1:-1]
M_SIZES_EDGES = (Condition.OVER_ROUTED, Condition.NEGATIVE_SIZES)
#: What the CPU tier runs of them (the gathered int32 boundary needs a >4 GiB output: a GPU).
ROUTED_CPU = ROUTED_ORDER[:-1]
DEFAULT_CONDITIONS = frozenset(SINGLE_ORDER + PAIR_ORDER + SWEEP_CONDITIONS + ROUTED_ORDER)
