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
DEFAULT_CONDITIONS = frozenset(SINGLE_ORDER + PAIR_ORDER + SWEEP_CONDITIONS)
