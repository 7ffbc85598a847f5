"""Shared test set-up.

CPU machines (CI) run Triton kernels through the interpreter: TRITON_INTERPRET must be set
before triton is imported, so it is set here when no CUDA device is present. GPU tests are
marked ``gpu`` / ``multigpu`` and skipped without the devices (run them on a GPU machine and
record the run in docs/validation/gpu-tests.md).
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on a GPU machine)")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA GPUs")
    for item in items:
        if "multigpu" in item.keywords and CUDA_DEVICES < 2:
            item.add_marker(skip_multi)
        elif "gpu" in item.keywords and CUDA_DEVICES < 1:
            item.add_marker(skip_gpu)
