"""Ordered GPU pairs in rounds of disjoint pairs: the schedule that lets a scan run pairs at once.

A pair session pins two GPUs (``CUDA_VISIBLE_DEVICES=<a>,<b>``) and touches no other, so pairs
that share no GPU can run at the same time: on 8 GPUs, 4 at once. Measured on 8 H200 (validation
run of 2026-11-22): 56 ordered pairs one after another at about 11.7 s each, about 650 s.

The rounds come from the circle method of a round-robin tournament: with n GPUs (one idle per
round when n is odd) every unordered pair meets once in n - 1 rounds (n rounds for odd n) of
disjoint pairs. The two directions of a pair share both GPUs, so a -> b is played in the first
half of the schedule and b -> a in the second: 2 (n - 1) rounds for even n, every ordered pair
exactly once, no GPU twice in a round. On 8 GPUs: 14 rounds of 4 pairs; the first pair of the
first round is the first pair in --gpus order (gpus[0] -> gpus[1]). Pure and deterministic:
the same GPUs give the same rounds in the same order, and a report lists its sessions in plan
order whatever order they finished in.
"""

from __future__ import annotations

from collections.abc import Sequence


def pair_rounds(gpus: Sequence[int]) -> list[list[tuple[int, int]]]:
    """The ordered pairs (a current, operands on b) of ``gpus`` (NVML indices, in --gpus order),
    in rounds of pairs that share no GPU."""
    order = list(dict.fromkeys(gpus))
    if len(order) < 2:
        return []
    # The second GPU sits opposite the first, so the first round opens with the first pair in
    # --gpus order (the scan's first session, which carries the sweeps; ``max_pairs=1``'s pair).
    rest: list[int | None] = [*order[2:], None] if len(order) % 2 else list(order[2:])
    seats: list[int | None] = [order[0], *rest, order[1]]
    n = len(seats)
    halves: list[list[tuple[int, int]]] = []
    for _ in range(n - 1):
        games = []
        for i in range(n // 2):
            a, b = seats[i], seats[n - 1 - i]
            if a is not None and b is not None:
                games.append((a, b) if order.index(a) < order.index(b) else (b, a))
        halves.append(sorted(games, key=lambda g: (order.index(g[0]), order.index(g[1]))))
        seats = [seats[0], seats[-1], *seats[1:-1]]  # the circle turns; the first seat stays
    return [*halves, *[[(b, a) for a, b in games] for games in halves]]


def is_disjoint(round_: Sequence[tuple[int, int]]) -> bool:
    """No GPU in two pairs of the round."""
    used = [g for pair in round_ for g in pair]
    return len(used) == len(set(used))


__all__ = ["is_disjoint", "pair_rounds"]
