"""What each command was asked to do, as records: the CLI builds them, planners and workflows read them.

Pure data (stdlib only). Defaults are declared here once; the CLI's options show them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

from qmoe_doctor.core import knobs
from qmoe_doctor.core.autotune import DEFAULT_AUTOTUNE, AutotunePolicy
from qmoe_doctor.core.conditions import DEFAULT_CONDITIONS, ROUTED_ORDER
from qmoe_doctor.core.launch_configs import TileConfig
from qmoe_doctor.core.modes import USER_MODES, Mode
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
    autotune: AutotunePolicy = DEFAULT_AUTOTUNE  # the kernel's autotuner in the probes (core.autotune)
    # pair sessions run at once, on disjoint GPU pairs (plan.pair_rounds); None: every disjoint
    # pair of a round. 1 runs the pairs one after another (the escape hatch when concurrent pairs
    # must be ruled out, e.g. a shared PCIe switch suspected of skewing the race cells' timing).
    pairs_at_once: int | None = None


#: The fast GPU subset. Pair cells on the first ordered pair: guarded (baseline), no-peer and
#: peer (the device guard, buffers on the current device), producer-race (stream order). Single
#: cells on the pair's operand GPU: repeat-call (must be the process's first call), single (the
#: side-stream rule's baseline), side-stream, over-routed and negative-sizes (small shapes).
#: int32-boundary (a 4.4 GiB stack, ~1.5 s on H200; without it check passed specimen:int32_offsets
#: in the 2x H200 validation of 2026-11-22). Left to ``scan``: untouched (a child of its own, ~5 s, and only shows
#: "works by accident"), sizes-race (an illegal access when it fails: a new child) and the offset /
#: launch-config sweeps. Measured on 2x H200 (2026-11-22): 8-10 s per kernel for the GPU subset.
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
        # the routed protocol's cells (a routed kernel runs them instead of over-routed and
        # negative-sizes; small shapes but the gathered int32 boundary's 4 GiB of rows)
        *ROUTED_ORDER,
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
    autotune: AutotunePolicy = DEFAULT_AUTOTUNE  # the kernel's autotuner in the probes (core.autotune)


#: Seconds one parallel launch may take, start-up and compilation included (a 30B-preset run on
#: H200: import, NCCL set-up, compile from a warm cache, four passes: well under a minute).
DEFAULT_RUN_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelOptions:
    """What ``qmoe-doctor parallel`` runs. ``None`` fields take the tier's default (``resolved``)."""

    modes: tuple[Mode, ...] = USER_MODES
    preset: str | None = None  # GPU: qwen3-30b-a3b; CPU: tiny
    tokens: int | None = None  # global tokens per step. GPU: 16384; CPU: 16
    steps: int | None = None  # timed steps. GPU: 5; CPU: 0 (interpreter timings mean nothing)
    warmup: int | None = None  # untimed steps after the checked one. GPU: 1; CPU: 0
    layers: int | None = None  # pp: blocks in the stack (default 2 per GPU)
    seed: int = 0
    dtype: str | None = None  # GPU: bfloat16; CPU: float32 (bf16 tl.dot is broken in the interpreter)
    backend: str | None = None  # GPU: nccl; CPU: gloo
    baseline: bool | None = None  # run the one-device baseline for tokens/s. GPU: yes; CPU: no
    nproc_per_node: int | None = None  # GPU: one per selected GPU; CPU: 2 processes
    nnodes: int = 1
    rdzv_endpoint: str | None = None  # HOST:PORT of the c10d rendezvous (None: localhost, a free port)
    rdzv_id: str = "qmoe-doctor"
    timeout_s: float = DEFAULT_RUN_TIMEOUT_S
    inject: dict[str, Any] | None = None  # self-tests of the orchestration (probes/parallel/rank.py)

    def resolved(self, *, cpu: bool, n_devices: int) -> ParallelOptions:
        return replace(
            self,
            preset=self.preset or ("tiny" if cpu else "qwen3-30b-a3b"),
            tokens=self.tokens if self.tokens is not None else (16 if cpu else 16384),
            steps=self.steps if self.steps is not None else (0 if cpu else 5),
            warmup=self.warmup if self.warmup is not None else (0 if cpu else 1),
            dtype=self.dtype or ("float32" if cpu else "bfloat16"),
            backend=self.backend or ("gloo" if cpu else "nccl"),
            baseline=self.baseline if self.baseline is not None else not cpu,
            nproc_per_node=self.nproc_per_node or (2 if cpu else n_devices),
        )


#: memcheck costs ~47x per kernel and ~1 s of start-up (FINDINGS); a probe of the scan's main
#: shape took 6-8 s under it on an H200. Generous, since a hang must not stall the verdict's report.
SANITIZER_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True, kw_only=True)
class ReproOptions:
    preset: str = "tiny"  # the pipeline's blocks
    layers: int | None = None  # default: two per GPU
    steps: int = 2
    tokens: int = 128
    busy_s: float = 0.01  # the stream held per layer (probes/pipeline.py BUSY_S)
    shrink_preset: str | None = None  # default: the pipeline's preset, or plan.repro.SHRINK_PRESET for "tiny"
    rows: int = 4096  # M of the shrink probes (the scan's main cells)
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    seed: int = 0
    sanitizer: bool = True
    timeout_s: float = knobs.DEFAULT_PROBE_TIMEOUT_S
    sanitizer_timeout_s: float = SANITIZER_TIMEOUT_S

    def n_layers(self, n_gpus: int) -> int:
        return self.layers if self.layers is not None else 2 * n_gpus
