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
    nan = torch.full((4, 3), float("nan"))
    fields = conditions.compare(ctx, nan, ref, ref.device)
    assert fields["status"] is Status.WRONG and fields["unwritten"] == 12
