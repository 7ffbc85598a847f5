"""Shared test set-up.

CPU machines (CI) run Triton kernels through the interpreter: TRITON_INTERPRET must be set
before triton is imported, so it is set here when no CUDA device is present. GPU tests are
marked ``gpu`` / ``multigpu`` and skipped without the devices (run them on a GPU machine and
record the run in docs/validation/gpu-tests.md). ``--shard I/N`` keeps every N-th test of the
selection from the I-th (0-based): N processes with I = 0..N-1 share one run, as the GPU recipe
does on one card (tools/gpu/validate_one_gpu.sh, SHARDS=N), where compiling is the slow part.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def _cuda_device_count() -> int:
    # Ask nvidia-smi rather than torch: importing torch here would put it in every test
    # process, and the "parent never imports torch" tests run in subprocesses anyway.
    if os.environ.get("QMOE_TEST_FORCE_CPU"):
        return 0
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return len([line for line in out.stdout.splitlines() if line.strip()]) if out.returncode == 0 else 0


CUDA_DEVICES = _cuda_device_count()

if CUDA_DEVICES == 0:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--shard",
        default=None,
        metavar="I/N",
        help="run only every N-th selected test from the I-th (0-based); N processes with I = 0..N-1 run "
        "each selected test once between them",
    )


def _shard(spec: str) -> tuple[int, int]:
    """(I, N) of ``--shard I/N``; a usage error names what is wrong."""
    index, _, count = spec.partition("/")
    try:
        i, n = int(index), int(count)
    except ValueError:
        raise pytest.UsageError(f"--shard {spec!r}: want I/N with whole numbers, e.g. 0/4") from None
    if n < 1 or not 0 <= i < n:
        raise pytest.UsageError(f"--shard {spec!r}: want 0 <= I < N, e.g. 0/4 .. 3/4")
    return i, n


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected: each shard gets its share of what runs
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    spec = config.getoption("--shard")
    if spec:
        i, n = _shard(spec)
        dropped = [item for j, item in enumerate(items) if j % n != i]
        items[:] = items[i::n]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on a GPU machine)")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA GPUs")
    for item in items:
        if "multigpu" in item.keywords and CUDA_DEVICES < 2:
            item.add_marker(skip_multi)
        elif "gpu" in item.keywords and CUDA_DEVICES < 1:
            item.add_marker(skip_gpu)
