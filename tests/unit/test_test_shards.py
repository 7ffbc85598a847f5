"""``pytest --shard I/N`` (tests/conftest.py): N processes with I = 0..N-1 run each selected test
exactly once between them, after -m and -k have selected; a malformed spec is a usage error.
The GPU recipe runs the GPU tests this way on one card (tools/gpu/validate_one_gpu.sh, SHARDS)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODULE = "tests/unit/test_lint.py"  # many parametrized tests, collected without importing torch


def _collect(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pytest", MODULE, "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )  # fmt: skip


def _ids(*args: str) -> list[str]:
    done = _collect(*args)
    assert done.returncode == 0, done.stdout + done.stderr
    return [line for line in done.stdout.splitlines() if "::" in line]


@pytest.mark.parametrize("select", [(), ("-k", "specimen")], ids=["all", "k-specimen"])
def test_the_shards_split_the_selection_between_them(select: tuple[str, ...]) -> None:
    whole = _ids(*select)
    shards = [_ids(*select, f"--shard={i}/3") for i in range(3)]
    assert sorted(sum(shards, [])) == sorted(whole)  # every test once: none lost, none twice
    assert all(abs(len(s) - len(whole) / 3) < 1 for s in shards)  # shares of the selection, not of the module


@pytest.mark.parametrize("spec", ["3/3", "-1/2", "0/0", "x"])
def test_a_malformed_shard_is_a_usage_error(spec: str) -> None:
    done = _collect(f"--shard={spec}")
    assert done.returncode == 4  # pytest's usage error
    assert f"--shard {spec!r}" in done.stderr
