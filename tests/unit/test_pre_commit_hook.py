""".pre-commit-hooks.yaml: `qmoe-doctor lint` as a pre-commit hook, tried the way a user tries a
hook repository before adopting it (`pre-commit try-repo`), on a file with a planted fault and on
its guarded twin."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PLANTED = """\
import torch
import triton


@triton.jit
def scale(x_ptr, n):
    pass


def scale_all(x: torch.Tensor) -> None:
    scale[(1,)](x, x.numel())  # PLANTED: launched on the current device, not x's
"""
GUARDED = PLANTED.replace(
    "    scale[(1,)](x, x.numel())  # PLANTED: launched on the current device, not x's",
    "    with torch.cuda.device(x.device):\n        scale[(1,)](x, x.numel())",
)


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture
def user_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "user"
    repo.mkdir()
    (repo / "planted.py").write_text(PLANTED)
    (repo / "guarded.py").write_text(GUARDED)
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    return repo


def _try_repo(user_repo: Path, tmp_path: Path, name: str) -> subprocess.CompletedProcess[str]:
    scripts = Path(shutil.which("qmoe-doctor") or Path(sys.executable).with_name("qmoe-doctor")).parent
    env = {
        **os.environ,
        "PRE_COMMIT_HOME": str(tmp_path / "pre-commit-home"),
        "PATH": f"{scripts}{os.pathsep}{os.environ.get('PATH', '')}",
        # the shadow commit try-repo makes of a checkout with uncommitted changes needs a name
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@example.com",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@example.com",
    }
    return subprocess.run(
        [sys.executable, "-m", "pre_commit", "try-repo", str(REPO), "qmoe-doctor-lint", "--files", name],
        cwd=user_repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_hook_fails_a_commit_of_a_planted_fault_and_names_it(user_repo: Path, tmp_path: Path) -> None:
    got = _try_repo(user_repo, tmp_path, "planted.py")
    assert got.returncode == 1, got.stdout + got.stderr
    assert "planted.py:11:5: unguarded-launch [missing-device-guard]" in got.stdout


def test_the_hook_passes_the_guarded_twin(user_repo: Path, tmp_path: Path) -> None:
    got = _try_repo(user_repo, tmp_path, "guarded.py")
    assert got.returncode == 0, got.stdout + got.stderr
    assert "Passed" in got.stdout
