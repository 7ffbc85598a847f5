"""The GPU recipes' shared header (``tools/gpu/run_common.sh``) on a machine lent for another card.

A call for one kind of machine may be lent another (an H100 for an H200). With ``CARD=TEXT`` a
recipe runs only where the first GPU's name contains TEXT; anywhere else it says which GPU it
found, writes its summary and exits 3 before any work (no install, no tune recorded for the
wrong card). Here ``nvidia-smi`` is a stand-in first on PATH.
"""

from __future__ import annotations

import os
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
