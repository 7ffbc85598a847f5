"""Report records: what each command produced, as data (stdlib only).

Workflows build them, the report writers (JSON, JUnit, scripts, plots) and the CLI's renderers
read them. Every report carries ``schema_version`` and round-trips through JSON like the records
in ``records``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from qmoe_doctor import __version__
from qmoe_doctor.core.audit import AuditReport
from qmoe_doctor.core.records import SCHEMA_VERSION, Diagnosis, Evidence, Outcome


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionInfo:
    label: str
    gpu_of_ordinal: dict[int, int]  # child ordinal -> NVML index
    cuda_visible_devices: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class ScanReport:
    schema_version: int = SCHEMA_VERSION
    tool_version: str = __version__
    kernel: str
    tier: str  # "gpu" or "cpu"
    started: str  # ISO 8601, UTC
    wall_s: float
    gpus: tuple[int, ...]  # NVML indices scanned, in --gpus order
    sessions: tuple[SessionInfo, ...]
    outcomes: tuple[Outcome, ...]
    diagnoses: tuple[Diagnosis, ...]
    explanations: tuple[str, ...] = ()
    unexplained: tuple[Evidence, ...] = ()
    skipped: tuple[str, ...] = ()
    log_dir: str = ""
    inventory: dict[str, Any] = field(default_factory=dict)
    audit: tuple[AuditReport, ...] = ()  # int32 offset audit of the scanned presets
    # False in the reports written while the scan runs (``on_progress``): what ran so far, and the
    # sessions still to run. A scan that is killed leaves the last of them behind.
    complete: bool = True
    not_run: tuple[str, ...] = ()

    @property
    def healthy(self) -> bool:
        return self.complete and not self.diagnoses and not self.unexplained
