"""The schedule of disjoint GPU pairs (``plan.pair_rounds``) for 2, 4 and 8 GPUs, and odd counts."""

from __future__ import annotations

import itertools

import pytest

from qmoe_doctor.plan.pair_rounds import is_disjoint, pair_rounds


@pytest.mark.parametrize(("n", "rounds", "per_round"), [(2, 2, 1), (3, 6, 1), (4, 6, 2), (5, 10, 2), (8, 14, 4)])
def test_every_ordered_pair_once_in_rounds_of_disjoint_pairs(n: int, rounds: int, per_round: int) -> None:
    gpus = list(range(n))
    schedule = pair_rounds(gpus)
    assert len(schedule) == rounds
    assert all(is_disjoint(r) and len(r) == per_round for r in schedule)
    played = [pair for r in schedule for pair in r]
    assert sorted(played) == sorted(itertools.permutations(gpus, 2))  # each ordered pair exactly once


def test_two_gpus_keep_today_s_order() -> None:
    assert pair_rounds([0, 1]) == [[(0, 1)], [(1, 0)]]
    assert pair_rounds([3, 1]) == [[(3, 1)], [(1, 3)]]  # --gpus order, not numeric


def test_the_schedule_is_deterministic_and_follows_the_gpus_given() -> None:
    assert pair_rounds([7, 2, 5, 0]) == pair_rounds([7, 2, 5, 0])
    assert {g for r in pair_rounds([7, 2, 5, 0]) for p in r for g in p} == {7, 2, 5, 0}
    assert pair_rounds([0]) == [] and pair_rounds([]) == []
    assert pair_rounds([0, 0, 1]) == pair_rounds([0, 1])  # a GPU named twice counts once
