"""Sticky CUDA errors as a real Hopper GPU raises them (run on a GPU machine; skipped without one).

A device-side TMA-descriptor copy kernel (``tl.make_tensor_descriptor``, scratch from
``triton.set_allocator``), each case in a fresh process: the same values with x 16-byte aligned
(a fresh tensor, or 8 bf16 elements into a buffer) and with x one bf16 element (2 bytes) into its
buffer. FINDINGS.md (one H100, 2026-12-06): a persistent grouped GEMM of this kind ended in
``CUDA error: misaligned address`` on the second, and passed on the first. The doctor must read
that end as ``misaligned-address`` from the dead program's stderr, and ``run`` must report it as a
CUDA error, never "No finding".
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
def copy_tma(x_ptr, y_ptr, M, K, stride_xm, stride_ym, BM: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    xd = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[stride_xm, 1], block_shape=[BM, BK])
    yd = tl.make_tensor_descriptor(y_ptr, shape=[M, K], strides=[stride_ym, 1], block_shape=[BM, BK])
    yd.store([pid_m * BM, pid_k * BK], xd.load([pid_m * BM, pid_k * BK]) * 2)


M, K, BM, BK = 1024, 256, 64, 64
offset = int(sys.argv[1])
src = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
x = src
if offset >= 0:
    buf = torch.full((M * K + offset + 64,), float("nan"), device="cuda", dtype=torch.bfloat16)
    x = buf[offset : offset + M * K].view(M, K)
    x.copy_(src)
y = torch.empty(M, K, device="cuda", dtype=torch.bfloat16)
copy_tma[(M // BM, K // BK)](x, y, M, K, x.stride(0), y.stride(0), BM=BM, BK=BK)
torch.cuda.synchronize()
assert torch.equal(y, src * 2), "wrong values"
"""


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability(0)[0] >= 9


needs_tma = pytest.mark.skipif(not _hopper(), reason="device-side TMA descriptors need a Hopper GPU (sm_90+)")


def _run(tmp_path: Path, offset: int) -> subprocess.CompletedProcess[str]:
    prog = tmp_path / "tma_copy.py"
    prog.write_text(PROGRAM)
    return subprocess.run(
        [sys.executable, str(prog), str(offset)], capture_output=True, text=True, timeout=300, env=dict(os.environ)
    )


@needs_tma
@pytest.mark.parametrize("offset", [-1, 8])
def test_an_aligned_operand_passes(tmp_path: Path, offset: int) -> None:
    done = _run(tmp_path, offset)
    assert done.returncode == 0, done.stderr[-2000:]


@needs_tma
def test_a_misaligned_operand_ends_in_a_misaligned_address_the_classifier_names(tmp_path: Path) -> None:
    done = _run(tmp_path, 1)
    assert done.returncode != 0
    assert classify_exit(done.returncode, done.stderr) is ErrorKind.MISALIGNED_ADDRESS, done.stderr[-2000:]


@needs_tma
def test_run_reports_the_misaligned_address_as_a_cuda_error(tmp_path: Path) -> None:
    prog = tmp_path / "tma_copy.py"
    prog.write_text(PROGRAM)
    save = tmp_path / "run.json"
    done = subprocess.run(
        [sys.executable, "-m", "qmoe_doctor", "run", "--save", str(save), "--", sys.executable, str(prog), "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0  # the command's own status
    doc = json.loads(save.read_text())
    kinds = [e["error_kind"] for p in doc["passes"] for e in p["cuda_errors"]]
    assert kinds == ["misaligned-address"], done.stdout[-3000:]
    assert "No finding" not in done.stdout
