"""The child-side conditions, run in-process on the CPU (Triton interpreter)."""

from __future__ import annotations

from typing import Any

import pytest

from qmoe_doctor.core.records import Condition, ProbeSpec, Shape, Status
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
    spec = ProbeSpec(probe_id="p", kernel="builtin", condition=Condition.SINGLE, shape=Shape(m=40, e=4, n=8, k=8, routing=pattern))
    assert conditions.routing_sizes(spec) == expect


def test_random_routing_is_deterministic_and_sums_to_m() -> None:
    spec = ProbeSpec(probe_id="p", kernel="builtin", condition=Condition.SINGLE, shape=SHAPE, seed=3)
    a, b = conditions.routing_sizes(spec), conditions.routing_sizes(spec)
    assert a == b and sum(a) == SHAPE.m


@pytest.mark.parametrize("cond", [Condition.SINGLE, Condition.OVER_ROUTED, Condition.NEGATIVE_SIZES])
def test_builtin_passes_every_cpu_condition(cond: Condition) -> None:
    fields, ctx = run("builtin", cond)
    assert fields["status"] is Status.PASS, (fields, ctx.notes)
    assert fields["rel_error"] < 2e-3
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
