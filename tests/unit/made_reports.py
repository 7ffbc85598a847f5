"""Reports made by hand for CLI tests that stand a workflow in: the smallest valid ones."""

from __future__ import annotations

from pathlib import Path

from qmoe_doctor.core.records import Condition, Outcome, Phase, ProbeSpec, Shape, Status
from qmoe_doctor.core.reports import ScanReport


def one_probe_scan(log_dir: Path) -> ScanReport:
    """A CPU scan of the built-in kernel with one passing cell, its logs in ``log_dir``."""
    spec = ProbeSpec(
        probe_id="CPU/single",
        kernel="builtin",
        condition=Condition.SINGLE,
        device=None,
        current=None,
        shape=Shape(m=64, e=4, n=32, k=32, dtype="float32"),
    )
    outcome = Outcome(probe_id=spec.probe_id, spec=spec, status=Status.PASS, phase=Phase.DONE)
    return ScanReport(
        kernel="builtin",
        tier="cpu",
        started="2026-01-01T00:00:00+00:00",
        wall_s=0.1,
        gpus=(),
        sessions=(),
        outcomes=(outcome,),
        diagnoses=(),
        log_dir=str(log_dir),
    )
