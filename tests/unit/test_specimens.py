"""The specimens (kernels that each plant one thing: a cause, or a public kernel's trait) on the CPU tier.

What the CPU can show: each specimen is right in the benign condition (one device, valid
routing, a cached autotune config) and the faults that need no second GPU: unmasked_rows
reading and writing past x and y when m_sizes sums past M, int32_offsets reading the wrong
weights at expert 69 of a 5120x6144 stack, autotune_inplace wrong on the first call only.
The placement specimens (unguarded, default_buffer, wrong_stream) only misbehave with two GPUs
or CUDA streams: tests/gpu/test_specimens_gpu.py. The specimens in the public kernels' style:
running_row_mask writes past its own y when over-routed, contiguous_only refuses strided inputs
with an assert, autotuned autotunes over 1,000 configs and is right, cached_sms is right on every
device (lint names its cause); their verdicts through the CLI: tests/unit/test_real_kernels.py.

Kernels run under TRITON_INTERPRET=1 with CPU tensors (conftest sets it without a GPU); on a
GPU machine the in-process cases run on cuda:0 and the subprocess cases still on the CPU.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import json
import os
import subprocess
import sys
import textwrap
from types import ModuleType
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from qmoe_doctor.cli.app import app
from qmoe_doctor.core.causes import CAUSES
from qmoe_doctor.core.lint_findings import Rule
from qmoe_doctor.core.records import Condition
from qmoe_doctor.core.specimens import SPECIMEN_PACKAGE, SPECIMENS, faulty_specimens, get_specimen, kernel_ref
from qmoe_doctor.core.tolerances import tolerance
from qmoe_doctor.kernels import grouped_gemm
from qmoe_doctor.kernels.grouped_gemm import interpreting, moe_grouped_gemm_torch
from qmoe_doctor.plan.scan import OFFSET_SWEEP

NAMES = [s.name for s in SPECIMENS]
#: The specimens of the m_sizes protocol, fn(x, w, m_sizes); the routed ones (fn(hidden_states, w,
#: topk_ids, topk_weights, expert_map=None)) have their own tests: tests/unit/test_routed.py.
M_SIZES_NAMES = [s.name for s in SPECIMENS if s.protocol == "m_sizes"]
ROUTED_NAMES = [s.name for s in SPECIMENS if s.protocol != "m_sizes"]

# ||out - ref|| / ||ref|| against the float32 twin, from the project's one table (float32 runs
# as tf32 on a GPU); no bfloat16 here: its tl.dot is broken in the interpreter (FINDINGS.md)
TOLERANCE = {dtype: tolerance(str(dtype)) for dtype in (torch.float32, torch.float16)}


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"{SPECIMEN_PACKAGE}.{get_specimen(name).module}")


def _device() -> torch.device:
    if interpreting():
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    pytest.skip("neither TRITON_INTERPRET=1 nor a CUDA device")


def _rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def _child_env() -> dict[str, str]:
    """A child that runs the interpreter on CPU tensors, whatever this machine has."""
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _run_child(script: str, *args: str, timeout: float = 240.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_child_env(),
        check=False,
    )


def _json_lines(stdout: str) -> list[str]:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert lines, f"child wrote no JSON line; stdout:\n{stdout}"
    return lines


def _last_json(stdout: str) -> dict[str, Any]:
    return json.loads(_json_lines(stdout)[-1])


# --------------------------------------------------------------------------------------------
# Registry <-> modules
# --------------------------------------------------------------------------------------------


def test_registry_names_and_causes_are_unique_and_known() -> None:
    assert len(set(NAMES)) == len(NAMES)
    assert len({s.module for s in SPECIMENS}) == len(SPECIMENS)
    for spec in SPECIMENS:
        assert all(isinstance(c, Condition) for c in spec.misbehaves_under)
        assert set(spec.rejected_under) <= set(OFFSET_SWEEP), spec
        if spec.cause is None:  # a correct kernel in a public style: nothing may fail
            assert spec.misbehaves_under == () and spec.lint_rule is None, spec
            continue
        assert spec.cause in CAUSES, spec
        # some scan cell sees it fail, or (no cell can on identical GPUs) a lint rule names it
        assert spec.misbehaves_under or spec.lint_rule, spec
        if spec.lint_rule is not None:
            assert Rule(spec.lint_rule).value == spec.lint_rule
        assert Condition.SINGLE not in spec.misbehaves_under  # the benign baseline
        assert Condition.GUARDED not in spec.misbehaves_under
    assert {s.name for s in faulty_specimens()} == {s.name for s in SPECIMENS if s.cause is not None}
    assert {s.name for s in SPECIMENS if s.cause is None} == {
        "contiguous_only",
        "autotuned",
        "tma_persistent",
        "sorted_ids",
        "gather_scatter",
    }


def test_get_specimen_and_kernel_ref() -> None:
    assert get_specimen("unguarded").cause == "missing-device-guard"
    assert kernel_ref("unguarded") == "qmoe_doctor.kernels.specimens.unguarded:moe_grouped_gemm"
    assert get_specimen("int32_offsets").kernel_option == "specimen:int32_offsets"
    with pytest.raises(KeyError) as info:
        get_specimen("nope")
    for name in NAMES:  # the error lists what exists
        assert name in str(info.value)


def test_every_specimen_module_is_registered() -> None:
    package = importlib.import_module(SPECIMEN_PACKAGE)
    files = {
        f.removesuffix(".py")
        for f in os.listdir(os.path.dirname(package.__file__ or ""))
        if f.endswith(".py") and not f.startswith("_")
    }
    assert files == {s.module for s in SPECIMENS}


@pytest.mark.parametrize("name", NAMES)
def test_module_docstring_names_exactly_its_cause(name: str) -> None:
    spec = get_specimen(name)
    doc = _module(name).__doc__ or ""
    named = {cause_id for cause_id in CAUSES if cause_id in doc}
    if spec.cause is None:
        assert named == set(), f"{name} is correct; its docstring names {sorted(named)}"
        assert "never misbehaves" in doc and "plants no cause" in doc
        return
    assert named == {spec.cause}, f"{name} docstring names {sorted(named)}"
    assert "misbehaves" in doc  # and says under which condition


@pytest.mark.parametrize("name", ROUTED_NAMES)
def test_routed_entry_point_has_its_twin_s_signature(name: str) -> None:
    """A routed specimen takes the router's ids, exactly as its style's correct twin does, and
    exposes that twin's kind of routing step (fn.route and routing=)."""
    from qmoe_doctor.kernels.specimens import gather_scatter, sorted_ids

    module, function = kernel_ref(name).split(":")
    fn = getattr(importlib.import_module(module), function)
    twin = sorted_ids.fused_moe if function == "fused_moe" else gather_scatter.ragged_moe
    assert inspect.signature(fn) == inspect.signature(twin)
    assert [p.name for p in inspect.signature(fn).parameters.values()][:5] == [
        "hidden_states",
        "w",
        "topk_ids",
        "topk_weights",
        "expert_map",
    ]
    assert callable(fn.route)
    assert get_specimen(name).protocol == ("routed-rows" if function == "fused_moe" else "routed")


@pytest.mark.parametrize("name", M_SIZES_NAMES)
def test_entry_point_has_the_grouped_gemm_signature(name: str) -> None:
    module, function = kernel_ref(name).split(":")
    fn = getattr(importlib.import_module(module), function)
    params = list(inspect.signature(fn).parameters.values())
    assert [(p.name, p.kind) for p in params] == [
        ("x", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("w", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("m_sizes", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("out_dtype", inspect.Parameter.KEYWORD_ONLY),
    ]
    assert params[3].default is None
    correct = inspect.signature(grouped_gemm.moe_grouped_gemm).parameters
    for p in params:  # the same parameters as the correct kernel, which only adds options
        assert correct[p.name].kind == p.kind and correct[p.name].default == p.default


@pytest.mark.parametrize("name", NAMES)
def test_the_planted_change_is_marked(name: str) -> None:
    assert "# PLANTED:" in inspect.getsource(_module(name))


def _code_lines(kernel: Any) -> list[str]:
    """Source lines of a (jit / autotuned) kernel without comments, blanks and its name."""
    while hasattr(kernel, "fn"):
        kernel = kernel.fn
    lines = []
    for line in inspect.getsource(kernel).splitlines():
        code = line.split("#", 1)[0].strip()  # kernels hold no '#' inside strings
        if code.startswith("def "):
            code = "def KERNEL("
        if code:
            lines.append(code)
    return lines


# Specimens whose fault is inside the @triton.jit body: a copy of the correct kernel (ours, or
# the correct twin of its design) with at most this many code lines changed (either side).
COPIED_KERNELS = [
    ("sorted_minus_one", "_sorted_moe_kernel_minus_one", 4, "sorted_ids"),  # the expert -1 branch
    ("sorted_int32_token", "_sorted_moe_kernel_int32", 1, "sorted_ids"),  # the int64 cast
    ("gather_past_t", "_ragged_kernel_past_t", 1, "gather_scatter"),  # the slot mask
    ("int32_offsets", "_grouped_gemm_kernel_int32", 1, None),  # the w_ptrs offset
    ("unmasked_rows", "_grouped_gemm_kernel_unmasked", 1, None),  # the m_size clamp
    ("autotune_inplace", "_grouped_gemm_kernel_acc", 2, None),  # the decorator, acc from y
    ("tma_unmasked_rows", "_grouped_gemm_tma_kernel_unmasked", 1, "tma_persistent"),  # the m_size clamp
]


@pytest.mark.parametrize(("name", "kernel_name", "max_changed", "twin"), COPIED_KERNELS)
def test_copied_kernel_is_a_small_diff(name: str, kernel_name: str, max_changed: int, twin: str | None) -> None:
    correct = (
        grouped_gemm._grouped_gemm_kernel
        if twin is None
        else getattr(
            _module(twin),
            {"tma_persistent": "_grouped_gemm_tma_kernel", "sorted_ids": "_sorted_moe_kernel"}.get(
                twin, "_ragged_kernel"
            ),
        )
    )
    ours = _code_lines(correct)
    theirs = _code_lines(getattr(_module(name), kernel_name))
    changed = [
        line
        for line in difflib.unified_diff(ours, theirs, lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    assert changed, f"{name}: the copied kernel is identical to the correct one"
    removed = [c for c in changed if c.startswith("-")]
    added = [c for c in changed if c.startswith("+")]
    assert max(len(removed), len(added)) <= max_changed, changed


# --------------------------------------------------------------------------------------------
# Benign condition: every specimen is right (so it misbehaves only under its condition)
# --------------------------------------------------------------------------------------------

# (M, [m_sizes], N, K, what the row covers); E = len(m_sizes)
BENIGN_CASES = [
    (40, [10, 0, 30], 36, 48, "an empty expert, partial row and column tiles"),
    (37, [5, 13, 2, 17], 19, 23, "prime sizes, partial K tiles"),
    (24, [0, 0, 24], 16, 32, "a single hot expert, the last one"),
    (30, [4, 6, 0], 20, 16, "m_sizes sums below M: uncovered rows are zero"),
]


def _operands(
    m: int, sizes: list[int], n: int, k: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(m * 1000 + n)
    # x as a row slice with a storage offset, w as a strided view (not contiguous in K's owner)
    x_big = torch.randn(m + 3, k, generator=gen)
    w_big = torch.randn(len(sizes), n, k + 5, generator=gen)
    x = x_big.to(device, dtype)[2 : 2 + m]
    w = w_big.to(device, dtype)[:, :, 3 : 3 + k]
    m_sizes = torch.tensor(sizes, dtype=torch.int32, device=device)
    return x, w, m_sizes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", BENIGN_CASES, ids=[c[-1] for c in BENIGN_CASES])
@pytest.mark.parametrize("name", M_SIZES_NAMES)
def test_specimen_is_right_in_the_benign_condition(
    name: str, case: tuple[int, list[int], int, int, str], dtype: torch.dtype
) -> None:
    m, sizes, n, k, _ = case
    device = _device()
    x, w, m_sizes = _operands(m, sizes, n, k, dtype, device)
    if get_specimen(name).rejected_under:  # its contract: contiguous inputs (refusals: below)
        x, w = x.contiguous(), w.contiguous()
    if name in TRUSTS_X_ALIGNED:  # benign: x as a TMA descriptor needs it (the fault: below)
        x = _aligned(x)
    ref = moe_grouped_gemm_torch(x, w, m_sizes, out_dtype=torch.float32)
    tri_fn = _module(name).moe_grouped_gemm
    if name == "autotune_inplace":
        tri_fn(x, w, m_sizes)  # the benign condition is a cached config: warm the key first
    tri = tri_fn(x, w, m_sizes)
    assert tri.device == x.device and tri.dtype == dtype and tri.shape == (m, n)
    if name in LEAVES_UNCOVERED_ROWS:  # rows no expert covers are left as torch.empty made them
        covered = sum(sizes)
        tri, ref = tri[:covered], ref[:covered]
    assert _rel_error(tri, ref) <= TOLERANCE[dtype], name


#: Specimens in the public style that write only the rows the routing covers (their callers
#: route every row; the probes always do).
LEAVES_UNCOVERED_ROWS = {"running_row_mask", "tma_persistent", "tma_unmasked_rows", "tma_misaligned"}
#: Specimens that hand x to a TMA descriptor unchecked: their benign condition is an x whose base
#: and row pitch are multiples of 16 bytes.
TRUSTS_X_ALIGNED = {"tma_misaligned"}


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """The values of 2-D ``t`` in a fresh buffer whose rows start every 16 bytes."""
    rows, cols = t.shape
    per_16_bytes = 16 // t.element_size()
    pitch = -(-cols // per_16_bytes) * per_16_bytes
    out = torch.empty_strided((rows, cols), (pitch, 1), dtype=t.dtype, device=t.device).copy_(t)
    assert out.data_ptr() % 16 == 0
    return out


@pytest.mark.parametrize(
    ("variant", "operand"), [("padded-rows", "x"), ("transposed-w", "w")], ids=["padded-rows", "transposed-w"]
)
def test_contiguous_only_refuses_strided_inputs_before_launch(variant: str, operand: str) -> None:
    device = _device()
    x, w, m_sizes = _operands(40, [10, 0, 30], 36, 48, torch.float32, device)
    x, w = x.contiguous(), w.contiguous()
    if operand == "x":
        x = torch.cat([x, x[:, :24]], dim=1)[:, :48]  # a row-padded view
    else:
        w = w.transpose(1, 2).contiguous().transpose(1, 2)
    assert variant in get_specimen("contiguous_only").rejected_under
    with pytest.raises(AssertionError):
        _module("contiguous_only").moe_grouped_gemm(x, w, m_sizes)


def test_autotuned_spans_a_public_sized_config_space_pruned_per_call() -> None:
    module = _module("autotuned")
    configs = module._configs()
    assert len(configs) == 1000 and len({str(c) for c in configs}) == 1000
    assert module._tile(configs[0]) == module._DEFAULT  # the hand-picked default first
    x = torch.empty(40, 48)
    kept = module._prune(configs, {"x_ptr": x, "M": 40, "N": 36, "K": 48})
    assert 1 <= len(kept) <= 2 if interpreting() else len(kept) < len(configs)


# --------------------------------------------------------------------------------------------
# Faults the CPU can show
# --------------------------------------------------------------------------------------------

# m_sizes sums past M. x is a view into a buffer whose trailing rows are a canary (2.0); y is
# poisoned and padded the same way (the wrapper's torch.empty((M, N)) is handed a view into a
# NaN buffer) so a write past y lands in rows we own and can read back, not in random heap.
_OVER_ROUTED_CHILD = """
    import importlib, json, sys
    import torch
    from qmoe_doctor.kernels.grouped_gemm import moe_grouped_gemm_torch

    M, N, K, PAD = 24, 20, 16, 16
    sizes = [8, 8, 8 + 10]  # sums to M + 10: ten rows past the end of x
    gen = torch.Generator().manual_seed(0)
    x_buf = torch.full((M + PAD, K), 2.0)  # rows M.. are the canary
    x_buf[:M] = torch.randn(M, K, generator=gen)
    x = x_buf[:M]
    w = torch.randn(len(sizes), N, K, generator=gen)
    m_sizes = torch.tensor(sizes, dtype=torch.int32)
    ref = moe_grouped_gemm_torch(x, w, m_sizes)
    real_empty = torch.empty
    real_new_empty = torch.Tensor.new_empty

    for ref_name in sys.argv[1:]:
        module, function = ref_name.split(":")
        fn = getattr(importlib.import_module(module), function)
        y_bufs = []

        def padded(shape, dtype):
            buf = torch.full((M + PAD, N), float("nan"), dtype=dtype)
            y_bufs.append(buf)
            return buf[:M]

        def padded_empty(*size, **kwargs):
            shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
            if tuple(shape) != (M, N):
                return real_empty(*size, **kwargs)
            return padded(shape, kwargs.get("dtype", torch.float32))

        def padded_new_empty(self, *size, **kwargs):  # our plans allocate y by x.new_empty
            shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
            if tuple(shape) != (M, N):
                return real_new_empty(self, *size, **kwargs)
            return padded(shape, kwargs.get("dtype", self.dtype))

        torch.empty, torch.Tensor.new_empty = padded_empty, padded_new_empty
        try:
            y = fn(x, w, m_sizes)
        finally:
            torch.empty, torch.Tensor.new_empty = real_empty, real_new_empty
        # the buffer behind the returned y (a kernel may allocate an (M, N) template first)
        (y_buf,) = [b for b in y_bufs if b.data_ptr() == y.data_ptr()]
        past = y_buf[M:]
        expect_past = x_buf[M : M + 10] @ w[2].T  # canary rows of x times the last expert
        print(json.dumps({
            "kernel": ref_name,
            "rel_error": float((y - ref).norm() / ref.norm()),
            "rows_written_past_y": int((~torch.isnan(past)).any(dim=1).sum()),
            "past_rows_are_canary_products": bool(
                torch.allclose(past[:10], expect_past, rtol=1e-4, atol=1e-4)
            ),
            "x_canary_intact": bool((x_buf[M:] == 2.0).all()),
        }), flush=True)
"""


@pytest.mark.parametrize(
    ("name", "correct"),
    [
        ("unmasked_rows", "qmoe_doctor.kernels.grouped_gemm:moe_grouped_gemm"),
        ("running_row_mask", "qmoe_doctor.kernels.grouped_gemm:moe_grouped_gemm"),
        ("tma_unmasked_rows", kernel_ref("tma_persistent")),  # TMA loads and stores, its twin
    ],
)
def test_trusting_m_sizes_reads_and_writes_past_x_and_y_when_over_routed(name: str, correct: str) -> None:
    out = _run_child(_OVER_ROUTED_CHILD, correct, kernel_ref(name))
    # Observed here (triton 3.9 interpreter): no crash, deterministic, since the padding keeps
    # every stray access inside buffers the child owns.
    assert out.returncode == 0, out.stderr[-2000:]
    runs = {doc["kernel"]: doc for doc in map(json.loads, _json_lines(out.stdout))}
    clean, fault = runs[correct], runs[kernel_ref(name)]
    assert clean["rows_written_past_y"] == 0  # the correct kernel clamps to M
    assert clean["rel_error"] < 1e-5 and clean["x_canary_intact"]
    # Rows M..M+9 of the padded y hold x's canary rows times expert 2's weights: the specimen
    # read 10 rows past x and wrote 10 rows past y; the rows inside y are still right.
    assert fault["rows_written_past_y"] == 10
    assert fault["past_rows_are_canary_products"]
    assert fault["rel_error"] < 1e-5


def test_unmasked_rows_shifts_rows_after_a_negative_sentinel() -> None:
    # the probes' negative-sizes case: expert 1's rows moved to expert 2 and its count set to
    # -1, so the counts still sum to M + 1 (in bounds here: the cursor never goes below row 0)
    device = _device()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 16, generator=gen).to(device)
    w = torch.randn(4, 12, 16, generator=gen).to(device)
    m_sizes = torch.tensor([10, -1, 8 + 9 + 1, 12], dtype=torch.int32, device=device)
    ref = moe_grouped_gemm_torch(x, w, m_sizes)  # -1 counts as 0
    assert _rel_error(grouped_gemm.moe_grouped_gemm(x, w, m_sizes), ref) <= TOLERANCE[torch.float32]
    tri = _module("unmasked_rows").moe_grouped_gemm(x, w, m_sizes)
    bad_rows = ((tri - ref).abs().amax(dim=1) > 1e-4).nonzero().flatten().tolist()
    # observed: row 9 overwritten by expert 2 (cursor one row back), row 27 at the 2 -> 3
    # boundary, and row 39 zeroed by the uncovered-rows walk (the cursor ends at M - 1)
    assert bad_rows == [9, 27, 39]


def test_tma_unmasked_rows_shifts_rows_after_a_negative_sentinel_and_its_twin_does_not() -> None:
    # as above: m_sizes [10, -1, 18, 12] sum to M = 40; -1 read as 0 they claim 41 rows
    device = _device()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 16, generator=gen).to(device)
    w = torch.randn(4, 12, 16, generator=gen).to(device)
    m_sizes = torch.tensor([10, -1, 8 + 9 + 1, 12], dtype=torch.int32, device=device)
    ref = moe_grouped_gemm_torch(x, w, m_sizes)  # -1 counts as 0
    twin = _module("tma_persistent").moe_grouped_gemm(x, w, m_sizes)
    assert _rel_error(twin, ref) <= TOLERANCE[torch.float32]  # -1 clamped to 0, the last expert to M
    tri = _module("tma_unmasked_rows").moe_grouped_gemm(x, w, m_sizes)[:39]
    bad_rows = ((tri - ref[:39]).abs().amax(dim=1) > 1e-4).nonzero().flatten().tolist()
    # the cursor steps back to row 9: expert 2's descriptors start there (row 9 overwritten)
    # and expert 3's one row early (row 27 computed with its weights); its rows end at 38, so
    # row 39 is never written (left as torch.empty made it, not compared)
    assert bad_rows == [9, 27]


def _storage_view(t: torch.Tensor, offset: int) -> torch.Tensor:
    """The values of ``t`` as a view ``offset`` elements into a fresh buffer (the scan's
    offsets: storage-offset-N cells)."""
    buf = torch.full((t.numel() + offset + 64,), float("nan"), dtype=t.dtype, device=t.device)
    return buf[offset : offset + t.numel()].view(t.shape).copy_(t)


@pytest.mark.parametrize(
    ("layout", "refusal"),
    [
        ("storage-offset-1", "base must be 16-byte aligned"),  # 4 bytes in (float32)
        ("odd-pitch", "stride must be 16-byte aligned"),  # rows of K + 1 = 33 floats: 132 bytes
        ("storage-offset-4", None),  # 16 bytes in: aligned, computed
    ],
)
def test_tma_misaligned_hands_x_unchecked_to_its_descriptors(layout: str, refusal: str | None) -> None:
    """Under the interpreter the descriptor's own check stands in for the GPU's fault (CUDA
    error: misaligned address, 716): it refuses the misaligned x inside the launch. The twin
    copies x into an aligned buffer and is right on every layout."""
    if not interpreting():
        pytest.skip("the interpreter's descriptor check; the GPU's fault: tests/gpu/test_specimens_gpu.py")
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(64, 32, generator=gen)
    w = torch.randn(4, 32, 32, generator=gen)
    m_sizes = torch.tensor([16, 8, 24, 16], dtype=torch.int32)
    if layout == "odd-pitch":
        x = torch.cat([x, torch.zeros(64, 1)], dim=1)[:, :32]
    else:
        x = _storage_view(x, int(layout.rsplit("-", 1)[1]))
    ref = moe_grouped_gemm_torch(x, w, m_sizes)
    assert _rel_error(_module("tma_persistent").moe_grouped_gemm(x, w, m_sizes), ref) <= TOLERANCE[torch.float32]
    if refusal is None:
        tri = _module("tma_misaligned").moe_grouped_gemm(x, w, m_sizes)
        assert _rel_error(tri, ref) <= TOLERANCE[torch.float32]
        return
    from triton.runtime.errors import InterpreterError

    with pytest.raises(InterpreterError, match=refusal):
        _module("tma_misaligned").moe_grouped_gemm(x, w, m_sizes)


def test_tma_operand_copies_only_what_a_descriptor_cannot_take() -> None:
    tma = _module("tma_persistent")
    x = torch.randn(8, 32)
    assert tma.tma_operand(x) is x  # aligned base, 128-byte rows
    for view in (_storage_view(x, 1), torch.cat([x, x[:, :1]], dim=1)[:, :32], x.t().contiguous().t()):
        assert not tma.tma_ready(view)
        copy = tma.tma_operand(view)
        assert tma.tma_ready(copy) and torch.equal(copy, view) and copy.data_ptr() != view.data_ptr()
    odd = torch.randn(5, 7, dtype=torch.float16)  # 14-byte rows: the copy's pitch is 8 elements
    assert tma.tma_operand(odd).stride() == (8, 1) and torch.equal(tma.tma_operand(odd), odd)


# 70 experts with the per-expert stride of a 5120x6144 stack, as a strided view with tiny N, K:
# 69 * 31,457,280 = 2,170,552,320 passes 2**31 - 1 and wraps to -2,124,414,976 in int32. The
# view starts that many elements into its buffer, so the wrapped address is the buffer's start
# (inside the allocation, as on the GPU), where we put a canary block of ones. Untouched pages
# of the 8.7 GB (virtual) buffer are never committed.
_STRIDE_WE = 5120 * 6144
_HOT = 69


def _int32_boundary_operands() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    e, n, k = _HOT + 1, 8, 16
    wrap = 2**32 - _HOT * _STRIDE_WE
    try:
        buf = torch.empty(wrap + e * _STRIDE_WE, dtype=torch.float16)
    except RuntimeError as exc:  # overcommit refused on a small machine
        pytest.skip(f"cannot reserve 8.7 GB of virtual memory: {exc}")
    w = buf.as_strided((e, n, k), (_STRIDE_WE, k, 1), storage_offset=wrap)
    gen = torch.Generator().manual_seed(0)
    for expert in range(e):
        w[expert].copy_(torch.randn(n, k, generator=gen))
    canary = buf[: n * k].view(n, k)
    canary.fill_(1.0)
    x = torch.randn(8, k, generator=gen).half()
    m_sizes = torch.zeros(e, dtype=torch.int32)
    m_sizes[_HOT] = 8  # every row on expert 69, the first whose offset wraps
    return x, w, m_sizes, canary


@pytest.mark.slow
def test_int32_offsets_reads_the_wrapped_address_at_expert_69() -> None:
    if not interpreting():
        pytest.skip("CPU-tier test; the GPU version is in tests/gpu/test_specimens_gpu.py")
    x, w, m_sizes, canary = _int32_boundary_operands()
    ref = moe_grouped_gemm_torch(x, w, m_sizes, out_dtype=torch.float32)
    assert _rel_error(grouped_gemm.moe_grouped_gemm(x, w, m_sizes), ref) <= TOLERANCE[torch.float16]
    tri = _module("int32_offsets").moe_grouped_gemm(x, w, m_sizes)
    assert _rel_error(tri, ref) > 0.5  # silently wrong, no error
    wrapped = x.float() @ canary.float().T  # what it read: the block at the wrapped offset
    assert _rel_error(tri, wrapped) <= TOLERANCE[torch.float16]


_REPEAT_CALL_CHILD = """
    import json
    import torch
    from qmoe_doctor.kernels.grouped_gemm import moe_grouped_gemm_torch
    from qmoe_doctor.kernels.specimens import autotune_inplace

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 48, generator=gen)
    w = torch.randn(3, 36, 48, generator=gen)
    m_sizes = torch.tensor([10, 0, 30], dtype=torch.int32)
    ref = moe_grouped_gemm_torch(x, w, m_sizes)
    errors, ratios = [], []
    for _ in range(3):  # identical inputs each call, fresh process (first call per key)
        y = autotune_inplace.moe_grouped_gemm(x, w, m_sizes)
        errors.append(float((y - ref).norm() / ref.norm()))
        ratios.append(float((y * ref).sum() / (ref * ref).sum()))
    print(json.dumps({"rel_errors": errors, "scale": ratios}))
"""


def test_autotune_inplace_is_wrong_on_the_first_call_only() -> None:
    out = _run_child(_REPEAT_CALL_CHILD)
    assert out.returncode == 0, out.stderr[-2000:]
    calls = _last_json(out.stdout)
    first, *later = calls["rel_errors"]
    assert first > 1.0, calls
    assert all(e < 1e-5 for e in later), calls
    # y = (runs) x the product: 2 configs x (1 warm-up + 3 timed) benchmark runs + the real one
    assert round(calls["scale"][0]) == 2 * (1 + 3) + 1


# --------------------------------------------------------------------------------------------
# `qmoe-doctor specimens`
# --------------------------------------------------------------------------------------------


def test_specimens_command_lists_every_specimen() -> None:
    result = CliRunner().invoke(app, ["specimens"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for spec in SPECIMENS:
        assert spec.kernel_option in result.output
        assert (spec.cause or "none (correct)") in result.output
        assert spec.summary in result.output


def test_specimens_command_json() -> None:
    result = CliRunner().invoke(app, ["specimens", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["kind"] == "specimens" and isinstance(doc["schema_version"], int)
    rows = {row["name"]: row for row in doc["specimens"]}
    assert list(rows) == NAMES
    for spec in SPECIMENS:
        row = rows[spec.name]
        assert row["cause"] == spec.cause  # null for a correct specimen
        assert row["kernel"] == f"specimen:{spec.name}"
        assert row["ref"] == kernel_ref(spec.name)
        assert row["docs"] == (f"docs/causes/{spec.cause}.md" if spec.cause else None)
        assert row["misbehaves_under"] == [c.value for c in spec.misbehaves_under]
        assert row["rejected_under"] == list(spec.rejected_under)
        assert row["lint_rule"] == spec.lint_rule
        assert row["protocol"] == spec.protocol


def test_registry_and_command_do_not_import_torch() -> None:
    code = (
        "import sys\n"
        "import qmoe_doctor.core.specimens, qmoe_doctor.cli.commands.specimens\n"
        "from typer.testing import CliRunner\n"
        "from qmoe_doctor.cli.app import app\n"
        "assert CliRunner().invoke(app, ['specimens', '--json']).exit_code == 0\n"
        "print('torch' in sys.modules, 'triton' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "False"]
