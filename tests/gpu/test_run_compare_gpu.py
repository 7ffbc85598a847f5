"""`qmoe-doctor run --compare` on real GPUs: the races only a compare sees, our kernels clean, an
atomic split-K kernel marked nondeterministic and not a fault.

Each case runs the command (and its reference) under the launch monitor with fingerprints on, in
fresh processes, through ``workflows.run.run_program``. The example's ``--race side-stream``
plants a consumer on a side stream that does not wait for its producer (the producer held 20 ms
on its stream): every tensor is on the launch device, so a plain run sees nothing, and the
compare against ``CUDA_LAUNCH_BLOCKING=1`` must name it. ``--race producer`` holds the producer
only: our guarded kernel is ordered after it; ``specimen:unguarded`` over two GPUs is not.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from qmoe_doctor.core.compare import RunCompare
from qmoe_doctor.core.reports import RunReport
from qmoe_doctor.workflows.run import RunOptions, run_program

pytestmark = pytest.mark.timeout(600)
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "qwen3_moe_device_map.py"
FORWARD = "_grouped_gemm_kernel"  # our forward grouped GEMM, the kernel the example's --race wraps

#: A split-K GEMM whose K slices add into the fp32 output with tl.atomic_add: the order of the
#: adds, so the rounding, changes from run to run (a legitimate nondeterminism, not a fault).
SPLIT_K = """\
import torch
import triton
import triton.language as tl


@triton.jit
def splitk_matmul(a_ptr, b_ptr, c_ptr, M, N, K, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(pid_k * BK, K, BK * SPLIT):
        rk = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        b = tl.load(b_ptr + rk[:, None] * N + rn[None, :], mask=(rk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc += tl.dot(a, b)
    tl.atomic_add(c_ptr + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


torch.manual_seed(0)
a = torch.randn(512, 4096, device="cuda")
b = torch.randn(4096, 512, device="cuda")
for _ in range(8):
    c = torch.zeros(512, 512, device="cuda")
    splitk_matmul[(8, 8, 16)](a, b, c, 512, 512, 4096, SPLIT=16, BM=64, BN=64, BK=64)
    a = a + c[:, :1] * 1e-6  # the next launch's input carries this one's rounding
torch.cuda.synchronize()
"""


def compare(tmp_path: Path, argv: list[str], reference: str, repeat: int = 1) -> RunCompare:
    report = run(tmp_path, argv, compare=reference, repeat=repeat)
    assert report.command_exit == 0, report.passes[0].end
    assert report.compare is not None
    return report.compare


def run(tmp_path: Path, argv: list[str], **options: object) -> RunReport:
    return run_program(argv, RunOptions(log_dir=tmp_path, **options), environ=dict(os.environ))  # type: ignore[arg-type]


def example(*args: str) -> list[str]:
    return [sys.executable, str(EXAMPLE), *args]


@pytest.mark.gpu
def test_blocking_names_the_side_stream_race_that_a_plain_run_cannot_see(tmp_path: Path) -> None:
    argv = example("--gpus", "0", "--race", "side-stream", "--steps", "2")
    plain = run(tmp_path / "plain", argv)
    assert plain.command_exit == 0 and plain.healthy  # every tensor on the launch device
    c = compare(tmp_path / "compare", argv, "blocking")
    d = c.divergence
    assert d is not None, c.verdict
    # the first pinned buffer a compare pass takes may wait on the device (cudaHostAlloc), so the
    # race may first show at a later launch of the kernel than its first
    assert d.launch.kernel == FORWARD
    assert d.where == "before"  # read on the side stream, its input is not written yet
    assert c.cause == "wrong-device-stream", c.explanation


@pytest.mark.gpu
def test_our_kernels_have_no_divergence_and_no_nondeterminism_of_their_own(tmp_path: Path) -> None:
    argv = example("--gpus", "0", "--steps", "2")
    blocking = compare(tmp_path / "blocking", argv, "blocking")
    assert blocking.divergence is None, blocking.verdict
    repeat = compare(tmp_path / "repeat", argv, "repeat", repeat=2)
    assert repeat.divergence is None
    assert all(p.nondeterministic_in_kernel == 0 for p in repeat.processes), repeat.verdict
    producer = compare(tmp_path / "producer", example("--gpus", "0", "--race", "producer", "--steps", "2"), "blocking")
    assert producer.divergence is None, producer.verdict  # ordered after its held producer


@pytest.mark.gpu
def test_an_atomic_split_k_kernel_is_nondeterministic_not_a_fault(tmp_path: Path) -> None:
    program = tmp_path / "splitk.py"
    program.write_text(SPLIT_K)
    repeat = compare(tmp_path / "repeat", [sys.executable, str(program)], "repeat", repeat=2)
    assert repeat.divergence is None and repeat.nondeterminism is not None, repeat.verdict
    assert repeat.nondeterminism.launch.kernel == "splitk_matmul" and repeat.nondeterminism.where == "in-kernel"
    assert repeat.processes[0].nondeterministic_in_kernel >= 1
    blocking = compare(tmp_path / "blocking", [sys.executable, str(program)], "blocking", repeat=2)
    assert blocking.divergence is None, blocking.verdict  # the same noise with every launch blocking
    assert blocking.processes[0].nondeterministic >= 1


@pytest.mark.multigpu
def test_blocking_names_the_side_stream_race_across_two_gpus(tmp_path: Path) -> None:
    c = compare(tmp_path, example("--gpus", "0,1", "--race", "side-stream", "--steps", "2"), "blocking")
    assert c.divergence is not None and c.divergence.launch.kernel == FORWARD, c.verdict
    assert c.cause == "wrong-device-stream"


@pytest.mark.multigpu
def test_a_placement_compare_names_the_unguarded_kernels_first_divergent_launch(tmp_path: Path) -> None:
    common = ("--layers", "4", "--steps", "1", "--race", "producer")
    one_gpu = " ".join([sys.executable, str(EXAMPLE), "--gpus", "0", *common, "--kernel", "specimen:unguarded"])
    c = compare(tmp_path / "unguarded", example("--gpus", "0,1", *common, "--kernel", "specimen:unguarded"), one_gpu)
    d = c.divergence
    assert d is not None, c.verdict
    assert d.launch.device == "cuda:0" and {t.device for t in d.launch.tensors} == {"cuda:1"}
    assert c.cause == "missing-device-guard"
    ours_one_gpu = " ".join([sys.executable, str(EXAMPLE), "--gpus", "0", *common])
    ours = compare(tmp_path / "ours", example("--gpus", "0,1", *common), ours_one_gpu)
    assert ours.divergence is None, ours.verdict
