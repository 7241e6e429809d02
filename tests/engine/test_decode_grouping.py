"""The torch backend's decode grouping: its dynamic program finds the cheapest grouping.

Checked against every way to cut the length-sorted rows, on random batches.
"""

from __future__ import annotations

import itertools
import random

from pdserve.engine.attention.torch_backend import _GROUP_COST_BLOCKS, _group_by_length


def cost(groups: list[list[int]], num_blocks: list[int]) -> int:
    return sum(len(g) * max(num_blocks[s] for s in g) + _GROUP_COST_BLOCKS for g in groups)


def cheapest(num_blocks: list[int]) -> int:
    """Every grouping into runs of the length-sorted order (the optimum is one of them)."""
    order = sorted(range(len(num_blocks)), key=num_blocks.__getitem__)
    best = None
    for cuts in itertools.product((False, True), repeat=len(order) - 1):
        groups, current = [], [order[0]]
        for seq, cut in zip(order[1:], cuts, strict=True):
            if cut:
                groups.append(current)
                current = []
            current.append(seq)
        groups.append(current)
        total = cost(groups, num_blocks)
        best = total if best is None else min(best, total)
    assert best is not None
    return best


def test_grouping_is_optimal_and_covers_every_row_once() -> None:
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        spread = rng.choice((3, 40, 200))
        num_blocks = [rng.randint(1, spread) for _ in range(n)]
        seqs = [10 + s for s in range(n)]  # row ids differ from positions in num_blocks
        groups = _group_by_length(seqs, num_blocks)
        assert sorted(s for g in groups for s in g) == seqs
        by_row = dict(zip(seqs, num_blocks, strict=True))
        assert cost(groups, [by_row.get(s, 0) for s in range(max(seqs) + 1)]) == cheapest(
            num_blocks
        ), num_blocks


def test_one_length_is_one_group_in_batch_order() -> None:
    assert _group_by_length([4, 2, 9], [3, 3, 3]) == [[4, 2, 9]]
    assert _group_by_length([], []) == []
