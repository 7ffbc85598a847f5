"""The routed protocol on one GPU: each routed kernel gets the verdict of the calibration table
(docs/validation/scan-specimens.md), through the real CLI (``scan --gpus 0 --json``).

* our routed kernels and the correct twins of both styles: healthy, exit 0, every routed cell
  that applies passing, the gathered int32 boundary (4 GiB of rows) included;
* each faulty routed specimen: its cause, nothing else, from exactly the cells the registry lists
  (``sorted_int32_token`` from the gathered-int32 cell, which no CPU can run);
* ``gather_sms_device0``: nothing on one GPU (device 0 is the operands' device), as registered.

Also the routed cells' timing: a routed scan is no longer than the m_sizes scan of the same
kernel plus its routing cells.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from qmoe_doctor.core.conditions import ROUTED_ORDER
from qmoe_doctor.core.specimens import SPECIMENS, get_specimen

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
ROUTED_ONLY = ",".join(["single", *(c.value for c in ROUTED_ORDER)])
ROUTED_SPECIMENS = [s.name for s in SPECIMENS if s.protocol != "m_sizes"]


def _scan(kernel: str, tmp: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, "-m", "qmoe_doctor", "scan", "--gpus", "0", "--kernel", kernel, "--json", *extra,
         "--log-dir", str(tmp / "logs")],
        capture_output=True,
        text=True,
        timeout=1200,
        env=dict(os.environ),
        cwd=REPO,
        check=False,
    )  # fmt: skip
    assert out.stdout.lstrip().startswith("{"), f"rc={out.returncode}\n{out.stderr[-3000:]}"
    return out.returncode, json.loads(out.stdout)


def _failing(report: dict[str, Any]) -> set[str]:
    return {o["spec"]["condition"] for o in report["outcomes"] if o["status"] in ("wrong", "error")}


@pytest.mark.parametrize(
    "kernel", ["adapter:routed", "adapter:routed-rows", "specimen:sorted_ids", "specimen:gather_scatter"]
)
def test_correct_routed_kernels_are_healthy_on_one_gpu(kernel: str, tmp_path: Path) -> None:
    rc, report = _scan(kernel, tmp_path, "--only", ROUTED_ONLY)
    assert rc == 0 and report["diagnoses"] == [] and report["unexplained"] == [], report["diagnoses"]
    boundary = [o for o in report["outcomes"] if o["spec"]["condition"] == "gathered-int32"]
    assert [o["status"] for o in boundary] == ["pass"], boundary  # 4 GiB of rows fit on an H100


@pytest.mark.parametrize("name", [n for n in ROUTED_SPECIMENS if get_specimen(n).cause is not None])
def test_each_routed_specimen_gets_its_cause_on_one_gpu(name: str, tmp_path: Path) -> None:
    info = get_specimen(name)
    rc, report = _scan(f"specimen:{name}", tmp_path, "--only", ROUTED_ONLY)
    if not info.misbehaves_under:  # gather_sms_device0: device 0 is the operands' device here
        assert rc == 0 and report["diagnoses"] == []
        return
    assert rc == 1
    assert {d["cause"] for d in report["diagnoses"]} == {info.cause} and report["unexplained"] == []
    assert _failing(report) == {c.value for c in info.misbehaves_under}


def test_a_routed_scan_costs_the_m_sizes_scan_plus_its_routing_cells(tmp_path: Path) -> None:
    """Wall times of one GPU: the routed scan of our routed kernel against the scan of the same
    kernel without its routed cells, and those cells alone."""
    others = "repeat-call,single,side-stream,int32-boundary,offsets,launch-config"
    _, routed = _scan("adapter:routed", tmp_path / "a")
    _, plain = _scan("adapter:routed", tmp_path / "b", "--only", others)
    _, cells = _scan("adapter:routed", tmp_path / "c", "--only", ROUTED_ONLY)
    print(
        f"routed scan {routed['wall_s']:.1f} s, without routed cells {plain['wall_s']:.1f} s, cells {cells['wall_s']:.1f} s"
    )
    assert routed["wall_s"] <= plain["wall_s"] + cells["wall_s"]
