"""What each command was asked to do, as records: the CLI builds them, planners and workflows read them.

Pure data (stdlib only). Defaults are declared here once; the CLI's options show them.
"""

from __future__ import annotations

from dataclasses import dataclass

from qmoe_doctor.core import knobs
from qmoe_doctor.core.conditions import DEFAULT_CONDITIONS
from qmoe_doctor.core.launch_configs import TileConfig
from qmoe_doctor.core.records import Condition


@dataclass(frozen=True, slots=True, kw_only=True)
class ScanOptions:
    preset: str = "qwen3-30b-a3b"
    rows: int = 4096  # M of the main cells
    dtype: str = "bfloat16"
    seed: int = 0
    conditions: frozenset[Condition] = DEFAULT_CONDITIONS
    boundary_preset: str = "qwen3-coder-480b-a35b"  # the int32 boundary probe's expert stack
    timeout_s: float = knobs.DEFAULT_PROBE_TIMEOUT_S
    # offset / stride / routing-edge sweep and the launch-config sweep, on the first GPU only
    sweeps: bool = True
    launch_configs: tuple[TileConfig, ...] = ()  # () = the built-in kernel's own config table
    max_pairs: int | None = None  # ordered pairs to scan, first in --gpus order (None: all)


#: The fast GPU subset. Pair cells on the first ordered pair: guarded (baseline), no-peer and
#: peer (the device guard, buffers on the current device), producer-race (stream order). Single
#: cells on the pair's operand GPU: repeat-call (must be the process's first call), single (the
#: side-stream rule's baseline), side-stream, over-routed and negative-sizes (small shapes).
#: int32-boundary (a 4.4 GiB stack, ~1.5 s on H200; without it check passed specimen:int32_offsets
#: in validation run 3). Left to ``scan``: untouched (a child of its own, ~5 s, and only shows
#: "works by accident"), sizes-race (an illegal access when it fails: a new child) and the offset /
#: launch-config sweeps. Measured on 2x H200 (run 3): 8-10 s per kernel for the GPU subset.
GPU_FAST_CONDITIONS = frozenset(
    {
        Condition.REPEAT_CALL,
        Condition.SINGLE,
        Condition.SIDE_STREAM,
        Condition.OVER_ROUTED,
        Condition.NEGATIVE_SIZES,
        Condition.INT32_BOUNDARY,
        Condition.GUARDED,
        Condition.NO_PEER,
        Condition.PEER,
        Condition.PRODUCER_RACE,
    }
)
GPU_FAST_MAX_PAIRS = 1  # the first ordered pair in --gpus order


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckOptions:
    preset: str = "qwen3-30b-a3b"
    rows: int = 4096  # M of the GPU main cells (the CPU tier has its own small shape)
    # None: every condition the CPU tier can run, and GPU_FAST_CONDITIONS on GPUs
    conditions: frozenset[Condition] | None = None
    timeout_s: float = knobs.DEFAULT_PROBE_TIMEOUT_S
    max_pairs: int = GPU_FAST_MAX_PAIRS
    cpu_tier: bool = True
