"""Sticky CUDA errors as a real Hopper GPU raises them (run on a GPU machine; skipped without one).

A device-side TMA-descriptor copy kernel (``tl.make_tensor_descriptor``, scratch from
``triton.set_allocator``), each case in a fresh process: the same values with x 16-byte aligned
(a fresh tensor, or 8 bf16 elements into a buffer), with x one bf16 element (2 bytes) into its
buffer, and with y's descriptor claiming rows past y. Recorded on one H100 (2026-12-07,
tests/fixtures/tracebacks/2026-12-07-h100-3d8e2cb): the aligned cases pass, the misaligned one
ends in ``CUDA error: misaligned address``, a store 8192 rows past y (caching allocator off) in
``CUDA error: an illegal instruction was encountered``; 64 rows past did not fault. The doctor
must read each end from the dead program's stderr, and ``run`` must report it as a CUDA error,
never "No finding".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qmoe_doctor.core.error_kind import classify_exit
from qmoe_doctor.core.records import ErrorKind

pytestmark = pytest.mark.gpu

PROGRAM = """\
import sys

import torch
import triton
import triton.language as tl

triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))


@triton.jit
def copy_tma(x_ptr, y_ptr, MX, MY, K, stride_xm, stride_ym, BM: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    xd = tl.make_tensor_descriptor(x_ptr, shape=[MX, K], strides=[stride_xm, 1], block_shape=[BM, BK])
    yd = tl.make_tensor_descriptor(y_ptr, shape=[MY, K], strides=[stride_ym, 1], block_shape=[BM, BK])
    yd.store([pid_m * BM, pid_k * BK], xd.load([pid_m * BM, pid_k * BK]) * 2)


# argv: the storage offset of x in elements (-1: a fresh tensor), the rows y's descriptor claims
# past the end of y (the over-routed case)
M, K = 1024, 256
offset, extra = int(sys.argv[1]), int(sys.argv[2])
src = torch.randn(M + extra, K, device="cuda", dtype=torch.bfloat16)
x = src
if offset >= 0:
    buf = torch.full((M * K + offset + 64,), float("nan"), device="cuda", dtype=torch.bfloat16)
    x = buf[offset : offset + M * K].view(M, K)
    x.copy_(src[:M])
y = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
my = M + extra
copy_tma[(triton.cdiv(my, 64), K // 64)](x, y, x.shape[0], my, K, x.stride(0), y.stride(0), BM=64, BK=64)
torch.cuda.synchronize()
assert torch.equal(y, src[:M] * 2), "wrong values"
"""


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0)[0] >= 9


needs_tma = pytest.mark.skipif(not _hopper(), reason="device-side TMA descriptors need a Hopper GPU (sm_90+)")


def _run(tmp_path: Path, offset: int, extra: int = 0, **env: str) -> subprocess.CompletedProcess[str]:
    prog = tmp_path / "tma_copy.py"
    prog.write_text(PROGRAM)
    return subprocess.run(
        [sys.executable, str(prog), str(offset), str(extra)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )


@needs_tma
@pytest.mark.parametrize("offset", [-1, 0, 8])
def test_an_aligned_operand_passes(tmp_path: Path, offset: int) -> None:
    done = _run(tmp_path, offset)
    assert done.returncode == 0, done.stderr[-2000:]


@needs_tma
def test_a_misaligned_operand_ends_in_a_misaligned_address_the_classifier_names(tmp_path: Path) -> None:
    done = _run(tmp_path, 1)
    assert done.returncode != 0
    assert classify_exit(done.returncode, done.stderr) is ErrorKind.MISALIGNED_ADDRESS, done.stderr[-2000:]


@needs_tma
def test_a_tma_store_far_past_its_tensor_ends_in_an_illegal_instruction(tmp_path: Path) -> None:
    """Recorded (tests/fixtures/tracebacks/2026-12-07-h100-3d8e2cb, traceback-tma-overrun-nocache):
    y's descriptor claiming 8192 rows past its 1024, the caching allocator off: the error surfaces
    when the scratch buffer is freed, a C++ exception in a destructor, SIGABRT."""
    done = _run(tmp_path, -1, 8192, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    assert done.returncode != 0
    assert classify_exit(done.returncode, done.stderr) is ErrorKind.ILLEGAL_INSTRUCTION, done.stderr[-2000:]


@needs_tma
def test_run_reports_the_misaligned_address_as_a_cuda_error(tmp_path: Path) -> None:
    prog = tmp_path / "tma_copy.py"
    prog.write_text(PROGRAM)
    save = tmp_path / "run.json"
    done = subprocess.run(
        [sys.executable, "-m", "qmoe_doctor", "run", "--save", str(save), "--", sys.executable, str(prog), "1", "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0  # the command's own status
    doc = json.loads(save.read_text())
    kinds = [e["error_kind"] for p in doc["passes"] for e in p["cuda_errors"]]
    assert kinds == ["misaligned-address"], done.stdout[-3000:]
    assert "No finding" not in done.stdout
