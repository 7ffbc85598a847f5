"""`qmoe-doctor lint`: each rule fires on its fault and stays silent on the near-miss.

Cases are tables of small sources. A line ending in ``# FIRE`` is where the rule under test
must report; a case with no ``# FIRE`` line must stay silent for that rule. Fixture files mark
their faults with ``# FAULT: <rule>`` and are linted with every rule on.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qmoe_doctor.cli.app import app
from qmoe_doctor.core.causes import CAUSES
from qmoe_doctor.core.exitcodes import ExitCode
from qmoe_doctor.lint import (
    RULES,
    LintFinding,
    LintReport,
    Rule,
    iter_python_files,
    lint_paths,
    lint_source,
    parse_rules,
)
from qmoe_doctor.reports.json import json_document

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "lint"
HEADER = "import functools\nimport torch\nimport triton\nimport triton.language as tl\n\n"

_KERNEL = """
@triton.jit
def add_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)
"""


def _marked(source: str) -> list[int]:
    return [i for i, line in enumerate(source.splitlines(), 1) if line.rstrip().endswith("# FIRE")]


def _run(rule: Rule, body: str) -> tuple[list[int], list[int], tuple[LintFinding, ...]]:
    source = HEADER + textwrap.dedent(body)
    found = lint_source(source, "case.py", select=[rule])
    return sorted({f.line for f in found}), _marked(source), found


# --------------------------------------------------------------------------- unguarded-launch

UNGUARDED_CASES = [
    (
        "plain wrapper launches on the current device",
        _KERNEL
        + """
def add(x, y):
    add_kernel[(1,)](x, y, x.numel(), BLOCK=128)  # FIRE
""",
    ),
    (
        "near-miss: torch.cuda.device(x.device)",
        _KERNEL
        + """
def add(x, y):
    with torch.cuda.device(x.device):
        add_kernel[(1,)](x, y, x.numel(), BLOCK=128)
""",
    ),
    (
        "near-miss: torch.cuda.device_of(x), several with items",
        _KERNEL
        + """
def add(x, y):
    with torch.no_grad(), torch.cuda.device_of(x):
        add_kernel[(1,)](x, y, x.numel(), BLOCK=128)
""",
    ),
    (
        "near-miss: a project helper named *device_guard",
        _KERNEL
        + """
def add(x, y):
    with _device_guard(x.device):
        add_kernel[(1,)](x, y, x.numel(), BLOCK=128)
""",
    ),
    (
        "near-miss: set_device earlier in the function",
        _KERNEL
        + """
def add(x, y):
    torch.cuda.set_device(x.device)
    add_kernel[(1,)](x, y, x.numel(), BLOCK=128)
""",
    ),
    (
        "torch.device(...) sets the factories' default device, not the CUDA device",
        _KERNEL
        + """
def add(x, y):
    with torch.device(x.device):
        add_kernel[(1,)](x, y, x.numel(), BLOCK=128)  # FIRE
""",
    ),
    (
        "near-miss: launch helper whose every caller holds the guard (grouped_gemm.py's shape)",
        _KERNEL
        + """
def _launch(x, y):
    add_kernel[(1,)](x, y, x.numel(), BLOCK=128)

def add(x, y):
    with torch.cuda.device(x.device):
        _launch(x, y)

def add_twice(x, y):
    with torch.cuda.device(x.device):
        _launch(x, y)
        _launch(y, x)
""",
    ),
    (
        "launch helper with one unguarded caller: reported at that call",
        _KERNEL
        + """
def _launch(x, y):
    add_kernel[(1,)](x, y, x.numel(), BLOCK=128)

def add(x, y):
    with torch.cuda.device(x.device):
        _launch(x, y)

def add_fast(x, y):
    _launch(x, y)  # FIRE
""",
    ),
    (
        "autotune + heuristics + jit stack, and kernel = triton.jit(fn)",
        """
@triton.autotune(configs=[triton.Config({"BLOCK": 128})], key=["n"])
@triton.heuristics({"EVEN": lambda args: args["n"] % 128 == 0})
@triton.jit
def tuned(x_ptr, n, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    pass

def _body(x_ptr, n):
    pass

wrapped = triton.jit(_body)

def run(x):
    tuned[(1,)](x, x.numel())  # FIRE
    wrapped[(1,)](x, x.numel())  # FIRE
""",
    ),
    (
        "kernel imported from outside the linted files, by its *_kernel name",
        """
from vllm.model_executor.layers.fused_moe.fused_moe import fused_moe_kernel

def invoke(a, b, c):
    fused_moe_kernel[(4,)](a, b, c)  # FIRE
""",
    ),
    (
        "near-miss: demo under __main__ and a test function make their own tensors",
        _KERNEL
        + """
def test_add():
    x = torch.ones(8, device="cuda")
    add_kernel[(1,)](x, x, 8, BLOCK=8)

if __name__ == "__main__":
    x = torch.ones(8, device="cuda")
    add_kernel[(1,)](x, x, 8, BLOCK=8)
""",
    ),
    (
        "near-miss: subscript calls that are not Triton launches",
        """
HANDLERS = {"a": print}
kernels_by_name = {}

def dispatch(kind, x):
    HANDLERS[kind](x)
    kernels_by_name[kind](x)
""",
    ),
    (
        "near-miss: side stream of the tensors' device entered around the launch",
        _KERNEL
        + """
def add(x, y):
    side = torch.cuda.Stream(device=x.device)
    with torch.cuda.stream(side):
        add_kernel[(1,)](x, y, x.numel(), BLOCK=128)
""",
    ),
]


@pytest.mark.parametrize(("edge", "body"), UNGUARDED_CASES, ids=[c[0] for c in UNGUARDED_CASES])
def test_unguarded_launch(edge: str, body: str) -> None:
    found, expected, findings = _run(Rule.UNGUARDED_LAUNCH, body)
    assert found == expected, [f.as_line() for f in findings]
    for f in findings:
        assert f.cause == "missing-device-guard"
        assert "torch.cuda.device(" in f.fix


def test_numba_cuda_kernels_are_not_triton_launches() -> None:
    source = textwrap.dedent(
        """
        from numba import cuda

        @cuda.jit
        def scale(x):
            pass

        def run(x):
            scale[32, 128](x)
        """
    )
    assert lint_source(source) == ()


def test_torch_device_context_is_named_in_the_message() -> None:
    body = _KERNEL + "\ndef add(x, y):\n    with torch.device(x.device):\n        add_kernel[(1,)](x, y, 1)\n"
    (finding,) = lint_source(HEADER + body, select=["unguarded-launch"])
    assert "torch.device(...)" in finding.message
    assert finding.fix.startswith("with torch.cuda.device(x.device):")


# --------------------------------------------------------------------------- int32-offset

INT32_CASES = [
    (
        "program_id row times the row stride",
        """
@triton.jit
def k(x_ptr, stride_xm, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    tl.load(x_ptr + pid * stride_xm + tl.arange(0, BLOCK))  # FIRE
""",
    ),
    (
        "softmax-style row pointer bump with a *_row_stride",
        """
@triton.jit
def k(X_ptr, X_row_stride, n_cols, BLOCK: tl.constexpr):
    row_idx = tl.program_id(0)
    X_ptr += row_idx * X_row_stride  # FIRE
    tl.load(X_ptr + tl.arange(0, BLOCK), mask=tl.arange(0, BLOCK) < n_cols)
""",
    ),
    (
        "loaded expert id times the expert stride (vLLM fused_moe shape)",
        """
@triton.jit
def k(b_ptr, expert_ids_ptr, stride_be, stride_bk, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    off_experts = tl.load(expert_ids_ptr + pid_m)
    offs_k = tl.arange(0, BLOCK_K)
    b_ptrs = b_ptr + off_experts * stride_be + offs_k[:, None] * stride_bk  # FIRE
""",
    ),
    (
        "loop variable expert (range, tl.static_range) times the expert stride",
        """
@triton.jit
def k(w_ptr, E, stride_we, NUM_E: tl.constexpr):
    for e in range(E):
        tl.load(w_ptr + stride_we * e)  # FIRE
    for e2 in tl.static_range(NUM_E):
        tl.load(w_ptr + e2 * stride_we)  # FIRE
""",
    ),
    (
        "global rows times a row length K, and *= on an index",
        """
@triton.jit
def k(x_ptr, K, stride_xm, BLOCK_M: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    tl.load(x_ptr + rows[:, None] * K)  # FIRE
    off = tl.program_id(1)
    off *= stride_xm  # FIRE
""",
    ),
    (
        "index assigned in one branch only is still unsafe after the if",
        """
@triton.jit
def k(x_ptr, stride_xm, FLAG: tl.constexpr):
    row = tl.program_id(0)
    if FLAG:
        row = row.to(tl.int64)
    tl.load(x_ptr + row * stride_xm)  # FIRE
""",
    ),
    (
        "pointer documented int32/int64: a load from it may be int32",
        """
@triton.jit
def k(x_ptr, m_sizes_ptr, stride_xm):  # m_sizes_ptr: (E,) int32/int64 rows per expert
    start = tl.load(m_sizes_ptr)
    tl.load(x_ptr + start * stride_xm)  # FIRE
""",
    ),
    (
        "expert * N feeding (expert * N + n) * K: only the offset that overflows is reported",
        """
@triton.jit
def k(w_ptr, N: tl.constexpr, K: tl.constexpr, E: tl.constexpr, BLOCK_N: tl.constexpr):
    for expert_idx in tl.range(E):
        n_start = expert_idx * N
        offs_bn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        w_ptrs = w_ptr + (n_start + offs_bn[:, None]) * K  # FIRE
""",
    ),
    (
        "separated stride names: gathered token rows and expert without casts",
        """
@triton.jit
def k(x_ptr, w_ptr, gather_ptr, tile_expert_ptr, stride_x_T, stride_x_H, stride_w_E, stride_w_N,
      H_dim: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    expert_idx = tl.load(tile_expert_ptr + pid_m)
    token_idx = tl.load(gather_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    n_idx = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    for kk in tl.range(0, H_dim, BLOCK_K):
        k_idx = kk + tl.arange(0, BLOCK_K)
        tl.load(x_ptr + token_idx[:, None] * stride_x_T + k_idx[None, :] * stride_x_H)  # FIRE
        tl.load(w_ptr + expert_idx * stride_w_E + n_idx[:, None] * stride_w_N)  # FIRE
""",
    ),
    (
        "near-miss: the same kernel with the index cast where it is loaded",
        """
@triton.jit
def k(x_ptr, w_ptr, gather_ptr, tile_expert_ptr, stride_x_T, stride_x_H, stride_w_E, stride_w_N,
      H_dim: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    expert_idx = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    token_idx = tl.load(gather_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    n_idx = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    for kk in tl.range(0, H_dim, BLOCK_K):
        k_idx = kk + tl.arange(0, BLOCK_K)
        tl.load(x_ptr + token_idx[:, None] * stride_x_T + k_idx[None, :] * stride_x_H)
        tl.load(w_ptr + expert_idx * stride_w_E + n_idx[:, None] * stride_w_N)
""",
    ),
    (
        "near-miss: tile-local arange times a stride (the classic false positive)",
        """
@triton.jit
def k(x_ptr, stride_xm, stride_xk, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk)
""",
    ),
    (
        "near-miss: int64 casts where the product is formed (.to, tl.cast, cast program id)",
        """
@triton.jit
def k(x_ptr, w_ptr, ids_ptr, stride_xm, stride_we, BLOCK_M: tl.constexpr):
    pid = tl.program_id(0)
    tl.load(x_ptr + pid.to(tl.int64) * stride_xm)
    e = tl.load(ids_ptr + pid)
    tl.load(w_ptr + tl.cast(e, tl.int64) * stride_we)
    tl.load(w_ptr + e.to(tl.int64, bitcast=False) * stride_we)
    row = tl.program_id(1).to(tl.int64)
    rows = row * BLOCK_M + tl.arange(0, BLOCK_M)
    tl.load(x_ptr + rows[:, None] * stride_xm)
""",
    ),
    (
        "near-miss: stride annotated tl.int64 (every product is int64)",
        """
@triton.jit
def k(w_ptr, ids_ptr, stride_we: tl.int64):
    e = tl.load(ids_ptr + tl.program_id(0))
    tl.load(w_ptr + e * stride_we)
""",
    ),
    (
        "near-miss: column offsets and K-loop steps stay within one row of the matrix",
        """
@triton.jit
def k(a_ptr, b_ptr, y_ptr, N, K, stride_ak, stride_bn, stride_yn,
      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(1)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    tl.load(b_ptr + cols[None, :] * stride_bn)
    tl.store(y_ptr + cols * stride_yn, 0.0)
    for kk in range(0, tl.cdiv(K, BLOCK_K)):
        tl.load(a_ptr + kk * BLOCK_K * stride_ak)
""",
    ),
    (
        "near-miss: constexpr products and tile counts",
        """
@triton.jit
def k(x_ptr, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    tile = tl.program_id(0) * BLOCK_M
    num = tl.cdiv(N, BLOCK_N) * tile
    tl.load(x_ptr + BLOCK_M * BLOCK_N)
""",
    ),
    (
        "near-miss: loads from a pointer documented int64 give int64 values",
        """
@triton.jit
def k(
    x_ptr,
    bounds_ptr,  # (E + 1,) int64 row bounds
    stride_xm,
    BLOCK_M: tl.constexpr,
):
    start = tl.load(bounds_ptr + tl.program_id(0))
    rows = start + tl.arange(0, BLOCK_M)
    tl.load(x_ptr + rows[:, None] * stride_xm)
""",
    ),
    (
        "near-miss: the same arithmetic outside @triton.jit is Python ints",
        """
def host_offset(row, stride_xm):
    return row * stride_xm
""",
    ),
]


@pytest.mark.parametrize(("edge", "body"), INT32_CASES, ids=[c[0] for c in INT32_CASES])
def test_int32_offset(edge: str, body: str) -> None:
    found, expected, findings = _run(Rule.INT32_OFFSET, body)
    assert found == expected, [f.as_line() for f in findings]
    for f in findings:
        assert f.cause == "int32-offset-overflow"
        assert ".to(tl.int64) *" in f.fix


def test_int32_fix_names_the_index_and_stride() -> None:
    body = "@triton.jit\ndef k(w_ptr, ids_ptr, stride_we):\n    e = tl.load(ids_ptr)\n    tl.load(w_ptr + e * stride_we)\n"
    (finding,) = lint_source(HEADER + body, select=["int32-offset"])
    assert finding.fix.startswith("e.to(tl.int64) * stride_we")
    assert "stride_we" in finding.message and "tl.load(ids_ptr)" in finding.message


# --------------------------------------------------------------------------- cached-device-property

CACHED_CASES = [
    (
        "module-level SM count of 'cuda'",
        """
NUM_SMS = torch.cuda.get_device_properties("cuda").multi_processor_count  # FIRE
""",
    ),
    (
        "lru_cache'd function with no device argument (device 0, no argument, current_device())",
        """
@functools.lru_cache(maxsize=None)
def sms():
    return torch.cuda.get_device_properties(0).multi_processor_count  # FIRE

@functools.cache
def props():
    return torch.cuda.get_device_properties()  # FIRE

@functools.cache
def smem():
    return torch.cuda.get_device_properties(torch.cuda.current_device()).shared_memory_per_block_optin  # FIRE
""",
    ),
    (
        "stored in a module global",
        """
_SMS = None

def init():
    global _SMS
    _SMS = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count  # FIRE
""",
    ),
    (
        "near-miss: cached by device index",
        """
@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
""",
    ),
    (
        "near-miss: read fresh on every call, and a table of every device",
        """
def sms_now(x):
    return torch.cuda.get_device_properties(x.device).multi_processor_count

def sms_current():
    return torch.cuda.get_device_properties().multi_processor_count

ALL_SMS = [torch.cuda.get_device_properties(i).multi_processor_count for i in range(torch.cuda.device_count())]
""",
    ),
    (
        "near-miss: cached function that reads under its own device guard",
        """
@functools.cache
def sms(device):
    with torch.cuda.device(device):
        return torch.cuda.get_device_properties().multi_processor_count
""",
    ),
]


@pytest.mark.parametrize(("edge", "body"), CACHED_CASES, ids=[c[0] for c in CACHED_CASES])
def test_cached_device_property(edge: str, body: str) -> None:
    found, expected, findings = _run(Rule.CACHED_DEVICE_PROPERTY, body)
    assert found == expected, [f.as_line() for f in findings]
    assert all(f.cause == "per-device-state-cached" for f in findings)


# --------------------------------------------------------------------------- stream-without-device

STREAM_CASES = [
    (
        "current_stream() without a device outside a guard",
        """
def wrapper(x):
    stream = torch.cuda.current_stream()  # FIRE
    return stream
""",
    ),
    (
        "current_stream of a hard-coded device, even under a guard",
        """
def wrapper(x):
    with torch.cuda.device(x.device):
        return torch.cuda.current_stream(0)  # FIRE
""",
    ),
    (
        "near-miss: current_stream() under the guard, current_stream(x.device) anywhere",
        """
def wrapper(x):
    with torch.cuda.device(x.device):
        s = torch.cuda.current_stream()
    t = torch.cuda.current_stream(x.device)
    return s, t
""",
    ),
    (
        "default stream entered around a launch",
        _KERNEL
        + """
def add(x, y):
    with torch.cuda.stream(torch.cuda.default_stream()):  # FIRE
        add_kernel[(1,)](x, y, x.numel(), BLOCK=128)
""",
    ),
    (
        "default stream of the right device, under the guard: still the null stream",
        _KERNEL
        + """
def add(x, y):
    with torch.cuda.device(x.device):
        with _on_default(x.device):
            add_kernel[(1,)](x, y, x.numel(), BLOCK=128)

def _on_default(device):
    return torch.cuda.stream(torch.cuda.default_stream(device))  # FIRE
""",
    ),
    (
        "Stream(0) assigned, then entered around a launch",
        _KERNEL
        + """
def add(x, y):
    s = torch.cuda.Stream(0)  # FIRE
    with torch.cuda.stream(s):
        add_kernel[(1,)](x, y, x.numel(), BLOCK=128)
""",
    ),
    (
        "near-miss: side stream made for the tensors' device, or under the guard",
        _KERNEL
        + """
def add(x, y):
    side = torch.cuda.Stream(device=x.device)
    with torch.cuda.stream(side):
        add_kernel[(1,)](x, y, x.numel(), BLOCK=128)
    with torch.cuda.device(x.device):
        other = torch.cuda.Stream()
        with torch.cuda.stream(other):
            add_kernel[(1,)](x, y, x.numel(), BLOCK=128)
""",
    ),
    (
        "near-miss: default stream used for a sync, not a launch",
        """
def wait_all(x):
    torch.cuda.default_stream(x.device).synchronize()
""",
    ),
]


@pytest.mark.parametrize(("edge", "body"), STREAM_CASES, ids=[c[0] for c in STREAM_CASES])
def test_stream_without_device(edge: str, body: str) -> None:
    found, expected, findings = _run(Rule.STREAM_WITHOUT_DEVICE, body)
    assert found == expected, [f.as_line() for f in findings]
    assert all(f.cause == "wrong-device-stream" for f in findings)


# --------------------------------------------------------------------------- default-device-alloc

ALLOC_CASES = [
    (
        'device="cuda", "cuda:0", torch.device("cuda") and .cuda() in a launching wrapper',
        _KERNEL
        + """
def add(x, y):
    out = torch.empty(x.numel(), device="cuda")  # FIRE
    tmp = torch.zeros(4, device="cuda:0")  # FIRE
    idx = torch.arange(4, device=torch.device("cuda"))  # FIRE
    cnt = torch.zeros(4, dtype=torch.int32).cuda()  # FIRE
    with torch.cuda.device(x.device):
        add_kernel[(1,)](x, out, x.numel(), BLOCK=128)
    return out, tmp, idx, cnt
""",
    ),
    (
        "tensor-annotated wrapper, device type only, module constant",
        """
DEVICE = "cuda"

def route(x: torch.Tensor, e: int) -> torch.Tensor:
    counts = torch.zeros(e, device=x.device.type)  # FIRE
    offsets = torch.empty(e + 1, device=DEVICE)  # FIRE
    moved = x.to("cuda")  # FIRE
    return counts, offsets, moved
""",
    ),
    (
        "near-miss: x.device, a device parameter, *_like, .to(x.device)",
        """
def route(x: torch.Tensor, e: int, device: torch.device) -> torch.Tensor:
    counts = torch.zeros(e, device=x.device)
    buf = torch.empty(e, device=device)
    like = torch.empty_like(x)
    moved = torch.ones(e).to(x.device)
    return counts, buf, like, moved
""",
    ),
    (
        'near-miss: device="cuda" under the guard is the guarded device',
        _KERNEL
        + """
def add(x, y):
    with torch.cuda.device(x.device):
        out = torch.empty(x.numel(), device="cuda")
        add_kernel[(1,)](x, out, x.numel(), BLOCK=128)
    return out
""",
    ),
    (
        "near-miss: input makers and tests create tensors on the current device on purpose",
        """
def make_inputs(m, k):
    return torch.randn(m, k, device="cuda")

def test_something(x: torch.Tensor):
    y = torch.empty(4, device="cuda")
""",
    ),
]


@pytest.mark.parametrize(("edge", "body"), ALLOC_CASES, ids=[c[0] for c in ALLOC_CASES])
def test_default_device_alloc(edge: str, body: str) -> None:
    found, expected, findings = _run(Rule.DEFAULT_DEVICE_ALLOC, body)
    assert found == expected, [f.as_line() for f in findings]
    for f in findings:
        assert f.cause == "default-device-buffer"
        assert ".device" in f.fix


# --------------------------------------------------------------------------- autotune-inplace

_TWO = '[triton.Config({"BLOCK": 128}), triton.Config({"BLOCK": 256})]'
AUTOTUNE_CASES = [
    (
        "in-place scale over two configs",
        f"""
@triton.autotune(configs={_TWO}, key=["n"])  # FIRE
@triton.jit
def scale_(x_ptr, s, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(x_ptr + offs, x * s, mask=offs < n)
""",
    ),
    (
        "atomic accumulation, configs computed by a function",
        """
@triton.autotune(configs=get_configs(), key=["n"])  # FIRE
@triton.jit
def combine(out_ptr, src_ptr, idx_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.atomic_add(out_ptr + tl.load(idx_ptr + offs), tl.load(src_ptr + offs))
""",
    ),
    (
        "accumulate into y through a pointer variable, configs in a module list",
        """
CONFIGS = [triton.Config({"BLOCK": b}) for b in (64, 128)]
LIST3 = [triton.Config({"BLOCK": 64}), triton.Config({"BLOCK": 128}), triton.Config({"BLOCK": 256})]

@triton.autotune(configs=LIST3, key=["n"])  # FIRE
@triton.jit
def acc(y_ptr, x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    y_ptrs = y_ptr + offs
    tl.store(y_ptrs, tl.load(y_ptrs) + tl.load(x_ptr + offs))
""",
    ),
    (
        "near-miss: restore_value / reset_to_zero given",
        f"""
@triton.autotune(configs={_TWO}, key=["n"], restore_value=["x_ptr"])
@triton.jit
def scale_(x_ptr, s, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) * s)

@triton.autotune(configs={_TWO}, key=["n"], reset_to_zero=["out_ptr"])
@triton.jit
def combine(out_ptr, src_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.atomic_add(out_ptr + offs, tl.load(src_ptr + offs))
""",
    ),
    (
        "near-miss: a single config is never re-run",
        """
@triton.autotune(configs=[triton.Config({"BLOCK": 128})], key=["n"])
@triton.jit
def scale_(x_ptr, s, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) * s)
""",
    ),
    (
        "near-miss: out-of-place kernel over many configs (shared offsets and sizes)",
        """
@triton.autotune(configs=get_configs(), key=["n"])
@triton.jit
def copy(x_ptr, y_ptr, n, start, stride, BLOCK: tl.constexpr):
    offs = start + tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs * stride, tl.load(x_ptr + offs * stride, mask=mask), mask=mask)
""",
    ),
    (
        "near-miss: in-place but not autotuned",
        """
@triton.jit
def scale_(x_ptr, s, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) * s)
""",
    ),
]


@pytest.mark.parametrize(("edge", "body"), AUTOTUNE_CASES, ids=[c[0] for c in AUTOTUNE_CASES])
def test_autotune_inplace(edge: str, body: str) -> None:
    found, expected, findings = _run(Rule.AUTOTUNE_INPLACE, body)
    assert found == expected, [f.as_line() for f in findings]
    for f in findings:
        assert f.cause == "autotune-inplace-rerun"
        assert "restore_value" in f.fix


# --------------------------------------------------------------------------- real files

FAULT_MARK = re.compile(r"#\s*FAULT:\s*([a-z0-9, -]+)")


def _expected_faults(path: Path) -> set[tuple[int, str]]:
    out = set()
    for i, line in enumerate(path.read_text().splitlines(), 1):
        hit = FAULT_MARK.search(line)
        if hit and not line.lstrip().startswith(("#", '"', "with a")):
            out |= {(i, rule.strip()) for rule in hit.group(1).split(",") if rule.strip()}
    return out


@pytest.mark.parametrize("name", ["public_grouped_gemm.py", "moe_combine_autotune.py"])
def test_public_style_fixtures_fire_the_right_rules_on_the_right_lines(name: str) -> None:
    path = FIXTURES / name
    report = lint_paths([path])
    assert report.errors == ()
    found = {(f.line, f.rule.value) for f in report.findings}
    assert found == _expected_faults(path), [f.as_line() for f in report.findings]


def test_fixed_twin_of_the_public_kernel_is_clean() -> None:
    report = lint_paths([FIXTURES / "fixed_grouped_gemm.py"])
    assert report.clean, [f.as_line() for f in report.findings]


def test_our_grouped_gemm_is_clean() -> None:
    report = lint_paths([REPO / "kernels" / "grouped_gemm.py"])
    assert report.errors == ()
    assert report.findings == (), [f.as_line() for f in report.findings]
    assert len(report.files) == 1 and report.rules == tuple(Rule)


# The calibration specimens (kernels/specimens/): each plants one cause; the lint must name
# exactly that one, linted alone (imports resolved by reading, never importing, the kernel).
SPECIMEN_RULES = [
    ("unguarded.py", Rule.UNGUARDED_LAUNCH),
    ("int32_offsets.py", Rule.INT32_OFFSET),
    ("default_buffer.py", Rule.DEFAULT_DEVICE_ALLOC),
    ("wrong_stream.py", Rule.STREAM_WITHOUT_DEVICE),
    ("autotune_inplace.py", Rule.AUTOTUNE_INPLACE),
    ("cached_sms.py", Rule.CACHED_DEVICE_PROPERTY),  # its planted SM count, read once from the current device
    ("gather_sms_device0.py", Rule.CACHED_DEVICE_PROPERTY),  # the SM count of device 0, hard-coded
    # a gathered token id times a row stride, in int32: once for the output row, once for the input row
    ("sorted_int32_token.py", Rule.INT32_OFFSET),
    ("sorted_int32_token.py", Rule.INT32_OFFSET),
]
# The other specimens must stay silent: running_row_mask, unmasked_rows, tma_unmasked_rows,
# global_expert_ids, rank_no_set_device and tma_misaligned plant causes no source rule sees (row
# masks, expert ids, a rank's current device, an operand's alignment: the scan's and the parallel
# modes' cells find them), and so do the routed specimens but the two above (ids past E, -1 ids,
# map entries, padded counts: the routed cells find them); contiguous_only, autotuned,
# tma_persistent, sorted_ids and gather_scatter are correct kernels (an assert contract; an
# autotune whose kernel only stores; device-side TMA descriptors whose launch, grid and scratch
# all take x's device; the routed twins, whose launch helper takes its kernel as a parameter).


@pytest.mark.parametrize("name", sorted({name for name, _ in SPECIMEN_RULES}))
def test_each_specimen_fires_exactly_its_rule(name: str) -> None:
    report = lint_paths([REPO / "kernels" / "specimens" / name])
    expected = [rule for n, rule in SPECIMEN_RULES if n == name]
    assert [f.rule for f in report.findings] == expected, [f.as_line() for f in report.findings]


def test_kernels_package_only_the_specimens_fire() -> None:
    """Linted as one project, our kernels are clean and every specimen names its own rule:
    specimens reuse the public function names, so callers must be resolved through imports."""
    report = lint_paths([REPO / "kernels"])
    assert report.errors == ()
    found = sorted((Path(f.path).name, f.rule) for f in report.findings)
    assert found == sorted(SPECIMEN_RULES), [f.as_line() for f in report.findings]


# --------------------------------------------------------------------------- files, imports, errors


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))


_PKG_KERNELS = """
import triton
import triton.language as tl

@triton.jit
def scale_kernel(x_ptr, stride_xm):
    row = tl.program_id(0)
    tl.load(x_ptr + row * stride_xm)
"""
_PKG_WRAPPER = """
import torch
from pkg.kernels import scale_kernel
from . import kernels as kmod

def scale(x):
    scale_kernel[(1,)](x, x.stride(0))
    kmod.scale_kernel[(1,)](x, x.stride(0))
"""


def test_directory_walk_skips_hidden_caches_and_virtualenvs(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "a.py": "x = 1\n",
            "sub/b.py": "y = 2\n",
            "sub/notes.txt": "not python\n",
            ".hidden/c.py": "z = 3\n",
            "__pycache__/d.py": "z = 4\n",
            "venv/lib/e.py": "z = 5\n",
            "venv/pyvenv.cfg": "home = /usr\n",
        },
    )
    names = [p.relative_to(tmp_path).as_posix() for p in iter_python_files(tmp_path)]
    assert names == ["a.py", "sub/b.py"]
    report = lint_paths([tmp_path])
    assert report.clean and len(report.files) == 2


def test_kernels_imported_across_files_of_one_run(tmp_path: Path) -> None:
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/kernels.py": _PKG_KERNELS, "pkg/ops.py": _PKG_WRAPPER})
    report = lint_paths([tmp_path / "pkg"])
    found = sorted((Path(f.path).name, f.line, f.rule.value) for f in report.findings)
    assert found == [
        ("kernels.py", 8, "int32-offset"),
        ("ops.py", 7, "unguarded-launch"),
        ("ops.py", 8, "unguarded-launch"),
    ]


_LAUNCH_HELPER = """
import triton

def launch(kernel, x):
    kernel[(1,)](x)
"""
_PLAN_CALLER = """
import torch
from pkg import helper

class Plan:
    def __init__(self, launch):
        self.launch = launch

    def run(self, x):
        self.launch(x)  # an attribute of the plan: not helper.launch

def by_module(x):
    with torch.cuda.device(x.device):
        helper.launch(None, x)
"""


def test_an_objects_attribute_is_not_a_module_function_of_its_name(tmp_path: Path) -> None:
    """``self.launch(x)`` calls what the object holds; only ``helper.launch(...)`` (through the
    import) reaches the module's function, and that call is guarded: nothing to report but the
    helper's own launch, whose every caller is guarded."""
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/helper.py": _LAUNCH_HELPER, "pkg/plan.py": _PLAN_CALLER})
    report = lint_paths([tmp_path / "pkg"])
    assert report.findings == (), [f.as_line() for f in report.findings]
    # the same helper called unguarded through its module is still followed to the caller
    (tmp_path / "pkg" / "plan.py").write_text(_PLAN_CALLER.replace("        helper.launch", "    helper.launch").replace(
        "    with torch.cuda.device(x.device):\n", ""))
    report = lint_paths([tmp_path / "pkg"])
    assert [(Path(f.path).name, f.rule.value) for f in report.findings] == [("plan.py", "unguarded-launch")]


def test_imported_files_are_read_for_context_but_not_reported(tmp_path: Path) -> None:
    _write(tmp_path, {"pkg/__init__.py": "", "pkg/kernels.py": _PKG_KERNELS, "pkg/ops.py": _PKG_WRAPPER})
    report = lint_paths([tmp_path / "pkg" / "ops.py"])
    assert report.files == ((tmp_path / "pkg" / "ops.py").as_posix(),)
    assert {(Path(f.path).name, f.rule.value) for f in report.findings} == {("ops.py", "unguarded-launch")}


def test_sources_are_never_executed(tmp_path: Path) -> None:
    sentinel = tmp_path / "executed"
    _write(tmp_path, {"boom.py": f"open({str(sentinel)!r}, 'w').write('x')\nraise SystemExit(3)\n"})
    report = lint_paths([tmp_path / "boom.py"])
    assert report.clean
    assert not sentinel.exists()


def test_linting_never_imports_torch_or_triton() -> None:
    code = (
        "import sys\n"
        "import qmoe_doctor.cli.app\n"
        "from qmoe_doctor.lint import lint_paths\n"
        "assert lint_paths(['kernels']).findings\n"
        "assert 'torch' not in sys.modules and 'triton' not in sys.modules, 'imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


def test_syntax_error_and_missing_path_are_errors_and_the_rest_is_linted(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "broken.py": "def f(:\n    pass\n",
            "ok.py": HEADER + _KERNEL + "\ndef add(x, y):\n    add_kernel[(1,)](x, y, 1)\n",
        },
    )
    report = lint_paths([tmp_path, tmp_path / "absent.py"])
    kinds = sorted((Path(e.path).name, e.kind) for e in report.errors)
    assert kinds == [("absent.py", "missing"), ("broken.py", "syntax")]
    syntax = next(e for e in report.errors if e.kind == "syntax")
    assert syntax.line == 1 and "syntax error" in syntax.message and syntax.source == "def f(:"
    assert [f.rule for f in report.findings] == [Rule.UNGUARDED_LAUNCH]
    with pytest.raises(SyntaxError):
        lint_source("def f(:\n")


def test_select_ignore_and_unknown_rules() -> None:
    path = FIXTURES / "public_grouped_gemm.py"
    only = lint_paths([path], select=["int32-offset"])
    assert only.rules == (Rule.INT32_OFFSET,) and {f.rule for f in only.findings} == {Rule.INT32_OFFSET}
    rest = lint_paths([path], ignore=["int32-offset,unguarded-launch"])
    assert Rule.INT32_OFFSET not in {f.rule for f in rest.findings}
    assert Rule.UNGUARDED_LAUNCH not in rest.rules
    assert parse_rules(None) is None
    with pytest.raises(ValueError, match="unknown lint rule 'bogus'"):
        lint_paths([path], select=["bogus"])


def test_ignore_comment_silences_one_rule_on_one_line() -> None:
    body = _KERNEL + (
        "\ndef add(x, y):\n"
        "    add_kernel[(1,)](x, y, 1)  # qmoe-doctor: ignore[unguarded-launch]\n"
        "    add_kernel[(1,)](x, y, 1)  # qmoe-doctor: ignore[int32-offset]\n"
        "    add_kernel[(1,)](x, y, 1)  # qmoe-doctor: ignore\n"
    )
    source = HEADER + body
    found = lint_source(source)
    assert [f.source for f in found] == ["add_kernel[(1,)](x, y, 1)  # qmoe-doctor: ignore[int32-offset]"]


def test_rules_name_known_causes_and_findings_are_frozen_records() -> None:
    assert set(RULES) == set(Rule)
    assert all(info.cause in CAUSES for info in RULES.values())
    (finding, *_) = lint_paths([FIXTURES / "public_grouped_gemm.py"]).findings
    with pytest.raises(FrozenInstanceError):
        finding.line = 3  # type: ignore[misc]
    doc = json.loads(
        json.dumps(json_document("lint", LintReport(paths=("a",), files=(), rules=(), findings=(finding,))))
    )
    assert doc["kind"] == "lint" and doc["findings"][0]["rule"] == finding.rule.value
    assert finding.as_line().startswith(f"{finding.path}:{finding.line}:{finding.col}: {finding.rule} [")


# --------------------------------------------------------------------------- the command


def _cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["lint", *args])
    return result.exit_code, result.stdout, result.stderr


def test_cli_clean_file_exits_0() -> None:
    code, out, _ = _cli(str(REPO / "kernels" / "grouped_gemm.py"))
    assert code == ExitCode.HEALTHY
    assert "No findings in 1 file" in out


def test_cli_a_file_not_linted_is_counted_in_the_summary(tmp_path: Path) -> None:
    """One clean file and one that does not parse: no finding, but not clean either (exit 2),
    and the summary line says a file was not linted."""
    (tmp_path / "ok.py").write_text("x = 1\n")
    (tmp_path / "broken.py").write_text("def (:\n")
    code, out, err = _cli(str(tmp_path))
    assert code == 2, out + err
    assert "No findings in 1 file" in out and "; 1 file not linted." in out
    assert "broken.py" in err


def test_cli_findings_exit_1_with_table_and_fixes() -> None:
    code, out, _ = _cli(str(FIXTURES / "public_grouped_gemm.py"))
    assert code == ExitCode.FAULT
    for text in ("unguarded-launch", "missing-device-guard", "fix:", "8 findings"):
        assert text in out


def test_cli_plain_lines() -> None:
    path = FIXTURES / "public_grouped_gemm.py"
    (line,) = [n for n, rule in _expected_faults(path) if rule == "unguarded-launch"]
    code, out, _ = _cli("--plain", "--select", "unguarded-launch", str(path))
    assert code == ExitCode.FAULT
    assert out.splitlines()[0] == (
        f"{path}:{line}:5: unguarded-launch [missing-device-guard] Triton launch of "
        "`_grouped_gemm_fwd_kernel` is not inside a device guard: it runs on the current CUDA device "
        "and that device's stream, not on the device of its tensors; no caller of "
        "`grouped_gemm_forward` in the linted files holds one"
    )
    assert out.splitlines()[1] == "1 finding in 1 of 1 file (unguarded-launch 1)."


def test_cli_json_parses() -> None:
    code, out, _ = _cli("--json", "--ignore", "int32-offset", str(FIXTURES))
    assert code == ExitCode.FAULT
    doc = json.loads(out)
    assert doc["kind"] == "lint" and doc["schema_version"] >= 1
    assert "int32-offset" not in doc["rules"] and doc["errors"] == []
    assert {f["rule"] for f in doc["findings"]} >= {"unguarded-launch", "autotune-inplace"}
    first = doc["findings"][0]
    assert set(first) >= {"path", "line", "col", "rule", "cause", "message", "fix"}


def test_cli_missing_path_and_syntax_error_exit_2(tmp_path: Path) -> None:
    code, _, err = _cli(str(tmp_path / "nope.py"))
    assert code == ExitCode.USAGE
    assert "nope.py: no such file or directory" in err
    bad = tmp_path / "bad.py"
    bad.write_text("x = 1\ndef f(:\n")
    code, out, err = _cli("--json", str(bad))
    assert code == ExitCode.USAGE
    assert f"{bad.as_posix()}:2:" in err and "syntax error" in err
    assert json.loads(out)["errors"][0]["line"] == 2


def test_cli_unknown_rule_exits_2() -> None:
    code, _, err = _cli("--select", "bogus", str(FIXTURES))
    assert code == ExitCode.USAGE
    assert "unknown lint rule 'bogus'" in err
