"""The routed protocol (issue #45): kernels that take the router's token ids,
``fn(hidden_states, w, topk_ids, topk_weights[, expert_map])``, on the CPU.

* the reference: ``adapter:routed`` / ``adapter:routed-rows`` (and a routed specimen's registry
  entry) say the protocol without importing the kernel; the loader builds a ``RoutedKernel``
  that the m_sizes cells call through a k = 1 view;
* our routed kernels against their twins, at every routing edge, float32 and float16;
* the plan: a routed kernel runs the routed cells instead of over-routed and negative-sizes;
* every routed cell in-process (Triton interpreter) on our kernels, the specimens and the small
  torch kernels of ``routed_kernels.py``: its outcome, its differential facts, its canary hits;
* the classification: fault (outside its tensors), hardening (in bounds), rejected (refused
  before launch), and the expert-map cell's failures always a fault;
* ``run --sanitize``'s placement of addresses in routing buffers, and the audit's gathered ids.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from qmoe_doctor.core.audit import audit_shape, gathered_rows
from qmoe_doctor.core.conditions import M_SIZES_EDGES, ROUTED_CPU, ROUTED_ORDER
from qmoe_doctor.core.kernel_ref import KernelRef
from qmoe_doctor.core.options import ScanOptions
from qmoe_doctor.core.records import Condition, Outcome, Phase, ProbeSpec, Shape, Status, TensorInfo
from qmoe_doctor.core.shapes import get_preset
from qmoe_doctor.core.specimens import SPECIMENS, get_specimen
from qmoe_doctor.core.tolerances import tolerance
from qmoe_doctor.diagnose.attribution import attribute_address
from qmoe_doctor.diagnose.scan_rules import classify
from qmoe_doctor.kernels.grouped_gemm import interpreting, moe_grouped_gemm_torch
from qmoe_doctor.kernels.routed import (
    local_expert_ids,
    routed_moe,
    routed_moe_rows,
    routed_moe_rows_torch,
    routed_moe_torch,
)
from qmoe_doctor.plan.scan import GATHERED_INT32_N, gathered_int32_shape, plan_scan
from qmoe_doctor.probes import conditions
from qmoe_doctor.probes.context import ProbeContext
from qmoe_doctor.probes.loader import KernelResolutionError, load_kernel
from qmoe_doctor.probes.routed import RoutedKernel, as_routed

HERE = Path(__file__).resolve().parent
USER = f"{HERE / 'routed_kernels.py'}"
ROUTED_SPECIMENS = [s.name for s in SPECIMENS if s.protocol != "m_sizes"]
SHAPE = Shape(m=32, e=4, n=32, k=32, dtype="float32", routing="random")


def _device() -> torch.device:
    if interpreting():
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    pytest.skip("neither TRITON_INTERPRET=1 nor a CUDA device")


# --------------------------------------------------------------------------------------------
# The reference: protocol known in the parent, resolved in the child
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "protocol", "source", "function"),
    [
        ("builtin", "m_sizes", "grouped_gemm.py", "moe_grouped_gemm"),
        ("adapter:routed", "routed", "routed.py", "routed_moe"),
        ("adapter:routed-rows", "routed-rows", "routed.py", "routed_moe_rows"),
        (f"adapter:routed:{USER}:clamping", "routed", "routed_kernels.py", "clamping"),
        ("adapter:flat-weights:json:dumps", "m_sizes", "__init__.py", "dumps"),
        ("specimen:sorted_ids", "routed-rows", "sorted_ids.py", "fused_moe"),
        ("specimen:gather_scatter", "routed", "gather_scatter.py", "ragged_moe"),
        ("specimen:unmasked_rows", "m_sizes", "unmasked_rows.py", "moe_grouped_gemm"),
    ],
)
def test_the_protocol_is_known_from_the_reference_alone(
    text: str, protocol: str, source: str | None, function: str
) -> None:
    ref = KernelRef.parse(text).validate()
    assert ref.protocol == protocol
    path = ref.source_path()
    assert (path.name if path is not None else None) == source  # what check lints, no import
    assert ref.function_name() == function
    if protocol != "m_sizes" and ref.kind.value == "specimen":
        assert ref.standalone() is None  # a script cannot call a routed specimen as fn(x, w, m_sizes)


@pytest.mark.parametrize(
    "text", ["adapter:routed", "adapter:routed-rows", "specimen:sorted_ids", "specimen:gather_scatter"]
)
def test_a_routed_kernel_loads_as_one_callable_through_its_m_sizes_view(text: str) -> None:
    """The m_sizes cells (single, placements, offsets, the int32 expert boundary) call it as
    fn(x, w, m_sizes): rows as tokens of one slot, the rows past sum(m_sizes) routed nowhere."""
    kernel = load_kernel(text)
    routed = as_routed(kernel)
    assert isinstance(routed, RoutedKernel) and routed.protocol == KernelRef.parse(text).protocol
    assert routed.takes_expert_map
    dev = _device()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 24, generator=gen).to(dev)
    w = torch.randn(3, 20, 24, generator=gen).to(dev)
    for sizes in ([10, 0, 27], [5, 13, 2], [0, 0, 37]):  # the middle one leaves 17 rows uncovered
        m_sizes = torch.tensor(sizes, dtype=torch.int32, device=dev)
        ref = moe_grouped_gemm_torch(x, w, m_sizes, out_dtype=torch.float32)
        y = kernel(x, w, m_sizes)
        assert y.shape == ref.shape
        assert float((y.float() - ref).norm() / ref.norm()) <= tolerance("float32")


def test_the_routing_step_is_found_on_the_kernel() -> None:
    assert as_routed(load_kernel("specimen:sorted_ids")).route is not None  # type: ignore[union-attr]
    assert as_routed(load_kernel("adapter:routed")).route is None  # type: ignore[union-attr]
    no_map = as_routed(load_kernel(f"adapter:routed:{USER}:no_map"))
    assert no_map is not None and not no_map.takes_expert_map


def test_a_kernel_of_the_other_signature_is_refused_by_the_routed_adapter() -> None:
    with pytest.raises(
        KernelResolutionError, match=r"the routed protocol calls fn\(hidden_states, w, topk_ids"
    ):
        load_kernel(f"adapter:routed:{USER}:three_args")
    assert as_routed(load_kernel("builtin")) is None


# --------------------------------------------------------------------------------------------
# Our routed kernels against their twins
# --------------------------------------------------------------------------------------------


# (T, H, E, N, k, edit of the ids, expert_map, what the row covers)
def _no_edit(ids: torch.Tensor, e: int) -> None:
    del ids, e


def _edges(ids: torch.Tensor, e: int) -> None:
    ids[1, 0], ids[2, -1], ids[3, 0] = e, -1, -2


def _map_edges(ids: torch.Tensor, e: int) -> None:
    ids[0, 0], ids[4, -1] = 2 * e + 3, -1  # past the map, dropped


KERNEL_CASES: list[tuple[int, int, int, int, int, Any, bool, str]] = [
    (16, 32, 4, 24, 2, _no_edit, False, "valid top-2"),
    (13, 20, 5, 17, 3, _no_edit, False, "prime sizes, partial tiles"),
    (16, 32, 4, 24, 2, _edges, False, "ids E, -1 and -2 routed nowhere"),
    (16, 32, 4, 24, 2, _map_edges, True, "a map with -1 and entries past the local count"),
    (1, 16, 2, 8, 1, _no_edit, False, "one token, k = 1"),
]


def _map(e: int) -> torch.Tensor:
    return torch.tensor(
        [g // 2 if g % 2 == 0 else (e if g % 4 == 1 else -1) for g in range(2 * e)], dtype=torch.int32
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=[c[-1] for c in KERNEL_CASES])
@pytest.mark.parametrize("rows", [False, True], ids=["routed", "routed-rows"])
def test_our_routed_kernels_match_their_twins(case: tuple[Any, ...], rows: bool, dtype: torch.dtype) -> None:
    t, h, e, n, k, edit, with_map, _ = case
    dev = _device()
    gen = torch.Generator().manual_seed(t * 100 + n)
    hidden = torch.randn(t, h, generator=gen).to(dev, dtype)
    w = (torch.randn(e, n, h, generator=gen) / math.sqrt(h)).to(dev, dtype)
    experts = 2 * e if with_map else e
    ids = torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(t)])
    edit(ids, e)
    weights = torch.rand(t, k, generator=gen).to(dev, dtype)
    ids = ids.to(dev)
    expert_map = _map(e).to(dev) if with_map else None
    tri, twin = (routed_moe_rows, routed_moe_rows_torch) if rows else (routed_moe, routed_moe_torch)
    out = tri(hidden, w, ids, weights, expert_map)
    ref = twin(hidden, w, ids, weights, expert_map, out_dtype=torch.float32)
    assert out.shape == ref.shape == ((t * k, n) if rows else (t, n)) and out.dtype == dtype
    assert float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)) <= tolerance(str(dtype))


def test_slots_routed_nowhere_add_nothing() -> None:
    ids = torch.tensor([[0, -1], [4, 1], [-2, 3]])
    assert local_expert_ids(ids, None, 4).tolist() == [[0, -1], [-1, 1], [-1, 3]]
    emap = torch.tensor([1, -1, 0, 7], dtype=torch.int32)  # 7: past 4 local experts
    assert local_expert_ids(torch.tensor([[0, 1], [2, 3], [4, -1]]), emap, 4).tolist() == [
        [1, -1],
        [0, -1],
        [-1, -1],
    ]


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------


class _Gpu:
    def __init__(self, index: int) -> None:
        self.index = index
        self.uuid = f"GPU-{index}"


def _conditions(kernel: str, gpus: list[_Gpu], opts: ScanOptions | None = None) -> list[Condition]:
    return [s.condition for s in plan_scan(kernel, gpus, opts).specs]


def test_a_routed_kernel_runs_the_routed_cells_instead_of_the_m_sizes_edges() -> None:
    cpu = _conditions("adapter:routed", [])
    assert [c for c in cpu if c in ROUTED_ORDER] == list(ROUTED_CPU)  # gathered-int32: GPU only
    assert not set(cpu) & set(M_SIZES_EDGES)
    gpu = _conditions("specimen:sorted_ids", [_Gpu(0)])
    assert [c for c in gpu if c in ROUTED_ORDER] == list(ROUTED_ORDER)
    assert Condition.SINGLE in gpu and Condition.INT32_BOUNDARY in gpu and not set(gpu) & set(M_SIZES_EDGES)
    pair = _conditions("adapter:routed", [_Gpu(0), _Gpu(1)])
    assert pair.count(Condition.GATHERED_INT32) == 1 and Condition.PEER in pair  # the pair cells as they are
    # an m_sizes kernel: no routed cell, its own edges
    plain = _conditions("builtin", [])
    assert not set(plain) & set(ROUTED_ORDER) and set(M_SIZES_EDGES) <= set(plain)


def test_the_routed_cells_carry_their_top_k_and_the_boundary_passes_2_31() -> None:
    specs = {s.condition: s for s in plan_scan("adapter:routed", [_Gpu(0)]).specs}
    assert specs[Condition.ROUTED].params["top_k"] > 1
    boundary = specs[Condition.GATHERED_INT32]
    rows = boundary.shape.m * boundary.params["top_k"]
    assert boundary.shape.n == GATHERED_INT32_N
    assert (rows - 1) * boundary.shape.n > 2**31 - 1 > (rows - 4097) * boundary.shape.n  # 4,096 rows past
    assert gathered_int32_shape(ScanOptions())[0] == boundary.shape


# --------------------------------------------------------------------------------------------
# Every routed cell, in-process
# --------------------------------------------------------------------------------------------


def run(kernel: str, cond: Condition) -> tuple[dict[str, Any], ProbeContext]:
    spec = ProbeSpec(
        probe_id=f"CPU/{cond.value}", kernel=kernel, condition=cond, shape=SHAPE, params={"top_k": 2}
    )
    ctx = ProbeContext(spec)
    return conditions.run_probe(ctx), ctx


HEALTHY = ["adapter:routed", "adapter:routed-rows", "specimen:sorted_ids", "specimen:gather_scatter"]
SKIPPED_FOR = {  # cells a healthy kernel skips, with a word of the reason
    "adapter:routed": {Condition.PADDED_COUNT: "no routing step", Condition.GATHER_PAST_T: "no routing step"},
    "adapter:routed-rows": {
        Condition.PADDED_COUNT: "no routing step",
        Condition.GATHER_PAST_T: "no routing step",
    },
    "specimen:sorted_ids": {Condition.GATHER_PAST_T: "not of the gather/scatter style"},
    "specimen:gather_scatter": {Condition.PADDED_COUNT: "not of the sorted-token-ids style"},
}


@pytest.mark.parametrize("cond", ROUTED_CPU, ids=[c.value for c in ROUTED_CPU])
@pytest.mark.parametrize("kernel", HEALTHY)
def test_correct_routed_kernels_pass_every_routed_cell(kernel: str, cond: Condition) -> None:
    fields, ctx = run(kernel, cond)
    skipped = SKIPPED_FOR[kernel].get(cond)
    if skipped is not None:
        assert fields["status"] is Status.SKIPPED and skipped in ctx.notes[-1]
        return
    assert fields["status"] is Status.PASS, (fields, ctx.notes, ctx.facts)
    assert fields["rel_error"] < tolerance("float32") and not fields.get("canary_hits")
    assert ctx.facts["output_guard"] is True  # guard rows surrounded its output: writes were checked
    if cond is not Condition.ROUTED:
        assert ctx.facts["baseline_ok"] is True and ctx.facts["variant_ok"] is True
    assert {"hidden_states", "w", "topk_ids", "topk_weights"} <= {t.name for t in ctx.tensors}


# specimen -> the cells it fails on the CPU, each with the canary hit that shows where it read
FAULTS = {
    "sorted_minus_one": {
        Condition.IDS_OUT_OF_RANGE: "read outside w",
        Condition.DROPPED_SLOTS: "read outside w",
        Condition.EXPERT_MAP: "read outside w",
        Condition.MAP_PAST_LOCAL: "read outside w",
    },
    "sorted_padded_count": {
        Condition.PADDED_COUNT: "read past sorted_token_ids and expert_ids (the guard's slot was computed)"
    },
    "gather_unchecked_ids": {
        Condition.IDS_OUT_OF_RANGE: "read outside w",
        Condition.MAP_PAST_LOCAL: "read outside w",
    },
    "gather_past_t": {Condition.GATHER_PAST_T: "read past hidden_states"},
    "sorted_int32_token": {},  # its cell needs a GPU
    "gather_sms_device0": {},  # no cell can see it: lint does
}


def test_every_routed_specimen_has_its_cpu_faults_listed() -> None:
    assert set(FAULTS) | {"sorted_ids", "gather_scatter"} == set(ROUTED_SPECIMENS)
    for name, cells in FAULTS.items():
        spec = get_specimen(name)
        # what the CPU can show of the registry's conditions (gathered-int32 needs a GPU)
        assert set(cells) == set(spec.misbehaves_under) & set(ROUTED_CPU), name


@pytest.mark.parametrize("cond", ROUTED_CPU, ids=[c.value for c in ROUTED_CPU])
@pytest.mark.parametrize("name", sorted(FAULTS))
def test_each_routed_specimen_fails_only_its_cells(name: str, cond: Condition) -> None:
    fields, ctx = run(f"specimen:{name}", cond)
    hit = FAULTS[name].get(cond)
    if fields["status"] is Status.SKIPPED:
        assert hit is None, ctx.notes
        return
    if hit is None:
        assert fields["status"] is Status.PASS, (fields, ctx.facts)
        return
    # the differential: right with valid routing on the same operands, wrong with the one edge
    assert fields["status"] is Status.WRONG
    assert ctx.facts["baseline_ok"] is True and ctx.facts["variant_ok"] is False
    assert fields["canary_hits"] == (hit,)


@pytest.mark.parametrize(
    ("name", "cond", "status", "how"),
    [
        ("clamping", Condition.IDS_OUT_OF_RANGE, Status.WRONG, "in bounds"),
        ("clamping", Condition.DROPPED_SLOTS, Status.WRONG, "in bounds"),
        ("refusing", Condition.IDS_OUT_OF_RANGE, Status.ERROR, "ValueError"),
        ("refusing", Condition.MAP_PAST_LOCAL, Status.ERROR, "ValueError"),
        ("refusing", Condition.DROPPED_SLOTS, Status.PASS, "-1 skipped"),
        ("ignores_map", Condition.EXPERT_MAP, Status.WRONG, "in bounds"),
        ("no_map", Condition.EXPERT_MAP, Status.SKIPPED, "takes no expert_map"),
    ],
)
def test_user_kernels_at_the_routing_edges(name: str, cond: Condition, status: Status, how: str) -> None:
    ref = f"adapter:routed:{USER}:{name}"
    if status is Status.ERROR:
        with pytest.raises(ValueError, match="topk_ids holds"):
            run(ref, cond)
        return
    fields, ctx = run(ref, cond)
    assert fields["status"] is status, (fields, ctx.notes)
    if status is Status.WRONG:
        assert not fields.get("canary_hits") and ctx.facts["baseline_ok"] is True  # every access inside
    if status is Status.SKIPPED:
        assert how in ctx.notes[-1]


def test_an_m_sizes_kernel_skips_the_routed_cells_and_a_routed_one_the_m_sizes_edges() -> None:
    fields, ctx = run("builtin", Condition.DROPPED_SLOTS)
    assert fields["status"] is Status.SKIPPED and "takes m_sizes" in ctx.notes[-1]
    fields, ctx = run("adapter:routed", Condition.OVER_ROUTED)
    assert fields["status"] is Status.SKIPPED and "takes no m_sizes" in ctx.notes[-1]


def test_gathered_int32_needs_a_gpu() -> None:
    fields, ctx = run("adapter:routed", Condition.GATHERED_INT32)
    assert fields["status"] is Status.SKIPPED and "GPU only" in ctx.notes[-1]


# --------------------------------------------------------------------------------------------
# The classification: fault, hardening, rejected, expert parallelism
# --------------------------------------------------------------------------------------------


def _outcome(kernel: str, cond: Condition, **fields: Any) -> Outcome:
    spec = ProbeSpec(probe_id=f"CPU/{cond.value}", kernel=kernel, condition=cond, shape=SHAPE)
    facts = {"baseline_ok": True, "variant_ok": False, "output_guard": True, "canary_after_output": True}
    facts.update(fields.pop("facts", {}))
    return Outcome(probe_id=spec.probe_id, spec=spec, phase=Phase.DONE, facts=facts, **fields)


def _single(kernel: str) -> Outcome:
    spec = ProbeSpec(probe_id="CPU/single", kernel=kernel, condition=Condition.SINGLE, shape=SHAPE)
    return Outcome(
        probe_id=spec.probe_id,
        spec=spec,
        status=Status.PASS,
        phase=Phase.DONE,
        rel_error=1e-7,
        tolerance=2e-3,
    )


def test_a_guard_read_is_a_fault_and_an_in_bounds_wrong_value_hardening() -> None:
    k = "adapter:routed"
    read = _outcome(
        k,
        Condition.IDS_OUT_OF_RANGE,
        status=Status.WRONG,
        rel_error=math.inf,
        canary_hits=("read outside w",),
    )
    inside = _outcome(k, Condition.DROPPED_SLOTS, status=Status.WRONG, rel_error=0.3, tolerance=2e-3)
    got = classify([_single(k), read, inside], kernel=k)
    (fault,) = got.diagnoses
    assert (fault.cause, fault.severity) == ("invalid-routing", "fault")
    assert "expert ids past E or below -1" in fault.summary and "does not mask by [0, E)" in fault.summary
    assert "--only ids-out-of-range" in fault.repro
    (hardening,) = got.hardening
    assert hardening.severity == "hardening" and "-1 ids (dropped slots)" in hardening.summary
    assert not got.unexplained


def test_the_expert_map_cell_is_a_fault_even_in_bounds() -> None:
    k = f"adapter:routed:{USER}:ignores_map"
    ep = _outcome(k, Condition.EXPERT_MAP, status=Status.WRONG, rel_error=0.8, tolerance=2e-3)
    got = classify([_single(k), ep], kernel=k)
    assert [(d.cause, d.severity) for d in got.diagnoses] == [("invalid-routing", "fault")]
    assert "valid expert-parallel routing" in got.diagnoses[0].summary and not got.hardening


def test_a_refusal_before_launch_is_rejected_and_a_failing_routed_baseline_unexplained() -> None:
    k = f"adapter:routed:{USER}:refusing"
    refused = _outcome(
        k,
        Condition.IDS_OUT_OF_RANGE,
        status=Status.ERROR,
        error_kind="bad-input",
        error_type="ValueError",
        error_message="topk_ids holds 6 ids outside [-1, 4)",
        facts={"kernel_launches": 0, "raised_in": "kernel", "raised_in_call": True},
    )
    got = classify([_single(k), refused], kernel=k)
    assert not got.diagnoses and not got.unexplained
    assert any("ids-out-of-range: topk_ids" in e for e in got.explanations)
    # the routed cell is the protocol's canonical call: refusing it is no contract
    wrong = _outcome(k, Condition.ROUTED, status=Status.WRONG, rel_error=0.5, facts={"baseline_ok": None})
    got = classify([_single(k), wrong], kernel=k)
    assert not got.diagnoses and [e.probe_id for e in got.unexplained] == ["CPU/routed"]


def test_a_gathered_int32_failure_is_an_int32_offset_overflow() -> None:
    k = "specimen:sorted_int32_token"
    spec = ProbeSpec(
        probe_id="GPU 0/gathered-int32", kernel=k, condition=Condition.GATHERED_INT32, shape=SHAPE
    )
    bad = Outcome(
        probe_id=spec.probe_id,
        spec=spec,
        status=Status.WRONG,
        phase=Phase.DONE,
        rel_error=1.0,
        facts={"baseline_ok": True, "rows": 8392704, "first_wrapping_row": 8388608},
    )
    (diag,) = classify([bad], kernel=k).diagnoses
    assert (
        diag.cause == "int32-offset-overflow" and "8,388,608" in diag.summary and "gathered" in diag.summary
    )


# --------------------------------------------------------------------------------------------
# run --sanitize: addresses in the routing buffers
# --------------------------------------------------------------------------------------------


def _tensor(name: str, ptr: int, shape: tuple[int, ...], dtype: str, item: int) -> TensorInfo:
    strides = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return TensorInfo(
        name=name,
        device="cuda:0",
        data_ptr=ptr,
        nbytes=math.prod(shape) * item,
        shape=shape,
        strides=strides,
        dtype=dtype,
    )


ROUTED_LAUNCH = {
    "cuda:0": [
        _tensor("hidden_ptr", 0x10000, (256, 64), "bfloat16", 2),
        _tensor("w_ptr", 0x100000, (8, 256, 64), "bfloat16", 2),
        _tensor("out_ptr", 0x800000, (1024, 256), "bfloat16", 2),
        _tensor("sorted_ids_ptr", 0x400000, (1536,), "int32", 4),
        _tensor("expert_ids_ptr", 0x500000, (24,), "int32", 4),
        _tensor("hist_ptr", 0x600000, (8,), "int32", 4),
        _tensor("topk_ids", 0x700000, (256, 4), "int64", 8),
    ]
}


@pytest.mark.parametrize(
    ("address", "tensor", "words", "sentence"),
    [
        (
            0x400000 + 1536 * 4 + 16,
            "sorted_ids_ptr",
            "a padded count past the end of its buffer",
            "element 1540 of 1536",
        ),
        (
            0x500000 + 24 * 4,
            "expert_ids_ptr",
            "a padded count past the end of its buffer",
            "element 24 of 24",
        ),
        (0x600000 + 8 * 4 + 4, "hist_ptr", "expert ids past E", "element 9 of 8"),
        (0x500000 - 4, "expert_ids_ptr", "a -1 read as an index", "a negative index"),
        (0x700000 + 256 * 4 * 8, "topk_ids", "slot ids past T*k", "slot ids past 1024"),
        (
            0x800000 + 1024 * 256 * 2 + 512,
            "out_ptr",
            "slot or token ids past the rows",
            "rows past its 1,024",
        ),
    ],
)
def test_addresses_are_placed_in_the_routing_buffers(
    address: int, tensor: str, words: str, sentence: str
) -> None:
    placed = attribute_address(address, ROUTED_LAUNCH, access="read of 4 bytes")
    nearest = placed.matches[0]
    assert nearest.tensor == tensor and nearest.relation != "inside"
    (fit,) = nearest.fits
    assert fit.cause == "invalid-routing" and fit.words.startswith(words)
    assert sentence in placed.sentences[0] and f"{words}" in placed.sentences[0]


def test_an_m_sizes_launch_keeps_its_rows_past_m() -> None:
    """Without a buffer indexed by position, rows past the end of y are still m_sizes summing past M."""
    tables = {"cuda:0": [t for t in ROUTED_LAUNCH["cuda:0"] if t.name in ("w_ptr", "out_ptr", "hist_ptr")]}
    (fit,) = attribute_address(0x800000 + 1024 * 256 * 2, tables).matches[0].fits
    assert fit.words == "m_sizes summing past M" and fit.cell == "over-routed"


# --------------------------------------------------------------------------------------------
# audit: the gathered ids
# --------------------------------------------------------------------------------------------


def test_audit_gives_the_gathered_id_boundary_for_a_config_and_top_k() -> None:
    shape = get_preset("qwen3-30b-a3b")  # H 2048, gate_up N 1536, top-8
    report = audit_shape(shape, 262_144)
    rows = {r.operand: r for r in report.gathered}
    # slot ids reach T*k: (T*k, 1536) rows pass 2**31 at slot 1,398,102, from 174,763 tokens
    assert (
        rows["gathered.gate_up.y"].first_wrap == "slot 1398102"
        and rows["gathered.gate_up.y"].wrap_tokens == 174_763
    )
    assert rows["gathered.down.y"].wrap_tokens == 131_073  # H = 2048 columns
    # the token gather (slot // k) wraps k times later
    assert rows["gathered.hidden"].wrap_tokens == 1_048_577 and not rows["gathered.hidden"].wraps
    assert report.gathered_min_wrap_tokens == 131_073 and report.top_k == 8
    fewer = audit_shape(shape, 262_144, top_k=2)
    assert (
        fewer.sorted_rows == 524_288
        and {r.operand: r for r in fewer.gathered}["gathered.down.y"].wrap_tokens == 524_289
    )
    with pytest.raises(ValueError, match="top_k"):
        audit_shape(shape, 16, top_k=129)
    assert gathered_rows(shape, 16) == audit_shape(shape, 16).gathered
