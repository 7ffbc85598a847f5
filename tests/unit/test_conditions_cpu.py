"""The child-side conditions, run in-process on the CPU (Triton interpreter)."""

from __future__ import annotations

from typing import Any

import pytest

from qmoe_doctor.core.records import Condition, ProbeSpec, Shape, Status
from qmoe_doctor.core.tolerances import tolerance
from qmoe_doctor.kernels.routing import routing_sizes
from qmoe_doctor.probes import conditions
from qmoe_doctor.probes.context import ProbeContext

SHAPE = Shape(m=40, e=4, n=24, k=32, dtype="float32", routing="random")


def run(kernel: str, cond: Condition, shape: Shape = SHAPE, **params: Any) -> tuple[dict[str, Any], ProbeContext]:
    spec = ProbeSpec(probe_id=f"CPU/{cond.value}", kernel=kernel, condition=cond, shape=shape, params=params)
    ctx = ProbeContext(spec)
    return conditions.run_probe(ctx), ctx


@pytest.mark.parametrize(
    ("pattern", "expect"),
    [
        ("uniform", [10, 10, 10, 10]),
        ("hot-expert", [0, 0, 40, 0]),
        ("last-expert", [0, 0, 0, 40]),
        ("expert:1", [0, 40, 0, 0]),
    ],
)
def test_routing_patterns(pattern: str, expect: list[int]) -> None:
    assert routing_sizes(pattern, 40, 4) == expect


@pytest.mark.parametrize("pattern", ["random", "empty-experts"])
def test_random_routing_is_deterministic_and_sums_to_m(pattern: str) -> None:
    a, b = routing_sizes(pattern, SHAPE.m, SHAPE.e, seed=3), routing_sizes(pattern, SHAPE.m, SHAPE.e, seed=3)
    assert a == b and sum(a) == SHAPE.m
    assert routing_sizes(pattern, 400, 8, seed=3) != routing_sizes(pattern, 400, 8, seed=4)  # the seed matters
    if pattern == "empty-experts":
        assert a[1::2] == [0] * (SHAPE.e // 2)


def test_probe_operands_take_the_shapes_routing() -> None:
    import torch

    shape = Shape(m=40, e=4, n=8, k=8, routing="hot-expert")
    spec = ProbeSpec(probe_id="p", kernel="builtin", condition=Condition.SINGLE, shape=shape, seed=3)
    x, w, m_sizes = conditions.make_operands(spec, torch.device("cpu"))
    assert (x.shape, w.shape) == ((40, 8), (4, 8, 8))
    assert m_sizes.dtype == torch.int32 and m_sizes.tolist() == routing_sizes("hot-expert", 40, 4, seed=3)


@pytest.mark.parametrize("cond", [Condition.SINGLE, Condition.OVER_ROUTED, Condition.NEGATIVE_SIZES])
def test_builtin_passes_every_cpu_condition(cond: Condition) -> None:
    fields, ctx = run("builtin", cond)
    assert fields["status"] is Status.PASS, (fields, ctx.notes)
    assert fields["rel_error"] < tolerance(SHAPE.dtype)
    assert {t.name for t in ctx.tensors} == {"x", "w", "m_sizes"}


def test_negative_sentinel_shifts_rows_of_a_kernel_that_trusts_m_sizes() -> None:
    fields, ctx = run("specimen:unmasked_rows", Condition.NEGATIVE_SIZES)
    assert fields["status"] is Status.WRONG
    assert ctx.facts["baseline_ok"] is True and ctx.facts["variant_ok"] is False


def test_pair_and_stream_conditions_skip_without_cuda() -> None:
    fields, ctx = run("builtin", Condition.SIDE_STREAM)
    assert fields["status"] is Status.SKIPPED and ctx.notes


def test_wrong_kernel_output_device_or_shape_is_wrong() -> None:
    ctx = ProbeContext(ProbeSpec(probe_id="p", kernel="builtin", condition=Condition.SINGLE, shape=SHAPE))
    import torch

    ref = torch.ones(4, 3)
    assert conditions.compare(ctx, torch.ones(3, 4), ref, ref.device)["status"] is Status.WRONG
    assert conditions.compare(ctx, "not a tensor", ref, ref.device)["status"] is Status.WRONG
    nan = torch.full((4, 3), float("nan"))  # computed NaN: written, not the poison
    fields = conditions.compare(ctx, nan, ref, ref.device)
    assert fields["status"] is Status.WRONG and (fields["unwritten"], fields["nan_written"]) == (0, 12)
    poisoned = torch.full((4, 3), -1, dtype=torch.int32).view(torch.float32)  # every byte POISON_BYTE
    poisoned[0] = float("nan")
    fields = conditions.compare(ctx, poisoned, ref, ref.device)
    assert fields["status"] is Status.WRONG and (fields["unwritten"], fields["nan_written"]) == (9, 3)


# --- guard rows, watched calls, the autotune policy -----------------------------------------


def test_output_guard_serves_the_output_shape_and_sees_writes_outside_it() -> None:
    import torch

    from qmoe_doctor.probes.output_guard import OutputGuard

    real_empty, real_new_empty = torch.empty, torch.Tensor.new_empty
    guard = OutputGuard((6, 4), guard_rows=3)
    with guard:
        y = torch.empty((6, 4), dtype=torch.float32)
        other = torch.empty(5, 4)  # another shape: untouched
        z = torch.zeros(6, 4)  # varargs form, zeros
        t = y.new_empty((6, 4))  # the method form
    assert torch.empty is real_empty and torch.Tensor.new_empty is real_new_empty  # restored
    assert guard.served_for(other) is None
    assert len(guard.served) == 3 and bool(torch.isnan(y).all()) and bool((z == 0).all())
    assert guard.served_for(t) is not None
    buf, view = guard.served[0]
    assert view.data_ptr() == y.data_ptr() and buf.shape == (12, 4) and y.is_contiguous()
    ctx = ProbeContext(ProbeSpec(probe_id="p", kernel="builtin", condition=Condition.OVER_ROUTED, shape=SHAPE))
    assert guard.report(ctx, y) == [] and ctx.facts["canary_after_output"] is True
    buf[-1, 0] = 1.0  # a row written past y
    buf[0, 2] = 1.0  # and one before it
    assert guard.report(ctx, y) == ["before y", "after y"]
    assert ctx.facts["rows_written_after_y"] == 1 and ctx.facts["rows_written_before_y"] == 1
    other_ctx = ProbeContext(ctx.spec)
    assert guard.report(other_ctx, other) == [] and other_ctx.facts["output_guard"] is False


def test_a_contract_refusal_is_recorded_where_it_was_raised() -> None:
    shape = Shape(m=40, e=4, n=24, k=32, dtype="float32", routing="random")
    spec = ProbeSpec(probe_id="CPU/offsets:padded-rows", kernel="specimen:contiguous_only",
                     condition=Condition.OFFSETS, shape=shape, params={"variant": "padded-rows"})
    ctx = ProbeContext(spec)
    with pytest.raises(AssertionError):
        conditions.run_probe(ctx)
    assert ctx.facts["raised_in"] == "kernel" and ctx.facts["kernel_launches"] == 0
    assert ctx.facts["raise_source"] == "assert x.is_contiguous()"
    assert ctx.facts["raise_site"].startswith("contiguous_only.py:")


def test_torch_control_is_skipped_on_the_cpu_with_the_reason() -> None:
    fields, ctx = run("torch:grouped_mm", Condition.SINGLE)
    assert fields["status"] is Status.SKIPPED
    assert "needs a CUDA GPU" in " ".join(ctx.notes)


def test_the_over_routed_cell_guards_the_output_the_kernel_allocates() -> None:
    fields, ctx = run("specimen:running_row_mask", Condition.OVER_ROUTED, Shape(m=40, e=4, n=24, k=32, dtype="float32", routing="uniform"))
    assert fields["status"] is Status.WRONG and fields["canary_hits"] == ("after y",)
    assert ctx.facts["output_guard"] is True and ctx.facts["rows_written_after_y"] == 64
    fields, ctx = run("builtin", Condition.OVER_ROUTED, Shape(m=40, e=4, n=24, k=32, dtype="float32", routing="uniform"))
    assert fields["status"] is Status.PASS and ctx.facts["canary_after_output"] is True
