"""The GPU recipes' shared header (``tools/gpu/run_common.sh``) on a machine lent for another card.

A call for one kind of machine may be lent another (an H100 for an H200). With ``CARD=TEXT`` a
recipe runs only where the first GPU's name contains TEXT; anywhere else it says which GPU it
found, writes its summary and exits 3 before any work (no install, no tune recorded for the
wrong card). Here ``nvidia-smi`` is a stand-in first on PATH.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _recipe(tmp_path: Path, card: str, gpu_name: str | None) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"  # shadows a real one: None stands for a machine where it fails
    smi.write_text(f"#!/bin/sh\necho '{gpu_name}'\n" if gpu_name is not None else "#!/bin/sh\nexit 9\n")
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CARD": card, "OUT": str(tmp_path / "out")}
    return subprocess.run(
        ["bash", str(REPO / "tools" / "gpu" / "perf_card.sh"), "--tiny", "bench"],
        capture_output=True, text=True, timeout=60, env=env, cwd=REPO,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("gpu_name", "shown"),
    [("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"), (None, "none (nvidia-smi found none)")],
)
def test_a_recipe_for_another_card_stops_before_any_work(tmp_path: Path, gpu_name: str | None, shown: str) -> None:
    done = _recipe(tmp_path, "H200", gpu_name)
    assert done.returncode == 3, done.stdout + done.stderr
    line = f"CARD=H200: this machine's GPU is {shown}; nothing run"
    assert line in done.stdout
    assert (tmp_path / "out" / "summary.txt").read_text().strip() == line
    assert not (tmp_path / "out" / "logs" / "install.log").exists()  # stopped before the install


CHECKS = Path(__file__).resolve().parents[1] / "fixtures" / "reports" / "check" / "2026-12-06-h100-761a4c8"


def _expect_check(xml: Path, own: str, tmp_path: Path) -> str:
    """The recipes' ``expect_check`` line for one ``check --junit`` report: the function alone,
    cut from the shared header (sourcing the header installs the tree)."""
    header = (REPO / "tools" / "gpu" / "run_common.sh").read_text()
    body = re.search(r"^expect_check\(\) \{\n.*?^\}\n", header, re.S | re.M)
    assert body is not None
    script = f'S={tmp_path / "summary.txt"}\n{body.group(0)}expect_check "$1" "$2"\n'
    done = subprocess.run(["bash", "-c", script, "-", str(xml), own], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.parametrize("xml", sorted(CHECKS.glob("check-*.xml")), ids=lambda p: p.stem)
def test_expect_check_judges_recorded_checks_by_the_specimen_s_own_cause(xml: Path, tmp_path: Path) -> None:
    """One-GPU `check` reports of the built-in kernel and each specimen (H100, 2026-12-06): each
    is "ok" against its own cause (the lint's where no one-GPU cell can see it, cached_sms; exit 0
    for a correct kernel) and "NOT AS EXPECTED" against any other."""
    from qmoe_doctor.core.specimens import SPECIMENS, get_specimen

    name = xml.stem.removeprefix("check-")
    own = "-" if name == "builtin" else get_specimen(name).cause or "-"
    assert _expect_check(xml, own, tmp_path).startswith("ok: ")
    others = sorted({s.cause for s in SPECIMENS if s.cause and s.cause != own} | ({"-"} if own != "-" else set()))
    for other in others[:3]:
        assert _expect_check(xml, other, tmp_path).startswith("NOT AS EXPECTED: ")


def test_expect_check_says_when_there_is_no_report(tmp_path: Path) -> None:
    line = _expect_check(tmp_path / "missing.xml", "-", tmp_path)
    assert line.startswith("NOT AS EXPECTED: no report")


def test_expect_check_counts_an_untyped_error_against_the_verdict(tmp_path: Path) -> None:
    """A report whose only fault is an <error> without a type (a child that crashed) is not "ok"
    for a correct kernel, and the line names it by its tag."""
    xml = tmp_path / "check.xml"
    xml.write_text(
        '<testsuites><testsuite name="k"><properties><property name="exit_code" value="1" /></properties>'
        '<testcase name="single"><error message="worker crashed" /></testcase></testsuite></testsuites>'
    )
    line = _expect_check(xml, "-", tmp_path)
    assert line.startswith("NOT AS EXPECTED: ") and "['error']" in line
