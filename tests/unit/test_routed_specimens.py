"""The routed protocol's kernels through the real CLI on the CPU tier: the verdict each must get.

Each case runs ``python3 -m qmoe_doctor scan --cpu --kernel K --json`` (``check`` for the causes
only lint can see on a CPU) in a child, as a user would, and reads the versioned JSON report. The
verdicts are the CPU column of the calibration table (docs/validation/scan-specimens.md) and the
registry (``core/specimens.py``): a faulty specimen gets its cause and no other, nothing
unexplained, from exactly the cells the registry lists; a correct one comes out healthy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from qmoe_doctor.core.conditions import ROUTED_CPU
from qmoe_doctor.core.specimens import get_specimen

REPO = Path(__file__).resolve().parents[2]
ROUTED_ONLY = ",".join(["single", *(c.value for c in ROUTED_CPU)])


def _cli(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU tier, whatever this machine has
    return subprocess.run(
        [sys.executable, "-m", "qmoe_doctor", *args, "--log-dir", str(tmp / "logs")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=REPO,
        check=False,
    )


def _scan(kernel: str, tmp: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    out = _cli("scan", "--cpu", "--kernel", kernel, "--json", *extra, tmp=tmp)
    assert out.stdout.lstrip().startswith("{"), (
        f"rc={out.returncode}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
    )
    return out.returncode, json.loads(out.stdout)


def _failing(report: dict[str, Any]) -> set[str]:
    return {o["probe_id"].split("/", 1)[1] for o in report["outcomes"] if o["status"] in ("wrong", "error")}


@pytest.mark.parametrize("kernel", ["adapter:routed", "specimen:sorted_ids", "specimen:gather_scatter"])
def test_correct_routed_kernels_are_healthy_in_a_full_cpu_scan(kernel: str, tmp_path: Path) -> None:
    rc, report = _scan(kernel, tmp_path)
    assert rc == 0, report["diagnoses"]
    assert report["diagnoses"] == [] and report["unexplained"] == [] and report["hardening"] == []
    ran = {o["spec"]["condition"] for o in report["outcomes"] if o["status"] == "pass"}
    assert {"single", "routed", "ids-out-of-range", "dropped-slots", "expert-map", "map-past-local"} <= ran
    assert "over-routed" not in {o["spec"]["condition"] for o in report["outcomes"]}
    assert any("gathered int32 boundary" in n for n in report["coverage"]["not_covered"])


@pytest.mark.parametrize(
    "name", ["sorted_padded_count", "sorted_minus_one", "gather_unchecked_ids", "gather_past_t"]
)
def test_each_faulty_routed_specimen_gets_its_cause_from_its_cells(name: str, tmp_path: Path) -> None:
    info = get_specimen(name)
    rc, report = _scan(f"specimen:{name}", tmp_path, "--only", ROUTED_ONLY)
    assert rc == 1
    assert [(d["cause"], d["severity"]) for d in report["diagnoses"]] == [(info.cause, "fault")]
    assert report["unexplained"] == [] and report["hardening"] == []
    assert _failing(report) == {c.value for c in info.misbehaves_under}
    (diag,) = report["diagnoses"]
    assert diag["repro"].startswith(f"qmoe-doctor scan --kernel specimen:{name} --only ")


@pytest.mark.parametrize(
    ("name", "rule"),
    [("gather_sms_device0", "cached-device-property"), ("sorted_int32_token", "int32-offset")],
)
def test_what_no_cpu_cell_can_see_lint_names(name: str, rule: str, tmp_path: Path) -> None:
    info = get_specimen(name)
    out = _cli(
        "check", "--cpu", "--kernel", f"specimen:{name}", "--only", ROUTED_ONLY, "--save", str(tmp_path / "c.json"),
        tmp=tmp_path,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr[-2000:]
    (kernel,) = json.loads((tmp_path / "c.json").read_text())["kernels"]
    assert kernel["diagnoses"] == []  # every probe passed: the CPU has no cell for it
    assert {(f["cause"], f["rule"]) for f in kernel["lint"]["findings"]} == {(info.cause, rule)}
